"""Measure the CPU that gloo's threads take from compute and re-predict recorded bench rows with it.

Real-compute bench rows on this machine run 4 workers on 2 shared cores: every byte gloo moves
costs compute time (copies, reduction, syscalls on the cores the workers compute on). The
simulator charges ``cpu_s_per_wire_byte`` of compute per wire byte when a network model
carries it (``NetworkModel.with_contention``); this script measures it
(``lowcomm.bench.contention.measure_contention``, a matmul loop alone vs beside all-reduces in
the same process group), on an emulated cluster of each of the bench's networks as the bench
itself does since 2026-11-28 (``--loopback``: on loopback, as before), and re-predicts a
recorded bench JSON with and without it (with the per-collective floor measured beside it;
``--k`` gives k alone), so the two can be compared row by row. Emulated-compute rows (``compute: emulated:*``) compute by
waiting and take no CPU: they are predicted without contention.

    python benchmarks/sim_contention.py docs/bench/resnet18_4w.json [--k 1.5e-9 | --k 100mbit=4e-8,1gbit=3e-9]\n        [--loopback] [--profile P.json]

Prints JSON: the measured constant, then per row measured / predicted (k = 0) / predicted (k).
Timings on a loaded machine: compare the two predictions in the same run, not across runs.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any



def repredict(bench: dict[str, Any], prof: Any, k: float | dict[str, float],
              floor: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Every real-compute ok row of ``bench`` predicted with contention ``k`` (s per wire byte;
    a dict: per requested network) and the per-collective ``floor`` (s, per network; none if
    not given), by the bench's own rule (:func:`lowcomm.bench.prediction.add_predictions`) on copies."""
    from lowcomm.bench.prediction import add_predictions

    out = []
    for info in bench.get("networks") or [bench["network"]]:
        runs = [copy.deepcopy(r) for r in bench["runs"] if r.get("net") == info["requested"] and r.get("status") == "ok"]
        if not any(r["method"] == "nocomm" for r in runs):
            continue
        kn = k.get(info["requested"], 0.0) if isinstance(k, dict) else k
        add_predictions(runs, prof, info, workers=bench["world_size"], contention_s_per_byte=kn,
                        contention_s_per_collective=(floor or {}).get(info["requested"], 0.0))
        for r in runs:
            pred = r.get("predicted_iter_time_s")
            if pred is None:
                continue
            meas = r["iter_time_s_median"]
            out.append({"net": r["net"], "method": r["method"], "measured_s": meas,
                        "predicted_s": pred, "error": (pred - meas) / meas})
    return out


def _measure(net: str, args: argparse.Namespace, bench: dict[str, Any]) -> dict[str, Any]:
    """The contention constant on an emulated cluster of ``net`` (as the bench measures it),
    or on loopback with ``--loopback`` or where namespaces are not available."""
    from lowcomm.bench import netns
    from lowcomm.bench.contention import measure_contention

    workers = args.workers or bench["world_size"]
    kw = {"seconds": args.seconds, "threads": bench.get("threads_per_worker") or 1}
    reason = "--loopback" if args.loopback else netns.netns_support()
    spec = netns.parse_net(net)
    if reason or spec.loopback:
        return {**measure_contention(workers, **kw), "where": f"loopback ({reason or 'no emulation'})"}
    cluster = netns.Cluster(workers, spec, 1)
    cluster.up()
    try:
        return {**measure_contention(workers, cluster=cluster, **kw), "where": f"emulated {spec.label()}"}
    finally:
        cluster.down()


def main(argv: list[str] | None = None) -> int:
    """Measure (or take) the contention constant and re-predict one bench JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench")
    ap.add_argument("--k", default=None,
                    help="seconds per wire byte, one value or NET=K,... per network (skip measuring)")
    ap.add_argument("--loopback", action="store_true",
                    help="measure on loopback, not on an emulated cluster of each network (the bench's rule)")
    ap.add_argument("--workers", type=int, default=None, help="workers to measure with (default: the bench's)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--profile", default=None, help="profile JSON (default: profile the bench's model here)")
    ap.add_argument("--save-profile", default=None)
    args = ap.parse_args(argv)
    bench = json.loads(Path(args.bench).read_text())
    nets = [info["requested"] for info in bench.get("networks") or [bench["network"]]]
    measured: dict[str, Any] = {}
    k: float | dict[str, float]
    floor: dict[str, float] = {}
    if args.k is not None:
        k = ({n: float(v) for n, v in (item.split("=", 1) for item in args.k.split(","))} if "=" in args.k
             else float(args.k))
    else:
        k = {}
        for net in nets:
            measured[net] = _measure(net, args, bench)
            k[net] = measured[net]["cpu_s_per_wire_byte"]
            floor[net] = measured[net]["cpu_s_per_collective"]
    if args.profile:
        from lowcomm.sim import Profile

        prof = Profile.load(args.profile)
    else:
        from lowcomm.bench.prediction import measure

        prof = measure(model=bench["model"], batch_size=bench["batch_size"],
                       input_shape=bench.get("input_shape"), threads=bench.get("threads_per_worker"))
        if args.save_profile:
            prof.save(args.save_profile)
    base = {(r["net"], r["method"]): r for r in repredict(copy.deepcopy(bench), prof, 0.0)}
    rows = []
    for r in repredict(bench, prof, k, floor):
        b = base[(r["net"], r["method"])]
        rows.append({**r, "predicted_no_contention_s": b["predicted_s"], "error_no_contention": b["error"]})
    within = sum(abs(r["error"]) <= 0.15 for r in rows if r["method"] != "nocomm")
    within0 = sum(abs(r["error_no_contention"]) <= 0.15 for r in rows if r["method"] != "nocomm")
    n = sum(r["method"] != "nocomm" for r in rows)
    print(json.dumps({"cpu_s_per_wire_byte": k, "cpu_s_per_collective": floor, "measurement": measured,
                      "within_15pct": f"{within} of {n}", "within_15pct_no_contention": f"{within0} of {n}",
                      "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
