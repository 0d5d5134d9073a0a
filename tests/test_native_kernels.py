"""lowcomm.compress.native: the compiled kernels load once per module, and a machine where they
cannot (numba missing or unusable) gets one warning and the same results from torch/numpy."""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels_testlib import require_compiled
from lowcomm.compress import native
from lowcomm.compress.sign import ScaledSign


def test_an_unusable_numba_falls_back_with_one_warning_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def broken(name: str, *a: object) -> object:
        if name == "lowcomm.compress.signjit":
            raise RuntimeError("no locator available for the cache")
        return real(name, *a)

    monkeypatch.delitem(native._LOADED, "signjit", raising=False)
    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.warns(RuntimeWarning, match="numba failed: RuntimeError: no locator"):
        assert native.load("signjit") is None
    assert native.load("signjit") is None  # decided once, no second warning


def test_the_sign_codec_gives_the_same_payload_and_residual_without_the_compiled_kernels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(1003, generator=torch.Generator().manual_seed(0))
    seg = [3, 500, 500]
    results = []
    for loaded in (require_compiled("signjit"), None):
        monkeypatch.setitem(native._LOADED, "signjit", loaded)
        comp = ScaledSign()
        payload, ctx = comp.compress(x, seg)
        results.append((payload[0], payload[1], comp.residual(x, payload, ctx)))
    for a, b in zip(*results):
        assert torch.equal(a, b)
