"""Run a function on N gloo ranks in forked subprocesses, with a hard timeout.

``@distributed(world_size=2)`` turns a test body into an N-rank run; a hang or an exception on
any rank becomes a test failure that shows every rank's output. :func:`run_distributed`
returns each rank's (picklable) return value, for tests that compare ranks.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch._dynamo  # noqa: F401  DDP imports it lazily (~5 s); import once before forking
import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class DistributedTestFailure(AssertionError):
    pass


def _child(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    log_path: str,
    conn: Any,
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
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
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
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result."""
    ctx = mp.get_context("fork")
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="lowcomm-dist-")
    procs, pipes, logs = [], [], []
    for rank in range(world_size):
        parent_end, child_end = ctx.Pipe(duplex=False)
        log_path = os.path.join(tmp, f"rank{rank}.log")
        p = ctx.Process(
            target=_child,
            args=(rank, world_size, port, fn, args, kwargs, log_path, child_end),
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

    if all(s == "ok" for s in status):
        return results
    report = []
    for r in range(world_size):
        s = status[r] or f"timed out after {timeout:.0f}s"
        with open(logs[r]) as f:
            out = f.read()[-6000:]
        report.append(f"--- rank {r}: {s} ---\n{out}")
    raise DistributedTestFailure(f"distributed run on {world_size} ranks failed\n" + "\n".join(report))


def distributed(world_size: int = 2, timeout: float = 120.0) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: run the test body on ``world_size`` gloo ranks (see module docstring).

    The wrapped test keeps pytest fixtures that are picklable-free (e.g. ``tmp_path``), since
    the ranks are forked, not pickled.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            run_distributed(fn, world_size, *args, timeout=timeout, **kwargs)

        return wrapper

    return decorate
