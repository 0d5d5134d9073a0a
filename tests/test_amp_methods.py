"""Mixed precision composes with every registered method and with LARS/LAMB, through the trainer.

For each method of the registry (so a method added later is covered without editing this
file), two ranks train a few steps with bf16 autocast (CPU's AMP) and with fp16 autocast +
GradScaler, with SGD and with the layer-wise optimizers. What must hold, in every run:

* autocast really ran in low precision (the first linear layer's output has the autocast
  dtype) while every parameter and every optimizer state tensor stays float32 -- the "fp32
  master weights" of mixed precision (Micikevicius et al. 2018; Jia et al. 2018);
* every training loss is finite and the weights moved;
* both ranks hold the same weights afterwards, bit for bit (every method keeps replicas equal).

A combination that cannot work is refused before training with a UsageError saying why
(lee18 updates 1/P slices of a tensor: a layer-wise trust ratio over a slice is another rule).
Whether the AMP run trains *like* the fp32 run is tests/test_amp.py's business (exact
bookkeeping under scale changes); here it is composition over the whole registry.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from compress_testlib import run_ranks
from lowcomm import methods
from lowcomm.errors import UsageError

methods.names()  # import the method modules once, before the ranks fork

STEPS = 3
#: (autocast, optimizer) per method: bf16 is the CPU AMP (every optimizer), fp16 + GradScaler
#: runs on CPU too (its scaler's unscale/skip path; CUDA's AMP)
RUNS = (("bf16", "sgd"), ("fp16", "sgd"), ("bf16", "lars"), ("fp16", "lamb"))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def method_spec(name: str) -> str:
    """``name`` with options that make it compress from the first step (``start_iter=1``, no
    sparsity warm-up), when the method has them as its own (engine schedules inherit codec
    fields only with ``compress=``)."""
    cls = methods.method_class(name)
    options = getattr(cls, "Options", None)
    if options is None or not dataclasses.is_dataclass(options):
        return name
    own = {f.name for f in dataclasses.fields(options) if isinstance(f.default, (int, float, str))}
    extra = [kv for key, kv in (("start_iter", "start_iter=1"), ("sparsity_warmup", "sparsity_warmup=0"),
                                ("sync_every", "sync_every=1"), ("fragments", "fragments=1"), ("delay", "delay=0"), ("alpha", "alpha=0"))
             if key in own]  # semi-synchronous methods: replicas equal after every step
    return f"{name}:{','.join(extra)}" if extra else name


def refused(name: str, optimizer: str) -> bool:
    """The combinations the trainer refuses (and must say why)."""
    return optimizer in ("lars", "lamb") and getattr(methods.create(name), "mode", None) == "shard"


def _train(spec: str, amp: str, optimizer: str) -> dict[str, Any]:
    from lowcomm.runtime.config import TrainConfig
    from lowcomm.runtime.train_cli import check_names
    from lowcomm.runtime.trainer import Trainer

    cfg = TrainConfig(model="mlp", data="mnist1d", method=spec, nproc=2, batch_size=64, lr=0.05, steps=STEPS,
                      amp=amp, optimizer=optimizer, threads=1, progress=False, eval=False)
    try:
        cfg.validate()
        check_names(cfg)
    except UsageError as e:
        return {"refused": str(e)}
    trainer = Trainer(cfg)
    before = torch.cat([p.detach().reshape(-1).clone() for p in trainer.raw.parameters()])
    first_linear = next(m for m in trainer.raw.modules() if isinstance(m, nn.Linear))
    seen: list[torch.dtype] = []
    first_linear.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    losses: list[float] = []
    step = trainer.train_step

    def recording_step(x: torch.Tensor, y: torch.Tensor) -> float:
        losses.append(step(x, y))
        return losses[-1]

    trainer.train_step = recording_step  # type: ignore[method-assign]
    trainer.run()
    params = list(trainer.raw.parameters())
    state_dtypes = {t.dtype for s in trainer.optimizer.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.is_floating_point()}
    after = torch.cat([p.detach().reshape(-1) for p in params])
    gathered = [torch.empty_like(after) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, after)
    trainer.close()
    return {"losses": losses, "autocast": seen[0] if seen else None, "params": {p.dtype for p in params},
            "state": state_dtypes, "moved": not torch.equal(before, after),
            "agree": all(torch.equal(gathered[0], g) for g in gathered[1:])}


def _all_runs(spec: str) -> list[dict[str, Any]]:
    return [_train(spec, amp, optimizer) for amp, optimizer in RUNS]


@pytest.mark.parametrize("name", methods.names())
def test_amp_trains_every_method_with_fp32_master_weights_and_ranks_agree(name: str) -> None:
    spec = method_spec(name)
    per_rank = run_ranks(_all_runs, 2, spec, timeout=600)
    for (amp, optimizer), result in zip(RUNS, per_rank[0]):
        where = f"{spec} --amp {amp} --optimizer {optimizer}"
        if refused(name, optimizer):
            assert "refused" in result and "trust ratio" in result["refused"], where
            continue
        assert "refused" not in result, f"{where}: {result.get('refused')}"
        assert result["autocast"] == DTYPES[amp], f"{where}: autocast did not run in {amp}"
        assert result["params"] == {torch.float32}, f"{where}: parameters are {result['params']}"
        assert result["state"] <= {torch.float32}, f"{where}: optimizer state is {result['state']}"
        assert len(result["losses"]) == STEPS and all(math.isfinite(v) for v in result["losses"]), where
        assert result["moved"], f"{where}: the weights did not move"
        assert result["agree"], f"{where}: the ranks' weights differ"
    assert [r.get("refused") for r in per_rank[0]] == [r.get("refused") for r in per_rank[1]]
