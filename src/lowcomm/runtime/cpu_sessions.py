"""A notice for one CPU host running several torchrun workers under scheduler autogroups.

Why: torchrun starts each worker in a new session. With the kernel's scheduler autogroups on
(``kernel.sched_autogroup_enabled = 1``, the default of many distributions), each session is
one scheduling group, so when a node's workers and their threads outnumber its cores, gloo's
communication threads wait for their own worker's share of the CPU: a small all-reduce issued
while the workers compute took 109-196 ms on a 2-vCPU VM with 4 torchrun workers, 8-9 ms with
the same workers started by ``lowcomm``'s launcher (``benchmarks/gloo_loaded_latency.py``,
docs/simulator.md 5.2). Nothing is wrong with the run, it is only slower than it need be, so
this is a notice, printed once by each node's first worker; with one worker per GPU it never
applies.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def autogroup_notice(environ: Mapping[str, str], *, threads: int, cpus: int,
                     autogroup: Path = AUTOGROUP) -> str | None:
    """The one-line notice for a CPU worker that torchrun started (``TORCHELASTIC_RUN_ID`` set,
    not ``lowcomm``'s launcher) when its node's workers times ``threads`` exceed ``cpus`` and
    autogroups are on; None otherwise (including when the setting cannot be read)."""
    if "TORCHELASTIC_RUN_ID" not in environ or environ.get("LOWCOMM_LAUNCHED") == "1":
        return None
    try:
        local = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return None
    if local < 2 or local * max(1, threads) <= cpus:
        return None
    try:
        if autogroup.read_text().strip() != "1":
            return None
    except OSError:
        return None
    return (f"lowcomm: notice: torchrun started {local} CPU workers ({threads} thread(s) each) on {cpus} "
            "core(s) in separate sessions, and the kernel's scheduler autogroups are on: collectives issued "
            "while the workers compute wait for their worker's CPU share (about 20x longer measured); on one "
            f"host use `lowcomm train --nproc {local}`, or `sysctl kernel.sched_autogroup_enabled=0`")
