"""The method registry finds its methods by listing the ``lowcomm.methods`` package, and the
timing references (PyTorch's own hooks) still train and count their bytes after the move."""

from __future__ import annotations

import copy
import importlib
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowcomm import methods
from lowcomm.comm import accounting
from lowcomm.errors import UsageError
from lowcomm.methods.base import MethodContext
from lowcomm.registry import Registry, package_modules
from lowcomm.testing import distributed
from tolerance import assert_close_eps


def test_every_module_of_the_methods_package_is_imported_by_the_first_lookup() -> None:
    names = methods.METHODS.names()
    assert set(package_modules("lowcomm.methods")) <= set(sys.modules)
    # the timing references live in lowcomm.methods.reference and are found there
    assert {"torch_powersgd", "torch_fp16", "torch_fsdp"} <= set(names)
    assert methods.method_class("torch_fsdp").__module__ == "lowcomm.methods.reference"
    assert "torch_fsdp" not in methods.names() and "torch_fsdp" in methods.names(include_timing_only=True)


def _package(tmp_path: Path, name: str, modules: dict[str, str]) -> None:
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for mod, code in modules.items():
        (pkg / f"{mod}.py").write_text(textwrap.dedent(code))


def test_a_new_module_in_the_package_is_found_without_being_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _package(tmp_path, "regpkg_new", {
        "one": "from regpkg_new import REG\nREG.register('a')(lambda: 1)\n",
        "two": "from regpkg_new import REG\nREG.register('b')(lambda: 2)\n",
        "_private": "raise AssertionError('private modules are not imported')\n",
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg = importlib.import_module("regpkg_new")
    reg: Registry[int] = Registry("thing", package="regpkg_new")
    pkg.REG = reg  # type: ignore[attr-defined]
    assert reg.names() == ["a", "b"] and reg.create("b") == 2
    with pytest.raises(UsageError, match=r"unknown thing 'c'.*valid: a, b"):
        reg.get("c")


def test_a_module_that_fails_to_import_fails_every_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _package(tmp_path, "regpkg_broken", {"bad": "raise ImportError('broken on purpose')\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry[int] = Registry("thing", package="regpkg_broken")
    for _ in range(2):  # not a silently empty registry the second time
        with pytest.raises(ImportError, match="broken on purpose"):
            reg.names()


@pytest.mark.parametrize(
    "text, specs",
    [
        ("ssgd,topk:density=0.01,start_iter=2,fp16", ["ssgd", "topk:density=0.01,start_iter=2", "fp16"]),
        ("pufferfish:then=(acpsgd:rank=4,start_iter=5),rank_ratio=0.25,ssgd",
         ["pufferfish:then=(acpsgd:rank=4,start_iter=5),rank_ratio=0.25", "ssgd"]),
        ("pufferfish:rank_ratio=0.25,then=acpsgd:rank=4, fp16", ["pufferfish:rank_ratio=0.25,then=acpsgd:rank=4", "fp16"]),
        (" ssgd , ,fp16 ", ["ssgd", "fp16"]),
    ],
)
def test_method_lists_split_at_top_level_commas_only(text: str, specs: list[str]) -> None:
    assert methods.split_list(text) == specs


def test_unbalanced_parentheses_in_a_method_list_are_refused() -> None:
    with pytest.raises(UsageError, match="unbalanced"):
        methods.split_list("pufferfish:then=(acpsgd:rank=4,ssgd")


# --- the timing references, moved from lowcomm.bench: same gradients, bytes still counted ----
def _synced_and_central(spec: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One step with different data per rank: the method's synchronized gradient, the central
    mean of every rank's local gradient (computed on a separate copy), and the ledger."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    local = []
    for x in xs:
        reference.zero_grad()
        reference(x).square().mean().backward()
        local.append(torch.cat([p.grad.flatten() for p in reference.parameters()]))
    method = methods.create(spec)
    wrapped = method.wrap(model, MethodContext(rank=rank, world_size=world))
    wrapped(xs[rank]).square().mean().backward()
    method.finish_sync()
    synced = torch.cat([p.grad.flatten() for p in model.parameters()])
    return synced, torch.stack(local).mean(0), accounting.ledger().as_dict()


@distributed(world_size=2)
def test_torch_fp16_reference_averages_in_half_precision_and_is_counted() -> None:
    synced, central, led = _synced_and_central("torch_fp16")
    # fp16 roundings along the chain: each rank's cast, the division by P, the sum
    assert_close_eps(synced, central, torch.float16, ops=3)
    assert led["by_tag"]["torch_fp16"]["payload_bytes"] == 2 * synced.numel()  # fp16 on the wire


@distributed(world_size=2)
def test_torch_powersgd_reference_compresses_and_is_counted() -> None:
    # start_iter=0 (allowed by PyTorch without error feedback and warm start): compressed at once
    synced, central, led = _synced_and_central(
        "torch_powersgd:rank=2,start_iter=0,error_feedback=false,warm_start=false"
    )
    assert torch.isfinite(synced).all() and synced.shape == central.shape
    counted = led["by_tag"]["torch_powersgd"]["payload_bytes"]
    assert 0 < counted < 4 * synced.numel()  # P, Q and the uncompressed vectors, under float32
    led_all = led["by_collective"]["all_reduce"]["payload_bytes"]
    assert led_all == counted  # every all-reduce the hook made went through the ledger


@distributed(world_size=2)
def test_torch_powersgd_warmup_all_reduces_are_counted_too() -> None:
    # before start_iter PyTorch's hook all-reduces through default_hooks' own ``dist``
    synced, central, led = _synced_and_central("torch_powersgd:rank=2,start_iter=2")
    assert_close_eps(synced, central, torch.float32, ops=2)  # the warm-up step is a plain mean
    assert led["by_tag"]["torch_powersgd.warmup"]["payload_bytes"] == 4 * synced.numel()
    assert led["by_collective"]["all_reduce"]["payload_bytes"] == 4 * synced.numel()
