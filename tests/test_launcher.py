"""The launcher starts ranks with torchrun's variables, stops them all when one fails, and
reports bad input seen by the workers as exactly one line, whatever order they exit in.

No test here asserts on elapsed time: a loaded 2-core machine can take tens of seconds just
to start the worker interpreters. Hangs are caught by the ``timeout`` marks instead.
"""

from __future__ import annotations

import sys

import pytest

from lowcomm.errors import UsageError
from lowcomm.runtime.launch import USAGE_EXIT, launch_workers, node_env

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

# Every rank hits the same bad input through the real CLI entry point ("fly" is no
# subcommand); the rank named in argv[1] first sleeps argv[2] seconds, so the other exits first.
_ALL_BAD = """
import os, sys, time
if os.environ["RANK"] == sys.argv[1]:
    time.sleep(float(sys.argv[2]))
from lowcomm.cli import main
sys.exit(main(["fly"]))
"""

# Only rank 1 refuses its input; rank 0 would wait forever.
_ONE_BAD = """
import os, sys, time
if os.environ["RANK"] != "1":
    time.sleep(3600)
from lowcomm.cli import main
sys.exit(main(["fly"]))
"""

# Rank 1 is killed by SIGKILL (no exit handler runs, like the OOM killer); rank 0 waits forever.
_KILLED = """
import os, signal, time
if os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(3600)
"""


def _err_lines(capfd: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines() if line.strip()]


def test_workers_get_torchrun_environment() -> None:
    assert launch_workers([], 3, command=[sys.executable, "-c", _ENV_ECHO]) == 0


_OMP_ECHO = """
import os, sys
sys.exit(0 if os.environ.get("OMP_NUM_THREADS") == sys.argv[1] else 9)
"""


def test_threads_set_omp_num_threads_unless_the_environment_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # gloo's callback threads follow OMP_NUM_THREADS, not the worker's torch.set_num_threads
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch_workers(["3"], 2, command=[sys.executable, "-c", _OMP_ECHO], threads=3) == 0
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the user's (or torchrun's) setting wins
    assert launch_workers(["5"], 2, command=[sys.executable, "-c", _OMP_ECHO], threads=3) == 0


@pytest.mark.timeout(240)  # the hang guard: rank 0 would block forever if not stopped
def test_failed_rank_is_named_and_others_stopped(capfd: pytest.CaptureFixture[str]) -> None:
    code = launch_workers([], 2, command=[sys.executable, "-c", _CRASHY], failure_grace_s=3.0)
    assert code == 3  # returning at all means rank 0 was stopped: the launcher waits for it
    assert "worker rank 1 failed with exit code 3" in capfd.readouterr().err


@pytest.mark.timeout(240)
def test_killed_rank_is_named_with_its_signal(capfd: pytest.CaptureFixture[str]) -> None:
    code = launch_workers([], 2, command=[sys.executable, "-c", _KILLED], failure_grace_s=3.0)
    assert code != 0
    assert "worker rank 1 was killed by SIGKILL" in capfd.readouterr().err


@pytest.mark.timeout(240)
@pytest.mark.parametrize("slow_rank", ["0", "1"])
def test_bad_input_on_every_rank_is_one_line_whichever_rank_exits_first(
    slow_rank: str, capfd: pytest.CaptureFixture[str]
) -> None:
    code = launch_workers([slow_rank, "1.0"], 2, command=[sys.executable, "-c", _ALL_BAD])
    err = _err_lines(capfd)
    assert code == USAGE_EXIT
    assert len(err) == 1, err
    assert err[0].startswith("lowcomm: error:") and "invalid choice: 'fly'" in err[0]


@pytest.mark.timeout(240)
def test_bad_input_on_one_rank_only_is_reported_once_and_the_others_stopped(
    capfd: pytest.CaptureFixture[str],
) -> None:
    code = launch_workers([], 2, command=[sys.executable, "-c", _ONE_BAD], failure_grace_s=3.0)
    err = _err_lines(capfd)
    assert code == USAGE_EXIT
    assert len(err) == 1 and "invalid choice: 'fly'" in err[0], err


def test_timeout_stops_hung_workers() -> None:
    code = launch_workers([], 1, command=[sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=1.0)
    assert code == 124


# Each rank checks torchrun's node layout for nodes of argv[1] workers (contiguous ranks).
_NODE_ECHO = """
import os, sys
g, rank = int(sys.argv[1]), int(os.environ["RANK"])
ok = (os.environ["LOCAL_RANK"] == str(rank % g) and os.environ["LOCAL_WORLD_SIZE"] == str(g)
      and os.environ["GROUP_RANK"] == str(rank // g) and os.environ["WORLD_SIZE"] == "4")
sys.exit(0 if ok else 9)
"""


@pytest.mark.parametrize("per_node", [1, 2, 4])
def test_nproc_per_node_gives_each_rank_torchruns_local_rank_and_node(per_node: int) -> None:
    assert launch_workers([str(per_node)], 4, nproc_per_node=per_node,
                          command=[sys.executable, "-c", _NODE_ECHO]) == 0


def test_without_nproc_per_node_all_ranks_are_on_one_node() -> None:
    assert node_env(2, 3) == {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3",
                              "GROUP_RANK": "0"}


@pytest.mark.parametrize("bad", [3, 0, -2])
def test_nproc_per_node_that_does_not_divide_the_world_is_refused_naming_valid_sizes(bad: int) -> None:
    with pytest.raises(UsageError, match=r"valid: 1, 2, 4"):
        launch_workers([], 4, nproc_per_node=bad, command=[sys.executable, "-c", "pass"])


# --- forked workers (lowcomm.runtime.forked): watched exactly like started ones ------------


def _forked_entry(args: list[str]) -> int:
    import os
    import signal

    rank = int(os.environ["RANK"])
    need = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(v in os.environ for v in need):
        return 9
    if args == ["die"] and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if args == ["bad"]:
        from lowcomm.cli import main

        return main(["fly"])
    return 0


@pytest.mark.timeout(60)
def test_forked_workers_get_torchruns_variables_and_are_started_once() -> None:
    started: list[int] = []
    assert launch_workers([], 3, fork_entry=_forked_entry, on_started=lambda: started.append(1), quiet=True) == 0
    assert started == [1]


@pytest.mark.timeout(60)
def test_a_killed_forked_worker_is_named_with_its_signal(capfd: pytest.CaptureFixture[str]) -> None:
    assert launch_workers(["die"], 2, fork_entry=_forked_entry) == 1
    assert "worker rank 1 was killed by SIGKILL" in capfd.readouterr().err


@pytest.mark.timeout(60)
def test_bad_input_in_forked_workers_is_one_line(capfd: pytest.CaptureFixture[str]) -> None:
    assert launch_workers(["bad"], 2, fork_entry=_forked_entry) == USAGE_EXIT
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("lowcomm: error:")
