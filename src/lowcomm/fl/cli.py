"""``lowcomm fl``: federated simulation of many clients on ``--nproc`` worker processes.

The command starts the workers the way torchrun would (or runs as one of them, under
torchrun) and, on the launching side, watches the memory of all of them together. It does
not import torch: the launcher only parses, starts, samples memory and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from lowcomm.errors import UsageError
from lowcomm.fl.config import SCHEDULE_POLICIES, FLConfig
from lowcomm.runtime.flags import key_value
from lowcomm.runtime.launch import launch_workers, under_torchrun


def _factors(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected one slowdown factor >= 1 per worker, comma separated (e.g. 1,3), got {text!r}") from None


def default_start() -> str:
    """``fork`` where the OS has it (Linux), else ``spawn``."""
    return "fork" if sys.platform.startswith("linux") else "spawn"


def add_fl_arguments(p: argparse.ArgumentParser) -> None:
    """The ``lowcomm fl`` options; defaults from :class:`FLConfig` (one source)."""
    d = FLConfig()
    p.add_argument("--clients", type=int, default=d.clients, help="registered clients")
    p.add_argument("--per-round", type=int, default=d.per_round, help="clients sampled each round")
    p.add_argument("--nproc", type=int, default=d.nproc, help="local worker processes")
    p.add_argument("--nproc-per-node", type=int, default=None, help="workers per (emulated) node")
    p.add_argument("--algorithm", default=d.algorithm,
                   help="fedavg, fedprox[:mu=0.01], fednova, fedopt[:server=adam|yogi|adagrad,...] "
                        "(fedadam, fedyogi, fedadagrad), scaffold, feddyn[:alpha=0.01]")
    p.add_argument("--algorithm-module", action="append", default=[], metavar="FILE.py|MODULE",
                   help="import this in every worker first: it registers your own algorithm "
                        "(docs/fl_api.md); repeatable")
    p.add_argument("--model", default=d.model)
    p.add_argument("--model-arg", type=key_value, action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--data", default=d.data, help="mnist1d (generated), digits, leaf (--data-dir), ...")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--data-arg", type=key_value, action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--samples-per-client", type=int, default=None,
                   help="mnist1d: training samples generated per client (default 40)")
    p.add_argument("--partition", default=d.partition,
                   help="iid, dirichlet:alpha=0.5[,min_size=10], shards:per_client=2, natural")
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--local-epochs", type=int, default=d.local_epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr, help="clients' local SGD learning rate")
    p.add_argument("--momentum", type=float, default=d.momentum)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--schedule", default=d.schedule, help=f"client placement: {', '.join(SCHEDULE_POLICIES)}")
    p.add_argument("--warmup-rounds", type=int, default=d.warmup_rounds,
                   help="rounds split evenly before the runtime model is fitted")
    p.add_argument("--slowdown", type=_factors, default=None, metavar="S1,S2,...",
                   help="emulate slower workers: worker i takes S_i times as long (one factor per worker)")
    p.add_argument("--cross-silo", action="store_true",
                   help="one client per worker, every round (cross-silo FL; torchrun across machines)")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="evaluate every N rounds (and the last)")
    p.add_argument("--state-dir", default=None, help="client state store (stateful algorithms)")
    p.add_argument("--checkpoint-dir", default=None, help="save every complete round here")
    p.add_argument("--resume", action="store_true", help="continue from the last complete round")
    p.add_argument("--stop-after-rounds", type=int, default=None, help="stop after N rounds of this run")
    p.add_argument("--json", default=None, help="write the summary JSON here")
    p.add_argument("--log", default=None, help="append one JSON line per round here")
    p.add_argument("--plot", default=None, help="accuracy vs round and vs wall-clock (PNG/SVG/PDF)")
    p.add_argument("--start", choices=("fork", "spawn"), default=default_start(),
                   help="fork: workers forked from the launcher, sharing its imported torch "
                        "(less memory; default on Linux); spawn: new interpreters")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    p.add_argument("--quiet", action="store_true", help="no progress and no summary table")
    p.add_argument("--no-progress", action="store_true")


def config_from_args(args: argparse.Namespace) -> FLConfig:
    """The validated config of parsed arguments (before any worker starts)."""
    cfg = FLConfig(
        clients=args.clients, per_round=args.per_round, nproc=args.nproc, nproc_per_node=args.nproc_per_node,
        algorithm=args.algorithm, algorithm_modules=list(args.algorithm_module), model=args.model, model_args=dict(args.model_arg), data=args.data,
        data_dir=args.data_dir, data_args=dict(args.data_arg), samples_per_client=args.samples_per_client,
        partition=args.partition, rounds=args.rounds, local_epochs=args.local_epochs,
        batch_size=args.batch_size, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
        seed=args.seed, device=args.device, schedule=args.schedule, warmup_rounds=args.warmup_rounds,
        slowdown=args.slowdown, cross_silo=args.cross_silo, eval_every=args.eval_every,
        state_dir=args.state_dir, checkpoint_dir=args.checkpoint_dir, resume=args.resume,
        stop_after_rounds=args.stop_after_rounds, json=args.json, log=args.log, plot=args.plot,
        threads=args.threads, quiet=args.quiet, no_progress=args.no_progress,
    )
    cfg.validate()
    from lowcomm.fl.partition import parse_partition

    parse_partition(cfg.partition)  # numpy only: a bad spec is refused before workers start
    if cfg.slowdown is not None and len(cfg.slowdown) != cfg.nproc and not under_torchrun():
        raise UsageError(f"--slowdown has {len(cfg.slowdown)} factor(s) for --nproc {cfg.nproc} workers; "
                         f"give one factor >= 1 per worker, e.g. {','.join(['1'] * cfg.nproc)}")
    return cfg


def run_fl_command(args: argparse.Namespace) -> int:
    """``lowcomm fl``: be a worker (under torchrun) or start ``--nproc`` of them and watch memory."""
    cfg = config_from_args(args)
    if under_torchrun():
        from lowcomm.fl.runner import run_fl

        summary = run_fl(cfg)
        if summary is not None:
            _present(summary, cfg)
        return 0
    if cfg.threads is None:
        cfg.threads = max(1, (os.cpu_count() or 1) // cfg.nproc)
    json_path = cfg.json or tempfile.mkstemp(prefix="lowcomm-fl-", suffix=".json")[1]
    worker_cfg = FLConfig.from_json(cfg.to_json())
    worker_cfg.json = json_path
    from lowcomm.fl.memory import ProcessTreeSampler

    sampler = ProcessTreeSampler(os.getpid())
    fork_entry = _preload_for_fork() if args.start == "fork" else None
    try:
        # the sampler's thread starts after the forks: a child gets only the forking thread
        code = launch_workers(["fl", "--worker-config", worker_cfg.to_json()], cfg.nproc,
                              nproc_per_node=cfg.nproc_per_node, fork_entry=fork_entry,
                              on_started=sampler.start)
    finally:
        peak = sampler.stop()
    try:
        if code != 0:
            return code
        with open(json_path) as f:
            summary = json.load(f)
        summary["peak_memory"] = {"rss_bytes": peak.rss_bytes, "pss_bytes": peak.pss_bytes,
                                  "processes": peak.processes,
                                  "source": "launcher + workers, sampled together (lowcomm.fl.memory)"}
        from lowcomm.runtime.checkpoint import atomic_write_json

        if cfg.json:
            atomic_write_json(summary, cfg.json)
        _present(summary, cfg)
        return 0
    finally:
        if not cfg.json and os.path.exists(json_path):
            os.unlink(json_path)


def _preload_for_fork() -> Any:
    """Import what every worker needs (torch, the engine, the built-in algorithms) once, here,
    so forked workers share it (:mod:`lowcomm.runtime.forked`); return the workers' entry."""
    import lowcomm.fl.runner  # noqa: F401  torch, the engine, data and model registries
    from lowcomm.cli import main
    from lowcomm.fl.algorithms import algorithm_names

    algorithm_names()  # imports every built-in algorithm module
    return main


def _present(summary: dict[str, Any], cfg: FLConfig) -> None:
    """Plot (``--plot``) and print the summary table (unless ``--quiet``)."""
    if cfg.plot:
        from lowcomm.fl.report import plot

        plot(summary["history"], cfg.plot)
    if not cfg.quiet:
        from lowcomm.fl.report import print_summary

        print_summary(summary)


def run_worker(args: argparse.Namespace) -> int:
    """A worker started by :func:`run_fl_command` (its settings arrive as JSON)."""
    from lowcomm.fl.runner import run_fl

    run_fl(FLConfig.from_json(args.worker_config))
    return 0


def _dispatch(args: argparse.Namespace) -> int:
    if args.worker_config is not None:
        return run_worker(args)
    return run_fl_command(args)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lowcomm fl``."""
    p = sub.add_parser("fl", help="federated simulation: many clients on a few worker processes (docs/fl.md)",
                       description=__doc__)
    add_fl_arguments(p)
    p.add_argument("--worker-config", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_dispatch)


__all__ = ["add_fl_arguments", "config_from_args", "register", "run_fl_command"]
