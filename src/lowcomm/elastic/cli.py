"""``lowcomm elastic train|search|extract``: elastic supernets from the command line.

- ``train``: every ``lowcomm train`` flag (model, data, ``--nproc``, ``--method``, optimizer,
  checkpoints, torchrun) plus the progressive-shrinking schedule (``--phases``, ``--subnets``,
  ``--phase-lr``, ``--distill``); ``--scratch CONFIG`` trains one sub-network alone instead.
- ``search``: the most accurate sub-network under each ``--latency-ms`` budget (latency table
  measured on this machine, evolutionary search, random baseline).
- ``extract``: a sub-network (``--config`` or the search's answer for ``--latency-ms``) as a
  plain module with copied weights and re-calibrated BN, written with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from lowcomm.errors import UsageError
from lowcomm.runtime.launch import launch_workers, under_torchrun
from lowcomm.runtime.train_cli import add_train_arguments, check_names, config_from_args, default_threads

PHASES_HELP = ("phases as NAME:EPOCHS in OFA's order full, kernel, depth, expand, scales (stereo); "
               "default: EASNet's ratio 64:25:25:25:25 scaled to --epochs")


def parse_config_spec(text: str) -> dict[str, Any] | str:
    """``max``, ``min``, a JSON object, or a path to a JSON file -> the config (or the keyword)."""
    if text in ("max", "min"):
        return text
    source = text
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise UsageError(f"config {text!r}: give max, min, a JSON object or a JSON file")
        source = path.read_text()
    try:
        value = json.loads(source)
    except json.JSONDecodeError as e:
        raise UsageError(f"config {text!r} is not valid JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise UsageError(f"config {text!r} must be a JSON object like {{\"kernel\": [3, 5], ...}}")
    return value


def _number_map(flag: str, text: str | None, kind: type) -> dict[str, Any]:
    """``depth=2,expand=4`` -> ``{"depth": 2, "expand": 4}`` (values of type ``kind``)."""
    out: dict[str, Any] = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        key, sep, value = item.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError
            out[key.strip()] = kind(value)
        except ValueError:
            what = "whole number" if kind is int else "number"
            raise UsageError(f"{flag}: {item!r} must be PHASE=VALUE with a {what}") from None
    return out


def elastic_config_from_args(args: argparse.Namespace) -> Any:
    """The validated :class:`~lowcomm.elastic.config.ElasticConfig` of ``elastic train``."""
    from lowcomm import models as model_registry
    from lowcomm.elastic.artifacts import build_supernet
    from lowcomm.elastic.config import ElasticConfig
    from lowcomm.elastic.shrinking import Phase, default_phases_text, parse_phases

    cfg = config_from_args(args)
    check_names(cfg)
    if not cfg.model.startswith("elastic_"):
        elastic = [n for n in model_registry.names() if n.startswith("elastic_")]
        raise UsageError(f"model {cfg.model!r} is not an elastic supernet; valid: {', '.join(elastic)}")
    model_args = {k: v for k, v in cfg.model_args.items()}
    space = build_supernet(cfg.model, model_args).space  # the dimensions the phases may use
    scratch = None
    if args.scratch is not None:
        spec = parse_config_spec(args.scratch)
        scratch = space.max_config() if spec == "max" else space.min_config() if spec == "min" else space.validate(spec)  # type: ignore[arg-type]
        phases = [Phase("scratch", cfg.epochs, (), 1)]
    else:
        text = args.phases or default_phases_text(space.names, cfg.epochs)
        phases = parse_phases(text, space.names, subnets=_number_map("--subnets", args.subnets, int),
                              lrs=_number_map("--phase-lr", args.phase_lr, float))
    if args.out:
        from lowcomm.runtime.config import check_writable

        check_writable("--out", args.out, is_dir=False)
    ecfg = ElasticConfig(train=cfg, phases=[p.to_json() for p in phases], distill=args.distill,
                         sandwich=args.sandwich,
                         bn_batches=args.bn_batches, out=args.out, init=args.init, scratch=scratch)
    ecfg.validate()
    return ecfg


def run_train_command(args: argparse.Namespace) -> int:
    """``lowcomm elastic train``: here (torchrun, one worker) or ``--nproc`` local workers."""
    from lowcomm.elastic.config import ElasticConfig

    if args.worker_config is not None:
        return _worker(ElasticConfig.from_json(args.worker_config))
    ecfg = elastic_config_from_args(args)
    if ecfg.train.threads is None:
        ecfg.train.threads = default_threads(ecfg.train.nproc)
    json_path = ecfg.train.json or tempfile.mkstemp(prefix="lowcomm-elastic-", suffix=".json")[1]
    worker = ElasticConfig.from_json(ecfg.to_json())
    worker.train.json = json_path
    try:
        if under_torchrun():
            code = _worker(worker)
        elif ecfg.train.nproc == 1 and ecfg.train.device != "cuda":
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            try:
                code = _worker(worker)
            finally:
                for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
                    os.environ.pop(v, None)
        else:
            code = launch_workers(["elastic", "train", "--worker-config", worker.to_json()], ecfg.train.nproc,
                                  nproc_per_node=ecfg.train.gpus_per_node)
        if code != 0:
            return code
        if not args.quiet and (not under_torchrun() or os.environ.get("RANK", "0") == "0"):
            with open(json_path) as f:
                print_train_summary(json.load(f))
        return 0
    finally:
        if not ecfg.train.json and os.path.exists(json_path):
            os.unlink(json_path)


def _worker(ecfg: Any) -> int:
    import torch.distributed as dist

    from lowcomm.elastic.train import run_elastic

    try:
        run_elastic(ecfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def print_train_summary(s: dict[str, Any]) -> None:
    """The phases and their final metrics as a table."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"lowcomm elastic train: {s['model']} on {s['data']} ({s['mode']}, {s['method']}, "
                        f"{s['world_size']} workers)")
    for col in ("phase", "epochs", "elastic", "sub-nets/step", "largest", "smallest", "iter (ms)"):
        table.add_column(col, justify="right" if col not in ("phase", "elastic") else "left")
    for p in s["phases"]:
        final = p.get("final", {})
        key = "test_accuracy" if "test_accuracy" in final else "test_epe" if "test_epe" in final else None
        fmt = (lambda v: f"{100 * v:.2f} %") if key == "test_accuracy" else (lambda v: f"{v:.3f} px")
        largest = fmt(final[key]) if key and key in final else "-"
        smallest = fmt(final[f"{key}_min"]) if key and f"{key}_min" in final else "-"
        table.add_row(p["name"], str(p["epochs"]), ",".join(p["elastic"]) or "-", str(p["subnets"]), largest,
                      smallest, f"{1000 * (p.get('iter_time_s_median') or 0):.1f}")
    Console().print(table)
    if s.get("out"):
        Console().print(f"written: {s['out']}")


def add_elastic_train_arguments(p: argparse.ArgumentParser) -> None:
    """``lowcomm train``'s flags plus the shrinking schedule."""
    add_train_arguments(p)
    g = p.add_argument_group("progressive shrinking")
    g.add_argument("--phases", default=None, help=PHASES_HELP)
    g.add_argument("--subnets", default=None,
                   help="sub-networks per step by phase, e.g. depth=2,expand=4,scales=6 (EASNet's, the default)")
    g.add_argument("--phase-lr", default=None, help="learning rate by phase, e.g. kernel=0.01 (default: --lr)")
    g.add_argument("--distill", type=float, default=0.0,
                   help="weight of the distillation loss against the full network (OFA's kd_ratio; 0: off)")
    g.add_argument("--sandwich", action="store_true",
                   help="also train each phase's smallest sub-network at every step (BigNAS's sandwich rule)")
    g.add_argument("--bn-batches", type=int, default=10, help="batches for BN re-calibration before evaluations")
    g.add_argument("--out", default=None, help="write the trained supernet (or --scratch sub-network) here")
    g.add_argument("--init", default=None, help="start from this supernet file's weights")
    g.add_argument("--scratch", default=None,
                   help="train this sub-network alone from scratch (max, min, JSON or a JSON file) instead")
    p.add_argument("--worker-config", default=None, help=argparse.SUPPRESS)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lowcomm elastic train|search|extract``."""
    from lowcomm.elastic.search_args import add_extract_arguments, add_search_arguments
    from lowcomm.elastic.search_cli import run_extract, run_search

    p = sub.add_parser("elastic", help="elastic supernets: progressive shrinking, latency-constrained search "
                                       "(docs/elastic.md)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="elastic_command", metavar="ACTION", parser_class=type(p))
    actions.required = True
    t = actions.add_parser("train", help="train a supernet with progressive shrinking (or a sub-network alone)")
    add_elastic_train_arguments(t)
    t.set_defaults(func=run_train_command)
    s = actions.add_parser("search", help="the best sub-network under latency budgets")
    add_search_arguments(s)
    s.set_defaults(func=run_search)
    e = actions.add_parser("extract", help="write a sub-network as a plain module")
    add_extract_arguments(e)
    e.set_defaults(func=run_extract)
