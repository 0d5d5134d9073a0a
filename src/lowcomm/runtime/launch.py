"""Start N local worker processes the way ``torchrun`` would, and watch them.

Each worker is ``python -m lowcomm <worker_args>`` with ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, exactly the
variables torchrun sets, so the worker code path is the same whether we or torchrun started
it. If one worker fails (an exception, or killed by a signal), the others are sent SIGTERM
at once and killed if they are still there ``failure_grace_s`` later; the message names the
failed rank (the likely cause, when several are found dead at once) and the command exits
non-zero. Ctrl-C / SIGTERM stop every worker.

Bad input (a :class:`~lowcomm.errors.UsageError`, exit code 2) is usually seen by every
worker at once. The workers do not print it: each writes its message to a report file in a
folder the launcher names in ``LOWCOMM_USAGE_ERROR_DIR``, and the launcher alone prints one
line, whatever the order in which the workers exit. (Letting rank 0 print and the launcher
stay quiet when rank 0 failed raced: rank 1 could exit first, the launcher printed its
"worker failed" line, then rank 0 printed the reason: two lines.)

``nproc_per_node`` G splits the ranks into nodes of G the way torchrun numbers them on a
multi-node job (contiguous: node ``rank // G``): ``LOCAL_RANK = rank % G``,
``LOCAL_WORLD_SIZE = G`` and ``GROUP_RANK = rank // G`` (torchrun's name for the node index),
so :meth:`lowcomm.comm.topology.Topology.from_env` sees the same layout as on a real cluster.
Without it every rank is on one node (G = nproc).

``rank_prefix`` lets the benchmark put each rank in its own network namespace (or each
emulated node's ranks in the node's namespace: ``ip netns exec NS``) and ``rank_env`` bind
gloo to that namespace's interface.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from lowcomm.errors import UsageError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: Exit code of a worker that refused bad input (see :mod:`lowcomm.cli`).
USAGE_EXIT = 2
#: Environment variable naming the folder where launched workers report usage errors.
USAGE_DIR_VAR = "LOWCOMM_USAGE_ERROR_DIR"
#: After one worker refused bad input, how long the others get to finish on their own
#: before they are stopped. Not needed for correctness (one report is enough); it only lets
#: rank 0's report, the lowest, be the one shown when every worker has one.
USAGE_GRACE_S = 3.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago: the rendezvous port of a local launch (and of
    the test helpers' ranks), so two runs on one host do not collide on a fixed port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def under_torchrun() -> bool:
    """True when this process is a worker started by torchrun or by :func:`launch_workers`."""
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE"))


class WorkerFailure(RuntimeError):
    """A worker exited non-zero or was killed; names the rank, so the user knows which one."""

    def __init__(self, rank: int, returncode: int) -> None:
        super().__init__(f"worker rank {rank} {describe_exit(returncode)}")
        self.rank = rank
        self.returncode = returncode


def describe_exit(returncode: int) -> str:
    """``failed with exit code 3`` or ``was killed by SIGKILL`` (Popen reports signal N as -N)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"failed with exit code {returncode}"


def report_usage_error(message: str) -> bool:
    """In a worker started by :func:`launch_workers`: hand ``message`` to the launcher.

    Returns False when this process was not started by us (or the report cannot be
    written): the caller prints the message itself then. The file is written under a
    temporary name and renamed, so the launcher never reads half a message.
    """
    folder = os.environ.get(USAGE_DIR_VAR)
    rank = os.environ.get("RANK")
    if not folder or rank is None or os.environ.get("LOWCOMM_LAUNCHED") != "1":
        return False
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
        with os.fdopen(fd, "w") as f:
            f.write(message)
        os.replace(tmp, os.path.join(folder, f"rank{int(rank)}.txt"))
    except (OSError, ValueError):
        return False
    return True


def peer_reported_usage_error() -> bool:
    """In a launched worker: True when another worker already handed the launcher a usage
    error (the launcher prints that one line; a peer's "lost contact" would be a second)."""
    folder = os.environ.get(USAGE_DIR_VAR)
    return bool(folder) and os.environ.get("LOWCOMM_LAUNCHED") == "1" and bool(_usage_reports(folder or ""))


def _usage_reports(folder: str) -> dict[int, str]:
    reports: dict[int, str] = {}
    for path in glob.glob(os.path.join(folder, "rank*.txt")):
        try:
            rank = int(os.path.basename(path)[4:-4])
            with open(path) as f:
                reports[rank] = f.read().strip()
        except (OSError, ValueError):
            continue
    return reports


def _cause_first(failed: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Order the ranks found dead in one poll so that the likely cause comes first.

    One worker's death makes its peers fail moments later (gloo: "Connection closed by
    peer", an exception or an abort), and one poll can see them all dead. A rank killed by
    SIGKILL (the OOM killer, a user) or SIGTERM was killed from outside, never as a
    consequence, so it is the cause; then bad input (exit code 2); then the lowest rank.
    """

    def key(item: tuple[int, int]) -> tuple[int, int]:
        rank, code = item
        outside = code in (-signal.SIGKILL, -signal.SIGTERM)
        return (0 if outside else 1 if code == USAGE_EXIT else 2, rank)

    return sorted(failed, key=key)


def _wait_all(procs: list[Any], timeout_s: float) -> None:
    """Wait until every process has exited or ``timeout_s`` passed (no signals sent)."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)


def _stop(procs: list[Any], grace_s: float) -> None:
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


def node_layout(nproc: int, nproc_per_node: int | None) -> int:
    """Workers per node for ``nproc`` ranks: ``nproc_per_node`` (checked), or ``nproc`` (one node).

    A G that does not divide ``nproc`` is refused: torchrun's layout needs equal nodes.
    """
    if nproc_per_node is None:
        return nproc
    if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1 \
            or nproc % nproc_per_node:
        valid = ", ".join(str(g) for g in range(1, nproc + 1) if nproc % g == 0)
        raise UsageError(f"{nproc_per_node!r} workers per node does not divide {nproc} workers; valid: {valid}")
    return nproc_per_node


def node_env(rank: int, nproc: int, nproc_per_node: int | None = None) -> dict[str, str]:
    """torchrun's per-rank layout variables for ``rank`` of ``nproc`` on nodes of ``nproc_per_node``."""
    g = node_layout(nproc, nproc_per_node)
    return {"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank % g),
            "LOCAL_WORLD_SIZE": str(g), "GROUP_RANK": str(rank // g)}


def launch_workers(
    worker_args: list[str],
    nproc: int,
    *,
    nproc_per_node: int | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    rank_env: Callable[[int], dict[str, str]] | None = None,
    rank_prefix: Callable[[int], list[str]] | None = None,
    failure_grace_s: float = 15.0,
    timeout_s: float | None = None,
    quiet: bool = False,
    command: list[str] | None = None,
    fork_entry: Callable[[list[str]], int] | None = None,
    on_started: Callable[[], object] | None = None,
    threads: int | None = None,
) -> int:
    """Run ``nproc`` workers to completion; return 0, or the first failure's exit code.

    A worker killed by a signal counts as exit code 1 (not 128+N: 130 means "interrupted"
    to the callers). Bad input reported by the workers (exit code 2) is printed once, as
    ``lowcomm: error: ...``, even when ``quiet`` (it is the user's answer, not launcher
    chatter); ``quiet`` silences only the launcher's own lines.

    ``command`` replaces ``python -m lowcomm`` (tests use it to start tiny scripts).
    ``fork_entry``: fork the workers from this process instead (:mod:`lowcomm.runtime.forked`;
    they share what this process imported); each runs ``fork_entry(worker_args)``.
    ``on_started`` is called once every worker has started (e.g. to start a sampler thread
    only after the forks).
    ``nproc_per_node``: workers per (emulated) node, see the module docstring; it must divide
    ``nproc`` (:class:`~lowcomm.errors.UsageError` otherwise, before anything starts).
    ``threads``: the workers' threads each; sets ``OMP_NUM_THREADS`` for them unless this
    environment sets it (torchrun sets it to 1). Why: ``torch.set_num_threads`` in a worker
    covers the threads torch starts, not the ones gloo runs a comm hook's callbacks on, which
    would otherwise take every core for their decode's kernels (oversubscribing them) and
    split its reductions differently from run to run (a low-rank codec's results then varied
    by float round-off between identical runs).
    """
    per_node = node_layout(nproc, nproc_per_node)
    if fork_entry is not None and (rank_prefix is not None or command is not None):
        raise ValueError("forked workers run in this process's namespace and program: "
                         "no rank_prefix or command with fork_entry")
    port = master_port or free_port(master_addr if master_addr != "0.0.0.0" else "127.0.0.1")
    usage_dir = tempfile.mkdtemp(prefix="lowcomm-usage-")
    try:
        return _run(worker_args, nproc, per_node, master_addr=master_addr, port=port, rank_env=rank_env,
                    rank_prefix=rank_prefix, failure_grace_s=failure_grace_s, timeout_s=timeout_s,
                    quiet=quiet, command=command, usage_dir=usage_dir, fork_entry=fork_entry,
                    on_started=on_started, threads=threads)
    finally:
        shutil.rmtree(usage_dir, ignore_errors=True)


def _run(
    worker_args: list[str],
    nproc: int,
    per_node: int,
    *,
    master_addr: str,
    port: int,
    rank_env: Callable[[int], dict[str, str]] | None,
    rank_prefix: Callable[[int], list[str]] | None,
    failure_grace_s: float,
    timeout_s: float | None,
    quiet: bool,
    command: list[str] | None,
    usage_dir: str,
    fork_entry: Callable[[list[str]], int] | None = None,
    on_started: Callable[[], object] | None = None,
    threads: int | None = None,
) -> int:
    procs: list[Any] = []  # subprocess.Popen, or ForkedWorker (the same methods)
    base_env = dict(os.environ)
    if threads and "OMP_NUM_THREADS" not in base_env:
        base_env["OMP_NUM_THREADS"] = str(threads)
    for rank in range(nproc):
        env = dict(base_env)
        env.update(node_env(rank, nproc, per_node))
        env.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(port),
            LOWCOMM_LAUNCHED="1",
        )
        env[USAGE_DIR_VAR] = usage_dir
        if rank_env:
            env.update(rank_env(rank))
        if fork_entry is not None:
            from lowcomm.runtime.forked import fork_worker

            procs.append(fork_worker(rank, env, functools.partial(fork_entry, list(worker_args))))
            continue
        program = command if command is not None else [sys.executable, "-m", "lowcomm"]
        cmd = [*(rank_prefix(rank) if rank_prefix else []), *program, *worker_args]
        procs.append(subprocess.Popen(cmd, env=env))
    if on_started is not None:
        on_started()

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
                (rank, code), *others = _cause_first(failed)
                reports: dict[int, str] = {}
                if code == USAGE_EXIT:
                    # The others most likely hit the same bad input: let them finish reporting.
                    _wait_all(procs, min(USAGE_GRACE_S, failure_grace_s))
                    reports = _usage_reports(usage_dir)
                if reports:  # bad input: one line, the lowest rank's reason, nothing else
                    print(f"lowcomm: error: {reports[min(reports)]}", file=sys.stderr, flush=True)
                elif not quiet:
                    also = "".join(f" (rank {r} {describe_exit(c)} too)" for r, c in others)
                    print(
                        f"lowcomm: worker rank {rank} {describe_exit(code)}{also}; "
                        f"stopping the other {nproc - 1} worker(s)",
                        file=sys.stderr,
                        flush=True,
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
