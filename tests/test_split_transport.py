"""The edge/cloud exchange over two gloo ranks: one split training step equals one step of the
unsplit model, the ledger's bytes per direction equal the message formula, evaluation and stop
messages need nothing special, and two sides started with different settings are refused.

Rank 0 is the edge, rank 1 the cloud; each rank also computes the unsplit reference locally
(same seed, same batch), so every comparison is within one process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lowcomm.comm import accounting
from lowcomm.errors import UsageError
from lowcomm.split.model import SplitModel
from lowcomm.split.transport import (
    BACKWARD_TAG,
    FORWARD_TAG,
    HEADER_BYTES,
    EdgeLink,
    backward_bytes,
    forward_bytes,
)
from lowcomm.testing import run_distributed
from split_testlib import HIDDEN, tiny_batch, tiny_classifier
from tolerance import eps, rel_err

RANK, LR = 6, 0.5
ROLES = ("edge", "cloud")


def _bytes(tag: str) -> int:
    return int(accounting.ledger().as_dict()["by_tag"].get(tag, {}).get("wire_bytes", 0))


def _one_step(wire: str, keep_residual: bool, compress: bool) -> dict[str, Any]:
    """One SGD step of this rank's side and of the unsplit model; the updates of this side's
    parameters under both, and the bytes this rank sent in each direction."""
    role = ROLES[dist.get_rank()]
    kw: dict[str, Any] = dict(split_layer=2, rank=RANK, keep_residual=keep_residual, compress=compress)
    model = tiny_classifier()
    ids, mask, labels = tiny_batch()

    whole = SplitModel.unsplit(model, **kw)
    before = {k: v.clone() for k, v in whole.state_dict().items()}
    F.cross_entropy(whole(ids, mask), labels).backward()
    torch.optim.SGD(whole.parameters(), lr=LR).step()
    reference = whole.state_dict()

    side = SplitModel(model, role=role, wire=wire, **kw)
    opt = torch.optim.SGD(side.parameters(), lr=LR)
    if role == "edge":
        side(ids, mask, labels)
        side.backward()
    else:
        out = side()
        assert out is not None and out.train and torch.equal(out.labels, labels)
        F.cross_entropy(out.logits, out.labels).backward()
        side.backward()
    opt.step()
    got = side.part.state_dict()
    return {
        "updates": {k: (got[k] - before[k], reference[k] - before[k]) for k in got},
        "forward": _bytes(FORWARD_TAG),
        "backward": _bytes(BACKWARD_TAG),
    }


@pytest.mark.parametrize("wire,keep_residual,compress", [
    pytest.param("fp32", False, True, id="fp32"),
    pytest.param("bf16", False, True, id="bf16"),
    pytest.param("fp16", True, True, id="fp16-keep-residual"),
    pytest.param("fp32", False, False, id="fp32-uncompressed"),
])
def test_one_split_step_updates_parameters_as_the_unsplit_model(wire: str, keep_residual: bool,
                                                                compress: bool) -> None:
    edge, cloud = run_distributed(_one_step, 2, wire, keep_residual, compress)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[wire]
    # fp32: the same operations as the unsplit step, up to the order in which the attention
    # output's two gradient paths are summed and carried through dot products of up to
    # FFN = 64 terms (ops = 64; measured: 0, the paths run in the same order). fp16/bf16: each
    # crossing rounds once (activations forward, gradients back: ops = 2), and the layers carry
    # that relative error into the parameter updates amplified by their condition, bounded
    # here by cond = 4: every block ends in a LayerNorm, so activations stay O(1), and the
    # softmax and GELU derivatives are at most ~1.1 (measured: at most 0.54 eps).
    tol = 64 * eps(torch.float32) if wire == "fp32" else 2 * 4 * eps(dtype)
    for side in (edge, cloud):
        for name, (got, want) in side["updates"].items():
            assert rel_err(got, want) <= tol, (name, rel_err(got, want) / eps(dtype))
    # bytes per direction: the message formula, spelled out
    b, t = tiny_batch()[1].shape
    item = dtype.itemsize
    widths = ([RANK, HIDDEN] if keep_residual else [RANK]) if compress else [HIDDEN]
    activations = sum(b * t * w * item for w in widths)
    assert edge["forward"] == HEADER_BYTES + activations + 4 * b + 1 * b  # header, tensors, lengths, uint8 labels
    scales = 4 * len(widths) if wire == "fp16" else 0  # fp16 gradients travel with a float32 scale each
    assert cloud["backward"] == activations + scales
    assert edge["backward"] == 0 and cloud["forward"] == 0
    assert edge["forward"] == forward_bytes(b, t, widths, wire) and cloud["backward"] == backward_bytes(b, t, widths, wire)


def _train_eval_stop() -> dict[str, Any]:
    """A training batch of 4, an evaluation batch of 3 with a left-padded mask, then stop."""
    role = ROLES[dist.get_rank()]
    model = tiny_classifier()
    side = SplitModel(model, role=role, split_layer=1, rank=RANK, wire="bf16")
    ids, mask, labels = tiny_batch(batch=4)
    eval_ids, eval_mask, eval_labels = tiny_batch(seed=5, batch=3)
    eval_mask = eval_mask.flip(1)  # left padding: not a prefix, so the whole mask crosses
    eval_ids = eval_ids.flip(1)
    seen: list[tuple[bool, int]] = []
    if role == "edge":
        side(ids, mask, labels)
        side.backward()
        side.eval()
        with torch.no_grad():
            side(eval_ids, eval_mask, eval_labels)
        with pytest.raises(UsageError, match="needs a preceding training batch"):
            side.backward()
        side.stop()
        return {"forward": _bytes(FORWARD_TAG), "backward": _bytes(BACKWARD_TAG)}
    eval_logits = None
    while (out := side()) is not None:
        seen.append((out.train, out.logits.shape[0]))
        if out.train:
            F.cross_entropy(out.logits, out.labels).backward()
            side.backward()
        else:
            assert not side.training and not out.logits.requires_grad
            assert torch.equal(out.labels, eval_labels)
            eval_logits = out.logits
    # no optimizer step ran: the evaluation is the unsplit model's, up to the bf16 link
    expected = SplitModel.unsplit(model, split_layer=1, rank=RANK).eval()(eval_ids, eval_mask)
    return {"seen": seen, "forward": _bytes(FORWARD_TAG), "backward": _bytes(BACKWARD_TAG),
            "eval": (eval_logits, expected.detach())}


def test_eval_batches_short_batches_and_stop_need_no_special_handling() -> None:
    edge, cloud = run_distributed(_train_eval_stop, 2)
    assert cloud["seen"] == [(True, 4), (False, 3)]
    got, want = cloud["eval"]
    # one bf16 rounding of the activations (ops = 1), carried through the cloud's layers
    # (cond = 4, as in the training-step test)
    assert got.shape == (3, 3) and rel_err(got, want) <= 4 * eps(torch.bfloat16)
    t = tiny_batch()[1].shape[1]
    train_msg = HEADER_BYTES + 4 * t * RANK * 2 + 4 * 4 + 4  # bf16 activations, lengths, labels
    eval_msg = HEADER_BYTES + 3 * t * RANK * 2 + 3 * t + 3  # the left-padded mask as B*T uint8
    assert edge["forward"] == train_msg + eval_msg + HEADER_BYTES  # + the stop header
    assert edge["forward"] == (forward_bytes(4, t, [RANK], "bf16") + forward_bytes(3, t, [RANK], "bf16", mask="full")
                               + HEADER_BYTES)
    assert cloud["backward"] == 4 * t * RANK * 2  # only the training batch is answered


def _mismatched() -> str:
    """The edge factorizes at rank 4, the cloud at rank 6: the cloud must refuse, clearly."""
    role = ROLES[dist.get_rank()]
    side = SplitModel(tiny_classifier(), role=role, split_layer=1, rank=4 if role == "edge" else 6)
    ids, mask, labels = tiny_batch()
    if role == "edge":
        side.eval()
        side(ids, mask, labels)  # an evaluation batch: the edge waits for no answer
        return ""
    try:
        side()
    except UsageError as e:
        return str(e)
    return "accepted"


def test_sides_started_with_different_ranks_are_refused_by_the_cloud() -> None:
    _, message = run_distributed(_mismatched, 2)
    assert "the edge sends widths [4] but this cloud expects [6]" in message
    assert "--rank" in message


def test_the_link_needs_an_initialized_process_group() -> None:
    ids, mask, _ = tiny_batch()
    with pytest.raises(UsageError, match="needs torch.distributed initialized"):
        EdgeLink().send_forward([torch.zeros(*ids.shape, 4)], mask)


def test_message_sizes_follow_width_wire_mask_and_labels() -> None:
    assert forward_bytes(32, 66, [8], "bf16") == HEADER_BYTES + 32 * 66 * 8 * 2 + 32 * 4 + 32
    assert forward_bytes(32, 66, [8, 384], "fp16", mask="full", labels="int64") == (
        HEADER_BYTES + 32 * 66 * (8 + 384) * 2 + 32 * 66 + 32 * 8)
    assert forward_bytes(2, 3, [384], "fp32", labels=None) == HEADER_BYTES + 2 * 3 * 384 * 4 + 2 * 4
    assert backward_bytes(32, 66, [8], "bf16") == 32 * 66 * 8 * 2
    assert backward_bytes(32, 66, [8, 384], "fp16") == 32 * 66 * (8 + 384) * 2 + 2 * 4
    with pytest.raises(UsageError, match="valid: fp32, fp16, bf16"):
        backward_bytes(1, 1, [1], "int8")


def test_fp16_gradients_keep_their_precision_far_below_fp16s_normal_range() -> None:
    from lowcomm.split.transport import _fp16_scales

    torch.manual_seed(0)
    grads = [1e-8 * torch.randn(4, 8, 6), 300.0 * torch.randn(4, 8, 32)]
    scales = _fp16_scales(grads)
    assert all(float(s).is_integer() or (1 / float(s)).is_integer() for s in scales)  # powers of two
    for g, s in zip(grads, scales):
        back = (g * s).half().float() / s
        assert rel_err(back, g) <= eps(torch.float16)  # one rounding at fp16's full precision
        assert float((g * s).abs().max()) < 2.0**14
    assert rel_err(grads[0].half().float(), grads[0]) > 0.25  # what the scale prevents: subnormals


def _documented_loops(steps: int) -> Any:
    """docs/split_api.md's edge and cloud loops (AdamW, zero_grad, eval, stop) on the tiny model,
    next to the plain one-process loop on the unsplit model."""
    role = ROLES[dist.get_rank()]
    model = tiny_classifier()
    batches = [tiny_batch(seed=10 + i, batch=4 + i) for i in range(steps)]
    test_ids, test_mask, test_labels = tiny_batch(seed=99, batch=5)

    whole = SplitModel.unsplit(model, split_layer=2, rank=RANK)
    opt = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    for ids, mask, labels in batches:
        F.cross_entropy(whole(ids, mask), labels).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        expected = whole.eval()(test_ids, test_mask)

    split = SplitModel(model, split_layer=2, rank=RANK, role=role)
    opt = torch.optim.AdamW(split.parameters(), lr=1e-2)
    if role == "edge":
        for ids, mask, labels in batches:
            split(ids, mask, labels)
            split.backward()
            opt.step()
            opt.zero_grad()
        split.eval()
        with torch.no_grad():
            split(test_ids, test_mask, test_labels)
        split.stop()
        return None
    logits = None
    while (batch := split()) is not None:
        if batch.train:
            F.cross_entropy(batch.logits, batch.labels).backward()
            split.backward()
            opt.step()
            opt.zero_grad()
        else:
            logits = batch.logits
    return logits, expected


def test_the_documented_loops_train_as_the_unsplit_model_does() -> None:
    _, (logits, expected) = run_distributed(_documented_loops, 2, 3)
    # three AdamW steps on the same gradients up to float reordering (ops = 64 per step, as
    # above; Adam's normalized update does not amplify a relative gradient error)
    assert rel_err(logits, expected) <= 3 * 64 * eps(torch.float32)
