"""The machine this process runs on, as results record it.

Why one place: measured times (bench rows, latency tables, cached compute profiles) are only
comparable between like machines, so they all name the CPU the same way.
"""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what ``platform`` knows; else "cpu")."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"
