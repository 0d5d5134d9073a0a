"""What a user types first must work: ``import lowcomm`` then ``lowcomm.hooks.register``.

Checked in fresh interpreters: inside the test process every subpackage is already imported,
which would hide a missing lazy attribute.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import lowcomm


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_lowcomm_does_not_import_torch() -> None:
    out = _python("import lowcomm, sys; assert 'torch' not in sys.modules, 'torch imported'")
    assert out.returncode == 0, out.stderr


def test_public_entry_points_resolve_right_after_import_lowcomm() -> None:
    out = _python(
        "import lowcomm\n"
        "assert callable(lowcomm.hooks.register)\n"
        "assert callable(lowcomm.lowrank.factorize)\n"
        "assert callable(lowcomm.models.create) and callable(lowcomm.data.create)\n"
        "assert callable(lowcomm.methods.create)\n"
        "assert lowcomm.comm.accounting is not None\n"
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("name", sorted(lowcomm.SUBMODULES))
def test_every_listed_subpackage_imports_and_is_listed_by_dir(name: str) -> None:
    assert name in dir(lowcomm) and name in lowcomm.__all__
    assert getattr(lowcomm, name).__name__ == f"lowcomm.{name}"


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lowcomm.nope  # noqa: B018
    assert not hasattr(lowcomm, "optim_that_does_not_exist")


def test_lowcomm_help_imports_neither_the_test_helpers_nor_torch_dynamo() -> None:
    # torch._dynamo costs seconds, and `lowcomm --help` (and every CLI usage error) must not pay it
    out = _python(
        "import sys\nfrom lowcomm.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "bad = [m for m in ('torch._dynamo', 'lowcomm.testing') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    assert out.returncode == 0, out.stderr


def test_lowcomm_fl_launcher_does_not_import_torch() -> None:
    # the launcher of `lowcomm fl` only starts and watches workers: torch there would add
    # ~220 MB to the memory of all processes that the run reports
    out = _python(
        "import sys\nfrom lowcomm.cli import build_parser\nimport lowcomm.fl, lowcomm.fl.memory\n"
        "build_parser('fl')\nassert 'torch' not in sys.modules\n"
        "assert callable(lowcomm.fl.register_algorithm) and 'torch' in sys.modules\n"
    )
    assert out.returncode == 0, out.stderr
