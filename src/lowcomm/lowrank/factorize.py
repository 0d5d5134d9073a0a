"""``factorize(model)``: rewrite any PyTorch model into its Pufferfish low-rank form.

The Pufferfish reference code hand-writes one low-rank class per architecture and copies
weights by hard-coded state_dict index ranges. Here the model is walked once: every
``nn.Linear``, ``nn.Conv1d/2d`` (ungrouped), ``nn.LSTM`` and ``nn.MultiheadAttention`` is a
*candidate*; each candidate gets a rank (ratio of ``min(out, in)``, or an explicit per-layer
rank) and is replaced by its :mod:`~lowcomm.lowrank.layers` counterpart, SVD-initialized from
its current weights — only if that lowers its parameters (and with them its multiply-adds:
for these layers both scale with ``r·(in+out)`` vs ``in·out``). Layers whose weight is shared
with another module (tied embeddings) are never touched, and neither are the layers the
model's hybrid preset (or ``full_rank``) keeps dense.

Rank specs (JSON-friendly, also what :func:`factorized_ranks` reports and checkpoints store):
``int`` for Linear/Conv; ``[[r_ih, r_hh], ...]`` per layer for ``nn.LSTM``;
``{"q": r, "k": r, "v": r, "out": r}`` for attention (``None`` = that projection stays dense).
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Sequence, TypeVar

import torch
from torch import nn

from lowcomm.errors import UsageError, check_fraction
from lowcomm.lowrank.layers import LowRankConv, LowRankLinear, LowRankLSTM, LowRankMultiheadAttention
from lowcomm.lowrank.presets import Preset, get_preset
from lowcomm.lowrank.rank import ratio_rank

LOWRANK_TYPES = (LowRankLinear, LowRankConv, LowRankLSTM, LowRankMultiheadAttention)
_PROJ = ("q", "k", "v", "out")

RankSpec = Any  # int | list[list[int]] | dict[str, int | None]
M = TypeVar("M", bound=nn.Module)


@dataclass
class Candidate:
    """One layer that could be factorized, with the arithmetic to decide whether it pays."""

    name: str
    module: nn.Module
    kind: str  # "linear" | "conv" | "lstm" | "mha"
    blocks: int = 1

    # --- the module as its kind's class (a mismatch is a bug in :func:`candidates`) --------
    def _as(self, cls: type[M]) -> M:
        if not isinstance(self.module, cls):
            raise TypeError(f"{self.kind} candidate {self.name!r} holds a {type(self.module).__name__}")
        return self.module

    def _conv(self) -> nn.Conv1d | nn.Conv2d:
        return self.module if isinstance(self.module, nn.Conv1d) else self._as(nn.Conv2d)

    # --- shapes ---------------------------------------------------------------------------
    def matrices(self) -> dict[str, list[torch.Tensor]]:
        """Dense matrices per rank slot (a slot shares one rank): used for stable ranks."""
        if self.kind == "linear":
            return {"": list(self._as(nn.Linear).weight.chunk(self.blocks))}
        if self.kind == "conv":
            w = self._conv().weight
            return {"": [w.reshape(w.shape[0], -1)]}
        if self.kind == "lstm":
            lstm = self._as(nn.LSTM)
            out = {}
            for layer in range(lstm.num_layers):
                for kind in ("ih", "hh"):
                    out[f"{layer}.{kind}"] = list(getattr(lstm, f"weight_{kind}_l{layer}").chunk(4))
            return out
        dense = LowRankMultiheadAttention.dense_projections(self._as(nn.MultiheadAttention))
        return {p: [dense[p].weight] for p in _PROJ}

    def slot_shape(self, slot: str) -> tuple[int, int]:
        """``(rows, cols)`` of one dense matrix of ``slot``: bounds its rank and its savings."""
        if self.kind == "mha":  # kdim == vdim == embed_dim (others are not candidates)
            e = self._as(nn.MultiheadAttention).embed_dim
            return e, e
        mat = self.matrices()[slot][0]
        return int(mat.shape[0]), int(mat.shape[1])

    def dense_params(self) -> int:
        """Parameters of the dense layer (the summary's before column)."""
        return sum(p.numel() for p in self.module.parameters())

    # --- ranks ----------------------------------------------------------------------------
    def ratio_spec(self, ratio: float) -> RankSpec:
        """Rank spec with every slot at ``ratio`` of its full rank (Pufferfish's ``rank_ratio``)."""
        slots: dict[str, int | None] = {s: ratio_rank(*self.slot_shape(s), ratio) for s in self.matrices()}
        return self.spec_from_slots(slots)

    def spec_from_slots(self, slots: dict[str, int | None]) -> RankSpec:
        """The layer-kind's spec (int, per-layer pairs, per-projection dict) from per-slot ranks."""
        if self.kind in ("linear", "conv"):
            return slots[""]
        if self.kind == "lstm":
            n = self._as(nn.LSTM).num_layers
            return [[slots[f"{layer}.ih"], slots[f"{layer}.hh"]] for layer in range(n)]
        return {p: slots[p] for p in _PROJ}

    def slots_from_spec(self, spec: RankSpec) -> dict[str, int | None]:
        """Per-slot ranks from a layer-kind's spec (inverse of :meth:`spec_from_slots`)."""
        if self.kind in ("linear", "conv"):
            return {"": spec}
        if self.kind == "lstm":
            return {f"{layer}.{k}": pair[i] for layer, pair in enumerate(spec) for i, k in enumerate(("ih", "hh"))}
        return {p: spec.get(p) for p in _PROJ}

    def check_spec(self, spec: RankSpec) -> None:
        """Refuse a spec of the wrong form or a rank outside ``[1, full rank]``, naming the layer."""
        try:
            slots = self.slots_from_spec(spec)
            names = set(self.matrices())
            if set(slots) != names:
                raise ValueError
        except (TypeError, ValueError, KeyError, IndexError, AttributeError):
            raise UsageError(f"bad rank {spec!r} for {self.kind} layer {self.name!r}") from None
        for slot, r in slots.items():
            if r is None and self.kind == "mha":
                continue
            top = min(self.slot_shape(slot))
            if not isinstance(r, int) or not 1 <= r <= top:
                raise UsageError(f"rank {r!r} of layer {self.name!r} must be an integer in [1, {top}]")

    def slot_saves(self, slot: str, r: int) -> bool:
        """Factorizing this slot at rank r lowers its parameters (hence its multiply-adds)."""
        rows, cols = self.slot_shape(slot)
        return r * (rows + cols) < rows * cols

    def prune(self, spec: RankSpec) -> RankSpec | None:
        """Drop what does not pay: attention projections individually, other layers whole."""
        slots = self.slots_from_spec(spec)
        if self.kind == "mha":
            kept = {s: (r if r is not None and self.slot_saves(s, r) else None) for s, r in slots.items()}
            return None if all(r is None for r in kept.values()) else self.spec_from_slots(kept)
        if all(r is not None and self.slot_saves(s, r) for s, r in slots.items()):
            return spec
        return None

    # --- conversion -----------------------------------------------------------------------
    def build(self, spec: RankSpec, *, extra_bn: bool) -> nn.Module:
        """The low-rank replacement of the layer at ``spec``, initialized by SVD."""
        if self.kind == "linear":
            return LowRankLinear.from_dense(self._as(nn.Linear), spec, blocks=self.blocks, extra_bn=extra_bn)
        if self.kind == "conv":
            return LowRankConv.from_dense(self._conv(), spec, extra_bn=extra_bn)
        if self.kind == "lstm":
            return LowRankLSTM(self._as(nn.LSTM), [(int(a), int(b)) for a, b in spec])
        m = self._as(nn.MultiheadAttention)
        dense = LowRankMultiheadAttention.dense_projections(m)
        projs: dict[str, nn.Module] = {}
        for p in _PROJ:
            r = spec.get(p)
            projs[p] = dense[p] if r is None else LowRankLinear.from_dense(dense[p], r, extra_bn=extra_bn)
        new = LowRankMultiheadAttention(
            embed_dim=m.embed_dim,
            num_heads=m.num_heads,
            q_proj=projs["q"],
            k_proj=projs["k"],
            v_proj=projs["v"],
            out_proj=projs["out"],
            dropout=m.dropout,
            batch_first=m.batch_first,
        )
        new.train(m.training)
        return new


# --------------------------------------------------------------------------------------------
def _name_matcher(full_rank: str | Sequence[str] | None, names: list[str]) -> tuple[Any, list[str]]:
    """Compile ``full_rank`` into a predicate over qualified names; refuse patterns or names
    that match no module (a typo would otherwise silently factorize everything)."""
    if full_rank is None:
        return (lambda _n: False), []
    if isinstance(full_rank, str):
        try:
            rx = re.compile(full_rank)
        except re.error as e:
            raise UsageError(f"full_rank regex {full_rank!r} is invalid: {e}") from None
        if not any(rx.fullmatch(n) for n in names):
            raise UsageError(
                f"full_rank regex {full_rank!r} matches no module name; names look like: "
                + ", ".join(names[:12])
            )
        return (lambda n: rx.fullmatch(n) is not None), [full_rank]
    wanted = list(full_rank)
    missing = [w for w in wanted if w not in names]
    if missing:
        raise UsageError(
            f"full_rank names {missing} match no module; names look like: " + ", ".join(names[:12])
        )
    keep = set(wanted)
    return (lambda n: n in keep), wanted


def _ancestors(name: str) -> Iterable[str]:
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        yield ".".join(parts[:i])


def _shared_param_ids(model: nn.Module) -> set[int]:
    """Parameters owned by more than one module (tied weights)."""
    seen: dict[int, int] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, n in seen.items() if n > 1}


def candidates(
    model: nn.Module,
    *,
    full_rank: str | Sequence[str] | None = None,
    preset: Preset | None = None,
) -> list[Candidate]:
    """Layers that :func:`factorize` may rewrite, in module order (not yet pruned by savings)."""
    names = [n for n, _ in model.named_modules() if n]
    keep, _ = _name_matcher(full_rank, names)
    blocks_rx = [(re.compile(rx), g) for rx, g in (preset.gate_blocks.items() if preset else [])]
    shared = _shared_param_ids(model)
    out: list[Candidate] = []
    skip_under: list[str] = []
    for name, mod in model.named_modules():
        if any(name == s or name.startswith(s + ".") for s in skip_under):
            continue
        if isinstance(mod, LOWRANK_TYPES) or isinstance(mod, nn.MultiheadAttention):
            skip_under.append(name)  # never descend into attention's out_proj or factors
        if name and any(keep(a) for a in _ancestors(name)):
            continue
        if any(id(p) in shared for p in mod.parameters(recurse=False)):
            continue
        if isinstance(mod, LOWRANK_TYPES):
            continue
        if isinstance(mod, nn.Linear):
            g = next((g for rx, g in blocks_rx if rx.fullmatch(name)), 1)
            if mod.out_features % g == 0:
                out.append(Candidate(name, mod, "linear", g))
        elif isinstance(mod, (nn.Conv1d, nn.Conv2d)) and mod.groups == 1:
            out.append(Candidate(name, mod, "conv"))
        elif isinstance(mod, nn.LSTM) and not mod.bidirectional and not mod.proj_size:
            out.append(Candidate(name, mod, "lstm"))
        elif isinstance(mod, nn.MultiheadAttention):
            if mod.bias_k is None and not mod.add_zero_attn and mod.kdim == mod.vdim == mod.embed_dim:
                out.append(Candidate(name, mod, "mha"))
    return out


def resolve_full_rank(model: nn.Module, full_rank: str | Sequence[str] | None, preset: str | Preset | None) -> tuple[str | Sequence[str] | None, Preset | None]:
    """``full_rank=None`` means: the preset of ``preset`` or of ``model.lowcomm_name``."""
    if isinstance(preset, str):
        from lowcomm.lowrank.presets import require_preset

        preset_obj: Preset | None = require_preset(preset)
    else:
        preset_obj = preset if preset is not None else get_preset(getattr(model, "lowcomm_name", None))
    if full_rank is None and preset_obj is not None:
        full_rank = preset_obj.full_rank
    return full_rank, preset_obj


def plan(
    model: nn.Module,
    rank_ratio: float = 0.25,
    full_rank: str | Sequence[str] | None = None,
    *,
    preset: str | Preset | None = None,
    ranks: dict[str, RankSpec] | None = None,
    require_savings: bool = True,
) -> list[tuple[Candidate, RankSpec]]:
    """Which layers :func:`factorize` would rewrite, at which ranks (nothing is changed)."""
    check_fraction("rank_ratio", rank_ratio)
    full_rank, preset_obj = resolve_full_rank(model, full_rank, preset)
    cands = candidates(model, full_rank=full_rank, preset=preset_obj)
    by_name = {c.name: c for c in cands}
    if ranks is not None:
        unknown = [n for n in ranks if n not in by_name]
        if unknown:
            raise UsageError(f"ranks given for layers that cannot be factorized: {unknown}")
    chosen: list[tuple[Candidate, RankSpec]] = []
    for c in cands:
        if ranks is not None:
            if c.name not in ranks:
                continue
            spec = ranks[c.name]
            c.check_spec(spec)
            if c.kind == "lstm":
                spec = [list(p) for p in spec]
        else:
            spec = c.ratio_spec(rank_ratio)
        if require_savings and ranks is None:
            spec = c.prune(spec)
            if spec is None:
                continue
        chosen.append((c, spec))
    return chosen


def factorize(
    model: nn.Module,
    rank_ratio: float = 0.25,
    full_rank: str | Sequence[str] | None = None,
    *,
    preset: str | Preset | None = None,
    ranks: dict[str, RankSpec] | None = None,
    extra_bn: bool = False,
    require_savings: bool = True,
    inplace: bool = False,
) -> nn.Module:
    """Return a low-rank copy of ``model``: its layers replaced by SVD-initialized factors.

    Like ``torch.ao.quantization`` conversions, the default leaves ``model`` untouched (its
    layers are deep-copied before any is replaced), because ``small = factorize(model)``
    reads as a copy and a caller still holding ``model`` (an optimizer built on its
    parameters, a dense baseline to compare with) must not see it change underneath. Pass
    ``inplace=True`` when you own the model and only want the result (saves the copy of the
    dense weights); the returned module is then ``model`` itself, modified, except when the
    model as a whole is one candidate layer (a bare ``nn.Linear``): a new module is returned.

    Args:
        model: any ``nn.Module``; models from :func:`lowcomm.models.create` have presets.
        rank_ratio: rank of each layer as a fraction of ``min(out, in)``, in (0, 1].
        full_rank: layers kept dense — a regex (full match on qualified module names, a match
            on an ancestor keeps the whole subtree) or a list of exact module names. ``None``:
            the model's hybrid preset (``preset`` or ``model.lowcomm_name``), or none.
        preset: a preset name or object, overriding ``model.lowcomm_name``.
        ranks: explicit ``{module name: rank spec}``; exactly these layers are factorized (used
            on resume and by automatic rank selection).
        extra_bn: insert a BatchNorm between the two factors (Cuttlefish); not exact at init.
        require_savings: skip layers whose low-rank form is not smaller (default). Set False
            to factorize regardless (e.g. to check full-rank reconstruction).
        inplace: ``False`` (default): work on a deep copy and leave ``model`` unchanged;
            ``True``: modify ``model`` itself.

    A model with nothing to factorize is returned unchanged with a warning.
    """
    chosen = plan(model, rank_ratio, full_rank, preset=preset, ranks=ranks, require_savings=require_savings)
    if not inplace:
        model = copy.deepcopy(model)
    if not chosen:
        warnings.warn(
            f"factorize: nothing to factorize in {type(model).__name__} (rank_ratio={rank_ratio}); "
            "no Linear/Conv/LSTM/attention layer outside the full-rank set gets smaller",
            stacklevel=2,
        )
        return model
    replaced_attention = False
    for cand, spec in chosen:
        target = model.get_submodule(cand.name) if cand.name else model
        live = Candidate(cand.name, target, cand.kind, cand.blocks)
        new = live.build(spec, extra_bn=extra_bn)
        if not cand.name:
            return new
        model.set_submodule(cand.name, new)
        replaced_attention |= cand.kind == "mha"
    if replaced_attention:
        for mod in model.modules():  # torch's nested-tensor fast path reads packed weights
            if hasattr(mod, "use_nested_tensor"):
                mod.__dict__["use_nested_tensor"] = False  # a plain attribute (what nn.Module sets)
    return model


def factorized_ranks(model: nn.Module) -> dict[str, RankSpec]:
    """The rank spec of every low-rank layer in ``model`` (what a checkpoint must record)."""
    out: dict[str, RankSpec] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (LowRankLinear, LowRankConv)):
            if any(name.startswith(n + ".") for n in out):
                continue
            out[name] = mod.rank
        elif isinstance(mod, LowRankLSTM):
            out[name] = [list(r) for r in mod.ranks]
        elif isinstance(mod, LowRankMultiheadAttention):
            out[name] = {
                p: (getattr(mod, f"{p}_proj").rank if isinstance(getattr(mod, f"{p}_proj"), LowRankLinear) else None)
                for p in _PROJ
            }
    # projections inside attention are reported with their attention module
    return {n: s for n, s in out.items() if not any(n.startswith(a + ".") for a, v in out.items() if isinstance(v, dict))}


def factorized_blocks(model: nn.Module) -> dict[str, int]:
    """Block counts of gate-blocked low-rank linears (needed to rebuild them on resume)."""
    return {n: m.blocks for n, m in model.named_modules() if isinstance(m, LowRankLinear) and m.blocks > 1}
