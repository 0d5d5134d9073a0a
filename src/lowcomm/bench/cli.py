"""``lowcomm bench``: compare methods on one model over an emulated (or loopback) network.

Examples::

    lowcomm bench --nproc 4 --model resnet18 --methods ssgd,fp16,powersgd --net 100mbit --plot b.png
    lowcomm bench --nproc 4 --methods ssgd,powersgd --sweep-net 100mbit,1gbit,10gbit --json b.json
    lowcomm bench --nproc 4 --methods ssgd,powersgd --epochs 5        # time-to-accuracy, MNIST-1D
    lowcomm bench --nodes 2 --nproc-per-node 4 --methods ssgd,hier --net 1gbit   # 2 nodes x 4 workers

With ``--nodes N --nproc-per-node G`` the N*G workers run as N emulated nodes: the G workers
of a node share one network namespace and talk over its loopback, and only the node's link is
shaped to ``--net`` (:mod:`lowcomm.bench.netns`); the workers get torchrun's node layout
(``LOCAL_WORLD_SIZE`` = G). Without them every worker is its own node.

In time-to-accuracy mode (``--epochs``) every evaluation is kept in the JSON, and the table
gives each method's training time to 99% of ssgd's final test accuracy and the speed-up to
it (:mod:`lowcomm.bench.tta`); a method that never reaches it is reported as not reached.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lowcomm.errors import UsageError
from lowcomm.methods import split_list

DEFAULT_METHODS = ("ssgd", "fp16", "signsgd", "topk", "powersgd", "acpsgd")
#: most rounds ``--repeat`` accepts (each round runs every method once)
MAX_REPEAT = 20


def split_methods(text: str) -> list[str]:
    """Method specs from ``--methods``; see :func:`lowcomm.methods.split_list`."""
    return split_list(text)


def default_methods() -> str:
    """``--methods`` default: the standard comparison, less any method this build lacks."""
    from lowcomm import methods

    have = set(methods.names())
    return ",".join(m for m in DEFAULT_METHODS if m in have)


def register(sub: Any) -> None:
    """Add ``lowcomm bench`` to the CLI (each tool registers its own subcommand)."""
    p = sub.add_parser(
        "bench",
        help="benchmark methods against each other on an emulated cluster",
        description="Run several methods one after another on the same model, data shape, batch "
        "and network (one shaped network namespace per worker, or per node with --nodes/--nproc-per-node, "
        "when root; loopback otherwise).",
    )
    p.add_argument("--nproc", type=int, default=None,
                   help="workers (default 4, or nodes x nproc-per-node)")
    p.add_argument("--nodes", type=int, default=None,
                   help="emulated nodes, each with one shaped link (default: one per worker)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="workers per emulated node; they share its namespace and talk over loopback")
    p.add_argument("--model", default=None, help="model (default resnet18; cnn1d with --epochs)")
    p.add_argument("--data", default=None, help="dataset (default synthetic; mnist1d with --epochs)")
    p.add_argument("--input-shape", default="3,32,32", help="synthetic per-sample shape (default 3,32,32)")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated method specs (default: those of {','.join(DEFAULT_METHODS)} that exist)")
    p.add_argument("--net", default="100mbit", help="RATE[,delay=MS] e.g. 100mbit, 1gbit, or none (loopback)")
    p.add_argument("--sweep-net", default=None, metavar="RATES", help="e.g. 100mbit,1gbit,10gbit (overrides --net)")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per method (default 10)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed warm-up iterations (default 2; more for a method that first measures itself: mgwfbp, dear:tune=true, lee18:tune=true)")
    p.add_argument("--repeat", type=int, default=1, metavar="R",
                   help="run every method R times, in R rounds (each round runs every method once); a row is "
                        "its method's median run, every run's time kept, with their spread (default 1)")
    p.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
    p.add_argument("--epochs", type=int, default=None,
                   help="time-to-accuracy mode: train E epochs, evaluating each; reports the training time "
                        "to 99%% of ssgd's final test accuracy")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default cores/nproc)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per method (default 900)")
    p.add_argument("--no-compute-only", action="store_true", help="skip the nocomm run (no lower bound)")
    p.add_argument("--no-predict", action="store_true",
                   help="skip the simulator's predictions (no profiling, no collective probe)")
    p.add_argument("--work-dir", default=None, help="keep per-method logs and summaries here")
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.add_argument("--plot", default=None, help="write the breakdown PNG here (+ _speedup/_accuracy PNGs)")
    p.add_argument("--markdown", default=None, help="write the Markdown table here")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="model constructor argument passed to the workers, e.g. hidden=1024 (repeatable)")
    p.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                   help="extra argument passed to every `lowcomm train` worker (repeatable)")
    p.add_argument("--compute", default="real", metavar="real|emulated:PROFILE|emulated:scale=K",
                   help="emulated: every layer's forward/backward waits a profile's time instead of computing "
                        "(a file from `lowcomm profile`, a shipped name, or this machine's profile divided by "
                        "K), so schedules are compared as on GPUs; rows say 'compute emulated'")
    p.set_defaults(func=run)


def _check_input_shape(text: str) -> None:
    """The workers parse ``--input-shape`` with ``lowcomm train``'s rules: check it here, once."""
    from lowcomm.runtime.train_cli import parse_shape

    try:
        parse_shape(text)
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"--input-shape: {e}") from None


def _check_kv(text: str) -> str:
    if "=" not in text:
        raise UsageError(f"--model-arg expects KEY=VALUE, got {text!r}")
    return text


def _check_compute(text: str, *, tta: bool, batch_size: int) -> str:
    """``--compute``, checked once here (the workers get it as ``lowcomm train --compute``)."""
    from lowcomm.runtime.compute_spec import parse_compute

    spec = parse_compute(text)
    if spec.emulated and tta:
        raise UsageError(f"--compute {spec.text} times iterations only (the layers compute nothing, so "
                         "there is no accuracy to reach); drop --epochs")
    if spec.path is not None:
        from lowcomm.sim.profile import Profile

        profile = Profile.load(spec.path)
        if profile.batch_size != batch_size:
            raise UsageError(f"--compute {spec.text}: the profile was measured at batch {profile.batch_size} per "
                             f"worker; use --batch-size {profile.batch_size}")
    return spec.label


def node_layout(nproc: int | None, nodes: int | None, per_node: int | None) -> tuple[int, int | None]:
    """``(workers, workers per node or None)`` from ``--nproc``, ``--nodes``, ``--nproc-per-node``.

    Any two determine the third; all three must agree. None per node: the flags were not
    used (one worker per emulated node, as before nodes existed).
    """
    from lowcomm.bench import netns
    from lowcomm.errors import check_count

    for flag, value in (("--nproc", nproc), ("--nodes", nodes), ("--nproc-per-node", per_node)):
        if value is not None:
            check_count(flag, value, maximum=netns.MAX_WORKERS)
    if nodes is None and per_node is None:
        return (4 if nproc is None else nproc), None
    if nodes is not None and per_node is not None:
        if nproc is not None and nproc != nodes * per_node:
            raise UsageError(f"--nproc {nproc} disagrees with --nodes {nodes} x --nproc-per-node {per_node} "
                             f"= {nodes * per_node}; give two of the three")
        total = nodes * per_node
        check_count("--nodes x --nproc-per-node", total, maximum=netns.MAX_WORKERS)
        return total, per_node
    total = 4 if nproc is None else nproc
    given, name = (nodes, "--nodes") if nodes is not None else (per_node, "--nproc-per-node")
    assert given is not None
    if total % given:
        valid = ", ".join(str(d) for d in range(1, total + 1) if total % d == 0)
        raise UsageError(f"{name} {given} does not divide {total} workers; valid: {valid}")
    return total, (total // given if nodes is not None else given)


def build_config(args: argparse.Namespace) -> Any:
    """Validate everything that can be validated before a namespace or worker exists."""
    import os

    from lowcomm.bench import harness, netns
    from lowcomm.errors import check_count, check_positive
    from lowcomm.runtime.config import MAX_THREADS

    nproc, per_node = node_layout(args.nproc, args.nodes, args.nproc_per_node)
    check_count("--iters", args.iters)
    check_count("--warmup", args.warmup, minimum=0)
    check_count("--repeat", args.repeat, maximum=MAX_REPEAT)
    check_count("--batch-size", args.batch_size)
    check_positive("--timeout", args.timeout)  # also refuses nan/inf: "no limit" is not offered
    if args.epochs is not None:
        check_count("--epochs", args.epochs)
    if args.threads is not None:
        check_count("--threads", args.threads, maximum=MAX_THREADS)
    tta = args.epochs is not None
    if tta and args.repeat > 1:
        raise UsageError("--repeat applies to timing runs; a time-to-accuracy run (--epochs) is repeated by "
                         "running it again with another --train-arg=--seed")
    model = args.model or ("cnn1d" if tta else "resnet18")
    data = args.data or ("mnist1d" if tta else "synthetic")
    # `is not None`: an empty --sweep-net or --methods is a mistake, not "use the default"
    nets = netns.parse_net_list(args.sweep_net) if args.sweep_net is not None else [netns.parse_net(args.net)]
    methods = harness.validate_methods(split_methods(args.methods if args.methods is not None else default_methods()))
    if data == "synthetic":
        _check_input_shape(args.input_shape)
    from lowcomm import data as data_mod
    from lowcomm import models

    if model not in models.names():
        models.MODELS.get(model)  # raises UsageError listing the valid names
    if data not in data_mod.names():
        data_mod.DATASETS.get(data)
    harness.check_capacity(nproc, model)
    compute = _check_compute(args.compute, tta=tta, batch_size=args.batch_size)
    threads = args.threads or max(1, (os.cpu_count() or 1) // nproc)
    return harness.BenchConfig(
        methods=methods, nets=nets, nproc=nproc, nproc_per_node=per_node, model=model, data=data,
        input_shape=args.input_shape if data == "synthetic" else None, batch_size=args.batch_size,
        iters=args.iters, warmup=args.warmup, epochs=args.epochs, threads=threads,
        timeout_s=args.timeout, work_dir=args.work_dir, compute_only=not args.no_compute_only,
        extra_train_args=([a for kv in args.model_arg for a in ("--model-arg", _check_kv(kv))] + list(args.train_arg)
                          + (["--compute", compute] if compute != "real" else [])),
        quiet=args.quiet, predict=not args.no_predict, repeat=args.repeat,
    )


def run(args: argparse.Namespace) -> int:
    """``lowcomm bench``: run, print the table, write the JSON; the exit code says if any row failed."""
    from lowcomm.bench import harness, report, tta

    cfg = build_config(args)
    result = tta.annotate(harness.run_bench(cfg))  # time-to-accuracy runs: target, times, speed-ups
    report.print_table(result)
    if result.get("compute", "real") != "real":
        print(f"compute emulated: every row above ran with --compute {result['compute']} "
              "(layers wait the profile's times; communication and compression are real)")
    if args.json:
        report.write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.markdown:
        from pathlib import Path

        Path(args.markdown).write_text(report.markdown(result))
        print(f"wrote {args.markdown}")
    if args.plot:
        for path in report.plot(result, args.plot):
            print(f"wrote {path}")
    ok = [r for r in result["runs"] if r.get("status") == "ok" and r["method"] != "nocomm"]
    if not ok:
        print("lowcomm bench: no method completed", file=sys.stderr)
        return 1
    return 0


__all__ = ["register", "run", "split_methods", "UsageError"]
