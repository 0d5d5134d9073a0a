"""Flat ring vs hierarchical vs hybrid all-reduce of ResNet-50's gradients on emulated nodes.

Why: issue 14's targets for the hierarchical all-reduce (Jia et al. 2018) are >= 1.3x faster
than the flat ring at 2 nodes x 2 workers and >= 1.5x at 2 nodes x 4, on a 1 Gbit/s link
between nodes with the workers of a node on loopback; the byte limits (node-link bytes of the
flat ring over the hierarchical's, 2(P-1)/P / 2(N-1)/N) are 1.5x and 1.75x.

What runs: for each layout an emulated cluster of N nodes (``lowcomm.bench.netns.Cluster`` with
``nproc_per_node`` G: one network namespace per node, its link shaped both ways, its G workers
talking over the namespace's loopback), probed (between nodes and inside a node). Then N*G
gloo workers with torchrun's node layout (``LOCAL_WORLD_SIZE`` = G) each hold ResNet-50's
gradients (``resnet50_imagenet``: 161 tensors, 25.6 M parameters, 102 MB in fp32) fused like
DDP (backward order, first bucket 1 MiB, then 25 MiB) and all-reduce every bucket, one after
another, with

* ``flat``: one ring all-reduce over all workers (``lowcomm.comm.accounting.all_reduce``);
* ``hier``: :func:`lowcomm.comm.hierarchical.hierarchical_all_reduce` (intra-node
  reduce-scatter, inter-node all-reduce among same-local-rank workers, intra-node all-gather);
* ``hybrid``: per bucket the one :func:`lowcomm.comm.hierarchical.choose` picks from link
  costs probed once by the workers (:func:`~lowcomm.comm.hierarchical.probe_link_costs`).

An iteration is every bucket once (buffers refilled before, outside the clock; a barrier
starts it); the slowest rank's time counts; the median of ``--iters`` iterations after
``--warmup`` is recorded, with the inter-node bytes per worker and iteration the accounting
ledger counted (its ``by_link``). The first iteration's sums are checked against the exact
value. Next to each figure: the simulator's prediction (``lowcomm.sim.NetworkModel.two_level``
from the probed links, one NIC per node) and the target.

Results: ``benchmarks/results/hier_allreduce.json``; the table goes into
``docs/hierarchical.md`` between ``<!-- hier-bench:begin -->`` and ``<!-- hier-bench:end -->``;
``--table-only`` re-renders it from the JSON. Timings depend on the machine (recorded with the
result) and on its load: run it alone. Needs root for the namespaces (else it runs on loopback
and says so: the figures then show no network effect).

    .venv/bin/python benchmarks/hier_allreduce.py                       # 2x2 and 2x4, 1 Gbit/s
    .venv/bin/python benchmarks/hier_allreduce.py --layouts 2x2 --iters 2 --warmup 1 --scale 0.02 \\
        --json /tmp/h.json --no-doc                                     # smoke run (tiny tensors)
    .venv/bin/python benchmarks/hier_allreduce.py --table-only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy as acc  # noqa: E402  (the sibling script: machine, commit, doc block helpers)

REPO = acc.REPO
RESULTS = REPO / "benchmarks" / "results" / "hier_allreduce.json"
DOC = REPO / "docs" / "hierarchical.md"
BLOCK = "hier-bench"
ALGORITHMS = ("flat", "hier", "hybrid")
#: (nodes, workers per node) -> (speed-up target over flat, byte limit)
TARGETS = {(2, 2): 1.3, (2, 4): 1.5}
PORT = 29700  # inside the namespaces nothing else listens (the trainer uses 29500)


# --- the workload ------------------------------------------------------------------------------


def bucket_sizes(model: str, bucket_mb: float, first_bucket_mb: float, scale: float) -> list[int]:
    """Elements of each fused bucket, in the order DDP fills them (backward: last layer first)."""
    from lowcomm import models
    from lowcomm.sim.schedules.base import MIB, GradTensor, ddp_buckets

    net = models.create(model)
    shapes = [tuple(p.shape) for p in net.parameters() if p.requires_grad]
    tensors = [GradTensor(i, s) for i, s in reversed(list(enumerate(shapes)))]
    buckets = ddp_buckets(tensors, 4, bucket_mb * MIB, first_bucket_mb * MIB)
    return [max(1, int(b.numel * scale)) for b in buckets]


# --- one worker (runs inside its node's namespace) ----------------------------------------------


def worker(out: str, sizes: list[int], iters: int, warmup: int, threads: int) -> None:
    """Time every algorithm on this rank; rank 0 writes the results to ``out``."""
    import torch
    import torch.distributed as dist

    from lowcomm.comm import accounting
    from lowcomm.comm.hierarchical import choose, hierarchical_all_reduce, probe_link_costs
    from lowcomm.comm.topology import Topology, node_groups

    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    topo = Topology.from_env()
    accounting.set_topology(topo)
    groups = node_groups(topo)
    costs = probe_link_costs(topo, groups) if topo.hierarchical else None
    rank, p = dist.get_rank(), dist.get_world_size()
    bufs = [torch.empty(n) for n in sizes]
    expect = p * (p + 1) / 2  # every rank holds rank + 1: the sum, exact in fp32

    def run(alg: str, buf: torch.Tensor, k: int) -> None:
        choice = alg if alg != "hybrid" else choose(buf.numel() * 4, topo, costs, "hybrid")
        if choice == "flat" or not topo.hierarchical:
            accounting.all_reduce(buf, tag=f"bench.flat.b{k}")
        else:
            hierarchical_all_reduce(buf, topo, groups, tag=f"bench.hier.b{k}")

    result: dict[str, Any] = {"workers": p, "nodes": topo.nodes, "nproc_per_node": topo.local_size,
                              "hierarchical": topo.hierarchical, "bucket_elems": sizes, "algorithms": {}}
    if costs is not None:
        result["link_costs"] = {"alpha_intra": costs.intra.alpha, "beta_intra": costs.intra.beta,
                                "alpha_inter": costs.inter.alpha, "beta_inter": costs.inter.beta}
    for alg in ALGORITHMS:
        times, correct = [], True
        for i in range(warmup + iters):
            for b in bufs:
                b.fill_(rank + 1.0)
            if i == warmup:
                accounting.ledger().reset()  # count the timed iterations only
            dist.barrier()
            t0 = time.perf_counter()
            for k, b in enumerate(bufs):
                run(alg, b, k)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # not counted: bookkeeping, not the workload
            if i == 0:
                correct = all(bool(torch.all(b == expect)) for b in bufs)
            if i >= warmup:
                times.append(float(elapsed.item()))
        led = accounting.ledger()
        result["algorithms"][alg] = {
            "times_s": times, "median_s": statistics.median(times), "correct": correct,
            "wire_bytes_per_worker_per_iter": led.wire_bytes / iters,
            "inter_node_bytes_per_worker_per_iter": led.inter_wire_bytes / iters,
            "intra_node_bytes_per_worker_per_iter": led.intra_wire_bytes / iters,
            "hierarchical_buckets": sum(1 for b in bufs if alg == "hier" or (
                alg == "hybrid" and choose(b.numel() * 4, topo, costs, "hybrid") == "hier")),
        }
    if rank == 0:
        Path(out).write_text(json.dumps(result) + "\n")
    dist.barrier()
    dist.destroy_process_group()


# --- the driver (runs in the host namespace) ----------------------------------------------------


def predict(sizes: list[int], nodes: int, g: int, net: dict[str, Any]) -> dict[str, float]:
    """Seconds per iteration of each algorithm under the simulator's two-level model."""
    from lowcomm.sim import Link, NetworkModel

    inter = Link(alpha_s=(net.get("rtt_ms") or 0.0) / 2e3, beta_s_per_byte=8.0 / net["measured_bits_per_s"])
    intra_bits = net.get("intra_node_bits_per_s") or 20e9
    intra = Link(alpha_s=(net.get("intra_node_rtt_ms") or 0.0) / 2e3, beta_s_per_byte=8.0 / intra_bits)
    model = NetworkModel.two_level(inter, intra, g)
    p = nodes * g
    names = {"flat": "flat", "hier": "hierarchical", "hybrid": "hybrid"}
    return {alg: sum(model.all_reduce_with(names[alg], 4 * n, p) for n in sizes) for alg in ALGORITHMS}


def run_layout(nodes: int, g: int, args: argparse.Namespace, sizes: list[int], work: Path) -> dict[str, Any]:
    """One layout on its own emulated cluster: probe, run the workers, predict."""
    from lowcomm.bench import netns, probe
    from lowcomm.bench.runner import launch_options, redirect_fds
    from lowcomm.runtime.launch import launch_workers

    spec = netns.parse_net(args.net)
    p = nodes * g
    out = work / f"hier-{nodes}x{g}.json"
    log = work / f"hier-{nodes}x{g}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    wargs = ["--out", str(out), "--sizes", ",".join(map(str, sizes)), "--iters", str(args.iters),
             "--warmup", str(args.warmup), "--threads", str(args.threads)]
    net: dict[str, Any] = {"requested": args.net, "emulated": False}
    reason = netns.netns_support()
    if reason:
        print(f"  cannot emulate nodes ({reason}): running on loopback, the figures show no network effect",
              file=sys.stderr)
        net["note"] = f"not emulated: {reason}"
        lb = probe.probe_loopback()
        net.update(measured_bits_per_s=lb.measured_bits_per_s, rtt_ms=lb.rtt_ms)
        with redirect_fds(log):
            code = launch_workers(wargs, p, nproc_per_node=g, command=cmd, timeout_s=args.timeout, quiet=True,
                                  **{k: v for k, v in launch_options(None, PORT).items() if k != "nproc_per_node"})
    else:
        with netns.Cluster(p, spec, g) as cluster:
            between, inside = probe.probe_cluster(cluster)
            net.update(emulated=True, label=spec.label(), measured_bits_per_s=between.measured_bits_per_s,
                       rtt_ms=between.rtt_ms)
            if inside is not None:
                net.update(intra_node_bits_per_s=inside.measured_bits_per_s, intra_node_rtt_ms=inside.rtt_ms)
            print(f"  link between nodes {netns.format_rate(between.measured_bits_per_s)}"
                  + (f", inside a node {netns.format_rate(inside.measured_bits_per_s)}" if inside else ""),
                  file=sys.stderr)
            with redirect_fds(log):
                code = launch_workers(wargs, p, command=cmd, timeout_s=args.timeout, quiet=True,
                                      **launch_options(cluster, PORT))
    if code != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        return {"status": "failed", "returncode": code, "error": tail, "network": net}
    res = json.loads(out.read_text())
    res.update(status="ok", network=net, predicted_s=predict(sizes, nodes, g, net))
    return res


# --- the table ----------------------------------------------------------------------------------


def _mb(b: float | None) -> str:
    return "-" if b is None else f"{b / 1e6:.1f}"


def render(doc: dict[str, Any]) -> str:
    """The Markdown block: one row per layout and algorithm, targets and limits beside them."""
    m = doc.get("machine", {})
    lines = [
        "_Generated by `benchmarks/hier_allreduce.py` from `benchmarks/results/hier_allreduce.json`; "
        "do not edit by hand._",
        "",
        f"Measured on {m.get('cpu') or m.get('platform', '?')}, {m.get('cpu_count', '?')} cores, torch "
        f"{m.get('torch', '?')}, commit {acc.short_commit(doc.get('git_commit'))}; "
        f"{doc.get('model', 'resnet50_imagenet')} gradients ({doc.get('params', 0) / 1e6:.1f} M parameters, "
        f"{doc.get('buckets', '?')} buckets of {doc.get('bucket_mb', 25):g} MiB, DDP's order), "
        f"node link {doc.get('net', '1gbit')}, median of {doc.get('iters', '?')} iterations.",
        "",
        "| layout | all-reduce | s/iter | speed-up vs flat | target | predicted s/iter (speed-up) "
        "| inter-node MB/worker/iter | node link MB/iter | flat/this node bytes (limit) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    notes = []
    for key, lay in doc.get("layouts", {}).items():
        nodes, g = lay.get("nodes"), lay.get("nproc_per_node")
        if lay.get("status") != "ok":
            lines.append(f"| {key} | failed: {str(lay.get('error', ''))[-120:].strip()} | | | | | | | |")
            continue
        net = lay.get("network", {})
        if not net.get("emulated"):
            notes.append(f"{key} ran on loopback ({net.get('note', 'not emulated')}): no network effect.")
        algs, pred = lay["algorithms"], lay.get("predicted_s", {})
        flat_t, flat_inter = algs["flat"]["median_s"], algs["flat"]["inter_node_bytes_per_worker_per_iter"]
        p = nodes * g
        limit = (2 * (p - 1) / p) / (2 * (nodes - 1) / nodes) if nodes > 1 else None
        target = TARGETS.get((nodes, g))
        for alg in ALGORITHMS:
            a = algs[alg]
            t = a["median_s"]
            speed = flat_t / t if t else None
            inter = a["inter_node_bytes_per_worker_per_iter"]
            if alg == "flat":
                tgt = "-"
            elif target is None:
                tgt = "-"
            else:
                tgt = f">= {target:g}x " + ("met" if speed and speed >= target else "**not met**")
            pr = pred.get(alg)
            pr_txt = "-" if pr is None else f"{pr:.3g} ({pred['flat'] / pr:.2f}x)"
            ratio = f"{flat_inter / inter:.2f}x" if inter else "-"
            lim = f" ({limit:.2f}x)" if limit else ""
            extra = "" if a.get("correct", True) else " **wrong sums**"
            if alg == "hybrid":
                extra += f" ({a.get('hierarchical_buckets', '?')}/{len(lay['bucket_elems'])} buckets hier)"
            lines.append(f"| {key} | {alg}{extra} | {t:.3g} | {speed:.2f}x | {tgt} | {pr_txt} | {_mb(inter)} "
                         f"| {_mb(inter * g if inter is not None else None)} | {ratio}{lim} |")
    most = max((int(lay.get("workers") or 0) for lay in doc.get("layouts", {}).values()), default=0)
    lines += ["", "Node link MB/iter = G x the inter-node bytes one worker sends (the accounting ledger's ring "
              "model: a flat ring crosses each node boundary once). The speed-up cannot exceed the byte limit "
              "while the node link is the bottleneck. The prediction is the simulator's two-level model "
              "(`NetworkModel.two_level`, one NIC per node) from the probed links, without gloo's per-step "
              f"CPU costs. Caveat: {most} workers shared the machine's {m.get('cpu_count', '?')} cores at the "
              "largest layout: the intra-node reduce-scatter (an all-to-all plus a local sum on gloo) and the "
              "loopback copies compete for the cores, so intra-node stages are slower than on real multi-GPU "
              "nodes and the hierarchical gain is understated."]
    lines += [f"\n{n}" for n in notes]
    return "\n".join(lines)


# --- command line -------------------------------------------------------------------------------


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """``2x2,2x4`` -> [(2, 2), (2, 4)]."""
    out = []
    for part in text.split(","):
        n, _, g = part.strip().partition("x")
        if not (n.isdigit() and g.isdigit()) or int(n) < 1 or int(g) < 1:
            raise SystemExit(f"bad layout {part!r}; use NODESxWORKERS, e.g. 2x2,2x4")
        out.append((int(n), int(g)))
    return out


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", help=argparse.SUPPRESS)
    ap.add_argument("--layouts", default="2x2,2x4", help="NODESxWORKERS list (default 2x2,2x4)")
    ap.add_argument("--net", default="1gbit", help="each node's link (default 1gbit)")
    ap.add_argument("--model", default="resnet50_imagenet", help="whose gradient sizes (default resnet50_imagenet)")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--first-bucket-mb", type=float, default=1.0)
    ap.add_argument("--scale", type=float, default=1.0, help="shrink every bucket (smoke runs)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per layout")
    ap.add_argument("--json", default=str(RESULTS))
    ap.add_argument("--doc", default=str(DOC))
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--table-only", action="store_true", help="re-render the table from --json")
    return ap.parse_args(argv)


def write_table(doc: dict[str, Any], args: argparse.Namespace) -> None:
    """Put the table into the doc's block, or say why not."""
    if args.no_doc:
        return
    path = Path(args.doc)
    try:
        acc.write_doc(path, BLOCK, render(doc))
    except (OSError, ValueError) as e:
        print(f"table not written to {path}: {e}", file=sys.stderr)
        return
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.worker:
        worker(args.out, [int(x) for x in args.sizes.split(",")], args.iters, args.warmup, args.threads)
        return 0
    if args.table_only:
        recorded: dict[str, Any] = json.loads(Path(args.json).read_text())
        print(render(recorded))
        write_table(recorded, args)
        return 0
    from lowcomm import models

    sizes = bucket_sizes(args.model, args.bucket_mb, args.first_bucket_mb, args.scale)
    params = sum(p.numel() for p in models.create(args.model).parameters())
    doc: dict[str, Any] = {"benchmark": "hier_allreduce", "model": args.model, "params": params,
                           "scale": args.scale, "bucket_mb": args.bucket_mb, "buckets": len(sizes),
                           "net": args.net, "iters": args.iters, "warmup": args.warmup,
                           "machine": acc.machine(), "git_commit": acc._git_commit(), "layouts": {}}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lowcomm-hier-") as tmp:
        for nodes, g in parse_layouts(args.layouts):
            key = f"{nodes}x{g}"
            print(f"{key}: {nodes} nodes x {g} workers, {len(sizes)} buckets, {4 * sum(sizes) / 1e6:.1f} MB ...",
                  file=sys.stderr)
            t0 = time.perf_counter()
            lay = run_layout(nodes, g, args, sizes, Path(tmp))
            lay.update(nodes=nodes, nproc_per_node=g, wall_s=round(time.perf_counter() - t0, 1))
            doc["layouts"][key] = lay
            if lay["status"] == "ok":
                print("  " + ", ".join(f"{a} {lay['algorithms'][a]['median_s']:.3f} s" for a in ALGORITHMS),
                      file=sys.stderr)
            else:
                print(f"  failed: {lay['error'][-300:]}", file=sys.stderr)
    doc["total_wall_s"] = round(time.perf_counter() - started, 1)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    print(render(doc))
    write_table(doc, args)
    return 0 if all(lay["status"] == "ok" for lay in doc["layouts"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
