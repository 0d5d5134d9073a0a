"""Parameters, multiply-adds and gradient bytes of a model, before and after factorization.

Multiply-adds are counted with forward hooks on one example batch (batch size 1 by
convention) for the layers that dominate: Linear, Conv1d/2d/3d, LSTM and multi-head attention
(projections plus the two attention matmuls). Normalization, activations, pooling and
embedding look-ups are not counted. Each low-rank layer also reports the MACs of the dense
layer it replaces, so one forward of a factorized model gives both the "after" and the
"before" figure — no dense copy is needed (the ``pufferfish`` method uses that at the end of
training, when only the factorized model exists).

``grad_bytes_per_step`` is the size of one full gradient (unique trainable parameters times
their element size): what plain data-parallel SGD all-reduces every step (the ring all-reduce
puts ``2(P-1)/P`` times that on each worker's wire).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lowcomm.lowrank.factorize import factorized_ranks
from lowcomm.lowrank.layers import LowRankConv, LowRankLinear, LowRankLSTM, LowRankMultiheadAttention


def count_params(model: nn.Module) -> int:
    """Unique parameters (tied weights once)."""
    return sum(p.numel() for p in model.parameters())


def grad_bytes(model: nn.Module) -> int:
    """Bytes of one gradient of the trainable parameters."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _dense_params(mod: nn.Module) -> int:
    if isinstance(mod, LowRankLinear):
        bias = mod.out_features if (mod.u.bias if mod.blocks == 1 else mod.bias) is not None else 0
        return mod.in_features * mod.out_features + bias
    if isinstance(mod, LowRankConv):
        k = mod.v.weight[0, 0].numel()
        return mod.out_channels * mod.in_channels * k + (mod.out_channels if mod.u.bias is not None else 0)
    if isinstance(mod, LowRankLSTM):
        h, total = mod.hidden_size, 0
        for layer in range(mod.num_layers):
            n_in = mod.input_size if layer == 0 else h
            total += 4 * h * (n_in + h) + (8 * h if mod.has_bias else 0)
        return total
    raise TypeError(type(mod))


def dense_equivalent_params(model: nn.Module) -> int:
    """Parameters the model would have with every low-rank layer dense again."""
    total = count_params(model)
    for mod in model.modules():
        if isinstance(mod, (LowRankLinear, LowRankConv, LowRankLSTM)):
            total += _dense_params(mod) - sum(p.numel() for p in mod.parameters())
    return total


def dense_equivalent_grad_bytes(model: nn.Module) -> int:
    """Gradient bytes the model would have unfactorized: what the factorization saves per all-reduce."""
    elem = next((p.element_size() for p in model.parameters()), 4)
    return grad_bytes(model) + (dense_equivalent_params(model) - count_params(model)) * elem


# --- multiply-adds ----------------------------------------------------------------------------
def _positions(out: torch.Tensor, features: int, dim: int = -1) -> int:
    return out.numel() // max(1, features)


def count_macs(model: nn.Module, example: Any) -> tuple[int, int]:
    """``(macs, dense_equivalent_macs)`` of one forward of ``model(example)`` (eval, no grad).

    ``example`` is a tensor or a tuple of positional arguments. The model's train/eval mode
    is restored afterwards; nothing else changes (eval mode: BN statistics stay put).
    """
    totals = [0, 0]
    handles = []
    owned: set[int] = set()  # children of low-rank layers are counted by their parent

    def add(actual: int, dense: int) -> None:
        totals[0] += int(actual)
        totals[1] += int(dense)

    def linear_hook(m: nn.Linear, _inp: Any, out: torch.Tensor) -> None:
        if id(m) in owned:
            return
        n = out.numel() // m.out_features * m.in_features * m.out_features
        add(n, n)

    def conv_hook(m: nn.Conv1d | nn.Conv2d, _inp: Any, out: torch.Tensor) -> None:
        if id(m) in owned:
            return
        per_out = m.weight[0].numel()  # in/groups * k...
        add(out.numel() * per_out, out.numel() * per_out)

    def lowrank_linear_hook(m: LowRankLinear, _inp: Any, out: torch.Tensor) -> None:
        pos = out.numel() // m.out_features
        add(pos * m.rank * m.blocks * m.in_features + pos * m.out_features * m.rank, pos * m.in_features * m.out_features)

    def lowrank_conv_hook(m: LowRankConv, _inp: Any, out: torch.Tensor) -> None:
        pos = out.numel() // m.out_channels
        k_in = m.v.weight[0].numel()
        add(pos * (m.rank * k_in + m.out_channels * m.rank), pos * m.out_channels * k_in)

    def lstm_hook(m: nn.LSTM | LowRankLSTM, inp: Any, out: Any) -> None:
        x = inp[0]
        tokens = x.shape[0] * (x.shape[1] if x.dim() == 3 else 1)
        h = m.hidden_size
        for layer in range(m.num_layers):
            n_in = m.input_size if layer == 0 else h
            dense = tokens * 4 * h * (n_in + h)
            if isinstance(m, LowRankLSTM):
                r_ih, r_hh = m.ranks[layer]
                actual = tokens * (4 * r_ih * (n_in + h) + 4 * r_hh * (h + h))
            else:
                dense *= 2 if getattr(m, "bidirectional", False) else 1
                actual = dense
            add(actual, dense)

    def attention_core(m: nn.Module, inp: Any, projections: bool) -> None:
        q, k = inp[0], inp[1]
        batch_first = getattr(m, "batch_first", False)
        if q.dim() == 2:
            lq, ls, b = q.shape[0], k.shape[0], 1
        elif batch_first:
            b, lq, ls = q.shape[0], q.shape[1], k.shape[1]
        else:
            lq, b, ls = q.shape[0], q.shape[1], k.shape[0]
        e = m.embed_dim
        core = 2 * b * lq * ls * e
        proj = b * (lq * e * e + 2 * ls * e * e + lq * e * e) if projections else 0
        add(core + proj, core + proj)

    def mha_hook(m: nn.Module, inp: Any, _out: Any) -> None:
        attention_core(m, inp, projections=True)

    def lowrank_mha_hook(m: nn.Module, inp: Any, _out: Any) -> None:
        attention_core(m, inp, projections=False)  # projections are hooked modules

    for mod in model.modules():
        if isinstance(mod, (LowRankLinear, LowRankConv, LowRankLSTM, nn.MultiheadAttention)):
            owned.update(id(c) for c in mod.modules() if c is not mod)
    for mod in model.modules():
        if isinstance(mod, LowRankLinear):
            handles.append(mod.register_forward_hook(lowrank_linear_hook))
        elif isinstance(mod, LowRankConv):
            handles.append(mod.register_forward_hook(lowrank_conv_hook))
        elif isinstance(mod, (nn.LSTM, LowRankLSTM)):
            handles.append(mod.register_forward_hook(lstm_hook))
        elif isinstance(mod, nn.MultiheadAttention):
            handles.append(mod.register_forward_hook(mha_hook))
        elif isinstance(mod, LowRankMultiheadAttention):
            handles.append(mod.register_forward_hook(lowrank_mha_hook))
        elif isinstance(mod, nn.Linear):
            handles.append(mod.register_forward_hook(linear_hook))
        elif isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            handles.append(mod.register_forward_hook(conv_hook))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            args = example if isinstance(example, tuple) else (example,)
            model(*args)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return totals[0], totals[1]


def example_input(model: nn.Module, *, batch_size: int = 1) -> Any:
    """A zero batch of the model's default input (models from :mod:`lowcomm.models`), or None."""
    name = getattr(model, "lowcomm_name", None)
    if name is None:
        return None
    from lowcomm import models

    meta = models.info(name)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if meta.task == "language_model":
        return torch.zeros(batch_size, *meta.default_input_shape, dtype=torch.long, device=device)
    dtype = param.dtype if param is not None else torch.float32
    return torch.zeros(batch_size, *meta.default_input_shape, dtype=dtype, device=device)


def _entry(before: int | None, after: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {"before": before, "after": after}
    if before and after is not None:
        out["reduction"] = round(before / after, 4) if after else math.inf
    return out


def summary(
    model: nn.Module,
    factorized: nn.Module | None = None,
    *,
    example: Any = None,
    macs: bool = True,
) -> dict[str, Any]:
    """Before/after report as a JSON-ready dict.

    ``summary(dense, factorized)`` compares two models; ``summary(factorized)`` alone derives
    the "before" column from the dense-equivalent sizes of its low-rank layers. MACs need an
    ``example`` input (default: :func:`example_input` for registered models); without one
    they are ``None`` (also with ``macs=False``).
    """
    after_model = factorized if factorized is not None else model
    if not macs:
        example = None
    elif example is None:
        example = example_input(after_model)
    if factorized is not None:
        p_before, p_after = count_params(model), count_params(factorized)
        g_before, g_after = grad_bytes(model), grad_bytes(factorized)
        m_before: int | None = None
        m_after: int | None = None
        if example is not None:
            m_before = count_macs(model, example)[0]
            m_after = count_macs(factorized, example)[0]
    else:
        p_before, p_after = dense_equivalent_params(model), count_params(model)
        g_before, g_after = dense_equivalent_grad_bytes(model), grad_bytes(model)
        m_before = m_after = None
        if example is not None:
            m_after, m_before = count_macs(model, example)
    ranks = factorized_ranks(after_model)
    return {
        "params": _entry(p_before, p_after),
        "macs": _entry(m_before, m_after),
        "grad_bytes_per_step": _entry(g_before, g_after),
        "layers_factorized": len(ranks),
        "ranks": ranks,
    }
