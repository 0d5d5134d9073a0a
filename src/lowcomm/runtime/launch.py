"""Start N local worker processes the way ``torchrun`` would, and watch them.

Each worker is ``python -m lowcomm <worker_args>`` with ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, exactly the
variables torchrun sets, so the worker code path is the same whether we or torchrun started
it. If one worker fails, the others get ``failure_grace_s`` to stop on their own (they
usually do, when gloo notices the closed connection), then are terminated; the message names
the first failed rank and the command exits non-zero. Ctrl-C / SIGTERM stop every worker.

``rank_prefix`` lets the benchmark put each rank in its own network namespace
(``ip netns exec NS``) and ``rank_env`` bind gloo to that namespace's interface.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable

from lowcomm.testing.distributed import free_port

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """True when this process is a worker started by torchrun or by :func:`launch_workers`."""
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE"))


class WorkerFailure(RuntimeError):
    def __init__(self, rank: int, returncode: int) -> None:
        super().__init__(f"worker rank {rank} failed with exit code {returncode}")
        self.rank = rank
        self.returncode = returncode


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch_workers(
    worker_args: list[str],
    nproc: int,
    *,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    rank_env: Callable[[int], dict[str, str]] | None = None,
    rank_prefix: Callable[[int], list[str]] | None = None,
    failure_grace_s: float = 15.0,
    timeout_s: float | None = None,
    quiet: bool = False,
    command: list[str] | None = None,
) -> int:
    """Run ``nproc`` workers to completion; return 0, or the first failure's exit code.

    Exit code 2 from rank 0 means bad input (a :class:`~lowcomm.errors.UsageError`) whose
    reason rank 0 printed, so the launcher stops the others without adding a line.

    ``command`` replaces ``python -m lowcomm`` (tests use it to start tiny scripts).
    """
    port = master_port or free_port(master_addr if master_addr != "0.0.0.0" else "127.0.0.1")
    procs: list[subprocess.Popen[bytes]] = []
    base_env = dict(os.environ)
    for rank in range(nproc):
        env = dict(base_env)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(port),
            LOWCOMM_LAUNCHED="1",
        )
        if rank_env:
            env.update(rank_env(rank))
        program = command if command is not None else [sys.executable, "-m", "lowcomm"]
        cmd = [*(rank_prefix(rank) if rank_prefix else []), *program, *worker_args]
        procs.append(subprocess.Popen(cmd, env=env))

    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    if previous is not None and hasattr(signal, "SIGTERM"):
        try:
            signal.signal(signal.SIGTERM, on_term)
        except ValueError:  # not the main thread
            pass
    start = time.monotonic()
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                if not quiet and not (code == 2 and rank == 0):  # rank 0 already said why
                    print(
                        f"lowcomm: worker rank {rank} failed with exit code {code}; "
                        f"stopping the other {nproc - 1} worker(s)",
                        file=sys.stderr,
                    )
                _stop(procs, failure_grace_s)
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                if not quiet:
                    print(f"lowcomm: workers timed out after {timeout_s:.0f}s; stopping them", file=sys.stderr)
                _stop(procs, 5.0)
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        if not quiet:
            print("lowcomm: interrupted; stopping all workers", file=sys.stderr)
        _stop(procs, 5.0)
        return 130
    finally:
        try:
            signal.signal(signal.SIGTERM, previous)
        except (ValueError, TypeError):
            pass
