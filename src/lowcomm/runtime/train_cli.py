"""``lowcomm train`` and ``lowcomm demo``.

``lowcomm train --nproc N`` validates everything, then starts N workers on this machine (the
same command re-executed with torchrun's environment variables). Under ``torchrun`` the
variables are already set, so the command runs as one worker: that is how multi-node works.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from typing import Any

from lowcomm.errors import MAX_COUNT, UsageError, check_count
from lowcomm.runtime.compute_spec import parse_compute
from lowcomm.runtime.config import SCHEDULES, TrainConfig
from lowcomm.runtime.flags import explicit_train_flags, key_value
from lowcomm.runtime.launch import launch_workers, under_torchrun


def parse_shape(text: str) -> tuple[int, ...]:
    """``--input-shape 3,32,32``: per-sample shape of synthetic data (also checked by ``bench``)."""
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 3,32,32, got {text!r}") from None
    if not shape or any(v < 1 for v in shape):
        raise argparse.ArgumentTypeError(f"shape dimensions must be >= 1, got {text!r}")
    if math.prod(shape) > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"shape {text!r} has more than {MAX_COUNT} elements per sample")
    return shape


def _milestones(text: str) -> list[float]:
    """``--milestones 0.5,0.75``: numbers only; their range is checked by the config."""
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers like 0.5,0.75 (fractions of training) or 30,60 (epochs), got {text!r}"
        ) from None


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The ``lowcomm train`` options, defaults taken from :class:`TrainConfig` (one source)."""
    d = TrainConfig()
    p.add_argument("--model", default=d.model, help="model name (see lowcomm.models)")
    p.add_argument("--data", default=d.data, help="dataset name; mnist1d is embedded")
    p.add_argument("--data-dir", default=None, help="folder with the dataset's files")
    p.add_argument("--data-workers", type=int, default=d.data_workers, metavar="N",
                   help="DataLoader worker processes per rank (0: read in the training process; "
                        "same batches either way)")
    p.add_argument("--prefetch", type=int, default=None, metavar="K",
                   help="batches each data worker prepares ahead (default 2; needs --data-workers)")
    p.add_argument("--data-cache", default=d.data_cache, metavar="none|memory|disk[:DIR]",
                   help="keep decoded samples: epoch 1 decodes and fills, later epochs read "
                        "(docs/input_pipeline.md)")
    p.add_argument("--method", default=d.method, help="e.g. ssgd, powersgd:rank=4, acpsgd, pufferfish")
    p.add_argument("--nproc", type=int, default=d.nproc, help="local worker processes")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                   help="workers per node (hierarchical methods, link accounting); default: "
                        "torchrun's LOCAL_WORLD_SIZE, else one node")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps in total")
    p.add_argument("--warmup-steps", type=int, default=None, help="steps left out of timing medians")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="per worker")
    p.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--optimizer", default=d.optimizer, metavar="NAME",
                   help="sgd, adamw, lars[:eta=0.001,...], lamb[:beta2=0.999,...] (layer-wise trust ratio, "
                        "docs/largebatch.md), or kfac[:key=value,...]: K-FAC preconditioning in front of "
                        "base=sgd (default), adamw, lars or lamb (docs/kfac.md)")
    p.add_argument("--momentum", type=float, default=d.momentum)
    p.add_argument("--nesterov", action="store_true")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--no-decay-norm-bias", action="store_true", help="no weight decay on norms and biases")
    p.add_argument("--schedule", choices=SCHEDULES, default=d.schedule)
    p.add_argument("--lr-warmup-epochs", type=float, default=d.lr_warmup_epochs)
    p.add_argument("--poly-power", type=float, default=d.poly_power,
                   help="--schedule poly: LR factor (1 - t/T) ** power after the warm-up")
    p.add_argument("--milestones", type=_milestones, default=d.milestones)
    p.add_argument("--gamma", type=float, default=d.gamma)
    p.add_argument("--step-size-epochs", type=int, default=d.step_size_epochs)
    p.add_argument("--clip-grad", type=float, default=None, help="max global gradient norm")
    p.add_argument(
        "--amp", nargs="?", const="auto", default=False, metavar="{fp16,bf16}",
        help="autocast: no value = bf16 on CPU, fp16 + GradScaler on CUDA; fp16 (+ GradScaler) or bf16 to choose",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device)
    p.add_argument("--compute", default="real", metavar="real|emulated:PROFILE|emulated:scale=K",
                   help="emulated: each layer's forward/backward waits a profile's time (a file from "
                        "`lowcomm profile`, a shipped name, or this machine's own profile divided by K); "
                        "parameters, gradients and communication stay real (docs/benchmarks.md)")
    p.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb,
                   help="DDP's bucket cap in MiB (default: DDP's own, 25 MiB after a 1 MiB first bucket; "
                        "a given cap applies to the first bucket too, as in DDP)")
    p.add_argument("--no-eval", action="store_true", help="skip evaluation (timing runs)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=None, help="also checkpoint every N steps")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    p.add_argument("--stop-after-steps", type=int, default=None,
                   help="checkpoint and exit after N steps of this run (preemptible jobs)")
    p.add_argument("--json", default=None, help="write the summary JSON here")
    p.add_argument("--log", default=None, help="append per-step JSONL records here")
    p.add_argument("--log-all-ranks", action="store_true",
                   help="with --log: every rank writes its own records (rank N > 0 to FILE's name with "
                        ".rankN before the extension); a straggler shows as one rank's long compute "
                        "and the others' comm_wait")
    p.add_argument("--tensorboard", default=None, metavar="DIR")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--model-arg", type=key_value, action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--data-arg", type=key_value, action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--input-shape", type=parse_shape, default=None, help="synthetic data: per-sample shape")
    p.add_argument("--num-classes", type=int, default=None, help="synthetic data: classes")
    p.add_argument("--vocab-size", type=int, default=None, help="synthetic data: token vocabulary")
    p.add_argument("--quiet", action="store_true", help="no summary table")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The validated :class:`TrainConfig` of parsed arguments (errors before any worker starts)."""
    data_args = dict(args.data_arg)
    for key, flag in (("num_classes", "--num-classes"), ("vocab_size", "--vocab-size")):
        if getattr(args, key) is not None:
            check_count(flag, getattr(args, key), minimum=2)  # one class or token predicts nothing
    for key in ("input_shape", "num_classes", "vocab_size"):
        if getattr(args, key) is not None:
            data_args[key] = getattr(args, key)
    cfg = TrainConfig(
        model=args.model, data=args.data, data_dir=args.data_dir, method=args.method,
        data_workers=args.data_workers, prefetch=args.prefetch, data_cache=args.data_cache,
        nproc=args.nproc, gpus_per_node=args.gpus_per_node, epochs=args.epochs, steps=args.steps, warmup_steps=args.warmup_steps,
        batch_size=args.batch_size, eval_batch_size=args.eval_batch_size, lr=args.lr,
        optimizer=args.optimizer, momentum=args.momentum, nesterov=args.nesterov,
        weight_decay=args.weight_decay, no_decay_norm_bias=args.no_decay_norm_bias,
        schedule=args.schedule, lr_warmup_epochs=args.lr_warmup_epochs, milestones=args.milestones,
        poly_power=args.poly_power,
        gamma=args.gamma, step_size_epochs=args.step_size_epochs, clip_grad=args.clip_grad,
        amp=args.amp, seed=args.seed, threads=args.threads, device=args.device,
        bucket_cap_mb=args.bucket_cap_mb, eval=not args.no_eval, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, resume=args.resume,
        stop_after_steps=args.stop_after_steps, json=args.json, log=args.log, log_all_ranks=args.log_all_ranks,
        tensorboard=args.tensorboard, progress=not args.no_progress,
        model_args=dict(args.model_arg), data_args=data_args,
    )
    cfg.compute = parse_compute(args.compute).label
    cfg.validate()
    cfg.explicit_flags = explicit_train_flags(getattr(args, "_argv", None))  # a method adapts only the others
    return cfg


def check_names(cfg: TrainConfig) -> None:
    """Unknown model, data or method names are refused before any worker starts."""
    from lowcomm import data, methods, models

    models.MODELS.get(cfg.model)
    data.DATASETS.get(cfg.data)
    method = methods.create(cfg.method)
    if cfg.kfac is not None:
        from lowcomm.runtime.kfac_hook import check_method

        check_method(cfg, method)  # e.g. dear: no full gradient in p.grad to precondition
        from lowcomm.optim.kfac.options import grad_workers

        try:  # KAISA's groups need a whole divisor of the world size: say so before the workers start
            grad_workers(cfg.kfac["grad_worker_fraction"], cfg.nproc)
        except UsageError as e:
            raise UsageError(f"--optimizer kfac: {e}") from None
    if cfg.optimizer in ("lars", "lamb") and getattr(method, "mode", None) == "shard":  # lee18 (a str enum)
        raise UsageError(f"--method {cfg.method} updates 1/P slices of each parameter, and a slice's norm is not "
                         f"the layer's, so --optimizer {cfg.optimizer}'s trust ratio would change; use sgd or adamw "
                         "with it, or lars/lamb with a method that updates whole tensors (ssgd, dear, wfbp, ...)")
    if cfg.model_args:
        check_model_args(cfg.model, cfg.model_args)
    if method.timing_only and cfg.eval:
        raise UsageError(f"method {cfg.method!r} is for timing only; add --no-eval")


def check_model_args(model: str, model_args: dict[str, Any]) -> None:
    """Build ``model`` with the user's ``--model-arg`` values on the meta device (shapes only,
    no memory, well under a second even for large models), so that a value the constructor
    rejects (``num_classes=-1``) is one line here and not a traceback in every worker.

    Only exceptions raised *because of* user arguments are turned into usage errors: without
    ``--model-arg`` this is not called, so a constructor bug still shows its traceback.
    """
    import warnings

    import torch

    from lowcomm import models

    for key in ("num_classes", "vocab_size"):  # constructors accept 0; nothing can train with it
        if key in model_args:
            check_count(f"--model-arg {key}", model_args[key], minimum=2)
    given = " ".join(f"{k}={v!r}" for k, v in model_args.items())
    rejected = (TypeError, ValueError, RuntimeError, ArithmeticError, AssertionError, IndexError, KeyError)
    reason = ""
    # Meta first (free); a constructor using an op the meta device lacks (NotImplementedError,
    # a RuntimeError) is retried for real on the CPU before the arguments are blamed.
    for device in ("meta", "cpu"):
        try:
            with warnings.catch_warnings(), torch.device(device):
                warnings.simplefilter("ignore")
                models.create(model, **model_args)
            return
        except UsageError:
            raise
        except rejected as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise UsageError(f"model {model!r} rejects --model-arg {given}: {reason}")


def default_threads(nproc: int) -> int:
    """torch threads per worker: the cores shared evenly, so workers do not oversubscribe them."""
    return max(1, (os.cpu_count() or 1) // nproc)


def run_train(args: argparse.Namespace) -> int:
    """``lowcomm train``: train here (under torchrun) or start ``--nproc`` local workers."""
    cfg = config_from_args(args)
    if under_torchrun():
        from lowcomm.runtime.trainer import run_training

        run_training(cfg)
        return 0
    check_names(cfg)
    from lowcomm.runtime.emulated_setup import check_config

    check_config(cfg)  # --compute emulated: no evaluation, no K-FAC, the profile's batch
    if cfg.gpus_per_node is not None and cfg.nproc % cfg.gpus_per_node:
        valid = ", ".join(str(g) for g in range(1, cfg.nproc + 1) if cfg.nproc % g == 0)
        raise UsageError(f"--gpus-per-node {cfg.gpus_per_node} does not divide --nproc {cfg.nproc}; valid: {valid}")
    json_path = cfg.json
    tmp = None
    if json_path is None:
        tmp = tempfile.NamedTemporaryFile(prefix="lowcomm-summary-", suffix=".json", delete=False)
        tmp.close()
        json_path = tmp.name
    worker_args = list(args._argv)
    if cfg.json is None:
        worker_args += ["--json", json_path]
    if cfg.threads is None:
        worker_args += ["--threads", str(default_threads(cfg.nproc))]
    try:
        if cfg.nproc == 1 and cfg.device != "cuda":
            # One worker: still a real process group of size 1 path-wise, but in-process.
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            from lowcomm.runtime.trainer import run_training

            try:
                cfg.json = json_path
                cfg.threads = cfg.threads or default_threads(1)
                run_training(cfg)
            finally:
                for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
                    os.environ.pop(v, None)
            code = 0
        else:
            code = launch_workers(worker_args, cfg.nproc, nproc_per_node=cfg.gpus_per_node,
                                  threads=cfg.threads or default_threads(cfg.nproc))
        if code != 0:
            return code
        with open(json_path) as f:
            summary = json.load(f)
        if not args.quiet:
            print_summary(summary)
        return 0
    finally:
        if tmp is not None and os.path.exists(tmp.name):
            os.unlink(tmp.name)


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units, for the summary table."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def print_summary(s: dict[str, Any]) -> None:
    """The run's summary as a table on the terminal."""
    from rich.console import Console
    from rich.table import Table

    title = f"lowcomm train: {s['model']} on {s['data']}" + (" (synthetic, timing only)" if s.get("synthetic") else "")
    table = Table(title=title, show_header=False)
    table.add_row("method", str(s["method"]))
    table.add_row("workers", str(s["world_size"]))
    if s.get("compute", "real") != "real":
        table.add_row("compute", f"compute emulated ({s['compute']})")
    table.add_row("steps / epochs", f"{s['steps']} / {s['epochs']}")
    table.add_row("parameters", f"{s['params']:,}")
    if s.get("final_test_accuracy") is not None:
        table.add_row("test accuracy", f"{100 * s['final_test_accuracy']:.2f} %")
    if s.get("final_test_metric") is not None:
        table.add_row(f"test {s.get('metric_name')}", f"{s['final_test_metric']:.2f}")
    table.add_row("bytes sent per worker", format_bytes(s["bytes_sent_per_worker"]))
    table.add_row("bytes per worker per iteration", format_bytes(s["bytes_per_worker_per_iter"]))
    table.add_row("iteration time (median)", f"{1000 * s['iter_time_s_median']:.1f} ms")
    for phase, v in s["breakdown_s"].items():
        table.add_row(f"  {phase}", f"{1000 * v:.1f} ms")
    Console().print(table)


DEMO_METHODS = "ssgd,powersgd,acpsgd,pufferfish:warmup_epochs=1"
#: Epochs per method in ``lowcomm demo``: long enough that the compressed methods can reach
#: 99% of ssgd's final test accuracy, which the demo's headline speed-up is measured against.
#: Measured with the defaults of issue 12 (cnn1d, 256 channels, seed 0): after 15 epochs
#: acpsgd ends at 92.2 % against ssgd's 94.1 % (short of 99 %), after 40 it is level (95.9 /
#: 95.5 %); 20 keeps the demo near 5 minutes (docs/results_accuracy.md).
DEMO_EPOCHS = 20
#: MNIST-1D training sequences (the embedded data set), for the demo's time estimate
DEMO_TRAIN_SAMPLES = 4000
#: Rough seconds per step of the demo's model (cnn1d, 256 channels, batch 64 per worker, 4
#: workers on 2 shared cores) at 100 Mbit/s, measured per method; others: DEMO_STEP_S_DEFAULT.
#: Of each, DEMO_COMPUTE_S is computation; the rest is communication, scaled with the link rate.
DEMO_STEP_S = {"ssgd": 0.30, "fp16": 0.19, "pufferfish": 0.14, "nocomm": 0.08}
DEMO_STEP_S_DEFAULT = 0.10
DEMO_COMPUTE_S = 0.08
#: Seconds per method outside training (starting the workers, imports, data, evaluations)
DEMO_START_S = 20.0


def estimate_demo_seconds(methods: list[str], *, epochs: int, nproc: int, batch_size: int,
                          rate_bits_per_s: float | None) -> float:
    """Rough wall-clock seconds of ``lowcomm demo`` on a 2-core machine (for its intro line):
    per method, start-up plus epochs x steps x the method's step time (:data:`DEMO_STEP_S`,
    communication scaled to ``rate_bits_per_s``; None = loopback, nearly free)."""
    from lowcomm.methods import split_spec

    steps = epochs * math.ceil(DEMO_TRAIN_SAMPLES / nproc / batch_size)
    compute = DEMO_COMPUTE_S * nproc / 4 * batch_size / 64  # the 2 cores are shared by the workers
    scale = 100e6 / rate_bits_per_s if rate_bits_per_s else 0.0
    total = 0.0
    for spec in methods:
        step = DEMO_STEP_S.get(split_spec(spec)[0], DEMO_STEP_S_DEFAULT)
        total += DEMO_START_S + steps * (compute + max(0.0, step - DEMO_COMPUTE_S) * scale)
    return total


def run_demo(args: argparse.Namespace) -> int:
    """The main job on the embedded default: the methods compared on an emulated slow network.

    MNIST-1D (embedded), a 1-D CNN wide enough (256 channels, 0.4 M parameters) that its
    gradients dominate a 100 Mbit/s link, 4 workers at the trainer's defaults (batch 64 per
    worker), :data:`DEMO_EPOCHS` epochs per method, evaluating after each. Prints test accuracy,
    bytes per worker, the time breakdown and, as the headline, each method's training time to
    99% of ssgd's final test accuracy and the speed-up to it (a method that does not reach it
    is reported as not reached, whatever its per-iteration speed); writes the JSON, the
    Markdown and the plots (accuracy against training time, target marked). Without root for
    network namespaces it runs on loopback and says so.
    """
    from lowcomm.bench import cli as bench_cli
    from lowcomm.cli import build_parser

    batch = TrainConfig().batch_size
    argv = ["bench", "--nproc", str(args.nproc), "--model", "cnn1d", "--model-arg", "channels=256",
            "--data", "mnist1d", "--epochs", str(args.epochs), "--batch-size", str(batch),
            "--methods", args.methods, "--net", args.net,
            "--json", os.path.join(args.out, "demo.json"), "--plot", os.path.join(args.out, "demo.png"),
            "--markdown", os.path.join(args.out, "demo.md")]
    bench_args = build_parser().parse_args(argv)
    cfg = bench_cli.build_config(bench_args)  # bad input: one line, before the output folder exists
    os.makedirs(args.out, exist_ok=True)
    minutes = estimate_demo_seconds(cfg.methods, epochs=args.epochs, nproc=args.nproc, batch_size=batch,
                                    rate_bits_per_s=cfg.nets[0].rate_bits_per_s) / 60
    print(f"lowcomm demo: {args.methods} on {args.nproc} workers, cnn1d (256 channels) on MNIST-1D, "
          f"{args.epochs} epochs each, network {args.net}; headline: each method's training time to 99% of "
          f"ssgd's final test accuracy. Takes roughly {max(1, round(minutes))} min on 2 cores "
          f"(outputs in {args.out}/)", flush=True)
    return int(bench_cli.run(bench_args))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``train`` subcommand to the top-level CLI."""
    p = sub.add_parser("train", help="train a model with a communication method")
    add_train_arguments(p)
    p.set_defaults(func=run_train)
    d = sub.add_parser("demo", help="the main job on the embedded default data")
    d.add_argument("--nproc", type=int, default=4)
    d.add_argument("--epochs", type=int, default=DEMO_EPOCHS,
                   help=f"epochs per method (default {DEMO_EPOCHS}: long enough to reach ssgd's accuracy)")
    d.add_argument("--methods", default=DEMO_METHODS)
    d.add_argument("--net", default="100mbit", help="emulated link rate, or none for loopback")
    d.add_argument("--out", default="runs/demo", help="folder for the JSON, Markdown and plots")
    d.set_defaults(func=run_demo)
