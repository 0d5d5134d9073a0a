"""Record a few plain-SGD steps of any method and check them against a central reference.

Shared by tests/test_sched_codecs.py (engine schedule x codec) and tests/test_composition.py
(the Pufferfish cells): each rank records, per step, its local gradient (a shadow model at
the method's flushed weights) and its weights before and after; the reference replays every
rank's local gradients and gives the mean gradient ``g``; the method's step must be
``w - lr * g``.

Tolerance (tests/tolerance.py): the reference's own round-off model (``ops``, ``cond``,
``dtype`` of the aggregate) at the scale of the summed terms, times ``lr`` for the update,
plus one float32 rounding of the subtraction at the weights' scale.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tolerance import eps, tolerance


def record_sgd_steps(method: Any, model: nn.Module, shadow: nn.Module, wrapped: nn.Module, *,
                     steps: int, lr: float, rank: int) -> dict[str, Any]:
    """Train ``wrapped`` (``method``'s wrapping of ``model``) for ``steps`` SGD steps on
    seeded random regression batches; record local gradients and weights per step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(100 + rank)
    rec: dict[str, Any] = {"local": [], "before": [], "after": []}
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        shadow.load_state_dict(model.state_dict())
        shadow.zero_grad()
        (shadow(x) - y).pow(2).mean().backward()
        rec["local"].append({n: p.grad.detach().clone() for n, p in shadow.named_parameters()})
        rec["before"].append({n: p.detach().clone() for n, p in model.named_parameters()})
        opt.zero_grad()
        (wrapped(x) - y).pow(2).mean().backward()
        method.finish_sync()
        method.optimizer_step(opt)
        method.flush()
        rec["after"].append({n: p.detach().clone() for n, p in model.named_parameters()})
    return rec


def check_sgd_steps(recs: list[dict[str, Any]], names: list[str], ref: Any, warm: Any, start: int, *,
                    steps: int, lr: float, label: str) -> int:
    """Assert every rank's every step equals ``w - lr * g`` with ``g`` from ``warm`` (before
    step ``start``) or ``ref``; return how many compressed steps differed from the plain mean."""
    compressed = 0
    for t in range(steps):
        current = warm if t < start else ref
        xs = [torch.cat([r["local"][t][n].reshape(-1) for n in names]) for r in recs]
        expected = current(xs, names)
        tol = tolerance(current.dtype, ops=current.ops(names), cond=current.cond)
        mean = torch.stack(xs).mean(0)
        if t >= start and not torch.allclose(expected, mean, rtol=0, atol=1e-3 * float(mean.abs().max())):
            compressed += 1
        for n, g, scale in zip(names, expected.split(ref.sizes(names)), current.scale.split(ref.sizes(names))):
            for rank, r in enumerate(recs):
                before, after = r["before"][t][n].reshape(-1), r["after"][t][n].reshape(-1)
                bound = lr * tol * float(scale.max()) + 2 * eps(torch.float32) * float(before.abs().max())
                err = float((after - (before - lr * g)).abs().max())
                assert err <= bound, f"{label} step {t} {n} rank {rank}: err {err:.3g} > {bound:.3g}"
    return compressed
