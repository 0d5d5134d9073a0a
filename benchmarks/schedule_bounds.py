"""Each method's schedule bound for a recorded ``lowcomm bench --json`` run.

    python benchmarks/schedule_bounds.py BENCH.json --profile PROFILE.json [--markdown OUT.md]

``lowcomm bench`` now writes ``schedule_bound_s`` into every row itself
(:mod:`lowcomm.bench.schedule_bound`); this script computes it for runs recorded before that,
from the run's rows and the profile the bench saved (``profile.json`` in its work directory,
or ``lowcomm profile`` of the same model, batch and threads). It prints, per network, each
row's time against the universal bound (``max(compute, wire) + kernels``) and against the
method's own schedule bound.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

from lowcomm.bench.schedule_bound import add_schedule_bounds
from lowcomm.sim import Profile


def table(bench: dict[str, Any], profile: Profile) -> str:
    """Markdown: one block per network, one row per successful method."""
    out = []
    for net in bench.get("networks") or [bench["network"]]:
        rows = [copy.deepcopy(r) for r in bench["runs"] if r.get("net") == net["requested"] and r.get("status") == "ok"]
        if not rows:
            continue
        add_schedule_bounds(rows, profile, net, workers=bench["world_size"],
                            nproc_per_node=bench.get("nproc_per_node") or 1)
        out += [f"**{net.get('label', net['requested'])}, {bench['world_size']} workers, compute {bench.get('compute')}**", "",
                "| method | iter ms | bound ms | iter/bound | sched bound ms | iter/sched bound |",
                "|---|---:|---:|---:|---:|---:|"]
        for r in rows:
            def ms(v: float | None) -> str:
                return "-" if v is None else f"{v * 1e3:.1f}"

            def x(v: float | None) -> str:
                return "-" if v is None else f"{v:.2f}x"

            out.append(f"| {r['method']} | {ms(r['iter_time_s_median'])} | {ms(r.get('lower_bound_s'))} | "
                       f"{x(r.get('bound_ratio'))} | {ms(r.get('schedule_bound_s'))} | {x(r.get('schedule_bound_ratio'))} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", type=Path, help="a lowcomm bench --json file")
    ap.add_argument("--profile", type=Path, required=True, help="the profile the bench used (its work_dir/profile.json)")
    ap.add_argument("--markdown", type=Path, help="also write the tables here")
    args = ap.parse_args()
    text = table(json.loads(args.bench.read_text()), Profile.load(args.profile))
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
