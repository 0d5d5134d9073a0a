"""Re-predict recorded bench runs with the simulator as it is now (predictions and schedule bounds).

Why: a change to the simulator or its calibration should be checked against runs already
measured, not only new ones. Each case is a bench JSON and the profile the bench measured
for it (saved from its ``--work-dir``); the rows' measured times are kept, the prediction
and bound keys are recomputed exactly as the bench computes them (same network dict, worker
count and core share), and a table gives the recorded and the new figures side by side.

    python benchmarks/repredict.py RUN.json:PROFILE.json [...] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path
from typing import Any


def refill(run: dict[str, Any], prof: Any) -> None:
    """Recompute every network's prediction and schedule-bound keys of ``run`` in place, as
    the bench computes them (same network dict and worker count; the contention and core share
    the run recorded)."""
    from lowcomm.bench import prediction, schedule_bound
    from lowcomm.sim.calibrate import core_share

    workers = int(run["world_size"])
    per_node = int(run.get("nproc_per_node") or 1)
    here = core_share(workers=workers, threads_per_worker=int(run.get("threads_per_worker") or 1),
                      cpus=os.cpu_count() or 1)  # for runs recorded before the share was
    for net in run.get("networks") or [run["network"]]:
        rows = [r for r in run["runs"] if r.get("net") == net["requested"] and r.get("status") == "ok"]
        recorded = net.get("prediction") or {}  # the run's own contention and core share
        contention = recorded.get("contention_s_per_wire_byte") or 0.0
        per_collective = recorded.get("contention_s_per_collective") or 0.0
        share = recorded.get("emulated_compression_share") or here
        shared = (run.get("prediction") or {}).get("shared_compressors")  # emulated runs since 2026-11-29
        net["prediction"] = prediction.add_predictions(rows, prof, net, workers=workers, nproc_per_node=per_node,
                                                       contention_s_per_byte=contention,
                                                       contention_s_per_collective=per_collective, cpu_share=share,
                                                       shared_compressors=shared)
        if any("lower_bound_s" in r for r in rows):  # bounds only where the bench derived them
            net["schedule_bound"] = schedule_bound.add_schedule_bounds(rows, prof, net, workers=workers,
                                                                       nproc_per_node=per_node)


def repredict(run: dict[str, Any], profile_path: str) -> list[dict[str, Any]]:
    """Per network and method: measured time, recorded and new prediction error and bound ratio."""
    from lowcomm.sim import Profile

    new = copy.deepcopy(run)
    refill(new, Profile.load(profile_path))
    out = []
    for old, r in zip(run["runs"], new["runs"]):
        if r.get("status") != "ok":
            continue
        out.append({"net": r.get("net"), "method": r.get("spec_run") or r["method"],
                    "iter_time_s": r["iter_time_s_median"],
                    "recorded_prediction_error": old.get("prediction_error"),
                    "prediction_error": r.get("prediction_error"),
                    "recorded_schedule_bound_ratio": old.get("schedule_bound_ratio"),
                    "schedule_bound_ratio": r.get("schedule_bound_ratio")})
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f} %"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def main(argv: list[str] | None = None) -> int:
    """Re-predict each ``RUN.json:PROFILE.json`` and print the comparison (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases", nargs="+", help="RUN.json:PROFILE.json")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    result = {}
    for case in a.cases:
        run_path, sep, prof_path = case.partition(":")
        if not sep or not Path(run_path).is_file() or not Path(prof_path).is_file():
            print(f"repredict: {case!r} is not RUN.json:PROFILE.json with both files present", file=sys.stderr)
            return 2
        rows = repredict(json.loads(Path(run_path).read_text()), prof_path)
        result[run_path] = rows
        print(f"\n{run_path}\n\n| net | method | iter ms | pred err (recorded) | pred err (now) "
              "| iter/sched bound (recorded) | (now) |\n|---|---|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['net']} | {r['method']} | {1e3 * r['iter_time_s']:.1f} | {_pct(r['recorded_prediction_error'])} "
                  f"| {_pct(r['prediction_error'])} | {_ratio(r['recorded_schedule_bound_ratio'])} "
                  f"| {_ratio(r['schedule_bound_ratio'])} |")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
