"""QSGD's own tests and its central reference (the registry-driven suites pick both up).

``Reference`` is QSGD written from the paper's formula (Alistarh et al. 2017, eq. (4)) with
plain dense ops, one bucket at a time; it shares with the codec only the documented
seeding (:func:`lowcomm.compress.qsgd.draw_seed`) and the documented fp32 arithmetic, so
the stochastic rounding draws the same levels. ``tests/test_compress_hooks.py`` (DDP comm
hook, 2 and 4 ranks, many buckets) and ``tests/test_sched_codecs.py`` (every engine
schedule) compare the codec against it through ``compress_testlib.reference_for``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import compress_testlib
from compress_testlib import HOOK_CASES, has_reference, resume_run, run_ranks
from lowcomm import methods
from lowcomm.comm import transport
from lowcomm.compress.codec import CODECS, Layout, codec_class
from lowcomm.compress.qsgd import draw_seed
from lowcomm.compress.qsgdkern import uniforms
from lowcomm.errors import UsageError
from tolerance import assert_close_eps, tolerance

#: small test runs: several buckets per tensor with a short last one, few levels so the
#: quantization is visible against the plain mean (``start_iter=1`` is added by the suites)
OPTIONS: dict[str, Any] = {"bucket_size": 48, "levels": 4}


class Reference(compress_testlib.Reference):
    """Mean over ranks of ``||v|| * sign(v_i) * xi_i / s`` per bucket ``v`` of each tensor."""

    def __init__(self, *a: Any, options: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.o = options
        self.calls: dict[str, int] = {}  # compressed steps seen per tensor

    def ops(self, names: list[str]) -> float:
        """A sum over ranks, plus two roundings per decoded value (``norm / s`` and the
        product with the level) which the codec and this reference order differently."""
        return float(self.world + 2)

    def quantize(self, x: torch.Tensor, seed: int) -> torch.Tensor:
        """Decoded QSGD of one tensor ``x``: the paper's formula, bucket by bucket, with the
        documented dithered rounding ``floor(v * s / ||v|| + u)`` (the law of ``sign * xi``)."""
        s, b = float(self.o.levels), self.o.bucket_size
        u = uniforms(seed, x.numel())
        out = torch.zeros_like(x)
        for start in range(0, x.numel(), b):
            v = x[start : start + b]
            norm = torch.linalg.vector_norm(torch.nn.functional.pad(v, (0, b - v.numel())))
            if float(norm) == 0.0:
                continue
            level = torch.clamp(torch.floor(v * (torch.tensor(s) / norm) + u[start : start + b]), -s, s)
            out[start : start + b] = level * norm / s
        return out

    def __call__(self, xs: list[torch.Tensor], names: list[str]) -> torch.Tensor:
        outs = [torch.zeros_like(x) for x in xs]
        off = 0
        for name, size in zip(names, self.sizes(names)):
            step = self.o.start_iter + self.calls.get(name, 0)
            self.calls[name] = self.calls.get(name, 0) + 1
            for r, x in enumerate(xs):  # xs[r] is rank r's input: each rank draws its own uniforms
                seed = draw_seed(self.o.seed, step, self.index[name], r)
                outs[r][off : off + size] = self.quantize(x[off : off + size].float(), seed)
            off += size
        self._summed(outs)
        return torch.stack(outs).mean(0)


def _roundtrip(codec: Any, flat: torch.Tensor, layout: Layout, finite: bool = True) -> tuple[Any, torch.Tensor]:
    """Encode and decode on one process (the transport's all-gather is then the identity)."""
    msg = codec.encode(flat.clone(), layout, torch.tensor(finite))
    received = transport.start(transport.run_rounds(codec, msg, tag="t"), tag="t").wait()
    out = torch.empty_like(flat)
    codec.decode(msg, received, out)
    return msg, out


def test_mean_of_many_quantizations_approaches_the_vector_within_the_papers_variance_bound() -> None:
    """Unbiasedness. Lemma 3.1 bounds each quantization's error: E||Q(v) - v||^2 <=
    B = sum over buckets of min(d/s^2, sqrt(d)/s) ||v_b||^2. The mean of N independent
    quantizations has E||mean - v||^2 <= B / N if E[Q(v)] = v (a bias would add its
    squared norm, independently of N), so by Markov's inequality ||mean - v||^2 <= 20 B / N
    fails with probability at most 5 % for an unbiased quantizer. The single draws' mean
    squared error must respect B itself (the same inequality for N = 1 in mean)."""
    torch.manual_seed(3)
    s, d, n, trials = 2, 64, 1000, 2000  # few levels: large variance, a bias would show
    v = torch.randn(n) * torch.linspace(0.01, 3.0, n)
    codec = codec_class("qsgd")(options=CODECS.get("qsgd").Options(levels=s, bucket_size=d, start_iter=0))
    layout = Layout.of(["w"], [(n,)], {"w": 0})
    total, sq_err = torch.zeros(n, dtype=torch.float64), 0.0
    for t in range(trials):
        codec.step = t
        q = _roundtrip(codec, v, layout)[1].double()
        total += q
        sq_err += float((q - v.double()).pow(2).sum())
    bound = sum(min(b.numel() / s**2, math.sqrt(b.numel()) / s) * float(b.double().pow(2).sum()) for b in v.split(d))
    mean = total / trials
    assert float((mean - v.double()).pow(2).sum()) <= 20 * bound / trials
    assert sq_err / trials <= bound
    # and the error is not trivially zero: the draws did differ
    assert sq_err > 0


def _ranks(world: int, **options: Any) -> list[Any]:
    """One qsgd codec per rank of a ``world``-worker group, all at the same step."""
    return [codec_class("qsgd")(options=CODECS.get("qsgd").Options(**options), world=world, rank=r)
            for r in range(world)]


def _gathered_mean(codecs: list[Any], v: torch.Tensor, layout: Layout) -> tuple[list[Any], torch.Tensor]:
    """Every rank encodes ``v``; rank 0 decodes the stacked payloads (what the all-gather
    delivers): the codec's own mean over workers."""
    msgs = [c.encode(v.clone(), layout, torch.tensor(True)) for c in codecs]
    out = torch.empty_like(v)
    codecs[0].decode(msgs[0], torch.stack([m.buf for m in msgs]), out)
    return msgs, out


def test_ranks_quantizing_the_same_vector_draw_different_levels() -> None:
    """Each worker draws its own uniforms (the rank is part of the seed): on the same vector
    at the same step, the norms agree and the levels differ wherever rounding is random. An
    element whose fractional level p is in (0, 1) differs with probability 2p(1-p); with 256
    such elements, identical levels would have probability far below 1e-20."""
    torch.manual_seed(6)
    n = 256
    v = torch.randn(n)
    layout = Layout.of(["w"], [(n,)], {"w": 0})
    codecs = _ranks(2, levels=4, bucket_size=32, start_iter=0)
    for c in codecs:
        c.step = 7
    msgs, _ = _gathered_mean(codecs, v, layout)
    levels = [m.buf[:n].view(torch.int8) for m in msgs]  # the packed payload: n int8 levels, then norms
    assert torch.equal(msgs[0].buf[n:], msgs[1].buf[n:])
    assert not torch.equal(levels[0], levels[1])
    # and each rank's draw is reproducible (same rank, same step: same levels)
    again = _ranks(2, levels=4, bucket_size=32, start_iter=0)[1]
    again.step = 7
    assert torch.equal(again.encode(v.clone(), layout, torch.tensor(True)).buf, msgs[1].buf)


def test_two_rank_mean_has_half_the_variance_of_one_workers_quantization() -> None:
    """Independent rounding on every worker (Alistarh et al.): the mean of P quantizations
    of v has E||mean - v||^2 = V / P, where V = sum_i (||v_b|| / s)^2 p_i (1 - p_i) is one
    worker's exact variance (p_i the fractional level of v_i; xi_i - r_i is -p_i or 1 - p_i,
    independently per element) and V <= B = sum_b min(d/s^2, sqrt(d)/s) ||v_b||^2 (Lemma
    3.1). Shared uniforms would give every rank the same Q(v), and the mean the full V.

    Threshold by Chebyshev, over T trials of n independent elements: the per-element
    squared error of the 2-rank mean is at most u_max^2 = max_b (||v_b|| / s)^2, so the
    empirical mean squared error has variance <= u_max^2 V / (2T) and exceeds 3V/4 with
    probability <= 8 u_max^2 / (T V); one worker's (variance <= u_max^2 V / T) falls below
    3V/4 with probability <= 16 u_max^2 / (T V). Both are asserted to be below 1 %."""
    torch.manual_seed(7)
    s, d, n, trials = 2, 64, 512, 100
    v = torch.randn(n)
    layout = Layout.of(["w"], [(n,)], {"w": 0})
    vb = v.double().view(-1, d)
    unit2 = vb.pow(2).sum(1, keepdim=True) / s**2  # (||v_b|| / s)^2 per bucket
    r = vb.abs() * s / vb.pow(2).sum(1, keepdim=True).sqrt()
    p = r - r.floor()
    var_one = float((unit2 * p * (1 - p)).sum())
    bound = sum(min(d / s**2, math.sqrt(d) / s) * float(b.pow(2).sum()) for b in vb)
    u_max2 = float(unit2.max())
    assert var_one <= bound
    assert 16 * u_max2 / (trials * var_one) <= 0.01  # the thresholds below are not luck
    codecs = _ranks(2, levels=s, bucket_size=d, start_iter=0)
    err_one = err_mean = 0.0
    for t in range(trials):
        for c in codecs:
            c.step = t
        msgs, mean = _gathered_mean(codecs, v, layout)
        one = torch.empty_like(v)
        codecs[0].decode(msgs[0], msgs[0].buf[None], one)
        err_one += float((one.double() - v.double()).pow(2).sum())
        err_mean += float((mean.double() - v.double()).pow(2).sum())
    assert err_mean / trials <= 0.75 * var_one <= err_one / trials
    assert err_mean / trials <= 0.75 * bound


def test_decoded_values_are_multiples_of_the_bucket_norm_over_s_next_to_the_value() -> None:
    """Each decoded entry is ||v|| * l / s or ||v|| * (l + 1) / s with l = floor(s|v_i|/||v||)."""
    torch.manual_seed(4)
    s, d = 5, 16
    x = torch.randn(40)
    codec = codec_class("qsgd")(options=CODECS.get("qsgd").Options(levels=s, bucket_size=d, start_iter=0))
    out = _roundtrip(codec, x, Layout.of(["w"], [(40,)], {"w": 0}))[1]
    for v, q in zip(x.split(d), out.split(d)):
        unit = float(torch.linalg.vector_norm(v)) / s
        r = v.abs() / unit
        level = q.abs() / unit
        k = level.round()  # an integer up to the two roundings of the decode and this division
        assert float((level - k).abs().max()) <= tolerance(torch.float32, ops=4) * s
        assert torch.all((k == r.floor()) | (k == r.floor() + 1))
        assert torch.all((torch.sign(q) == torch.sign(v)) | (q == 0))


@pytest.mark.parametrize("shapes, bucket_size", [([(16, 8), (16,)], 512), ([(100, 3), (7,), (1,)], 48),
                                                  ([(1025,)], 1024), ([(4, 4)], 1)])
def test_packed_payload_has_exactly_the_bytes_cost_declares(shapes: list[tuple[int, ...]], bucket_size: int) -> None:
    """n int8 levels + 4 bytes per bucket of every tensor, one all-gather per buffer."""
    codec = codec_class("qsgd")(options=CODECS.get("qsgd").Options(bucket_size=bucket_size), world=4)
    names = [f"p{i}" for i in range(len(shapes))]
    layout = Layout.of(names, shapes, {n: i for i, n in enumerate(names)})
    msg, _ = _roundtrip(codec, torch.randn(layout.numel), layout)
    cost = codec.cost(shapes, world=4)
    expected = sum(math.prod(s) + 4 * math.ceil(math.prod(s) / bucket_size) for s in shapes)
    assert msg.buf.numel() == cost.nbytes == expected
    assert [r.collective for r in cost.rounds] == ["all_gather"]


def test_same_levels_whatever_the_tensors_are_fused_with() -> None:
    """Seeds follow (seed, step, parameter index, rank): a DDP bucket rebuild or an engine regroup
    quantizes every tensor identically."""
    torch.manual_seed(5)
    a, b = torch.randn(70), torch.randn(30)
    index = {"a": 3, "b": 8}
    codec = codec_class("qsgd")(options=CODECS.get("qsgd").Options(levels=3, bucket_size=16))
    codec.step = 12
    fused = _roundtrip(codec, torch.cat([a, b]), Layout.of(["a", "b"], [(70,), (30,)], index))[1]
    alone = [_roundtrip(codec, t, Layout.of([n], [(t.numel(),)], index))[1] for n, t in (("a", a), ("b", b))]
    assert torch.equal(fused, torch.cat(alone))
    codec.step = 13
    assert not torch.equal(fused, _roundtrip(codec, torch.cat([a, b]), Layout.of(["a", "b"], [(70,), (30,)], index))[1])


def test_checkpoint_resume_draws_the_same_levels_as_an_uninterrupted_run() -> None:
    """The uniforms depend on the codec step: a resumed hook must continue its count (a
    wrong step would redraw every level, an error of whole quantization steps). Both runs do
    the same arithmetic; the resumed DDP's initial bucket layout may only reorder 2-rank
    sums, 3 steps carried forward (as tests/test_compress_hooks.py's resume test)."""
    opts = compress_testlib.test_options("qsgd")
    straight = run_ranks(resume_run, 2, "qsgd", opts, steps=6, split=3, fresh=False)
    resumed = run_ranks(resume_run, 2, "qsgd", opts, steps=6, split=3, fresh=True)
    for a_rank, b_rank in zip(straight, resumed):
        for a, b in zip(a_rank, b_rank):
            for name in a:
                assert_close_eps(a[name], b[name], torch.float32, ops=2 * 3, msg=name)


def test_nonfinite_input_decodes_to_nan_everywhere() -> None:
    """NaN policy: the poisoned norms make every decoded entry non-finite (zeros included)."""
    codec = codec_class("qsgd")()
    x = torch.zeros(600)
    x[3] = float("nan")
    out = _roundtrip(codec, x, Layout.of(["w"], [(600,)], {"w": 0}), finite=False)[1]
    assert torch.isnan(out).all()


@pytest.mark.parametrize("spec, option, valid", [
    ("qsgd:levels=0", "levels", "[1, 127]"),
    ("qsgd:levels=128", "levels", "[1, 127]"),
    ("qsgd:bucket_size=0", "bucket_size", "[1, "),
    ("qsgd:seed=-1", "seed", "[0, "),
    ("qsgd:start_iter=-1", "start_iter", ">= 0"),
])
def test_invalid_options_are_refused_naming_the_option_and_its_range(spec: str, option: str, valid: str) -> None:
    with pytest.raises(UsageError) as e:
        methods.create(spec)
    assert option in str(e.value) and valid in str(e.value)
    for bad in (True, 2.5):
        with pytest.raises(UsageError):
            CODECS.get("qsgd").Options(levels=bad)


def test_defaults_are_8_bit_with_the_papers_bucket_size_and_a_warm_up() -> None:
    o = methods.create("qsgd").options
    assert (o.levels, o.bucket_size, o.start_iter) == (127, 512, "10%")
    assert methods.create("wfbp:compress=qsgd,levels=15").options.codec_options.levels == 15


def test_the_registry_driven_suites_carry_qsgd_with_its_reference() -> None:
    """Nothing lists qsgd by hand: the hook cases, the methods and the reference come from
    the registries and this module."""
    assert "qsgd" in CODECS.names() and "qsgd" in methods.names()
    assert ("qsgd", {**OPTIONS, "start_iter": 1}) in HOOK_CASES
    assert has_reference("qsgd")
    assert isinstance(compress_testlib.reference_for("qsgd", OPTIONS, 2), Reference)
