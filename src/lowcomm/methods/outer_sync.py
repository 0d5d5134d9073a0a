"""The shared machinery of the semi-synchronous methods (``localsgd``, ``diloco``,
``streaming_diloco``): fragments of the model, their global copies, and the averaging of
what is sent, plain or through a codec.

Why one engine: DiLoCo is Streaming DiLoCo with one fragment, no delay and a plain replace
(``alpha=0``), and Local SGD is DiLoCo's sync with the parameters themselves averaged instead
of a pseudo-gradient. The methods in :mod:`lowcomm.methods.localsgd` and
:mod:`lowcomm.methods.streaming_diloco` only choose the options.

Every collective goes through :mod:`lowcomm.comm.accounting` (plain) or
:mod:`lowcomm.comm.transport` (a codec), on tensors on the training device, so bytes are
counted where they are sent. The global copy may live on the CPU: the pseudo-gradient is
computed and averaged on the device, then moved for the outer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting, transport
from lowcomm.compress.codec import Codec, Layout, codec_class
from lowcomm.compress.feedback import finite_flag
from lowcomm.compress.warm import compile_kernels
from lowcomm.errors import UsageError
from lowcomm.methods.base import parse_options, strip_parens


def layer_groups(model: nn.Module) -> list[list[str]]:
    """Parameter names grouped by the module that owns them, in ``named_parameters`` order:
    the "layers" fragments are cut from (a layer is never split between fragments)."""
    groups: list[list[str]] = []
    last = None
    for name, _ in model.named_parameters():
        owner = name.rpartition(".")[0]
        if owner != last or not groups:
            groups.append([])
            last = owner
        groups[-1].append(name)
    return groups


def contiguous_groups(weights: list[int], parts: int) -> list[list[int]]:
    """Indices ``0..len(weights)-1`` cut into ``parts`` non-empty contiguous groups of about
    equal total weight (greedy: a group closes once the running total reaches its share, or
    when the items left are just enough for the groups left). Shared with the simulator."""
    total = sum(weights)
    out: list[list[int]] = [[] for _ in range(parts)]
    k, acc = 0, 0
    for i, w in enumerate(weights):
        out[k].append(i)
        acc += w
        left = len(weights) - i - 1
        if k < parts - 1 and (acc >= total * (k + 1) / parts or left == parts - 1 - k):
            k += 1
    return out


def split_fragments(model: nn.Module, fragments: int) -> list[list[str]]:
    """Cut the layers into ``fragments`` contiguous groups of about equal parameter count.

    Why contiguous: Streaming DiLoCo syncs fragments of consecutive layers (blocks), so each
    fragment's pseudo-gradient is one piece of the network. Refused with a one-line error when
    there are fewer layers than fragments."""
    layers = layer_groups(model)
    check_fragments(fragments, len(layers))
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    groups = contiguous_groups([sum(sizes[n] for n in layer) for layer in layers], fragments)
    return [[n for i in g for n in layers[i]] for g in groups]


def check_fragments(fragments: int, layers: int) -> None:
    """One-line refusal of more fragments than layers (a layer is never split)."""
    if fragments < 1 or fragments > layers:
        raise UsageError(
            f"fragments={fragments} is invalid for this model: it has {layers} layers "
            f"(valid: 1..{layers})"
        )


def parse_compress(spec: str, method: str) -> tuple[str, Any] | None:
    """``compress=`` of a DiLoCo method: ``none`` or a codec spec (``topk:density=0.01``,
    parenthesized when it has several options). The codec's ``start_iter`` (its dense warm-up,
    counted in syncs here) defaults to 0: a pseudo-gradient is compressed from the first sync."""
    text = strip_parens(spec).strip()
    if text.lower() in ("", "none"):
        return None
    name, _, opts = text.partition(":")
    name = name.strip().lower()
    try:
        cls = codec_class(name)
    except UsageError as e:
        raise UsageError(
            f"compress={name!r} of method {method!r} must be a payload compressor ({e})"
        ) from None
    fields = {f.strip().partition("=")[0].strip() for f in opts.split(",") if f.strip()}
    if (
        "start_iter" in getattr(cls.Options, "__dataclass_fields__", {})
        and "start_iter" not in fields
    ):
        opts = ",".join(x for x in (opts, "start_iter=0") if x)
    return name, parse_options(f"{method}:compress={name}", cls.Options, opts)


@dataclass
class Fragment:
    """One fragment: its parameters (device tensors), its global copy (flat; CPU or device),
    its codec (None: plain all-reduce), and the sync in flight, if any."""

    index: int
    names: list[str]
    params: list[torch.Tensor]
    offset: int
    global_flat: torch.Tensor | None = None
    codec: Codec | None = None
    #: (due step, averaged pseudo-gradient or parameters, started collective or None, codec message)
    pending: list[Any] = field(default_factory=list)

    @property
    def layout(self) -> Layout:
        """The flat buffer's tensors, for a codec (state is kept per parameter name)."""
        return Layout.of(
            self.names, [p.shape for p in self.params], {n: i for i, n in enumerate(self.names)}
        )

    def flat(self) -> torch.Tensor:
        """This rank's parameters of the fragment as one new flat tensor (device)."""
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def write(self, flat: torch.Tensor) -> None:
        """Copy a flat tensor (any device) into the fragment's parameters."""
        start = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(flat[start : start + n].view_as(p))
                start += n


#: marks a non-leader's pending sync: its result is the leader's broadcast (see :class:`OuterSync`)
_FROM_LEADER = object()


class OuterSync:
    """Runs the syncs of ``fragments`` for one model on this rank.

    ``mode="average"``: the parameters themselves are averaged (Local SGD). ``"outer"``:
    the pseudo-gradient ``global - local`` is averaged, the outer SGD (Nesterov) steps the
    global copy and the local parameters are merged with it:
    ``local <- alpha * local + (1 - alpha) * global`` (``alpha=0``: replaced).

    Replicas of several GPUs (``inner=``, :mod:`lowcomm.methods.replicas_inner`): ``group`` is
    the leaders' inter-node group, ``node_group`` the node's intra group and ``leader_rank``
    its leader's global rank. Only the leader sends (the node's ranks hold the same weights);
    it broadcasts the averaged result inside the node when the sync is waited for.
    Buffers are averaged over ``buffer_group`` (default ``group``; the world with ``inner=``:
    each rank's BatchNorm statistics saw its own batches).
    """

    def __init__(
        self,
        model: nn.Module,
        fragments: list[list[str]],
        offsets: list[int],
        *,
        name: str,
        mode: str,
        device: torch.device,
        group: dist.ProcessGroup | None,
        global_on: str = "device",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        alpha: float = 0.0,
        compress: tuple[str, Any] | None = None,
        syncs: int | None = None,
        node_group: dist.ProcessGroup | None = None,
        leader_rank: int | None = None,
        buffer_group: Any = "group",
    ) -> None:
        self.name, self.mode, self.device, self.group, self.alpha = name, mode, device, group, alpha
        self.node_group, self.leader_rank = node_group, leader_rank
        self.sends = leader_rank is None or dist.get_rank() == leader_rank
        self.world = dist.get_world_size(group) if dist.is_initialized() and self.sends else 1
        rank = dist.get_rank(group) if dist.is_initialized() and self.sends else 0
        self.buffer_group = group if buffer_group == "group" else buffer_group
        self.buffer_world = dist.get_world_size(self.buffer_group) if dist.is_initialized() else 1
        params = dict(model.named_parameters())
        self.fragments = [
            Fragment(i, names, [params[n] for n in names], offsets[i])
            for i, names in enumerate(fragments)
        ]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.outer: torch.optim.SGD | None = None
        if mode == "outer":
            where = torch.device("cpu") if global_on == "cpu" else device
            for f in self.fragments:
                f.global_flat = f.flat().to(where, copy=True)
            self.outer = torch.optim.SGD(
                [f.global_flat for f in self.fragments if f.global_flat is not None],
                lr=outer_lr,
                momentum=outer_momentum,
                nesterov=nesterov and outer_momentum > 0,
            )
        if compress is not None and self.sends:
            for f in self.fragments:
                f.codec = codec_class(compress[0])(compress[1], world=self.world, rank=rank)
                f.codec.set_run(steps_per_epoch=None, total_steps=syncs)
                compile_kernels(f.codec, model.parameters())  # once: the fragments share a configuration

    # --- one sync ----------------------------------------------------------------------------
    def launch(self, f: Fragment, due: int) -> None:
        """Start fragment ``f``'s sync (collective issued now, asynchronously); it is merged at
        inner step ``due`` by :meth:`complete`. Buffers travel with fragment 0, synchronously."""
        with torch.no_grad():
            if self.mode == "outer":
                assert f.global_flat is not None
                buf = f.global_flat.to(self.device) - f.flat()
            else:
                buf = f.flat()
            if f.index == 0 and self.buffers and self.buffer_world > 1:
                self._average_buffers()
            if not self.sends:  # the node's leader syncs; the result comes at wait()
                f.pending.append([due, buf, _FROM_LEADER, None])
                return
            codec = f.codec
            if codec is None or not codec.active or self.world == 1:
                work = (
                    accounting.all_reduce(buf, group=self.group, async_op=True, tag=self.name)
                    if self.world > 1
                    else None
                )
                f.pending.append([due, buf, work, None])
                # a dense sync (the codec's warm-up) counts as one of its steps
                if codec is not None:
                    codec.end_step()
                return
            msg = codec.encode(buf, f.layout, finite_flag(buf))
            msg = transport.run_rounds(codec, msg, group=self.group, tag=self.name)
            started = transport.start(msg, group=self.group, tag=self.name, async_op=True)
            f.pending.append([due, buf, started, msg])

    def wait(self, f: Fragment) -> None:
        """Complete fragment ``f``'s collectives in flight (no merge: the trajectory is the same
        whether or not an evaluation or a checkpoint waited first)."""
        for item in f.pending:
            _, buf, work, msg = item
            if work is None:
                continue
            if work is _FROM_LEADER:
                pass
            elif msg is None:
                work.wait()
                buf.div_(self.world)
            else:
                assert f.codec is not None
                f.codec.decode(msg, work.wait(), buf)  # the mean, written into buf
                f.codec.end_step()
            if self.leader_rank is not None:
                accounting.broadcast(
                    buf, self.leader_rank, group=self.node_group, tag=f"{self.name}.node"
                )
            item[2] = item[3] = None

    def complete(self, f: Fragment, step: int) -> None:
        """Merge fragment ``f``'s syncs due at inner step ``step`` (or earlier)."""
        due = [item for item in f.pending if item[0] <= step]
        if not due:
            return
        self.wait(f)
        for item in due:
            f.pending.remove(item)
            self._merge(f, item[1])

    def _merge(self, f: Fragment, averaged: torch.Tensor) -> None:
        with torch.no_grad():
            if self.mode == "average":
                f.write(averaged)
                return
            assert f.global_flat is not None and self.outer is not None
            f.global_flat.grad = averaged.to(f.global_flat.device)
            self.outer.step()
            f.global_flat.grad = None
            new = f.global_flat.to(self.device)
            if self.alpha:
                new = torch.lerp(new, f.flat(), self.alpha)  # alpha * local + (1 - alpha) * global
            f.write(new)

    def _average_buffers(self) -> None:
        flat = torch.cat([b.reshape(-1) for b in self.buffers])
        accounting.all_reduce(flat, group=self.buffer_group, tag=f"{self.name}.buffers")
        flat.div_(self.buffer_world)
        start = 0
        for b in self.buffers:
            b.copy_(flat[start : start + b.numel()].view_as(b))
            start += b.numel()

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Global copies, outer optimizer, codecs and completed-but-unmerged syncs (on CPU)."""
        for f in self.fragments:
            self.wait(f)
        return {
            "global": [
                None if f.global_flat is None else f.global_flat.detach().cpu().clone()
                for f in self.fragments
            ],
            "outer": self.outer.state_dict() if self.outer is not None else None,
            "codecs": [
                f.codec.state_dict() if f.codec is not None else None for f in self.fragments
            ],
            "pending": [
                [(int(d), b.detach().cpu().clone()) for d, b, _, _ in f.pending]
                for f in self.fragments
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the fragments must match: same model and options)."""
        if len(state["global"]) != len(self.fragments):
            raise ValueError(
                f"checkpoint has {len(state['global'])} fragments, the method {len(self.fragments)}"
            )
        for f, g, c, pend in zip(
            self.fragments, state["global"], state["codecs"], state["pending"]
        ):
            if g is not None and f.global_flat is not None:
                with torch.no_grad():
                    f.global_flat.copy_(g)
            if c is not None and f.codec is not None:
                f.codec.load_state_dict(c)
            f.pending = [[d, b.to(self.device), None, None] for d, b in pend]
        if self.outer is not None and state["outer"] is not None:
            self.outer.load_state_dict(state["outer"])
