"""Workers forked from the launcher instead of started as new interpreters (Linux).

Why: every worker of a run imports the same torch (~140 MB of private memory per process
once its libraries are relocated and its modules built). A launcher that imports torch once
and then forks its workers shares those pages copy-on-write, so the machine holds them once
instead of once per worker; what a worker writes (its data, model, buffers) becomes its own.
It is the preload that ``multiprocessing``'s forkserver and gunicorn's ``--preload`` offer,
applied to our launcher: the workers still see exactly torchrun's variables and join the
process group the same way, and the launcher still watches them (:class:`ForkedWorker` has
the parts of ``subprocess.Popen`` the launcher uses).

Safe only while the launcher has run no torch operation (no OpenMP pool) and has not
touched CUDA: the launcher imports, it does not compute.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Callable

#: Linux ``prctl`` option that names the calling thread (shown in ``/proc/PID/comm``)
_PR_SET_NAME = 15
#: the name a forked worker of rank R shows in ``/proc/PID/comm`` (its environment block in
#: ``/proc/PID/environ`` is the launcher's, without ``RANK``)
COMM_PREFIX = "lowcomm-r"


class ForkedWorker:
    """A forked worker, watched like a ``subprocess.Popen`` (``returncode`` -N: killed by N)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the worker has exited (reaped here), else None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = 1  # reaped elsewhere: it is gone, cause unknown
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the worker if it is still running."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


def _name_process(rank: int) -> None:
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(_PR_SET_NAME, f"{COMM_PREFIX}{rank}".encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the name is only a convenience for finding workers


def fork_worker(rank: int, env: dict[str, str], entry: Callable[[], int]) -> ForkedWorker:
    """Fork; the child takes ``env`` as its whole environment, runs ``entry()`` and exits
    with its code (an exception: its traceback on stderr and exit code 1)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedWorker(pid)
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        _name_process(rank)
        code = int(entry() or 0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001  the child must never return into the launcher's code
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
