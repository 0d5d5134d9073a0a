"""The notice for torchrun workers sharing a CPU host's cores under scheduler autogroups."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowcomm.runtime.cpu_sessions import autogroup_notice, usable_cpus

TORCHRUN = {"TORCHELASTIC_RUN_ID": "abc", "LOCAL_WORLD_SIZE": "4"}


def setting(tmp_path: Path, value: str) -> Path:
    path = tmp_path / "sched_autogroup_enabled"
    path.write_text(value + "\n")
    return path


def test_torchrun_workers_outnumbering_the_cores_with_autogroups_on_get_one_line(tmp_path: Path) -> None:
    text = autogroup_notice(TORCHRUN, threads=1, cpus=2, autogroup=setting(tmp_path, "1"))
    assert text is not None and "\n" not in text
    assert "4 CPU workers" in text and "lowcomm train --nproc 4" in text and "sched_autogroup_enabled=0" in text


@pytest.mark.parametrize("env, threads, cpus, value", [
    ({"LOCAL_WORLD_SIZE": "4"}, 1, 2, "1"),  # not torchrun
    ({**TORCHRUN, "LOWCOMM_LAUNCHED": "1"}, 1, 2, "1"),  # lowcomm's launcher
    (TORCHRUN, 1, 4, "1"),  # as many cores as workers
    (TORCHRUN, 1, 2, "0"),  # autogroups off
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "1"}, 4, 2, "1"),  # one worker per node
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "x"}, 1, 2, "1"),  # unreadable
])
def test_no_notice_where_it_does_not_apply(tmp_path: Path, env: dict, threads: int, cpus: int, value: str) -> None:
    assert autogroup_notice(env, threads=threads, cpus=cpus, autogroup=setting(tmp_path, value)) is None


def test_threads_count_against_the_cores_and_a_missing_setting_says_nothing(tmp_path: Path) -> None:
    env = {**TORCHRUN, "LOCAL_WORLD_SIZE": "2"}
    assert autogroup_notice(env, threads=1, cpus=2, autogroup=setting(tmp_path, "1")) is None
    assert autogroup_notice(env, threads=2, cpus=2, autogroup=setting(tmp_path, "1")) is not None
    assert autogroup_notice(env, threads=2, cpus=2, autogroup=tmp_path / "absent") is None
    assert usable_cpus() >= 1
