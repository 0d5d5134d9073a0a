"""Momentum correction (Lin et al., Deep Gradient Compression, ICLR'18, sec. 3.2): the codec
keeps the optimizer's momentum as a velocity ``u <- m*u + g`` and compresses ``u``; the
optimizer runs without momentum and with weight decay ``wd / (1 - m)``.

Checked here: the velocity stage itself (accumulate, NaN policy, masking, checkpoint, cost),
the trainer's move of the optimizer settings (moved even when typed, nesterov refused,
AdamW off with a notice), and on two ranks: a dense warm-up with the velocity *is* heavy-ball
SGD for every transport (DDP hook, engine in each mode), compressed steps compress the
velocity (the codec's central reference applied to it), and a resume is bit-exact.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from compress_testlib import make_model, reference_for, resume_run, run_ranks
from sgd_testlib import record_sgd_steps
from tolerance import eps, tolerance
from lowcomm import methods
from lowcomm.compress.codec import CODECS, Layout, codec_class
from lowcomm.errors import UsageError
from lowcomm.methods.base import MethodContext
from lowcomm.methods.compression import codec_optimizer_overrides
from lowcomm.optim import apply_method_overrides
from lowcomm.runtime.config import TrainConfig
from lowcomm.testing import distributed

methods.names()  # load the method modules before forking

#: codecs whose options have ``momentum_correction`` (error feedback codecs)
CORRECTED = [n for n in CODECS.names()
             if any(f.name == "momentum_correction" for f in dataclasses.fields(codec_class(n).Options))]
MU = 0.9
LR = 0.05
STEPS = 4


def _codec(name: str = "signsgd", m: float = MU, **opts: Any) -> Any:
    codec = codec_class(name)(codec_class(name).Options(**opts))
    codec.set_momentum(m)
    return codec


LAYOUT = Layout.of(["a", "b"], [(3, 2), (4,)], {"a": 0, "b": 1})
TRUE = torch.tensor(True)


# --- the velocity stage ---------------------------------------------------------------------

def test_the_momentum_correction_cases_cover_the_error_feedback_codecs() -> None:
    assert {"topk", "gtopk", "signsgd", "powersgd", "acpsgd"} <= set(CORRECTED)


def test_accumulate_turns_the_gradient_into_the_heavy_ball_velocity() -> None:
    codec = _codec()
    g1, g2 = torch.randn(10), torch.randn(10)
    x1, x2 = g1.clone(), g2.clone()
    codec.accumulate(x1, LAYOUT, TRUE)
    codec.accumulate(x2, LAYOUT, TRUE)
    assert torch.equal(x1, g1)
    assert torch.equal(x2, torch.add(g2, g1, alpha=MU))  # the same float32 operation: exact
    assert torch.equal(codec.velocity.find(LAYOUT.names), x2)


def test_accumulate_without_momentum_changes_nothing_and_keeps_no_state() -> None:
    codec = _codec(m=0.0)
    g = torch.randn(10)
    x = g.clone()
    codec.accumulate(x, LAYOUT, TRUE)
    assert torch.equal(x, g) and not codec.velocity.names() and "velocity" not in codec.state_dict()
    assert not codec.accumulates


def test_a_nonfinite_gradient_leaves_the_velocity_unchanged_and_travels_on() -> None:
    codec = _codec()
    codec.accumulate(torch.randn(10), LAYOUT, TRUE)
    before = codec.velocity.find(LAYOUT.names).clone()
    bad = torch.randn(10)
    bad[3] = float("nan")
    codec.accumulate(bad, LAYOUT, torch.tensor(False))
    assert torch.equal(codec.velocity.find(LAYOUT.names), before)
    assert not bool(torch.isfinite(bad).all())  # the payload stays poisoned (NaN policy)


def test_velocity_is_masked_at_the_sent_positions_only() -> None:
    codec = _codec()
    codec.accumulate(torch.arange(1.0, 11.0), LAYOUT, TRUE)
    sent = torch.tensor([0, 7], dtype=torch.int32)
    codec.mask_velocity(LAYOUT, sent)
    u = codec.velocity.find(LAYOUT.names)
    assert u[0] == 0 and u[7] == 0
    keep = torch.ones(10, dtype=torch.bool)
    keep[[0, 7]] = False
    assert torch.equal(u[keep], torch.arange(1.0, 11.0)[keep])


def test_masking_on_a_nonfinite_step_leaves_the_velocity_unchanged() -> None:
    codec = _codec()
    codec.accumulate(torch.arange(1.0, 11.0), LAYOUT, TRUE)
    codec.mask_velocity(LAYOUT, torch.tensor([1, 2]), torch.tensor(False))
    assert torch.equal(codec.velocity.find(LAYOUT.names), torch.arange(1.0, 11.0))
    codec.mask_velocity(LAYOUT, torch.tensor([1, 2]), TRUE)
    assert codec.velocity.find(LAYOUT.names)[1:3].eq(0).all()


def test_masking_without_momentum_is_a_no_op() -> None:
    codec = _codec(m=0.0)
    codec.mask_velocity(LAYOUT, torch.tensor([0]))
    assert not codec.velocity.names()


@pytest.mark.parametrize("name", CORRECTED)
def test_velocity_is_checkpointed_and_continues_bit_exactly(name: str) -> None:
    a = _codec(name)
    a.accumulate(torch.randn(10), LAYOUT, TRUE)
    state = a.state_dict()
    assert set(state["velocity"]) == {"a", "b"}
    b = _codec(name)
    b.load_state_dict(state)
    g = torch.randn(10)
    xa, xb = g.clone(), g.clone()
    a.accumulate(xa, LAYOUT, TRUE)
    b.accumulate(xb, LAYOUT, TRUE)
    assert torch.equal(xa, xb)


@pytest.mark.parametrize("name", CORRECTED)
def test_the_velocity_adds_its_two_elementwise_passes_to_the_encode_cost(name: str) -> None:
    shapes = [(32, 16), (16,)]
    n = sum(math.prod(s) for s in shapes)
    # (the low-rank codecs' subspace masking adds its own products: measured separately below)
    opts = {"momentum_masking": False} if name in ("powersgd", "acpsgd") else {}
    plain, corrected = _codec(name, m=0.0, **opts), _codec(name, **opts)
    before = plain.cost(shapes, world=4).encode.elementwise
    assert corrected.cost(shapes, world=4).encode.elementwise == before + 2 * n


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_low_rank_masking_adds_two_products_per_matrix_to_the_encode_cost(name: str) -> None:
    shapes = [(32, 16), (16,)]
    unmasked = _codec(name, momentum_masking=False).cost(shapes, world=4).encode
    masked = _codec(name).cost(shapes, world=4).encode
    assert masked.matmul_flops > unmasked.matmul_flops
    assert masked.elementwise == unmasked.elementwise + 32 * 16


@pytest.mark.parametrize("spec", ["fp16", "signum", "qsgd", "topk:momentum_correction=false"])
def test_a_codec_without_momentum_correction_refuses_the_momentum_with_the_fix(spec: str) -> None:
    name, _, opts = spec.partition(":")
    options = methods.create(spec).options if opts else None
    codec = codec_class(name)(options)
    with pytest.raises(UsageError, match="keep the momentum in the optimizer and pass momentum=0"):
        codec.set_momentum(MU)
    codec.set_momentum(0.0)  # nothing to move: fine


@pytest.mark.parametrize("start_iter", [1000, 0])
def test_the_velocity_is_kept_in_unscaled_units_under_amp(start_iter: int) -> None:
    """A GradScaler's scale is divided out before the velocity stage (dense warm-up and
    compressed steps alike) and the warm-up's gradient is handed on scaled, as the scaler expects."""
    torch.manual_seed(0)
    model, shadow = make_model(), make_model()
    method = methods.create(f"wfbp:compress=powersgd,rank=2,start_iter={start_iter},momentum_masking=false")
    method.wrap(model, MethodContext(codec_momentum=MU))
    scale = 2.0**10
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    method.attach_scaler(scaler)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    scaler.scale((model(x) - y).pow(2).mean()).backward()
    method.finish_sync()
    (shadow(x) - y).pow(2).mean().backward()
    assert method.codec is not None
    velocity = method.codec.state_dict()["velocity"]
    for n, p in shadow.named_parameters():
        assert torch.equal(velocity[n].reshape(p.shape), p.grad), n  # first step: u = g, unscaled
    if start_iter:
        for (n, p), q in zip(model.named_parameters(), shadow.parameters()):
            assert torch.equal(p.grad, q.grad * scale), n  # the scaled mean, for the scaler


# --- the trainer's move of the optimizer settings ---------------------------------------------

def _apply(method: str, **cfg_fields: Any) -> tuple[TrainConfig, list[str], dict[str, Any]]:
    explicit = cfg_fields.pop("explicit", [])
    cfg = TrainConfig(method=method, explicit_flags=["method", *explicit], **cfg_fields)
    moved: dict[str, Any] = {}
    lines = apply_method_overrides(cfg, methods.create(method), moved)
    return cfg, lines, moved


@pytest.mark.parametrize("method", ["wfbp:compress=topk", "dear:compress=acpsgd", "lee18:compress=signsgd"])
def test_trainer_moves_momentum_into_the_codec_and_scales_weight_decay(method: str) -> None:
    cfg, lines, moved = _apply(method)
    default = TrainConfig()
    assert cfg.momentum == 0.0 and moved["momentum"] == default.momentum
    assert cfg.weight_decay == pytest.approx(default.weight_decay / (1 - default.momentum), rel=eps(torch.float64) * 4)
    assert len(lines) == 1 and "moved, not overridden" in lines[0] and "momentum_correction=false" in lines[0]


def test_pufferfish_moves_the_momentum_only_when_every_phase_keeps_it_in_its_codec() -> None:
    default = TrainConfig()
    # (engine schedules: a DDP-hook method in one process without a process group runs no codec)
    cfg, _, moved = _apply("pufferfish:warmup_epochs=1,then=(wfbp:compress=topk)")  # ssgd warm-up
    assert cfg.momentum == default.momentum and "momentum" not in moved
    cfg, _, moved = _apply("pufferfish:warmup_epochs=1,warmup_method=(wfbp:compress=powersgd),"
                           "then=(wfbp:compress=topk)")
    assert cfg.momentum == 0.0 and moved["momentum"] == default.momentum


def test_a_typed_momentum_and_weight_decay_are_moved_too() -> None:
    cfg, lines, moved = _apply("wfbp:compress=signsgd", momentum=0.5, weight_decay=1e-3,
                               explicit=["momentum", "weight_decay"])
    assert (cfg.momentum, moved["momentum"]) == (0.0, 0.5)
    assert cfg.weight_decay == pytest.approx(2e-3, rel=eps(torch.float64) * 4)
    assert not any(line.startswith("warning") for line in lines)


def test_the_methods_context_carries_the_moved_momentum_to_the_codec() -> None:
    method = methods.create("wfbp:compress=powersgd,start_iter=1")
    method.wrap(make_model(), MethodContext(codec_momentum=0.8))
    assert method.codec is not None and method.codec.momentum_factor == 0.8


def test_without_weight_decay_only_the_momentum_moves() -> None:
    cfg, _, moved = _apply("wfbp:compress=topk", weight_decay=0.0)
    assert cfg.momentum == 0.0 and cfg.weight_decay == 0.0 and set(moved) == {"momentum"}


def test_a_hook_method_moves_nothing_when_no_hook_will_run() -> None:
    cfg = TrainConfig()
    opts = codec_class("topk").Options()
    assert codec_optimizer_overrides("topk", opts, cfg, carried=False) == []
    moves = codec_optimizer_overrides("topk", opts, cfg)
    assert [(o.field, o.moves) for o in moves] == [("momentum", True), ("weight_decay", True)]


def test_nesterov_with_momentum_correction_is_refused_with_the_fix() -> None:
    with pytest.raises(UsageError, match="--nesterov.*momentum_correction=false"):
        _apply("wfbp:compress=topk", nesterov=True, explicit=["nesterov"])
    cfg, lines, _ = _apply("wfbp:compress=topk,momentum_correction=false", nesterov=True, explicit=["nesterov"])
    assert cfg.nesterov and cfg.momentum == TrainConfig().momentum and lines == []


@pytest.mark.parametrize("spec, local", [("topk", True), ("powersgd", True), ("signsgd", False)])
def test_clip_grad_with_momentum_correction_is_refused_with_the_fix(spec: str, local: bool) -> None:
    """The fix names the codec's own local clipping where it has one."""
    with pytest.raises(UsageError, match="--clip-grad.*momentum_correction=false") as err:
        _apply(f"wfbp:compress={spec}", clip_grad=1.0, explicit=["clip_grad"])
    assert ("clip=NORM" in str(err.value)) == local
    cfg, lines, _ = _apply(f"wfbp:compress={spec},momentum_correction=false", clip_grad=1.0, explicit=["clip_grad"])
    assert cfg.clip_grad == 1.0 and cfg.momentum == TrainConfig().momentum and lines == []


def test_adamw_turns_momentum_correction_off_with_a_one_line_notice() -> None:
    cfg, lines, moved = _apply("wfbp:compress=acpsgd", optimizer="adamw", explicit=["optimizer"])
    assert moved == {} and cfg.weight_decay == TrainConfig().weight_decay
    assert len(lines) == 1 and "adamw" in lines[0] and "off" in lines[0]


@pytest.mark.parametrize("name", CORRECTED)
def test_momentum_correction_false_keeps_the_optimizer_as_it_is(name: str) -> None:
    cfg, lines, moved = _apply(f"wfbp:compress={name},momentum_correction=false")
    assert (cfg.momentum, cfg.weight_decay, lines, moved) == (TrainConfig().momentum, TrainConfig().weight_decay, [], {})


# --- two ranks: every transport -------------------------------------------------------------

#: dense warm-up only (start_iter beyond the test): DDP hook, and the engine in each mode
DENSE = ["topk:start_iter=1000", "powersgd:start_iter=1000", "wfbp:compress=signsgd,start_iter=1000",
         "dear:compress=acpsgd,start_iter=1000,threshold_mb=0", "lee18:compress=signsgd,start_iter=1000"]
#: compressed from step 1: the codec's reference applied to the velocity
#: (the low-rank masking is left out here: its own tests below check it)
COMPRESSED = ["signsgd:start_iter=1", "powersgd:rank=2,start_iter=1,momentum_masking=false",
              "wfbp:compress=acpsgd,rank=2,start_iter=1,momentum_masking=false"]


def _train(spec: str) -> dict[str, Any]:
    rank = dist.get_rank()
    model, shadow = make_model(), make_model()
    method = methods.create(spec)
    ctx = MethodContext(rank=rank, world_size=dist.get_world_size(), codec_momentum=MU, bucket_cap_mb=0.0001)
    wrapped = method.wrap(model, ctx)
    return record_sgd_steps(method, model, shadow, wrapped, steps=STEPS, lr=LR, rank=rank)


def _train_all() -> dict[str, Any]:
    return {spec: _train(spec) for spec in DENSE + COMPRESSED}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    """Every case trained once, in one 2-rank run (one spawn)."""
    return run_ranks(_train_all, 2, timeout=240)


def _check(recs: list[dict[str, Any]], expected_of: Any, label: str) -> None:
    """Each rank's step ``t`` is ``w - lr * expected`` up to the round-off of the velocity
    chain (2 roundings per step, 2 for the mean) at the scale of its summed terms, plus one
    float32 rounding of the subtraction at the weights' scale (as tests/sgd_testlib.py)."""
    names = list(recs[0]["local"][0])
    sizes = [recs[0]["local"][0][n].numel() for n in names]
    for t in range(STEPS):
        expected, scale, tol = expected_of(t, names)
        for n, g, sc in zip(names, expected.split(sizes), scale.split(sizes)):
            for rank, r in enumerate(recs):
                before, after = r["before"][t][n].reshape(-1), r["after"][t][n].reshape(-1)
                bound = LR * tol * float(sc.max()) + 2 * eps(torch.float32) * float(before.abs().max())
                err = float((after - (before - LR * g.float())).abs().max())
                assert err <= bound, f"{label} step {t} {n} rank {rank}: err {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("spec", DENSE)
def test_dense_warmup_with_momentum_correction_equals_heavy_ball_sgd(runs: list[dict[str, Any]], spec: str) -> None:
    recs = [r[spec] for r in runs]

    def heavy_ball(t: int, names: list[str]) -> tuple[torch.Tensor, torch.Tensor, float]:
        buf = torch.zeros(0, dtype=torch.float64)
        scale = torch.zeros(0, dtype=torch.float64)
        for k in range(t + 1):  # buf <- mu * buf + mean_r g_r (SGD's momentum buffer, float64)
            xs = torch.stack([torch.cat([r["local"][k][n].reshape(-1) for n in names]).double() for r in recs])
            buf = xs.mean(0) + (MU * buf if k else 0)
            scale = xs.abs().mean(0) + (MU * scale if k else 0)
        return buf, scale, tolerance(torch.float32, ops=2 * (t + 1) + 2)

    _check(recs, heavy_ball, spec)


@pytest.mark.parametrize("spec", COMPRESSED)
def test_compressed_steps_compress_the_velocity(runs: list[dict[str, Any]], spec: str) -> None:
    recs = [r[spec] for r in runs]
    method = methods.create(spec)
    carried = getattr(method.options, "codec_options", None)  # an engine schedule's codec
    name = method.codec_class.name if carried is not None else method.name
    opts = dataclasses.asdict(carried if carried is not None else method.options)
    ref = reference_for(name, opts, len(recs))
    warm = reference_for("ssgd", {}, len(recs))
    start = int(opts["start_iter"])
    names = list(recs[0]["local"][0])
    velocity: list[torch.Tensor | None] = [None] * len(recs)

    def codec_on_velocity(t: int, names: list[str]) -> tuple[torch.Tensor, torch.Tensor, float]:
        xs = []
        for i, r in enumerate(recs):  # u <- m*u + g in float32, the codec's own operations
            g = torch.cat([r["local"][t][n].reshape(-1) for n in names]).clone()
            if velocity[i] is not None:
                g.add_(velocity[i], alpha=MU)
            velocity[i] = g
            xs.append(g.clone())
        current = warm if t < start else ref
        out = current(xs, names)
        return out, current.scale, tolerance(current.dtype, ops=current.ops(names), cond=current.cond)

    assert names
    _check(recs, codec_on_velocity, spec)


@pytest.mark.parametrize("method, options", [("topk", {"density": 0.1, "start_iter": 2}),
                                             ("powersgd", {"rank": 2, "start_iter": 2}),
                                             ("signsgd", {"start_iter": 2})])
def test_resume_with_momentum_correction_is_bit_exact(method: str, options: dict[str, Any]) -> None:
    opts = {**options, "momentum": MU}
    straight = run_ranks(resume_run, 2, method, opts, steps=6, split=3, fresh=False)
    resumed = run_ranks(resume_run, 2, method, opts, steps=6, split=3, fresh=True)
    for a, b in zip(straight, resumed):
        for ga, gb in zip(a, b):
            assert all(torch.equal(ga[n], gb[n]) for n in ga)


# --- the trainer ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["acpsgd:rank=2,start_iter=1ep", "wfbp:compress=signsgd,start_iter=1ep"])
@distributed(world_size=2)
def test_the_trainer_hands_the_moved_momentum_and_the_run_length_to_the_codec(spec: str) -> None:
    from lowcomm.runtime.trainer import Trainer

    cfg = TrainConfig(model="mlp", data="mnist1d", method=spec, nproc=2, batch_size=128, steps=2,
                      eval=False, progress=False, threads=1)
    trainer = Trainer(cfg)
    group = trainer.optimizer.param_groups[0]
    assert group["momentum"] == 0.0
    assert group["weight_decay"] == pytest.approx(TrainConfig().weight_decay / (1 - TrainConfig().momentum))
    hook = getattr(trainer.method, "hook_state", None)
    codec = hook.codec if hook is not None else trainer.method.codec  # type: ignore[attr-defined]
    assert codec.momentum_factor == TrainConfig().momentum
    assert codec.start_iter == trainer.steps_per_epoch
    trainer.close()


def test_a_run_with_momentum_correction_and_fp16_resumes_bit_exactly(tmp_path: Path) -> None:
    from lowcomm.cli import main
    from lowcomm.runtime import checkpoint

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # 16 steps per epoch: dense for half an epoch (velocity averaged), then compressed velocity
    common = ["--model", "mlp", "--data", "mnist1d", "--nproc", "2", "--batch-size", "128", "--lr", "0.05",
              "--threads", "1", "--quiet", "--no-progress", "--epochs", "2", "--amp", "fp16",
              "--method", "powersgd:rank=2,start_iter=0.5ep"]
    assert main(["train", *common, "--checkpoint-dir", str(straight)]) == 0
    assert main(["train", *common, "--checkpoint-dir", str(resumed), "--stop-after-steps", "20"]) == 0
    saved = checkpoint.load_rank(str(resumed), 20, 1)["method"]
    assert saved["velocity"]  # the velocity is checkpointed with the codec's state
    assert main(["train", *common, "--checkpoint-dir", str(resumed), "--resume"]) == 0
    for ckpt in (straight, resumed):
        assert checkpoint.latest(str(ckpt)) is not None
    a = checkpoint.load_rank(str(straight), checkpoint.latest(str(straight))["step"], 0)["model"]
    b = checkpoint.load_rank(str(resumed), checkpoint.latest(str(resumed))["step"], 0)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- low-rank momentum masking: the sent subspace leaves the velocity ---------------------------

MATRIX = Layout.of(["w"], [(16, 12)], {"w": 0})  # compressible at rank 2


def _masked_velocity(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(velocity before masking, after, the basis sent, whether it is a right basis) after one
    compressed step of a 1-worker codec with momentum correction."""
    torch.manual_seed(0)
    # no clipping: the velocity this step compresses is then ``flat`` itself on a first step
    # (zero velocity), on every path (acpsgd's CPU encode applies the clipping and the
    # velocity stage itself, after accumulate)
    codec = codec_class(name)(codec_class(name).Options(rank=2, start_iter=0, clip=0.0))
    codec.set_momentum(MU)
    flat = torch.randn(192)
    codec.accumulate(flat, MATRIX, TRUE)
    before = flat.clone().view(16, 12)
    msg = codec.encode(flat, MATRIX, TRUE)
    if name == "powersgd":
        msg = codec.advance(msg, msg.buf.clone())
    st = msg.ctx
    right = name == "acpsgd" and st.p_step
    return before, codec.velocity.find(MATRIX.names).view(16, 12), st.fixed[0][0], right


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_low_rank_masking_removes_the_sent_subspace_from_the_velocity(name: str) -> None:
    before, after, basis, right = _masked_velocity(name)
    tol = 64 * eps(torch.float32) * float(before.norm())
    left_over = after @ basis if right else basis.T @ after
    assert float(left_over.abs().max()) <= tol  # nothing of the sent part is left
    sent = before @ basis @ basis.T if right else basis @ basis.T @ before
    assert float((after - (before - sent)).abs().max()) <= tol  # and nothing else was removed


def test_simulator_prices_the_velocity_the_trainer_moves_into_the_codec() -> None:
    from lowcomm.compress.codec import TRAINER_MOMENTUM
    from lowcomm.sim.schedules.codec import CodecPlan

    assert TRAINER_MOMENTUM == TrainConfig().momentum
    shapes = [(64, 32), (64,)]
    for name in CORRECTED:
        plain = codec_class(name)(world=4).cost(shapes, world=4).encode
        moved = codec_class(name)(world=4)
        moved.set_momentum(TrainConfig().momentum)
        priced = CodecPlan(name).codec(4).cost(shapes, world=4).encode
        assert priced == moved.cost(shapes, world=4).encode, name
        assert priced.elementwise >= plain.elementwise + 2 * (64 * 32 + 64), name
    off = CodecPlan("topk", codec_class("topk").Options(momentum_correction=False)).codec(4)
    assert off.momentum_factor == 0.0
