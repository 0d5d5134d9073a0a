"""The compiled CPU kernels, required by their tests.

numba is in the ``fast`` extra, which ``make`` installs with the test dependencies: a test of a
compiled kernel fails (it does not skip) where it is missing, because then the kernels the
project ships for CPUs would go untested."""

from __future__ import annotations

from types import ModuleType

import pytest

from lowcomm.compress import native


def require_compiled(name: str) -> ModuleType:
    """The loaded kernel module ``lowcomm.compress.<name>``; fails the test without numba."""
    module = native.load(name)
    if module is None:
        pytest.fail(f"{name}: numba (the `fast` extra) is not installed, so the compiled kernels cannot be "
                    "tested; `make install` or pip install -e '.[fast]'")
    return module
