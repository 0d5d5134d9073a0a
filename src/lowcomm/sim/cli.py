"""``lowcomm profile | simulate | advise``: measure a profile, predict at scale, recommend.

Examples::

    lowcomm profile --model resnet18 --batch-size 32 --out resnet18.json
    lowcomm simulate --profile resnet18.json --workers 8,64,1024 --net 10gbit \\
        --methods ssgd,powersgd:rank=4,acpsgd --plot speedup.png --json sim.json
    lowcomm advise --model resnet18 --net 10gbit --workers 64
    lowcomm simulate --profile resnet50.json --nodes 2 --gpus-per-node 4 --net 1gbit \
        --intra loopback --methods ssgd,hier,hier:mode=hybrid

``--nodes N --gpus-per-node G`` simulates N*G workers on a two-level topology: ``--net`` is
each node's link (one NIC per node, shared by its G workers), ``--intra`` the link inside a
node (:meth:`lowcomm.sim.network.NetworkModel.two_level`).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from lowcomm.errors import UsageError, check_count, check_positive
from lowcomm.methods import split_list
from lowcomm.sim.advise import advise, candidates, caveat
from lowcomm.sim.network import INTRA_PRESETS, NetworkModel, parse_intra, parse_network
from lowcomm.sim.predict import Prediction, ddp_caps, predict_iteration_time
from lowcomm.sim.schedules import make_schedule
from lowcomm.sim.profile import Profile, load_profile


#: Largest worker count the simulator accepts: well past any real cluster (the docs cover
#: 8-1024); larger numbers are typos.
MAX_WORKERS = 2**20


def split_methods(text: str) -> list[str]:
    """Method specs from ``--methods`` (:func:`lowcomm.methods.split_list`), checked."""
    specs = split_list(text)
    if not specs:
        raise UsageError("--methods is empty")
    for s in specs:
        make_schedule(s)  # refuse unknown names/options before any work
    return specs


def parse_workers(text: str) -> list[int]:
    """``--workers``: comma-separated counts, refused in one line before any work."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--workers must be comma-separated integers, got {text!r}") from None
    if not out or any(not 1 <= p <= MAX_WORKERS for p in out):
        raise UsageError(f"--workers needs integers from 1 to {MAX_WORKERS}, got {text!r}")
    return out


def check_device(device: str) -> None:
    """``--device``: ``cpu`` or ``cuda[:N]``, refused in one line before torch sees it."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise UsageError(f"--device must be cpu or cuda[:N], got {device!r}")


# -- profile ------------------------------------------------------------------------------
def measure_profile(model_name: str, batch_size: int, device: str, *, iters: int = 5,
                    warmup: int = 2, factorized: bool = True,
                    input_shape: tuple[int, ...] | None = None) -> Profile:
    """Profile a registry model on synthetic inputs (and its Pufferfish form if available).

    ``input_shape`` (per sample, classifiers only) overrides the model's default, as the
    bench's ``--input-shape`` does.
    """
    import torch
    from torch import nn

    from lowcomm import models
    from lowcomm.sim.profiler import profile_model

    check_count("--batch-size", batch_size)
    check_count("--iters", iters)
    check_count("--warmup", warmup, minimum=0)
    check_device(device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but CUDA is not available; use --device cpu")
    meta = models.info(model_name)
    kw: dict[str, Any] = {}
    shape = tuple(meta.default_input_shape)
    if input_shape is not None and meta.task == "classification":
        shape = tuple(input_shape)
        kw = models.kwargs_for_data(model_name, input_shape=shape)
    g = torch.Generator().manual_seed(0)
    dev = torch.device(device)
    if meta.task == "classification":
        x = torch.randn(batch_size, *shape, generator=g).to(dev)
        y = torch.randint(0, meta.output_size, (batch_size,), generator=g).to(dev)

        def loss_fn(out: Any, target: Any) -> Any:
            return nn.functional.cross_entropy(out, target)
    else:
        seq = meta.default_input_shape[0]
        x = torch.randint(0, meta.output_size, (batch_size, seq), generator=g).to(dev)
        y = torch.randint(0, meta.output_size, (batch_size, seq), generator=g).to(dev)

        def loss_fn(out: Any, target: Any) -> Any:
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    def batch() -> tuple[Any, Any]:
        return x, y

    torch.manual_seed(0)
    model = models.create(model_name, **kw)
    prof = profile_model(model, batch, loss_fn, model_name=model_name, batch_size=batch_size,
                         device=dev, iters=iters, warmup=warmup)
    if factorized:
        try:
            from lowcomm.lowrank import factorize
        except ImportError:
            factorize = None  # type: ignore[assignment]
        if factorize is not None:
            small = factorize(models.create(model_name, **kw), inplace=True)  # a fresh model
            fact = profile_model(small, batch, loss_fn, model_name=f"{model_name}:pufferfish",
                                 batch_size=batch_size, device=dev, iters=iters, warmup=warmup,
                                 measure_kernels=False)
            fact.costs, fact.compressors = prof.costs, prof.compressors
            prof.factorized = fact
    return prof


def run_profile(args: argparse.Namespace) -> int:
    """``lowcomm profile``: measure a model and write its profile JSON."""
    prof = measure_profile(args.model, args.batch_size, args.device, iters=args.iters,
                           warmup=args.warmup, factorized=not args.no_factorized)
    out = Path(args.out or f"profile-{args.model}-b{args.batch_size}.json")
    prof.save(out)
    print(f"profile of {prof.model} (batch {prof.batch_size}, {prof.device}): "
          f"{len(prof.layers)} layers, {prof.numel:,} parameters")
    print(f"  forward {prof.forward_s * 1e3:.2f} ms  backward {prof.backward_s * 1e3:.2f} ms  "
          f"optimizer {prof.optimizer_s * 1e3:.2f} ms")
    if prof.factorized is not None:
        f = prof.factorized
        print(f"  factorized: {f.numel:,} parameters, forward {f.forward_s * 1e3:.2f} ms, "
              f"backward {f.backward_s * 1e3:.2f} ms")
    print(f"wrote {out}")
    if args.json:
        Path(args.json).write_text(json.dumps(prof.to_dict(), indent=2) + "\n")
    return 0


# -- simulate -----------------------------------------------------------------------------
def two_level_network(net_spec: str, intra_spec: str, gpus_per_node: int) -> NetworkModel:
    """``--net`` as each node's link, ``--intra`` inside a node, one NIC per node."""
    check_count("--gpus-per-node", gpus_per_node, maximum=MAX_WORKERS)
    base = parse_network(net_spec)
    return NetworkModel.two_level(base.inter, parse_intra(intra_spec), gpus_per_node,
                                  algorithm="ring" if base.algorithm == "hierarchical" else base.algorithm,
                                  name=f"{net_spec} between nodes, {intra_spec} inside ({gpus_per_node}/node)")


BUCKET_HELP = ("DDP's bucket cap in MB, as `lowcomm train --bucket-cap-mb` (default: DDP's own, 25 MB after "
               "a 1 MB first bucket; a cap given applies to the first bucket too)")


def simulate_table(prof: Profile, methods: list[str], workers: list[int],
                   net_spec: str | NetworkModel, *, bucket_mb: float | None = None) -> dict[str, Any]:
    """Every method at every worker count, with speed-up and scaling efficiency (JSON-ready);
    ``bucket_mb`` as :func:`~lowcomm.sim.predict.ddp_caps` reads it."""
    net = parse_network(net_spec) if isinstance(net_spec, str) else net_spec
    cap, first = ddp_caps(bucket_mb)

    def predict(method: str, p: int) -> Prediction:
        return predict_iteration_time(prof, method, workers=p, network=net, bucket_mb=cap, first_bucket_mb=first)

    single = predict("ssgd", 1).iter_time_s
    rows = []
    for p in workers:
        base = predict("ssgd", p)
        for m in methods:
            pred = base if m == "ssgd" else predict(m, p)
            rows.append(dict(pred.as_dict(),
                             scaling_efficiency=single / pred.iter_time_s,
                             speedup_vs_ssgd=base.iter_time_s / pred.iter_time_s))
    return {
        "profile": {"model": prof.model, "batch_size": prof.batch_size, "device": prof.device,
                    "params": prof.numel, "single_worker_iter_time_s": single},
        "network": net.describe(),
        "workers": workers,
        "methods": methods,
        "results": rows,
    }


def print_results(rows: list[dict[str, Any]]) -> None:
    """The ``simulate`` table, one row per method and worker count."""
    head = f"{'method':<22}{'P':>6}{'iter ms':>11}{'samples/s':>12}{'eff':>7}{'vs ssgd':>9}" \
           f"{'MB/iter':>10}{'exposed ms':>12}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['method']:<22}{r['workers']:>6}{r['iter_time_s'] * 1e3:>11.2f}"
              f"{r['samples_per_s']:>12.1f}{r['scaling_efficiency']:>7.2f}"
              f"{r['speedup_vs_ssgd']:>8.2f}x{r['wire_bytes_per_worker'] / 1e6:>10.2f}"
              f"{r['breakdown_s']['comm_exposed'] * 1e3:>12.2f}")


def plot_speedup(result: dict[str, Any], path: str) -> None:
    """``--plot``: predicted speed-up vs workers, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in result["methods"]:
        pts = [(r["workers"], r["speedup_vs_ssgd"]) for r in result["results"] if r["method"] == m]
        ax.plot([p for p, _ in pts], [s for _, s in pts], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylabel("predicted speed-up vs ssgd")
    ax.set_title(f"{result['profile']['model']} on {result['network']['name']} (simulated)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def default_methods(prof: Profile) -> list[str]:
    """What ``simulate`` runs without ``--methods``: every advised method the profile allows."""
    return candidates(prof)


def run_simulate(args: argparse.Namespace) -> int:
    """``lowcomm simulate``: predict every method at every worker count."""
    prof = load_profile(args.profile)
    if args.bucket_mb is not None:
        check_positive("--bucket-mb", args.bucket_mb)
    workers = parse_workers(args.workers)
    net: str | NetworkModel = args.net
    if args.nodes is not None or args.gpus_per_node is not None:
        nodes = args.nodes if args.nodes is not None else 1
        g = args.gpus_per_node if args.gpus_per_node is not None else 1
        check_count("--nodes", nodes, maximum=MAX_WORKERS)
        check_count("--gpus-per-node", g, maximum=MAX_WORKERS)
        workers = [nodes * g]
        net = two_level_network(args.net, args.intra, g)
    methods = split_methods(args.methods) if args.methods is not None else default_methods(prof)
    result = simulate_table(prof, methods, workers, net, bucket_mb=args.bucket_mb)
    print(f"{prof.model} batch {prof.batch_size} ({prof.device}), "
          f"{prof.numel:,} params, network {result['network']['name']} "
          f"({result['network']['algorithm']})")
    print_results(result["results"])
    warned = {w for r in result["results"] for w in r["warnings"]}
    for w in sorted(warned):
        print(f"warning: {w}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot_speedup(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


# -- advise -------------------------------------------------------------------------------
def run_advise(args: argparse.Namespace) -> int:
    """``lowcomm advise``: rank the candidates at one scale and recommend one."""
    # Cheap checks first: a bad --workers must not cost a local profiling run.
    check_count("--workers", args.workers, maximum=MAX_WORKERS)
    if args.bucket_mb is not None:
        check_positive("--bucket-mb", args.bucket_mb)
    net = parse_network(args.net)
    methods = split_methods(args.methods) if args.methods is not None else candidates()
    if args.profile:
        prof = load_profile(args.profile)
    elif args.model:
        print(f"profiling {args.model} locally (batch {args.batch_size}, {args.device}) ...")
        prof = measure_profile(args.model, args.batch_size, args.device)
    else:
        raise UsageError("advise needs --model M (profiled locally) or --profile PATH")
    adv = advise(prof, workers=args.workers, network=net, methods=methods,
                 bucket_mb=args.bucket_mb)
    print(f"{prof.model} batch {prof.batch_size} ({prof.device}) on {args.workers} workers, "
          f"network {net.name}")
    print(f"{'method':<22}{'iter ms':>11}{'vs ssgd':>9}{'MB/iter':>10}")
    for p in adv.ranking:
        print(f"{p.method:<22}{p.iter_time_s * 1e3:>11.2f}{adv.speedup(p):>8.2f}x"
              f"{p.wire_bytes_per_worker / 1e6:>10.2f}")
    for m, why in adv.skipped.items():
        print(f"(skipped {m}: {why})")
    best = adv.best
    print(f"\nrecommended: {best.method} — predicted {adv.speedup(best):.2f}x vs ssgd "
          f"({best.iter_time_s * 1e3:.2f} ms/iter)")
    if best is not adv.ranking[0]:
        print(f"  ({adv.ranking[0].method} is predicted {adv.ranking[0].iter_time_s * 1e3:.2f} ms "
              "but changes the updates; an exact method within 5% is preferred)")
    print(f"  caveat: {caveat(best.method)}")
    for w in best.warnings:
        print(f"  warning: {w}")
    if adv.fc is not None:
        print(f"  fully-connected layers: {adv.fc['advice']}")
    for p in adv.semi_synchronous:
        print(f"  synchronizing less often: {p.method} is predicted {adv.speedup(p):.2f}x vs ssgd "
              f"({p.iter_time_s * 1e3:.2f} ms/iter averaged over its period; it changes the updates)")
    print("  the simulator predicts speed only; check accuracy on your task.")
    if args.json:
        Path(args.json).write_text(json.dumps(adv.as_dict(), indent=2) + "\n")
    return 0


def register(sub: Any) -> None:
    """Add ``profile``, ``simulate`` and ``advise`` to the ``lowcomm`` command line."""
    p = sub.add_parser("profile", help="measure per-layer times and gradient sizes of a model")
    p.add_argument("--model", required=True)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--iters", type=int, default=5, help="timed iterations (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-factorized", action="store_true",
                   help="skip profiling the Pufferfish-factorized model")
    p.add_argument("--out", default=None, help="profile JSON (default profile-MODEL-bB.json)")
    p.add_argument("--json", default=None, help="also write the profile here")
    p.set_defaults(func=run_profile)

    s = sub.add_parser("simulate", help="predict iteration times of methods at scale")
    s.add_argument("--profile", required=True,
                   help="profile JSON from 'lowcomm profile' or by hand, or a shipped GPU profile "
                        "(v100|a100|h100 - resnet50|vgg16|bert-base|lstm-lm, e.g. a100-resnet50)")
    s.add_argument("--workers", default="8,64,1024", help="comma-separated worker counts")
    s.add_argument("--net", default="10gbit",
                   help="preset (1gbit,10gbit,25gbit,100gbit,infiniband,nvlink) or RATE, "
                        "options ,delay=MS ,algo=ring|tree ,intra=nvlink,gpus_per_node=G")
    s.add_argument("--nodes", type=int, default=None,
                   help="two-level topology: nodes (workers = nodes x gpus-per-node; --net is the node link)")
    s.add_argument("--gpus-per-node", type=int, default=None, help="two-level topology: workers per node")
    s.add_argument("--intra", default="nvlink",
                   help=f"link inside a node with --nodes: {', '.join(INTRA_PRESETS)}, a network preset "
                        "or a RATE (default nvlink)")
    s.add_argument("--methods", default=None, help="comma-separated method specs (default: all)")
    s.add_argument("--bucket-mb", type=float, default=None, help=BUCKET_HELP)
    s.add_argument("--json", default=None)
    s.add_argument("--plot", default=None, help="PNG of speed-up vs workers")
    s.set_defaults(func=run_simulate)

    a = sub.add_parser("advise", help="recommend the fastest method for a model, network and scale")
    a.add_argument("--model", default=None)
    a.add_argument("--profile", default=None,
                   help="use this profile instead of measuring: a JSON path or a shipped GPU "
                        "profile name (e.g. a100-resnet50)")
    a.add_argument("--net", required=True)
    a.add_argument("--workers", type=int, required=True)
    a.add_argument("--batch-size", type=int, default=32)
    a.add_argument("--device", default="cpu")
    a.add_argument("--methods", default=None, help="restrict to these methods")
    a.add_argument("--bucket-mb", type=float, default=None, help=BUCKET_HELP)
    a.add_argument("--json", default=None)
    a.set_defaults(func=run_advise)
