"""Rank selection: Pufferfish's fixed ratio and Cuttlefish's scaled stable rank.

Pufferfish uses ``r = ratio · min(out, in)`` for every factorized layer (ratio 1/4).
Cuttlefish (Wang et al., MLSys'23) picks a rank per layer from the *stable rank*
``‖σ‖² / σ_max²`` — a smooth, noise-robust lower bound of the rank. Because a random
initialization already has a stable rank far below full rank, Cuttlefish scales it by
``full_rank / srank(W_init)``, so a layer starts at full rank and shrinks as training makes
its spectrum decay. The switch epoch is chosen when those per-layer ranks stop changing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

if TYPE_CHECKING:
    from lowcomm.lowrank.factorize import Candidate


def ratio_rank(out_features: int, in_features: int, ratio: float) -> int:
    """``max(1, floor(ratio · min(out, in)))`` — 512 -> 128 and 1500 -> 375 at ratio 1/4."""
    return max(1, int(ratio * min(out_features, in_features) + 1e-9))


def stable_rank(weight: torch.Tensor) -> float:
    """``‖W‖_F² / ‖W‖_2²`` of a matrix (conv kernels are flattened to out x in·k·k)."""
    w = weight.detach().reshape(weight.shape[0], -1).to(device="cpu", dtype=torch.float64)
    s = torch.linalg.svdvals(w)
    top = float(s[0]) if s.numel() else 0.0
    if top == 0.0:
        return 0.0
    return float((s * s).sum()) / (top * top)


def scaled_stable_rank(current: float, initial: float, full: int) -> int:
    """Cuttlefish's rank: ``ceil(full · srank_now / srank_init)``, clipped to ``[1, full]``."""
    if initial <= 0.0:
        return full
    return int(min(full, max(1, math.ceil(full * current / initial))))


def ranks_stable(history: Sequence[dict[str, int]], *, window: int = 2, tolerance: float = 0.05) -> bool:
    """True when, over the last ``window`` changes, no layer's rank moved by more than
    ``tolerance`` (relative) — Cuttlefish's signal that the switch can happen."""
    if len(history) < window + 1:
        return False
    recent = history[-(window + 1) :]
    for before, after in zip(recent, recent[1:]):
        for name, r in after.items():
            old = before.get(name, r)
            if abs(r - old) > tolerance * max(old, 1):
                return False
    return True


def flatten_ranks(spec: object) -> Iterable[int]:
    """All integer ranks inside a layer's rank spec (int, list of pairs, or dict)."""
    if isinstance(spec, int):
        yield spec
    elif isinstance(spec, dict):
        for v in spec.values():
            if v is not None:
                yield from flatten_ranks(v)
    elif isinstance(spec, (list, tuple)):
        for v in spec:
            yield from flatten_ranks(v)


def slot_stable_ranks(cands: Sequence[Candidate]) -> dict[str, float]:
    """Stable rank of every rank slot ``"layer|slot"`` (max over the blocks sharing one rank):
    what Cuttlefish-style automatic ranks and switch points track during the warm-up."""
    out: dict[str, float] = {}
    for c in cands:
        for slot, mats in c.matrices().items():
            out[f"{c.name}|{slot}"] = max(stable_rank(m) for m in mats)
    return out


def auto_slot_ranks(cands: Sequence[Candidate], initial: dict[str, float]) -> dict[str, int]:
    """Each slot's rank from its current stable rank scaled by the one at initialization."""
    now = slot_stable_ranks(cands)
    return {f"{c.name}|{slot}": scaled_stable_rank(now[f"{c.name}|{slot}"], initial.get(f"{c.name}|{slot}", 0.0),
                                                   min(c.slot_shape(slot)))
            for c in cands for slot in c.matrices()}


def broadcast_ints(values: dict[str, int], device: torch.device, *, tag: str) -> dict[str, int]:
    """Rank 0's values on every rank (keys are in the same order everywhere), so every rank
    builds the same architecture. ``device`` is the model's: a process group on NCCL alone
    has no CPU backend."""
    import torch.distributed as dist

    from lowcomm.comm import accounting

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    keys = list(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.int64, device=device)
    accounting.broadcast(t, src=0, tag=tag)
    return dict(zip(keys, (int(v) for v in t.tolist())))
