"""Compare the simulator's predictions with a recorded ``lowcomm bench --json`` run.

    python benchmarks/sim_validation.py BENCH.json [--profile P.json] [--markdown OUT.md]
    python benchmarks/sim_validation.py --recorded A.json B.json ...   # the bench's own predictions

``lowcomm bench`` itself now prints the prediction beside every row; this script re-predicts
a recorded run (e.g. after changing the simulator) the same way: it profiles the bench's
model locally (same batch size, input shape and torch threads per worker) unless
``--profile`` is given, calibrates compute to each network's measured ``nocomm`` run and uses
the network the bench measured, with the per-collective α/β of its collective probe when the
JSON has one (:mod:`lowcomm.bench.prediction`). ``--raw`` skips both calibrations (α = RTT/2,
profile compute as measured) to show what they are worth.

The counts the docs quote ("N of M rows within 15 %") are written from the same JSON by
``benchmarks/doc_numbers.py --write`` and checked by ``tests/test_docs_consistency.py``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from lowcomm.sim import NetworkModel, Profile, predict_iteration_time
from lowcomm.sim.cli import measure_profile


def networks_by_name(bench: dict[str, Any]) -> dict[str, NetworkModel]:
    out = {}
    for n in bench.get("networks") or [bench["network"]]:
        bits = n.get("measured_bits_per_s") or n.get("requested_bits_per_s")
        rtt = (n.get("rtt_ms") or 0.0) / 1e3
        if not bits:
            continue
        out[n["requested"]] = NetworkModel.from_probe(bits, rtt, name=n.get("label", n["requested"]))
    return out


def rows(bench: dict[str, Any], prof: Profile, *, raw: bool = False) -> list[dict[str, Any]]:
    import copy

    from lowcomm.bench.prediction import add_predictions

    if not raw:
        out = []
        for n in bench.get("networks") or [bench["network"]]:
            runs = [copy.deepcopy(r) for r in bench["runs"] if r.get("net") == n["requested"] and r.get("status") == "ok"]
            add_predictions(runs, prof, n, workers=bench["world_size"])
            out += [{"net": r["net"], "method": r["method"], "measured_s": r["iter_time_s_median"],
                     "predicted_s": r["predicted_iter_time_s"], "error": r["prediction_error"],
                     "measured_bytes": r.get("bytes_per_worker_per_iter"),
                     "predicted_bytes": r.get("predicted_bytes_per_worker_per_iter")}
                    for r in runs if r.get("predicted_iter_time_s") is not None]
        return out
    nets = networks_by_name(bench)
    out = []
    for r in bench["runs"]:
        if r.get("status") != "ok" or r.get("net") not in nets:
            continue
        spec = r.get("spec_run") or r["method"]
        opts = (r.get("method_info") or {}).get("options") or {}
        try:
            pred = predict_iteration_time(prof, spec, workers=bench["world_size"], network=nets[r["net"]])
        except Exception:  # noqa: BLE001 - reference hooks have no schedule
            continue
        meas = r["iter_time_s_median"]
        out.append({
            "net": r["net"], "method": spec, "measured_s": meas, "predicted_s": pred.iter_time_s,
            "error": (pred.iter_time_s - meas) / meas,
            "measured_bytes": r.get("bytes_per_worker_per_iter"),
            "predicted_bytes": pred.wire_bytes_per_worker, "options": opts,
        })
    return out


def _compute_s(r: dict[str, Any]) -> float:
    b = r.get("breakdown_s") or {}
    return sum(float(b.get(k, 0.0)) for k in ("forward", "backward", "optimizer"))


def recorded_markdown(benches: list[dict[str, Any]]) -> str:
    """The predictions ``lowcomm bench`` recorded, one row per method, with what explains the
    misses: the machine's load before the run and the row's own measured compute (forward +
    backward + optimizer) against the ``nocomm`` run's that calibrated the profile."""
    lines = [
        "| net | method | measured ms | predicted ms | error | load 1m | compute / nocomm compute | counted MB | sent MB (IP) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for bench in benches:
        for n in bench.get("networks") or [bench["network"]]:
            runs = [r for r in bench["runs"] if r.get("net") == n["requested"] and r.get("status") == "ok"]
            noc = next((r for r in runs if r["method"] == "nocomm"), None)
            for r in runs:
                pred = r.get("predicted_iter_time_s")
                drift = _compute_s(r) / _compute_s(noc) if noc and _compute_s(noc) else None
                tx = r.get("measured_tx_bytes_per_iter")
                lines.append(
                    f"| {n['requested']} | {r['method']} | {r['iter_time_s_median'] * 1e3:.0f} | "
                    + (f"{pred * 1e3:.0f} | {r['prediction_error'] * 100:+.0f}%" if pred is not None else "- | -")
                    + f" | {r.get('load_avg_1m_before') or 0:.1f} | " + (f"{drift:.2f}" if drift else "-")
                    + f" | {(r.get('bytes_per_worker_per_iter') or 0) / 1e6:.3g} | "
                    + (f"{tx / 1e6:.3g}" if tx is not None else "-") + " |")
    return "\n".join(lines) + "\n"


def markdown(bench: dict[str, Any], prof: Profile, table: list[dict[str, Any]]) -> str:
    lines = [
        f"{bench['model']} batch {bench['batch_size']}, {bench['world_size']} workers, "
        f"{bench.get('threads_per_worker')} thread(s)/worker; profile: forward "
        f"{prof.forward_s * 1e3:.3f} ms, backward {prof.backward_s * 1e3:.3f} ms, optimizer "
        f"{prof.optimizer_s * 1e3:.3f} ms",
        "",
        "| net | method | measured ms | predicted ms | error | measured B/iter | predicted B/iter |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in table:
        lines.append(
            f"| {r['net']} | {r['method']} | {r['measured_s'] * 1e3:.2f} | {r['predicted_s'] * 1e3:.2f} "
            f"| {r['error'] * 100:+.0f}% | {r['measured_bytes']:.0f} | {r['predicted_bytes']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bench", nargs="+")
    ap.add_argument("--recorded", action="store_true", help="print the predictions the bench recorded")
    ap.add_argument("--repredict", default=None, metavar="DIR",
                    help="re-predict recorded runs with the current simulator (saved profile); write to DIR")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--save-profile", default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--raw", action="store_true", help="no calibration: alpha = RTT/2, profile compute as measured")
    args = ap.parse_args()
    if args.repredict:
        # recompute the predictions (and schedule bounds) of recorded runs with the current
        # simulator, using the profile each bench saved (profile_path), and write the updated
        # JSONs (benchmarks/repredict.py: the same recomputation, as a comparison table)
        from repredict import refill

        for b in args.bench:
            bench = json.loads(Path(b).read_text())
            refill(bench, Profile.load(args.profile or bench["prediction"]["profile_path"]))
            out = Path(args.repredict) / Path(b).name
            out.write_text(json.dumps(bench, indent=2) + "\n")
            print(f"wrote {out}")
        return
    if args.recorded:
        text = recorded_markdown([json.loads(Path(b).read_text()) for b in args.bench])
        print(text)
        if args.markdown:
            Path(args.markdown).write_text(text)
        return
    bench = json.loads(Path(args.bench[0]).read_text())
    saved = (bench.get("prediction") or {}).get("profile_path")
    if args.profile or (saved and Path(saved).is_file()):
        prof = Profile.load(args.profile or saved)
    else:
        torch.set_num_threads(int(bench.get("threads_per_worker") or 1))
        raw = bench.get("input_shape")
        shape = (tuple(int(x) for x in raw) if isinstance(raw, list)
                 else tuple(int(x) for x in str(raw).split(",")) if raw else None)
        prof = measure_profile(bench["model"], bench["batch_size"], "cpu", iters=20, warmup=5,
                               input_shape=shape)
        if args.save_profile:
            prof.save(args.save_profile)
    table = rows(bench, prof, raw=args.raw)
    text = markdown(bench, prof, table)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
