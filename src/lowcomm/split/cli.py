"""``lowcomm split``: fine-tune a pretrained encoder split between an edge and a cloud process.

Three ways to run it: (1) plainly, this command starts the edge (rank 0) and the cloud (rank 1)
on this machine, with ``--net RATE`` each in its own network namespace behind a shaped link
(the bench's, ``lowcomm.bench.netns``); (2) on two machines, ``--role edge|cloud
--master-addr HOST --master-port PORT`` on each (or torchrun with 2 nodes of 1 process);
(3) ``--unsplit``: the same fine-tuning in one process, the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from lowcomm.errors import UsageError
from lowcomm.runtime.launch import launch_workers, under_torchrun
from lowcomm.split.config import ROLES, WIRES, SplitConfig


def add_split_arguments(p: argparse.ArgumentParser) -> None:
    """The ``lowcomm split`` options; defaults from :class:`SplitConfig`."""
    d = SplitConfig()
    p.add_argument("--model", default=d.model, help="minilm (installed package) or a BERT checkpoint folder")
    p.add_argument("--split-layer", type=int, default=d.split_layer,
                   help="the edge runs layers 1..K, 1 <= K <= N (K's FFN output matrix is factorized; "
                        "K = N, the last layer, is the authors' placement)")
    p.add_argument("--rank", type=int, default=d.rank, help="rank r of the factorization: r floats per token cross")
    p.add_argument("--data", default=d.data, help="tweets (installed package), sst2, cola, mrpc, qnli, rte (--data-dir)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--max-train", type=int, default=None, help="a seeded stratified subset of the training set")
    p.add_argument("--max-test", type=int, default=None)
    p.add_argument("--wire", default=d.wire, help=f"dtype on the link: {', '.join(WIRES)}")
    p.add_argument("--no-compress", action="store_true", help="the same split without factorization (baseline)")
    p.add_argument("--keep-residual", action="store_true",
                   help="keep the residual at the split (a full-width tensor crosses too)")
    p.add_argument("--unsplit", action="store_true", help="fine-tune the whole model in one process (baseline)")
    p.add_argument("--net", default=None, metavar="RATE[,delay=MS]",
                   help="edge and cloud in two namespaces joined by a shaped link (root; e.g. 100mbit)")
    p.add_argument("--compute", default=d.compute, metavar="real|emulated:scale=K",
                   help="emulated:scale=K: after 4 measured steps each side waits its measured computation / K "
                        "instead of computing, the link stays real (step time only, no accuracy)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--epochs", type=int, default=None)
    group.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size)
    p.add_argument("--max-len", type=int, default=d.max_len, help="tokens per text (padded/truncated)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process")
    p.add_argument("--role", choices=ROLES, default=None, help="two machines: this machine's side")
    p.add_argument("--master-addr", default=None, help="two machines: the edge's address")
    p.add_argument("--master-port", type=int, default=None, help="two machines: a free port on the edge")
    p.add_argument("--json", default=None, help="write the summary JSON here (the edge writes it)")
    p.add_argument("--log", default=None, help="append one JSON line per training step here (the edge)")
    p.add_argument("--quiet", action="store_true", help="no summary table")


def config_from_args(args: argparse.Namespace) -> SplitConfig:
    """The validated config (before any process starts)."""
    cfg = SplitConfig(
        model=args.model, split_layer=args.split_layer, rank=args.rank, data=args.data, data_dir=args.data_dir,
        max_train=args.max_train, max_test=args.max_test, wire=args.wire, compress=not args.no_compress,
        keep_residual=args.keep_residual, unsplit=args.unsplit, net=args.net, compute=args.compute,
        epochs=args.epochs if args.epochs is not None else SplitConfig.epochs, steps=args.steps,
        batch_size=args.batch_size, eval_batch_size=args.eval_batch_size, max_len=args.max_len, lr=args.lr,
        weight_decay=args.weight_decay, seed=args.seed, device=args.device, threads=args.threads,
        json=args.json, log=args.log, quiet=args.quiet)
    cfg.validate()
    if args.role is not None and (args.master_addr is None or args.master_port is None):
        raise UsageError("--role needs --master-addr (the edge's address) and --master-port on both machines")
    if args.role is not None and (cfg.unsplit or cfg.net):
        raise UsageError("--role runs one side on this machine: --unsplit and --net do not apply")
    return cfg


def _check_model_here(cfg: SplitConfig) -> None:
    """Load the model's config and tokenizer once here: a missing package, folder or a bad split
    layer / rank is one line before any process starts."""
    from lowcomm.split.checkpoint import checkpoint_dir, read_config
    from lowcomm.split.factorize import check_rank
    from lowcomm.split.parts import check_split_layer

    from lowcomm.split.data import text_dataset_names

    if cfg.data not in text_dataset_names():
        raise UsageError(f"--data: unknown text dataset {cfg.data!r}; valid: {', '.join(text_dataset_names())}")
    config = read_config(checkpoint_dir(cfg.model))
    n = config.num_hidden_layers
    check_split_layer(cfg.split_layer, n, what="--split-layer", model=cfg.model)
    if cfg.compress and not cfg.unsplit:
        check_rank(cfg.rank, config.intermediate_size, config.hidden_size, what="--rank")
    if cfg.keep_residual and not cfg.compress:
        raise UsageError("--keep-residual applies to the compressed split only (without compression the "
                         "edge sends layer K's whole output, residual included)")


def run_split_command(args: argparse.Namespace) -> int:
    """``lowcomm split``: one side (under torchrun or ``--role``), the baseline, or both sides here."""
    cfg = config_from_args(args)
    from lowcomm.split.runner import run_split

    if args.role is not None:
        os.environ.update(RANK=str(ROLES.index(args.role)), WORLD_SIZE="2", LOCAL_RANK="0",
                          MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.master_port))
    if cfg.unsplit or args.role is not None or under_torchrun():
        _check_model_here(cfg)
        summary = run_split(cfg)
        if summary is not None:
            _finish(summary, cfg)
        return 0
    _check_model_here(cfg)
    json_path = cfg.json or tempfile.mkstemp(prefix="lowcomm-split-", suffix=".json")[1]
    worker = SplitConfig.from_json(cfg.to_json())
    worker.json = json_path
    worker.quiet = True
    try:
        code = _launch(worker)
        if code != 0:
            return code
        with open(json_path) as f:
            summary = json.load(f)
        _finish(summary, cfg)
        return 0
    finally:
        if not cfg.json and os.path.exists(json_path):
            os.unlink(json_path)


def _launch(worker: SplitConfig) -> int:
    """Edge and cloud as two processes, on loopback or in two shaped namespaces (``--net``),
    placed the way the bench places its workers (:func:`lowcomm.bench.runner.launch_options`)."""
    from lowcomm.bench import netns
    from lowcomm.bench.runner import launch_options
    from lowcomm.runtime.launch import free_port

    cluster = None
    if worker.net and not netns.parse_net(worker.net).loopback:
        try:
            cluster = netns.Cluster(2, netns.parse_net(worker.net))
            cluster.up()
        except netns.NetnsUnavailable as e:
            print(f"lowcomm: no emulated network ({e}); running on loopback, unshaped", flush=True)
            cluster, worker.net = None, None
    try:
        return launch_workers(["split", "--worker-config", worker.to_json()], 2,
                              **launch_options(cluster, free_port()))
    finally:
        if cluster is not None:
            cluster.down()


def _finish(summary: dict[str, Any], cfg: SplitConfig) -> None:
    if cfg.json:
        from lowcomm.runtime.checkpoint import atomic_write_json

        atomic_write_json(summary, cfg.json)
    if not cfg.quiet:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"lowcomm split: {summary['mode']}")
        table.add_column("")
        table.add_column("", justify="right")
        rows = [("model", summary["model"]), ("split layer", summary["split_layer"]), ("rank", summary["rank"]),
                ("wire", summary["wire"]), ("data", f"{summary['data']} ({summary['train_samples']} train, "
                                                    f"{summary['test_samples']} test)"),
                ("steps", summary["steps"]), ("test accuracy", _accuracy(summary)),
                ("bytes per step, edge -> cloud", f"{summary['bytes_per_step']['edge_to_cloud']:,.0f}"),
                ("bytes per step, cloud -> edge", f"{summary['bytes_per_step']['cloud_to_edge']:,.0f}"),
                ("step time (median)", f"{summary['step_time_s_median']:.3f} s"),
                ("network", summary["network"]["requested"]), ("compute", summary.get("compute", "real"))]
        for key, value in rows:
            table.add_row(key, str(value))
        Console().print(table)


def _accuracy(summary: dict[str, Any]) -> str:
    accuracy = summary["final_test_accuracy"]
    return "not measured (compute emulated)" if accuracy is None else f"{100 * accuracy:.2f} %"


def _dispatch(args: argparse.Namespace) -> int:
    if args.worker_config is not None:
        from lowcomm.split.runner import run_split

        summary = run_split(SplitConfig.from_json(args.worker_config))
        if summary is not None:
            _finish(summary, SplitConfig.from_json(args.worker_config))
        return 0
    return run_split_command(args)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lowcomm split``."""
    p = sub.add_parser("split", help="split fine-tuning between an edge and a cloud process (docs/split.md)",
                       description=__doc__)
    add_split_arguments(p)
    p.add_argument("--worker-config", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_dispatch)
