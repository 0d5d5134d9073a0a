"""The low-rank codecs' blocked CPU kernels (masking, rebuild) and ACP-SGD's velocity stage
fused into its encode: the same results as the plain formulas and the device paths, within
the float tolerance of a reordered sum."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lowcomm.compress import matrices
from lowcomm.compress.codec import Layout, codec_class
from lowcomm.compress.matrices import mask_, orthogonalize, rebuild_
from tolerance import rel_err, tolerance

SHAPES = [(32, 8, 3, 3), (32,), (64, 32, 3, 3), (64, 32, 3, 3), (10, 64)]
NAMES = [f"p{i}" for i in range(len(SHAPES))]
LAYOUT = Layout.of(NAMES, SHAPES, {n: i for i, n in enumerate(NAMES)})


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("right", [True, False])
def test_blocked_masking_removes_the_same_subspace_as_the_plain_formula(
        right: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matrices, "BLOCK", 1_000)  # many blocks, a short last one
    n, m, r = 48, 130, 3
    u0 = torch.randn(n, m, generator=_gen(1))
    f = orthogonalize(torch.randn(m if right else n, r, generator=_gen(2)))
    u = u0.clone()
    mask_(u, f, right=right)
    want = u0 - (u0 @ f @ f.T if right else f @ (f.T @ u0))
    assert rel_err(u, want) <= tolerance(torch.float32, ops=max(n, m))  # a sum over a side, then r


def test_blocked_rebuild_writes_the_product_and_the_residual_even_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matrices, "BLOCK", 1_000)
    n, m, r = 50, 70, 4
    mat = torch.randn(n, m, generator=_gen(3))
    left, right = torch.randn(n, r, generator=_gen(4)), torch.randn(m, r, generator=_gen(5))
    want = left @ right.T
    target, residual = mat.clone(), torch.empty(n, m)
    rebuild_(target, target, left, right, residual)  # target aliases the matrix (as in the hooks)
    assert rel_err(target, want) <= tolerance(torch.float32, ops=r)
    assert rel_err(residual, mat - want) <= tolerance(torch.float32, ops=r + 1)


def _acp_steps(fast: str, monkeypatch: pytest.MonkeyPatch, steps: int = 4) -> list[Any]:
    """Messages, memory and velocity of a compressed ACP-SGD run with momentum correction
    (P- and Q-steps alternating), as a transport drives it: accumulate, encode, decode."""
    monkeypatch.setenv("LOWCOMM_CPU_FAST", fast)
    codec = codec_class("acpsgd")(codec_class("acpsgd").Options(rank=2, start_iter=0), world=2)
    codec.set_momentum(0.9)
    finite = torch.tensor(True)
    seen = []
    for t in range(steps):
        flat = torch.randn(LAYOUT.numel, generator=_gen(10 + t))
        codec.accumulate(flat, LAYOUT, finite)
        msg = codec.encode(flat, LAYOUT, finite)
        sent = msg.buf[: msg.numel].clone()
        out = torch.empty(LAYOUT.numel)
        codec.decode(msg, msg.buf, out)
        memory, velocity = codec.store.state_dict(), codec.velocity.state_dict()
        seen.append((sent, out, *(memory[k] for k in sorted(memory)), *(velocity[k] for k in sorted(velocity))))
        codec.end_step()
    return seen


def test_acpsgd_with_the_velocity_fused_into_its_encode_matches_the_device_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU path defers accumulate into the fused encode (u <- g + m u per block); the
    device path runs them apart. Messages, decoded means, memory and velocity agree over
    P- and Q-steps within the tolerance of the factor's sums (over a matrix side, <= 576)
    carried through 4 steps."""
    fused, plain = _acp_steps("1", monkeypatch), _acp_steps("0", monkeypatch)
    tol = tolerance(torch.float32, ops=4 * 576, cond=4)
    for a, b in zip(fused, plain):
        for x, y in zip(a, b):
            assert rel_err(x, y) <= tol


def test_acpsgd_warm_up_accumulate_is_never_deferred() -> None:
    """On a warm-up step the transport averages the buffer right after accumulate: it must
    hold the velocity then."""
    codec = codec_class("acpsgd")(codec_class("acpsgd").Options(rank=2, start_iter=5, clip=0.0), world=2)
    codec.set_momentum(0.9)
    flat = torch.randn(LAYOUT.numel, generator=_gen(20))
    g = flat.clone()
    for _ in range(2):
        codec.accumulate(flat, LAYOUT, torch.tensor(True))
    assert torch.equal(flat, torch.add(g, g, alpha=0.9))  # u1 = g, then u2 = g + 0.9 u1 in flat


@pytest.mark.parametrize("kernels", ["compiled", "blas"])
@pytest.mark.parametrize("rows", [True, False])
@pytest.mark.parametrize("velocity", [None, "stage", "mask only"])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_fused_step_equals_the_plain_formulas_over_many_blocks(
        kernels: str, rows: bool, velocity: str | None, scale: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """ACP-SGD's fused encode of one matrix, compiled (numba) and by BLAS blocks (without it),
    with blocks small enough that a Q-step spans several column blocks and a short last one:
    factor, residual and masked velocity equal the unfused formulas, the gradient scaled by
    its clipping factor as it is read (``scale``) and left as it came."""
    from kernels_testlib import require_compiled
    from lowcomm.compress import native

    if kernels == "blas":
        monkeypatch.setitem(native._LOADED, "lowrankjit", None)
    else:
        require_compiled("lowrankjit")
    monkeypatch.setattr(matrices, "BLOCK", 600)
    n, m, r, mom = 37, 53, 3, 0.9
    g = torch.randn(n, m, generator=_gen(30))
    e0 = torch.randn(n, m, generator=_gen(31))
    u0 = torch.randn(n, m, generator=_gen(32))
    f = orthogonalize(torch.randn(m if rows else n, r, generator=_gen(33)))
    e, u, out = e0.clone(), u0.clone(), torch.empty(n if rows else m, r)
    g_in = g.clone()
    matrices.fused_step(g, e, f, out, rows=rows, velocity=u if velocity else None,
                        momentum=mom if velocity == "stage" else None, scale=scale)
    assert torch.equal(g, g_in)
    gs = g * scale
    u_new = gs + mom * u0 if velocity == "stage" else u0
    c = e0 + (u_new if velocity == "stage" else gs)
    want_out = c @ f if rows else c.T @ f
    want_e = c - (want_out @ f.T if rows else f @ want_out.T)
    want_u = u_new - (u_new @ f @ f.T if rows else f @ (f.T @ u_new))
    tol = tolerance(torch.float32, ops=max(n, m) + r)
    assert rel_err(out, want_out) <= tol
    assert rel_err(e, want_e) <= tol
    if velocity:
        assert rel_err(u, want_u) <= tol
    else:
        assert torch.equal(u, u0)


def _orth_batches() -> list[torch.Tensor]:
    """Factor batches of several shapes, as one buffer's plan makes them (rank clipped on the last)."""
    return [torch.randn(3, 40, 4, generator=_gen(61)), torch.randn(2, 130, 4, generator=_gen(62)),
            torch.randn(1, 7, 2, generator=_gen(63))]


def test_device_paths_orthogonalize_every_batch_at_once_like_qr() -> None:
    """The device paths' padded Gram-Schmidt (one set of launches for all batches) gives QR's
    basis, oriented alike, within QR's forward error (cond * rows * r * eps), and orthonormal."""
    from lowcomm.compress.base import device_paths
    from lowcomm.compress.matrices import orthogonalize_all

    xs = _orth_batches()
    with device_paths():
        got = orthogonalize_all(xs)
    for x, q in zip(xs, got):
        want = orthogonalize(x)
        cond = max(float(torch.linalg.cond(m.double())) for m in x)
        assert q.shape == x.shape
        assert rel_err(q, want) <= tolerance(torch.float32, ops=x.shape[1] * x.shape[2], cond=cond)
        eye = torch.eye(x.shape[2]).expand(x.shape[0], -1, -1)
        assert rel_err(q.transpose(1, 2) @ q, eye) <= tolerance(torch.float32, ops=x.shape[1] * x.shape[2])


def test_cpu_paths_orthogonalize_batch_by_batch_with_qr() -> None:
    from lowcomm.compress.matrices import orthogonalize_all

    xs = _orth_batches()
    for x, q in zip(xs, orthogonalize_all(xs)):
        assert torch.equal(q, orthogonalize(x))


def test_device_orthogonalization_zeroes_dependent_columns_and_passes_non_finite_input_on() -> None:
    """A dependent column (or an all-zero factor, an unused parameter's) becomes zero, not NaN;
    with the step's finite flag False every batch comes back as it came (the poison travels on)."""
    from lowcomm.compress.base import device_paths
    from lowcomm.compress.matrices import orthogonalize_all

    x = torch.randn(2, 30, 3, generator=_gen(64))
    x[0, :, 1] = 2.0 * x[0, :, 0]
    x[1] = 0.0
    with device_paths():
        (q,) = orthogonalize_all([x])
        assert torch.isfinite(q).all()
        assert torch.equal(q[0, :, 1], torch.zeros(30)) and torch.equal(q[1], torch.zeros(30, 3))
        kept = q[0][:, [0, 2]]
        assert rel_err(kept.T @ kept, torch.eye(2)) <= tolerance(torch.float32, ops=30 * 3)
        bad = [torch.full((1, 9, 2), float("nan")), torch.randn(2, 5, 2, generator=_gen(65))]
        out = orthogonalize_all(bad, torch.tensor(False))
        assert torch.isnan(out[0]).all() and torch.equal(out[1], bad[1])


@pytest.mark.parametrize("r", [1, 2, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("n,m", [(1, 1), (37, 5), (3, 9000), (600, 17)])
def test_compiled_rank_r_products_equal_the_formulas_for_every_term_count_and_chunk(
        r: int, n: int, m: int) -> None:
    """The compiled ``a @ bt`` forms up to four terms per pass and a chunk of rows at a time:
    every remainder of ``r`` by four, rows wider than a chunk (9000) and many rows per chunk
    (17 wide) give the product, the rebuild (in place too) and the subtraction of the formulas."""
    from kernels_testlib import require_compiled

    jit = require_compiled("lowrankjit")
    a = torch.randn(n, r, generator=_gen(40)).numpy()
    bt = torch.randn(r, m, generator=_gen(41)).numpy()
    mat = torch.randn(n, m, generator=_gen(42))
    want = torch.from_numpy(a).double() @ torch.from_numpy(bt).double()
    size = torch.from_numpy(a).double().abs() @ torch.from_numpy(bt).double().abs()  # what rounding scales with
    tol = tolerance(torch.float32, ops=r + 1, cond=max(1.0, float(size.max() / want.abs().max())))
    res = mat.double() - want
    res_tol = tolerance(torch.float32, ops=r + 2, cond=max(1.0, float((size + mat.double().abs()).max() / res.abs().max())))
    out = torch.empty(n, m)
    jit.outer_into(out.numpy(), a, bt)
    assert rel_err(out.double(), want) <= tol
    target, residual = mat.clone(), torch.empty(n, m)
    jit.rebuild(target.numpy(), target.numpy(), a, bt, residual.numpy())  # target aliases the matrix
    assert rel_err(target.double(), want) <= tol
    assert rel_err(residual.double(), res) <= res_tol
    x = mat.clone()
    jit.sub_outer(x.numpy(), a, bt)
    assert rel_err(x.double(), res) <= res_tol
