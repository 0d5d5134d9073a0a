"""The launcher starts ranks with torchrun's variables and stops them all when one fails."""

from __future__ import annotations

import sys
import time

from lowcomm.runtime.launch import launch_workers

# Rank 1 dies; rank 0 blocks in an all-reduce that can never complete.
_CRASHY = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
if int(os.environ["RANK"]) == 1:
    sys.exit(3)
dist.all_reduce(torch.ones(1))
"""

_ENV_ECHO = """
import os, sys
need = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
sys.exit(0 if all(v in os.environ for v in need) and os.environ["WORLD_SIZE"] == "3" else 9)
"""


def test_workers_get_torchrun_environment() -> None:
    assert launch_workers([], 3, command=[sys.executable, "-c", _ENV_ECHO]) == 0


def test_failed_rank_is_named_and_others_stopped_in_bounded_time(capfd) -> None:
    start = time.monotonic()
    code = launch_workers([], 2, command=[sys.executable, "-c", _CRASHY], failure_grace_s=3.0)
    elapsed = time.monotonic() - start
    assert code == 3
    assert elapsed < 60
    assert "worker rank 1 failed with exit code 3" in capfd.readouterr().err


def test_timeout_stops_hung_workers() -> None:
    code = launch_workers([], 1, command=[sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=1.0)
    assert code == 124
