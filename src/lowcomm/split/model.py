"""One BERT classifier cut into an edge part and a cloud part at a split layer (Shi et al.).

Layers are numbered 1..N. With ``split_layer=K`` and compression (the default):

* the **edge** runs the embeddings, layers 1..K-1, layer K's attention block and FFN
  intermediate activation ``h`` (B, T, I), and the first SVD factor: it sends ``z = first(h)``
  (B, T, r) — and, only with ``keep_residual``, the attention block's output ``a`` (B, T, H);
* the **cloud** runs the second factor, layer K's output LayerNorm (``LN(second(z))``, or
  ``LN(second(z) + a)`` with the residual kept), layers K+1..N, mean pooling and the head.

Dropping the residual around the factorized matrix is Shi et al.'s *link elimination*: without
it a full-width tensor would have to cross as well, and the rank-r compression would gain
nothing. Without compression (``compress=False``, the baseline) the edge runs all of layer K and
sends its (B, T, H) output; the cloud starts at layer K+1.

``K`` goes from 1 to N. ``K = N`` is the authors' own placement (their SST-2 script splits
12-layer BERT-base at layer 12): the cloud then runs the last layer's second factor and
LayerNorm, the pooling and the head, and the link elimination touches only the last layer.

:meth:`SplitModel.unsplit` is the whole model with the same factorization (and residual
choice): ``cloud(edge(x)) == unsplit(x)`` exactly, which is both the test of the cut and the
accuracy baseline of "the same model, not split". The two parts' ``state_dict`` keys are the
unsplit model's keys (each part holds its modules under their original names), so after split
fine-tuning ``unsplit.load_state_dict({**edge.state_dict(), **cloud.state_dict()})`` rebuilds
the fine-tuned whole model.

The halves themselves are built in :mod:`lowcomm.split.parts`; the exchange is
:mod:`lowcomm.split.transport`. Every builder works on a deep copy: the caller's model is never modified, and the edge and the
cloud built from identical weights hold identical factors (the SVD runs in float64 on the CPU).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from lowcomm.errors import UsageError
from lowcomm.split.bert import BertClassifier
from lowcomm.split.parts import CloudModel, EdgeModel, SplitPlan, factorized_copy, plan
from lowcomm.split.transport import CloudLink, EdgeLink, Kind, wire_dtype

__all__ = ["ROLES", "CloudBatch", "CloudModel", "EdgeModel", "SplitCloud", "SplitEdge", "SplitModel",
           "SplitPlan"]

ROLES = ("edge", "cloud")


class CloudBatch(NamedTuple):
    """What :class:`SplitCloud` returns per batch: the logits, the labels the edge sent, and
    whether it is a training batch (then call ``loss.backward()`` and ``backward()``)."""

    logits: Tensor
    labels: Tensor | None
    train: bool


class SplitModel(nn.Module):
    """The edge or the cloud side of a split model, with its link: the few-lines API.

    ``SplitModel(model, split_layer=K, rank=r, role="edge")`` returns a :class:`SplitEdge`,
    ``role="cloud"`` a :class:`SplitCloud` (both are SplitModels). ``model`` is a
    :class:`BertClassifier` (never modified: the side works on its own copy); both processes
    must pass identical weights and options. ``wire`` is the dtype on the link (``fp32``,
    ``fp16``, ``bf16``), ``peer`` the other side's global rank (default: the edge is rank 0, the
    cloud rank 1), ``group`` the process group (default: the world). The process group must be
    initialized before the first batch. ``parameters()`` are this side's only: give them to
    any optimizer.

    The static builders :meth:`edge`, :meth:`cloud` and :meth:`unsplit` return plain modules
    without a link (tests, the unsplit baseline, custom transports).
    """

    part: nn.Module
    link: EdgeLink | CloudLink

    def __new__(cls, *args: Any, role: str = "", **kwargs: Any) -> SplitModel:
        """``SplitModel(..., role=...)`` builds the side's class (:class:`SplitEdge` / :class:`SplitCloud`)."""
        # copy/pickle call cls.__new__(cls) on the concrete side: nothing to dispatch then
        if cls is SplitModel:
            sides: dict[str, type[SplitModel]] = {"edge": SplitEdge, "cloud": SplitCloud}
            if role not in sides:
                raise UsageError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
            cls = sides[role]
        return super().__new__(cls)

    def __init__(self, model: nn.Module, *, split_layer: int, rank: int | None = None, role: str = "",
                 keep_residual: bool = False, compress: bool = True, wire: str = "fp32",
                 peer: int | None = None, group: Any = None) -> None:
        super().__init__()
        wire_dtype(wire)  # refuse a bad name before any work
        self.plan = plan(model, split_layer=split_layer, rank=rank, keep_residual=keep_residual,
                         compress=compress)
        self.role = "edge" if isinstance(self, SplitEdge) else "cloud"
        if role and role != self.role:
            raise UsageError(f"{type(self).__name__} is the {self.role} side, got role={role!r}")
        self.wire = wire
        self._build(factorized_copy(_as_classifier(model), self.plan), peer, group)

    def _build(self, whole: BertClassifier, peer: int | None, group: Any) -> None:
        raise UsageError(f"{type(self).__name__}: construct SplitModel(..., role='edge'|'cloud')")

    @property
    def comm_s(self) -> float:
        """Seconds this side has spent blocked in link sends and receives."""
        return self.link.comm_s

    @staticmethod
    def edge(model: nn.Module, *, split_layer: int, rank: int | None = None, keep_residual: bool = False,
             compress: bool = True) -> EdgeModel:
        """The edge part of ``model`` as a plain module (no link)."""
        split = plan(model, split_layer=split_layer, rank=rank, keep_residual=keep_residual, compress=compress)
        return EdgeModel(factorized_copy(_as_classifier(model), split), split)

    @staticmethod
    def cloud(model: nn.Module, *, split_layer: int, rank: int | None = None, keep_residual: bool = False,
              compress: bool = True) -> CloudModel:
        """The cloud part of ``model`` as a plain module (no link)."""
        split = plan(model, split_layer=split_layer, rank=rank, keep_residual=keep_residual, compress=compress)
        return CloudModel(factorized_copy(_as_classifier(model), split), split)

    @staticmethod
    def unsplit(model: nn.Module, *, split_layer: int, rank: int | None = None, keep_residual: bool = False,
                compress: bool = True) -> BertClassifier:
        """The whole model with the same factorization and residual choice, in one module."""
        split = plan(model, split_layer=split_layer, rank=rank, keep_residual=keep_residual, compress=compress)
        return factorized_copy(_as_classifier(model), split)


def _as_classifier(model: nn.Module) -> BertClassifier:
    assert isinstance(model, BertClassifier)  # plan() refused anything else
    return model


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


class SplitEdge(SplitModel):
    """The edge side: ``split(input_ids, attention_mask, labels)`` sends a batch; in train mode
    (and with gradients enabled) ``split.backward()`` then receives the gradient and backprops
    the edge; ``split.stop()`` ends the cloud's loop. In eval mode the cloud evaluates."""

    part: EdgeModel
    link: EdgeLink

    def _build(self, whole: BertClassifier, peer: int | None, group: Any) -> None:
        self.part = EdgeModel(whole, self.plan)
        self.link = EdgeLink(1 if peer is None else peer, self.wire, group=group)
        self._pending: list[Tensor] | None = None

    def forward(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Run the edge part and send its output, the mask and the labels to the cloud; returns
        what was sent (before the wire dtype cast). A training batch when in train mode with
        gradients enabled: then call :meth:`backward` once."""
        out = self.part(input_ids, attention_mask, token_type_ids)
        tensors = list(out) if isinstance(out, tuple) else [out]
        train = self.training and all(t.requires_grad for t in tensors)
        self.link.send_forward(tensors, attention_mask, labels, train=train)
        self._pending = tensors if train else None
        return out

    def backward(self) -> None:
        """Receive the cloud's gradient of the last training batch and backprop the edge part."""
        if self._pending is None:
            raise UsageError("backward() needs a preceding training batch (edge in train mode, "
                             "gradients enabled), once per batch")
        sent, self._pending = self._pending, None
        torch.autograd.backward(sent, self.link.recv_backward())

    def stop(self) -> None:
        """Tell the cloud that no more batches follow."""
        self._pending = None
        self.link.send_stop()


class SplitCloud(SplitModel):
    """The cloud side: ``split()`` receives a batch and returns a :class:`CloudBatch` (None once
    the edge stopped); after ``loss.backward()`` on a training batch, ``split.backward()`` sends
    the gradient to the edge. The edge's mode decides the cloud's (train: dropout on,
    gradients; eval: dropout off, no gradients)."""

    part: CloudModel
    link: CloudLink

    def _build(self, whole: BertClassifier, peer: int | None, group: Any) -> None:
        self.part = CloudModel(whole, self.plan)
        self.link = CloudLink(0 if peer is None else peer, self.wire, group=group)

    def forward(self) -> CloudBatch | None:
        """Receive the next batch and run the cloud part on it; None when the edge stopped."""
        msg = self.link.recv_forward(self.plan.widths, device=_device(self.part))
        if msg.kind is Kind.STOP:
            return None
        train = msg.kind is Kind.TRAIN
        self.train(train)
        assert msg.attention_mask is not None
        with torch.set_grad_enabled(train):
            logits = self.part(msg.tensors, msg.attention_mask)
        return CloudBatch(logits, msg.labels, train)

    def backward(self) -> None:
        """Send the received tensors' gradients (after ``loss.backward()``) to the edge."""
        self.link.send_backward()
