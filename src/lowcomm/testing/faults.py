"""Fault injection: start ``lowcomm train --nproc N``, SIGKILL one worker mid-run, watch.

Used by ``tests/test_fault_tolerance.py`` and ``benchmarks/kill_loop.py``. Nothing here
guesses from elapsed time when training is "under way": it waits for rank 0's JSONL
``--log`` to hold a number of step records, then kills. The only clocks are hang guards.

Linux only (worker processes are found through ``/proc``), like the launcher's benchmark
side (network namespaces).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from lowcomm.runtime.forked import COMM_PREFIX


@dataclass
class KillResult:
    """What one kill did. ``returncode`` is None when the launcher hung past the guard."""

    rank: int
    step_at_kill: int
    returncode: int | None
    exit_s: float | None  # seconds from the kill to the launcher's exit
    stderr: str
    leftover_pids: list[int]  # worker processes still alive after the launcher returned

    @property
    def hung(self) -> bool:
        """The launcher did not exit in time after the kill (the failure this harness exists to catch)."""
        return self.returncode is None

    @property
    def rank_named(self) -> bool:
        """The launcher's message named the killed rank (the user must learn which one died)."""
        return f"worker rank {self.rank} " in self.stderr


def step_records(log_path: str | Path, event: str = "step") -> list[dict[str, object]]:
    """Complete ``"event": EVENT`` records (``train``'s steps, ``fl``'s rounds) of a JSONL log
    being appended to (a torn last line, written while we read, is skipped)."""
    try:
        text = Path(log_path).read_text()
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("event") == event:
            records.append(rec)
    return records


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """``{rank: pid}`` of the launcher's child processes that carry a ``RANK`` variable (or,
    forked, the rank in their name)."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(
                    item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item
                )
        except (OSError, ValueError):
            continue  # exited meanwhile, or not ours to read
        if b"RANK" in env:
            found[int(env[b"RANK"])] = int(entry)
            continue
        # a forked worker (lowcomm.runtime.forked) keeps the launcher's environment block
        # but names itself after its rank
        try:
            with open(f"/proc/{entry}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if comm.startswith(COMM_PREFIX) and comm[len(COMM_PREFIX):].isdigit():
            found[int(comm[len(COMM_PREFIX):])] = int(entry)
    return found


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _wait_until(predicate: Callable[[], bool], proc: subprocess.Popen[bytes], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise RuntimeError(f"lowcomm train exited (code {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.05)


def run_and_kill(
    train_args: Sequence[str],
    *,
    nproc: int,
    rank: int,
    log_path: str | Path,
    after_steps: int = 10,
    start_timeout_s: float = 300.0,
    hang_guard_s: float = 120.0,
    env: dict[str, str] | None = None,
    command: Sequence[str] = ("train",),
    event: str = "step",
) -> KillResult:
    """Run ``lowcomm train --nproc nproc --log log_path *train_args``, SIGKILL worker
    ``rank`` once ``after_steps`` steps are logged, and wait for the command to exit.

    ``command``/``event``: another subcommand and the log records it writes (``("fl",)``
    and ``"round"``: kill a federated run after that many complete rounds).

    ``start_timeout_s`` bounds the start-up (interpreters importing torch on a loaded
    machine), ``hang_guard_s`` the time from the kill to the exit; a command still running
    then is killed with its whole process group and reported as hung.
    """
    cmd = [sys.executable, "-m", "lowcomm", *command, "--nproc", str(nproc), "--log", str(log_path), *train_args]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
        try:
            _wait_until(lambda: len(step_records(log_path, event)) >= after_steps, proc, start_timeout_s,
                        f"{after_steps} logged {event}s")
            pids: dict[int, int] = {}

            def all_found() -> bool:
                pids.update(worker_pids(proc.pid))
                return len(pids) == nproc

            _wait_until(all_found, proc, 30.0, f"{nproc} worker processes")
            step = len(step_records(log_path, event))
            os.kill(pids[rank], signal.SIGKILL)
            killed_at = time.monotonic()
            try:
                code: int | None = proc.wait(timeout=hang_guard_s)
                exit_s: float | None = time.monotonic() - killed_at
            except subprocess.TimeoutExpired:
                code, exit_s = None, None
            leftover = [p for p in pids.values() if alive(p)]
        finally:
            # Whatever happened, nothing we started outlives this call (the launcher and its
            # workers share the new session's process group).
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    return KillResult(rank=rank, step_at_kill=step, returncode=code, exit_s=exit_s, stderr=stderr,
                      leftover_pids=leftover)
