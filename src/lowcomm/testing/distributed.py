"""Run a function on N gloo ranks in forked subprocesses, with a hard timeout.

``@distributed(world_size=2)`` turns a test body into an N-rank run; a hang or an exception on
any rank becomes a test failure that shows every rank's output. :func:`run_distributed`
returns each rank's (picklable) return value, for tests that compare ranks.

``device="cuda"`` puts rank ``r`` on GPU ``r % device_count`` (several ranks may share one GPU
on ``backend="gloo"``; NCCL refuses that) and starts the ranks with ``spawn`` instead of
``fork``: a forked child cannot use CUDA once the parent has touched it, and pytest's parent
may have. Spawned ranks import the test function by module and name, so it must be defined
at module level (a ``@distributed`` wrapper is unwrapped to its body).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import torch
import torch._dynamo  # noqa: F401  DDP imports it lazily (~5 s); import once before forking
import torch.distributed as dist

from lowcomm.runtime.launch import free_port

#: how the ranks start (``multiprocessing`` start methods)
StartMethod = Literal["fork", "spawn"]


class DistributedTestFailure(AssertionError):
    """A rank failed, hung or crashed; the message holds every rank's output (an assertion, so
    pytest reports it as a test failure, not an error)."""


@dataclass(frozen=True)
class _FunctionRef:
    """A module-level function named by module, file and qualified name, for spawned ranks.

    Pickle refuses a test body whose module attribute is its ``@distributed`` wrapper ("not
    the same object"); the child imports the module and unwraps the attribute instead.
    """

    module: str
    path: str
    qualname: str

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> _FunctionRef | Callable[..., Any]:
        qualname = getattr(fn, "__qualname__", "")
        code = getattr(fn, "__code__", None)
        if code is None or "<locals>" in qualname or not getattr(fn, "__module__", None):
            return fn  # let pickle try (and report) as usual
        return cls(fn.__module__, code.co_filename, qualname)

    def resolve(self) -> Callable[..., Any]:
        try:
            module = importlib.import_module(self.module)
        except ImportError:
            spec = importlib.util.spec_from_file_location(self.module, self.path)
            if spec is None or spec.loader is None:
                raise
            module = importlib.util.module_from_spec(spec)
            sys.modules[self.module] = module
            spec.loader.exec_module(module)
        obj: Any = module
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return inspect.unwrap(obj)


def _child(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    log_path: str,
    conn: Any,
    backend: str = "gloo",
    device: str = "cpu",
) -> None:
    log = open(log_path, "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        from lowcomm.comm import accounting
        from lowcomm.runtime import timing

        accounting.ledger().reset()
        timing.timer().steps.clear()
        if isinstance(fn, _FunctionRef):
            fn = fn.resolve()
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(*args, **kwargs)
        dist.barrier()
        dist.destroy_process_group()
        # Plain pickle copies tensor data; the default reducer would share memory that
        # vanishes when this process exits before the parent reads it.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        tb = traceback.format_exc()
        print(tb, flush=True)
        try:
            conn.send_bytes(pickle.dumps(("error", tb)))
        except Exception:
            pass
        log.flush()
        os._exit(1)
    log.flush()
    os._exit(0)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    device: str = "cpu",
    start_method: StartMethod | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result.

    ``backend`` is passed to ``init_process_group``; ``device="cuda"`` binds each rank to a
    GPU. ``start_method`` defaults to ``spawn`` with CUDA and ``fork`` otherwise (see module
    docstring).
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    method: StartMethod = start_method or ("spawn" if device == "cuda" else "fork")
    ctx = mp.get_context("spawn") if method == "spawn" else mp.get_context("fork")
    target: Any = fn if method == "fork" else _FunctionRef.of(fn)
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="lowcomm-dist-")
    procs, pipes, logs = [], [], []
    for rank in range(world_size):
        parent_end, child_end = ctx.Pipe(duplex=False)
        log_path = os.path.join(tmp, f"rank{rank}.log")
        p = ctx.Process(
            target=_child,
            args=(rank, world_size, port, target, args, kwargs, log_path, child_end, backend, device),
        )
        p.start()
        child_end.close()
        procs.append(p)
        pipes.append(parent_end)
        logs.append(log_path)

    results: list[Any] = [None] * world_size
    status: list[str | None] = [None] * world_size
    deadline = time.monotonic() + timeout
    pending = set(range(world_size))
    while pending and time.monotonic() < deadline:
        for r in list(pending):
            if pipes[r].poll(0.05):
                try:
                    status[r], results[r] = pickle.loads(pipes[r].recv_bytes())
                except EOFError:
                    status[r] = "died"
                pending.discard(r)
            elif not procs[r].is_alive() and not pipes[r].poll():
                status[r] = f"died (exit code {procs[r].exitcode})"
                pending.discard(r)
        if any(s not in (None, "ok") for s in status):
            time.sleep(0.5)  # let the others print, then stop them
            break
    for p in procs:
        p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join()

    try:
        if all(s == "ok" for s in status):
            return results
        report = []
        for r in range(world_size):
            s = status[r] or f"timed out after {timeout:.0f}s"
            with open(logs[r]) as f:
                out = f.read()[-6000:]
            report.append(f"--- rank {r}: {s} ---\n{out}")
    finally:  # the logs are in the report; a suite of thousands of runs leaves no folders
        shutil.rmtree(tmp, ignore_errors=True)
    raise DistributedTestFailure(f"distributed run on {world_size} ranks failed\n" + "\n".join(report))


def distributed(
    world_size: int = 2,
    timeout: float = 120.0,
    *,
    backend: str = "gloo",
    device: str = "cpu",
    start_method: StartMethod | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: run the test body on ``world_size`` ranks (see module docstring).

    The wrapped test keeps pytest fixtures that are picklable-free (e.g. ``tmp_path``), since
    the ranks are forked, not pickled; with ``device="cuda"`` they are spawned, so fixture
    values must pickle (``tmp_path`` does).
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            run_distributed(
                fn, world_size, *args, timeout=timeout, backend=backend, device=device,
                start_method=start_method, **kwargs,
            )

        return wrapper

    return decorate
