"""docs/composition.md is generated, up to date, and every cell it marks as working is
tested on 2 ranks against a central reference.

The dense model's cells are tested elsewhere (the DDP comm hooks by
``tests/test_compress_hooks.py``, the engine schedules by ``tests/test_sched_codecs.py`` and,
without a codec, ``tests/test_sched_correctness.py``): this module checks that their case
lists are exactly the working cells. The model-axis cells (``pufferfish:then=...``) are
tested here: one 2-rank run trains the tiny MLP of ``compress_testlib``, factorized at once
(``warmup_epochs=0``), with every working (payload, schedule) pair as the ``then`` method,
3 plain SGD steps each (``start_iter=1``: one warm-up step of plain averaging, then
compressed steps). Each rank records per step its local gradient (a shadow copy of the
factorized model at the current weights) and the weights before and after the step; the
codec's central reference, built on the factorized model's parameter shapes, replays the
steps from every rank's local gradients, and the step must be ``w - lr * g``.

Tolerance (tests/tolerance.py): as tests/test_sched_codecs.py, the reference's own
round-off model at the scale of the summed terms, times ``lr``, plus one float32 rounding
of the subtraction at the weights' scale.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from compress_testlib import TINY_BUCKET_MB, HOOK_CASES, Reference, make_model, reference_for, run_ranks
from sgd_testlib import check_sgd_steps, record_sgd_steps
from lowcomm import methods
from lowcomm.compress.codec import CODECS, codec_class
from lowcomm.errors import UsageError
from lowcomm.methods.base import MethodContext
from lowcomm.sched.pairing import pairing_refusal

methods.names()  # load the method modules before forking
REPO = Path(__file__).resolve().parent.parent
LR = 0.05
STEPS = 3


def _generator() -> ModuleType:
    """benchmarks/composition.py, imported in-process."""
    path = REPO / "benchmarks" / "composition.py"
    spec = importlib.util.spec_from_file_location("composition", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("composition", module)
    spec.loader.exec_module(module)
    return module


comp = _generator()


def _engine_schedules() -> dict[str, str]:
    """Engine schedule -> its small test options (tests/test_sched_codecs.py's)."""
    import test_sched_codecs

    return dict(test_sched_codecs.SCHEDULES)


def cell_options(payload: str) -> dict[str, Any]:
    """The suites' small test options of the payload's codec (compress from step 1), with
    ``rank=1`` for a codec that has a rank: the tiny model's factors are at most 16 x 4,
    where rank 2 would not pay off and the codec would send every tensor uncompressed."""
    if payload == "none":
        return {}
    opts = dict(dict(HOOK_CASES)[payload])
    if "rank" in {f.name for f in dataclasses.fields(codec_class(payload).Options)}:
        opts["rank"] = 1
    return opts


def inner_spec(payload: str, schedule: str) -> str:
    """The ``then`` method of a cell: DDP's method named like the payload (``ssgd`` for none)
    or the engine schedule (with the engine suite's options) carrying the payload."""
    if schedule == "ddp":
        parts = ["ssgd" if payload == "none" else payload]
    else:
        parts = [schedule, _engine_schedules()[schedule]] + ([f"compress={payload}"] if payload != "none" else [])
    parts += [f"{k}={v}" for k, v in cell_options(payload).items()]
    head, rest = parts[0], [p for p in parts[1:] if p]
    return f"{head}:{','.join(rest)}" if rest else head


def cell_spec(payload: str, schedule: str) -> str:
    """Pufferfish factorizing at once, then the cell's method."""
    return f"pufferfish:warmup_epochs=0,then=({inner_spec(payload, schedule)})"


#: every (payload, schedule) pair, from the registries and the engine suite's schedules
PAIRS = [(p, s) for p in ["none", *CODECS.names()] for s in ["ddp", *_engine_schedules()]]
#: the pairs pufferfish must carry: all but the engine's refusals
PUFFERFISH_CELLS = [(p, s) for p, s in PAIRS if s == "ddp" or pairing_refusal(s, p) is None]
PUFFERFISH_REFUSED = [c for c in PAIRS if c not in PUFFERFISH_CELLS]


# --- (a) the page is what the generator writes ----------------------------------------------
def test_docs_composition_md_is_what_the_generator_writes() -> None:
    assert (REPO / "docs" / "composition.md").read_text() == comp.render(), (
        "docs/composition.md is stale: run `.venv/bin/python benchmarks/composition.py`")
    assert comp.main(["--check"]) == 0


def test_check_mode_fails_on_a_stale_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "composition.md"
    stale.write_text(comp.render().replace("✓", "?", 1))
    monkeypatch.setattr(comp, "DOC", stale)
    assert comp.main(["--check"]) == 1
    assert comp.main([]) == 0 and comp.main(["--check"]) == 0  # rewritten


def test_the_axes_are_read_from_the_registries() -> None:
    assert comp.payloads() == ["none", *sorted(CODECS.names())]
    assert comp.schedules() == ["ddp", *sorted(_engine_schedules())]
    assert "pufferfish" in comp.models()
    for cell in comp.cells():  # every refusal is the one the user gets
        if cell.refused is not None:
            with pytest.raises(UsageError) as e:
                methods.create(cell.spec)
            assert str(e.value) == cell.refused


# --- (b) every working cell is covered by a 2-rank reference test ----------------------------
def test_every_working_cell_is_covered_by_a_two_rank_reference_test() -> None:
    import test_sched_codecs
    import test_sched_correctness

    working = comp.working()
    dense = {(p, s) for m, p, s in working if m == "dense"}
    hook_cells = {("none" if name == "ssgd" else name, "ddp") for name, _ in HOOK_CASES}
    assert {c for c in dense if c[1] == "ddp"} == hook_cells
    assert {c for c in dense if c[1] != "ddp" and c[0] != "none"} == {(c, s) for s, c in test_sched_codecs.WORKING}
    assert {s for p, s in dense if p == "none" and s != "ddp"} == set(test_sched_correctness.SPECS)
    assert comp.models() == ["dense", "pufferfish"]  # a new model-axis method needs its cells' test
    assert {(p, s) for m, p, s in working if m == "pufferfish"} == set(PUFFERFISH_CELLS)


# --- (c) the pufferfish cells against their central references ------------------------------
def _train(spec: str) -> dict[str, Any]:
    rank = dist.get_rank()
    method = methods.create(spec)
    model = method.prepare(make_model())  # factorized now: warmup_epochs=0
    shadow = copy.deepcopy(model)
    ctx = MethodContext(rank=rank, world_size=dist.get_world_size(), bucket_cap_mb=TINY_BUCKET_MB)
    wrapped = method.wrap(model, ctx)
    return record_sgd_steps(method, model, shadow, wrapped, steps=STEPS, lr=LR, rank=rank)


def _train_all() -> dict[str, Any]:
    return {f"{p}+{s}": _train(cell_spec(p, s)) for p, s in PUFFERFISH_CELLS}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    """Every working pufferfish cell trained once, in one 2-rank run (one spawn)."""
    return run_ranks(_train_all, 2, timeout=240)


def _reference(payload: str, model: torch.nn.Module, world: int) -> tuple[Reference, int]:
    """The payload's central reference on ``model``'s parameters, and its warm-up steps."""
    name = "ssgd" if payload == "none" else payload
    opts = cell_options(payload)
    return reference_for(name, opts, world, model=model), int(opts.get("start_iter", 0))


@pytest.mark.parametrize("payload, schedule", PUFFERFISH_CELLS)
def test_every_working_pufferfish_cell_matches_its_central_reference_on_two_ranks(
    runs: list[dict[str, Any]], payload: str, schedule: str
) -> None:
    recs = [r[f"{payload}+{schedule}"] for r in runs]
    factorized = methods.create(cell_spec(payload, schedule)).prepare(make_model())
    names = [n for n, _ in factorized.named_parameters()]
    assert names == list(recs[0]["local"][0]) and any(".u." in n for n in names), "not the factorized model"
    ref, start = _reference(payload, factorized, len(recs))
    warm, _ = _reference("none", factorized, len(recs))
    compressed = check_sgd_steps(recs, names, ref, warm, start, steps=STEPS, lr=LR,
                                 label=f"pufferfish+{schedule}+{payload}")
    if payload != "none" and not codec_class(payload).elementwise:  # a cast may round these exactly
        assert compressed >= 1, f"pufferfish+{schedule}+{payload}: the reference never differed from the mean"


@pytest.mark.parametrize("payload, schedule", PUFFERFISH_REFUSED)
def test_refused_pufferfish_cell_is_refused_with_the_engines_reason(payload: str, schedule: str) -> None:
    with pytest.raises(UsageError) as e:
        methods.create(cell_spec(payload, schedule))
    assert str(e.value) == pairing_refusal(schedule, payload)
