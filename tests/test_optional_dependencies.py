"""An optional package that is missing (or too old) is refused in one line before training.

``dear:tune=true`` needs bayes_opt (the ``tune`` extra). Without it the method used to
start, and every rank then died with an ImportError traceback at its first step.
"""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from lowcomm import methods
from lowcomm.cli import main
from lowcomm.errors import UsageError


def test_dear_tune_without_bayes_opt_is_refused_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bayes_opt", None)  # `import bayes_opt` now fails
    with pytest.raises(UsageError) as e:
        methods.create("dear:tune=true")
    assert "bayesian-optimization" in str(e.value) and "lowcomm[tune]" in str(e.value)
    methods.create("dear")  # without tuning nothing is needed


def test_dear_tune_with_a_too_old_bayes_opt_is_refused_with_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "1.4.3" if name == "bayesian-optimization" else real(name))
    with pytest.raises(UsageError, match=r">= 2 \(found 1\.4\.3\)"):
        methods.create("dear:tune=true")


def test_train_cli_prints_one_line_and_exits_2_before_starting_workers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "bayes_opt", None)
    code = main(["train", "--nproc", "2", "--method", "dear:tune=true", "--epochs", "1", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "lowcomm[tune]" in err, err
