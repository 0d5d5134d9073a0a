"""Compare the simulator's predictions with a recorded ``lowcomm bench --json`` run.

    python benchmarks/sim_validation.py BENCH.json [--profile P.json] [--markdown OUT.md]

Profiles the bench's model locally (same batch size, input shape and torch threads per
worker as the bench) unless ``--profile`` is given, then predicts every measured run with
the network the bench measured (``NetworkModel.from_probe(measured_bits_per_s, rtt)``) and
prints measured vs predicted iteration time and the relative error.
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


def rows(bench: dict[str, Any], prof: Profile) -> list[dict[str, Any]]:
    nets = networks_by_name(bench)
    out = []
    for r in bench["runs"]:
        if r.get("status") != "ok" or r.get("net") not in nets:
            continue
        spec = r["method"]
        opts = (r.get("method_info") or {}).get("options") or {}
        pred = predict_iteration_time(prof, spec, workers=bench["world_size"], network=nets[r["net"]])
        meas = r["iter_time_s_median"]
        out.append({
            "net": r["net"], "method": spec, "measured_s": meas, "predicted_s": pred.iter_time_s,
            "error": (pred.iter_time_s - meas) / meas,
            "measured_bytes": r.get("bytes_per_worker_per_iter"),
            "predicted_bytes": pred.wire_bytes_per_worker, "options": opts,
        })
    return out


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
    ap.add_argument("bench")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--save-profile", default=None)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    bench = json.loads(Path(args.bench).read_text())
    if args.profile:
        prof = Profile.load(args.profile)
    else:
        torch.set_num_threads(int(bench.get("threads_per_worker") or 1))
        raw = bench.get("input_shape")
        shape = tuple(raw) if isinstance(raw, list) else ((int(raw),) if raw else None)
        prof = measure_profile(bench["model"], bench["batch_size"], "cpu", iters=20, warmup=5,
                               input_shape=shape)
        if args.save_profile:
            prof.save(args.save_profile)
    table = rows(bench, prof)
    text = markdown(bench, prof, table)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
