"""One method of ``lowcomm bench``: ``lowcomm train`` in N worker processes, read back as a row.

Why out of process: each method runs exactly as a user would run it, so the measured time
includes everything the real run pays (gloo over TCP, the shaper, the hooks' Python
overhead). A run that fails becomes a row with ``status: "failed"`` and the most telling
line of its log (:func:`failure_reason`), so the other methods still run.

Time-to-accuracy runs (``--epochs``) keep every evaluation of the run (``history``) and an
``accuracy_curve`` whose ``train_s`` is the training-only clock, summed from the workers'
per-step log (evaluation left out; :mod:`lowcomm.bench.tta` measures time to accuracy on it).

Emulated nodes (``nproc_per_node`` G): the launcher gives every worker torchrun's node layout
(``LOCAL_WORLD_SIZE`` = G), so the methods see the same topology as on a real cluster, and each
row records ``nodes``, ``nproc_per_node`` and ``inter_node_bytes_per_worker_per_iter`` (the
accounting ledger's inter-node bytes). Without G, workers of an emulated cluster are one per
node (each has its own shaped link) and on loopback they are all one node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from lowcomm.bench import netns
from lowcomm.bench.netns import NetSpec
from lowcomm.runtime.launch import launch_workers

MASTER_PORT = 29500  # inside a namespace nothing else listens


@dataclass
class BenchConfig:
    """What ``lowcomm bench`` runs: the methods, the networks and the shared training settings
    (every method of one invocation gets the same ones, so their rows are comparable)."""

    methods: list[str]
    nets: list[NetSpec]
    nproc: int = 4
    #: workers per emulated node (``--nproc-per-node``); None: one worker per shaped namespace
    #: (one node on loopback), the layout of the benchmarks before nodes existed
    nproc_per_node: int | None = None
    model: str = "resnet18"
    data: str = "synthetic"
    input_shape: str | None = "3,32,32"
    batch_size: int = 32
    iters: int = 10  # timed iterations per method
    warmup: int = 2  # excluded from the medians
    epochs: int | None = None  # time-to-accuracy mode
    threads: int | None = None
    timeout_s: float = 900.0
    work_dir: str | None = None
    compute_only: bool = True  # run `nocomm` for the lower bound
    extra_train_args: list[str] = field(default_factory=list)
    quiet: bool = False
    predict: bool = True  # profile + collective probe + simulator prediction per row
    #: rounds: every method run this many times, round after round; a row is its method's median
    #: run (the fastest for compute references), every run's time kept (lowcomm.bench.repeats)
    repeat: int = 1

    @property
    def nodes(self) -> int:
        """Emulated nodes (``nproc`` with one worker per node when not given)."""
        return self.nproc // (self.nproc_per_node or 1)

    @property
    def tta(self) -> bool:
        """Time-to-accuracy mode (``--epochs``) instead of timed iterations."""
        return self.epochs is not None


@contextlib.contextmanager
def redirect_fds(path: Path) -> Iterator[None]:
    """Send this process's fd 1/2 (inherited by the workers) to ``path`` while they run: the
    workers' output goes to the run's log, not into the bench's own report."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def failure_reason(log_text: str, returncode: int) -> str:
    """The most telling line of a failed run's log (the exception, else the last line)."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln.strip()) for ln in log_text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Failure)\b|^lowcomm: error", ln)]
    fatal = [ln for ln in lines if ln.startswith("what():") or "terminate called" in ln]
    pick = (fatal[-1] if fatal else errors[-1] if errors else lines[-1] if lines else "no output")
    if returncode == 124:
        pick = f"timed out; last output: {pick}"
    return f"exit code {returncode}: {pick[:300]}"


def train_args(cfg: BenchConfig, method: str, json_path: Path) -> list[str]:
    """The ``lowcomm train`` command line every worker runs for ``method``."""
    args = ["train", "--model", cfg.model, "--data", cfg.data, "--method", method,
            "--batch-size", str(cfg.batch_size), "--json", str(json_path)]
    if cfg.input_shape and cfg.data == "synthetic":
        args += ["--input-shape", cfg.input_shape]
    if cfg.tta:
        args += ["--epochs", str(cfg.epochs), "--warmup-steps", str(cfg.warmup),
                 "--log", str(steps_log_path(json_path))]
    else:
        warmup = timing_warmup(method, cfg)
        args += ["--steps", str(cfg.iters + warmup), "--warmup-steps", str(warmup), "--no-eval"]
    if cfg.threads:
        args += ["--threads", str(cfg.threads)]
    return args + ["--no-progress"] + list(cfg.extra_train_args)


def steps_log_path(json_path: Path) -> Path:
    """The per-step JSONL log of a time-to-accuracy run, beside its summary JSON."""
    return json_path.with_name(json_path.stem + ".steps.jsonl")


def training_seconds(log_path: Path) -> dict[int, float]:
    """``{step: training seconds up to and including it}`` from a ``--log`` file: the running sum
    of the steps' ``iter_time_s`` (data, forward, backward, communication, optimizer), so
    evaluation and the bookkeeping between steps are left out. Empty when there is no log."""
    if not log_path.exists():
        return {}
    out: dict[int, float] = {}
    total = 0.0
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == "step" and rec.get("iter_time_s") is not None:
            total += float(rec["iter_time_s"])
            out[int(rec["step"])] = total
    return out


def accuracy_curve(history: list[dict[str, Any]], step_clock: dict[int, float]) -> list[dict[str, Any]]:
    """The evaluations of a time-to-accuracy run, each with its wall clock and, when known, its
    training-only clock ``train_s`` (the trainer's own, else the step log's at that step)."""
    curve = []
    for h in history:
        if "test_accuracy" not in h or "wall_s" not in h:
            continue
        point = {"epoch": h.get("epoch"), "wall_s": h["wall_s"], "test_accuracy": h["test_accuracy"]}
        for key in ("train_s", "eval_s"):
            if h.get(key) is not None:
                point[key] = h[key]
        if "train_s" not in point and h.get("step") in step_clock:
            point["train_s"] = step_clock[h["step"]]
        curve.append(point)
    return curve


def timing_spec(spec: str, cfg: BenchConfig) -> str:
    """In timing runs, time the method's steady state: compress from the end of the warm-up
    iterations on, at the final density.

    Methods with a ``start_iter`` option send uncompressed gradients for their first steps
    (10 % of the run by default, as the papers advise for accuracy), and the sparse codecs
    raise their sparsity over the first epochs (``sparsity_warmup``, DGC's warm-up: density
    0.25 at first); a timing run of a few iterations would otherwise measure plain all-reduce
    or the warm-up's much larger payloads. So ``start_iter`` becomes the bench's warm-up
    iterations and ``sparsity_warmup`` 0. An option given explicitly is kept, and
    time-to-accuracy runs keep the method's defaults.
    """
    from lowcomm import methods

    if cfg.tta:
        return spec
    name, opts = methods.split_spec(spec)
    holder = _codec_options(methods.create(spec).options)
    if holder is None:
        return spec
    fields = {f.name for f in dataclasses.fields(holder)}
    steady = {"start_iter": cfg.warmup, "sparsity_warmup": 0}
    added = [f"{k}={v}" for k, v in steady.items() if k in fields and f"{k}=" not in opts]
    if not added:
        return spec
    return f"{name}:{','.join([opts, *added] if opts else added)}"


#: compressed steps a timing run leaves out after the dense ones (``start_iter``): the first
#: allocates the codec's state (error feedback, factors, its buffers) and ACP-SGD's first two
#: are its first P- and Q-step. Measured on ResNet-18, 4 workers sharing 2 vCPUs: ``acpsgd``'s
#: first compressed step took 1.19-1.50 s where its steps 5-30 averaged 1.02-1.09 s, and with
#: four timed steps that one step lifted the median by 0.5-3.7 % (benchmarks.md, "The first
#: compressed step left out of the timing").
FIRST_COMPRESSED_STEPS = 2


def _codec_options(options: Any) -> Any:
    """The options of the codec a method with ``options`` runs (an engine method holds its
    chosen codec's, None without one; a hook method's are its own): where its warm-ups
    (``start_iter``, DGC's ``sparsity_warmup``) live."""
    return options.codec_options if hasattr(options, "codec_options") else options


def timing_warmup(spec: str, cfg: BenchConfig) -> int:
    """The steps a timing run leaves out of ``spec``'s medians: the bench's ``--warmup``, or
    more where the method first measures itself online (``mgwfbp`` profiles its layers before
    it plans the fusion, ``dear:tune=true`` and ``lee18:tune=true`` time each trial threshold)
    or first compresses (its dense steps and :data:`FIRST_COMPRESSED_STEPS`, when ``start_iter``
    is a step count); timing those steps would average the method with something else
    (:meth:`lowcomm.methods.base.Method.warmup_steps`)."""
    from lowcomm import methods

    method = methods.create(spec)
    warm = max(cfg.warmup, method.warmup_steps())
    start = getattr(_codec_options(method.options), "start_iter", None)
    if isinstance(start, int):  # (a duration resolves only in the run)
        warm = max(warm, start + FIRST_COMPRESSED_STEPS)
    return warm


#: :func:`lowcomm.runtime.launch.launch_workers` or a stand-in (tests): ``(args, nproc, **kw) -> exit code``
Launcher = Callable[..., int]


def launch_options(cluster: netns.Cluster | None, master_port: int, *, measure_iface: bool = False,
                   nproc_per_node: int | None = None) -> dict[str, Any]:
    """The launcher's placement keywords: in ``cluster``'s namespaces (rank 0's node address, a
    fixed port, gloo bound to the namespace's interface, each rank in its node's namespace),
    else on loopback. ``measure_iface``: the workers also count the bytes that cross that
    interface (``LOWCOMM_MEASURE_IFACE``). ``nproc_per_node`` (default: the cluster's) is the
    node layout the workers are told (``LOCAL_WORLD_SIZE``)."""
    if nproc_per_node is None and cluster is not None:
        nproc_per_node = cluster.nproc_per_node
    if cluster is None:
        return {"rank_env": lambda r: {"GLOO_SOCKET_IFNAME": "lo"}, "nproc_per_node": nproc_per_node}
    env = {"GLOO_SOCKET_IFNAME": cluster.ifname}
    if measure_iface:
        env["LOWCOMM_MEASURE_IFACE"] = cluster.ifname
    return {"master_addr": cluster.addresses[0], "master_port": master_port,
            "rank_prefix": cluster.exec_prefix, "rank_env": lambda r: env,
            "nproc_per_node": nproc_per_node}


def run_method(
    cfg: BenchConfig,
    method: str,
    *,
    work: Path,
    tag: str,
    cluster: netns.Cluster | None,
    launcher: Launcher | None = None,
) -> dict[str, Any]:
    """Run one method on the current network; return its row (``status`` ok or failed)."""
    if launcher is None:
        launcher = launch_workers
    run_spec = timing_spec(method, cfg)
    json_path = work / f"{tag}.json"
    log_path = work / f"{tag}.log"
    json_path.unlink(missing_ok=True)
    steps_log_path(json_path).unlink(missing_ok=True)  # the trainer appends to its --log
    kw: dict[str, Any] = {"timeout_s": cfg.timeout_s, "failure_grace_s": 10.0, "threads": cfg.threads,
                          **launch_options(cluster, MASTER_PORT, measure_iface=True,
                                           nproc_per_node=cfg.nproc_per_node)}
    started = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with redirect_fds(log_path):
        code = launcher(train_args(cfg, run_spec, json_path), cfg.nproc, **kw)
    wall = time.perf_counter() - started
    if code == 130:  # the launcher caught Ctrl-C / SIGTERM and stopped the workers: stop the bench
        raise KeyboardInterrupt
    row: dict[str, Any] = {"method": method, "spec_run": run_spec, "wall_s": wall, "log": str(log_path),
                           "warmup_iters": cfg.warmup if cfg.tta else timing_warmup(run_spec, cfg),
                           "load_avg_1m_before": load, "nodes": cfg.nodes,
                           "nproc_per_node": cfg.nproc_per_node or 1}
    if code != 0 or not json_path.exists():
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        row.update(status="failed", reason=failure_reason(text, code) if code else "no summary JSON written")
        return row
    summary = json.loads(json_path.read_text())
    row.update(status="ok")
    for key in ("iter_time_s_median", "bytes_per_worker_per_iter", "bytes_sent_per_worker", "breakdown_s",
                "measured_tx_bytes_per_iter", "params", "timed_steps", "threads", "final_test_accuracy", "method_info", "synthetic",
                "inter_node_bytes_per_worker_per_iter", "grad_shapes", "compute", "compute_profile"):
        if key in summary:
            row[key] = summary[key]
    row.setdefault("inter_node_bytes_per_worker_per_iter", None)
    if (cfg.nproc_per_node or 1) > 1 and row.get("measured_tx_bytes_per_iter") is not None:
        # the node's interface is shared by its G workers: what rank 0 read is the node's traffic
        row["measured_node_tx_bytes_per_iter"] = row.pop("measured_tx_bytes_per_iter")
    if cfg.tta:
        history = list(summary.get("history", []))
        row["history"] = history  # every per-epoch evaluation, as the trainer recorded it
        row["accuracy_curve"] = accuracy_curve(history, training_seconds(steps_log_path(json_path)))
    return row
