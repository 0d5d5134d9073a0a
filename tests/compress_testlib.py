"""Helpers for tests/test_compress_*.py: a recording DDP run and central reference math.

The references below are written from the papers' formulas with plain dense tensor ops,
independently of lowcomm's hooks: they share only the documented seeded factor init
(:func:`lowcomm.compress.lowrank.factor_seed`) so the low-rank methods start from the same Q.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (DDP imports it lazily: ~5 s per forked rank otherwise)
import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting
from lowcomm.comm.hooks import HOOKS, run_hook
from lowcomm.compress.codec import CODECS
from lowcomm.compress.lowrank import factor_seed
from lowcomm.compress.dgc import clip_segments_, clip_threshold
from lowcomm.hooks import create, options_for
from lowcomm.testing.distributed import run_distributed
from tolerance import tolerance

def _as_bytes(fn: Any, *args: Any, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(fn(*args, **kwargs), buf)
    return buf.getvalue()


def run_ranks(fn: Any, world: int, *args: Any, timeout: float = 90.0, **kwargs: Any) -> list[Any]:
    """run_distributed, but results travel as torch.save bytes: tensors pickled through the
    result pipe use shared-memory fds that die with the (already exited) child."""
    raw = run_distributed(_as_bytes, world, fn, *args, timeout=timeout, **kwargs)
    return [torch.load(io.BytesIO(b), weights_only=False) for b in raw]


TINY_BUCKET_MB = 0.0001  # 100 floats: after the rebuild, one layer (weight + bias) per bucket

#: small values for the payload-size options a codec declares (by option name, not by
#: codec: a codec with a ``density`` or ``rank`` field gets these); a codec's own test
#: module may give its options as ``OPTIONS`` instead (see :func:`test_options`)
SMALL_OPTIONS: dict[str, Any] = {"density": 0.1, "rank": 2}


def codec_test_module(name: str) -> Any:
    """``tests/test_codec_<name>.py`` if it exists (a new compressor's own test module)."""
    try:
        return importlib.import_module(f"test_codec_{name}")
    except ModuleNotFoundError as e:
        if e.name != f"test_codec_{name}":
            raise
        return None


def test_options(name: str) -> dict[str, Any]:
    """Options that compress from step 1 with small payloads, for codec ``name``."""
    module = codec_test_module(name)
    fields = {f.name for f in dataclasses.fields(HOOKS[name].Options)}
    small = {k: v for k, v in SMALL_OPTIONS.items() if k in fields}
    opts = dict(getattr(module, "OPTIONS", small))
    if "start_iter" in fields:
        opts.setdefault("start_iter", 1)
    return opts


test_options.__test__ = False  # type: ignore[attr-defined]  # not a test, despite its name

class _Cases(Sequence[tuple[str, dict[str, Any]]]):
    """Built on first use, not at import: a codec's test module imports this module (for
    :class:`Reference`) and is itself imported here for its ``OPTIONS``."""

    def __init__(self) -> None:
        self._cases: list[tuple[str, dict[str, Any]]] | None = None

    def _all(self) -> list[tuple[str, dict[str, Any]]]:
        if self._cases is None:
            self._cases = [("ssgd", {})] + [(n, test_options(n)) for n in CODECS.names()]
        return self._cases

    def __getitem__(self, i: Any) -> Any:
        return self._all()[i]

    def __len__(self) -> int:
        return len(self._all())


#: every comm hook: ssgd and each registered codec, with small options (the reference cases)
HOOK_CASES: Sequence[tuple[str, dict[str, Any]]] = _Cases()


class TinyMLP(nn.Sequential):
    """An MLP whose optional ``unused`` child never takes part in forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        for name, module in self.named_children():
            if name != "unused":
                x = module(x)
        return x


def make_model(extra_unused: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = TinyMLP(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    if extra_unused:
        model.add_module("unused", nn.Linear(16, 16))
    return model


def recorded_run(
    method: str,
    options: dict[str, Any],
    *,
    steps: int,
    bucket_cap_mb: float = TINY_BUCKET_MB,
    lr: float = 0.05,
    data_seed: int = 100,
    find_unused: bool = False,
    accumulate: int = 0,
    nan_at: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Train a tiny MLP with the hook; record per synchronized step every bucket's local input
    and the synchronized gradients. Runs on each rank (inside run_ranks).

    ``accumulate``: micro-steps under ``no_sync()`` before each synchronized one.
    ``find_unused``: the model has a module that never gets a gradient.
    ``nan_at=(rank, step)``: that rank's bucket holding ``0.weight`` gets a NaN at that step.
    """
    rank = dist.get_rank()
    model = make_model(extra_unused=find_unused)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused)
    state = create(ddp, method, **options)
    holder: list[list[tuple[list[str], torch.Tensor]]] = [[]]
    step_now = [0]

    def hook(st, bucket):  # type: ignore[no-untyped-def]  # unannotated: DDP checks annotations
        names = list(st.layout(bucket).names)
        if nan_at == (rank, step_now[0]) and "0.weight" in names:
            bucket.buffer()[0] = float("nan")
        holder[0].append((names, bucket.buffer().detach().clone()))
        return run_hook(st, bucket)

    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(data_seed + rank)
    log = []
    states = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(steps):
            step_now[0] = s
            holder[0] = []
            opt.zero_grad(set_to_none=True)
            for _ in range(accumulate):
                with ddp.no_sync():
                    x = torch.randn(16, 8, generator=gen)
                    (ddp(x) - torch.randn(16, 4, generator=gen)).pow(2).mean().backward()
            x = torch.randn(16, 8, generator=gen)
            y = torch.randn(16, 4, generator=gen)
            loss = (ddp(x) - y).pow(2).mean()
            loss.backward()
            out = {
                n: (p.grad.detach().clone().reshape(-1) if p.grad is not None else None)
                for n, p in model.named_parameters()
            }
            # the NaN policy's single host read per step, after backward (warns if skipping)
            finite = state.check_finite()
            log.append({"buckets": holder[0], "out": out, "finite": finite})
            states.append(state.state_dict())
            if finite:
                opt.step()
    nonfinite_warnings = sum("non-finite" in str(w.message) for w in caught)
    return {
        "log": log,
        "ledger": accounting.ledger().as_dict(),
        "state": state.state_dict(),
        "states": states,
        "warnings": nonfinite_warnings,
    }


def resume_run(method: str, options: dict[str, Any], *, steps: int, split: int, fresh: bool) -> list[dict[str, torch.Tensor]]:
    """Gradients of steps ``split..steps-1``: uninterrupted (``fresh=False``) or from a new
    DDP + hook restored from the checkpoint taken after step ``split - 1`` (``fresh=True``)."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(7 + rank)
    data = [(torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)) for _ in range(steps)]

    def build() -> tuple[nn.Module, Any, Any, torch.optim.Optimizer]:
        model = make_model()
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=TINY_BUCKET_MB)
        from lowcomm.hooks import register

        st = register(ddp, method, **options)
        return model, ddp, st, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def train(ddp: Any, model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> dict[str, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        (ddp(batch[0]) - batch[1]).pow(2).mean().backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        return grads

    model, ddp, st, opt = build()
    out = []
    for s in range(steps):
        if s == split and fresh:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": st.state_dict()}, buf)
            buf.seek(0)
            ckpt = torch.load(buf, weights_only=False)
            model, ddp, st, opt = build()
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            st.load_state_dict(ckpt["hook"])
        g = train(ddp, model, opt, data[s])
        if s >= split:
            out.append(g)
    return out


# --- central references ------------------------------------------------------------------


class Reference:
    """Per-rank, per-name state; ``step(inputs, names)`` returns the expected mean output.

    Each reference also states its round-off model (see ``tests/tolerance.py``): after a call,
    ``scale`` holds per element the mean over ranks of |the terms that were summed| (the
    honest scale of a sum's round-off, which cancellation in the result does not shrink),
    ``ops(names)`` the rounding steps the hook may order differently, ``cond`` the condition
    number of the most sensitive step so far and ``dtype`` the precision of the aggregate."""

    dtype: torch.dtype = torch.float32

    def __init__(self, world: int, shapes: dict[str, torch.Size], index: dict[str, int], **opts: Any) -> None:
        self.world = world
        self.shapes = shapes
        self.index = index
        self.opts = opts
        self.mem: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
        self.t = 0
        self.scale = torch.zeros(0)
        self.cond = 1.0

    def ops(self, names: list[str]) -> float:
        """A sum over ``world`` ranks in any order: world - 1 additions and one division."""
        return float(self.world)

    def _summed(self, terms: list[torch.Tensor]) -> None:
        self.scale = torch.stack([t.abs() for t in terms]).mean(0)

    def sizes(self, names: list[str]) -> list[int]:
        return [math.prod(self.shapes[n]) for n in names]

    def get(self, r: int, names: list[str]) -> torch.Tensor:
        return torch.cat([self.mem[r].get(n, torch.zeros(s)) for n, s in zip(names, self.sizes(names))])

    def put(self, r: int, names: list[str], flat: torch.Tensor) -> None:
        for n, piece in zip(names, flat.split(self.sizes(names))):
            self.mem[r][n] = piece.clone()

    def __call__(self, xs: list[torch.Tensor], names: list[str]) -> torch.Tensor:
        raise NotImplementedError


class Mean(Reference):
    def __call__(self, xs: list[torch.Tensor], names: list[str]) -> torch.Tensor:
        self._summed(xs)
        return torch.stack(xs).mean(0)


class Cast(Reference):
    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.dtype = self.opts["dtype"]  # the sum is rounded to the wire dtype

    def __call__(self, xs: list[torch.Tensor], names: list[str]) -> torch.Tensor:
        dt = self.opts["dtype"]
        self._summed(xs)
        return torch.stack([(x / self.world).to(dt).float() for x in xs]).sum(0)


class _Scaled(Reference):
    def ops(self, names: list[str]) -> float:
        """The per-tensor scale is a mean over up to ``max(sizes)`` entries, then a rank sum."""
        return float(self.world + max(self.sizes(names)))


class SignEF(_Scaled):
    def __call__(self, xs: list[torch.Tensor], names: list[str]) -> torch.Tensor:
        outs = []
        for r, x in enumerate(xs):
            c = x + self.get(r, names) if self.opts["ef"] else x
            dec = torch.cat([
                torch.where(seg >= 0, 1.0, -1.0) * seg.abs().sum() / seg.numel()
                for seg in c.split(self.sizes(names))
            ])
            if self.opts["ef"]:
                self.put(r, names, c - dec)
            outs.append(dec)
        self._summed(outs)
        return torch.stack(outs).mean(0)


class Signum(_Scaled):
    def __call__(self, xs: list[torch.Tensor], names: list[str]) -> torch.Tensor:
        beta = self.opts["beta"]
        ms = []
        for r, x in enumerate(xs):
            m = beta * self.get(r, names) + (1 - beta) * x
            self.put(r, names, m)
            ms.append(m)
        votes = torch.stack([torch.where(m >= 0, 1.0, -1.0) for m in ms]).sum(0).sign()
        scale = torch.stack([
            torch.cat([torch.full((s.numel(),), float(s.abs().mean())) for s in m.split(self.sizes(names))])
            for m in ms
        ]).mean(0)
        self.scale = scale  # votes are exact small integers; only the scale is rounded
        return votes * scale


def _dense_topk(c: torch.Tensor, density: float, sizes: list[int]) -> torch.Tensor:
    """Keep the ceil(density * n) largest |entries| of every tensor (segment)."""
    out = []
    for seg in c.split(sizes):
        k = max(1, math.ceil(density * seg.numel()))
        keep = torch.zeros_like(seg)
        idx = seg.abs().argsort(descending=True)[:k]
        keep[idx] = seg[idx]
        out.append(keep)
    return torch.cat(out)


class TopKRef(Reference):
    def __call__(self, xs: list[torch.Tensor], names: list[str]) -> torch.Tensor:
        outs = []
        for r, x in enumerate(xs):
            c = x + self.get(r, names)
            dec = _dense_topk(c, self.opts["density"], self.sizes(names))
            self.put(r, names, c - dec)
            outs.append(dec)
        self._summed(outs)
        return torch.stack(outs).mean(0)


class GTopKRef(Reference):
    """Recursive doubling simulated densely, with the non-power-of-two fold-in."""

    def __call__(self, xs: list[torch.Tensor], names: list[str]) -> torch.Tensor:
        cs = [x + self.get(r, names) for r, x in enumerate(xs)]
        dens, sizes = self.opts["density"], self.sizes(names)
        local = [_dense_topk(c, dens, sizes) for c in cs]
        core = 1 << (self.world.bit_length() - 1)  # fallback: extras fold into rank - core
        cur = [
            _dense_topk(local[r] + local[r + core], dens, sizes) if r + core < self.world else local[r]
            for r in range(core)
        ]
        d = 1
        while d < core:
            cur = [_dense_topk(cur[r] + cur[r ^ d], dens, sizes) for r in range(core)]
            d *= 2
        glob = cur[0]
        support = glob != 0
        for r, c in enumerate(cs):
            self.put(r, names, c - local[r] * support)
        self._summed(local)  # every kept value is a sum of (at most world) ranks' entries
        return glob / self.world


class LowRank(Reference):
    """Round-off model of PowerSGD / ACP-SGD: each compressed step orthogonalizes once per
    matrix, whose Q factor has a forward error of about cond * sqrt(rows * r) * u (backward
    stable QR, Higham §19.3, §3.6; perturbation bound of Sun 1991); warm start and error
    feedback carry it forward, so the errors add over the steps."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.qr_steps = 0  # most orthogonalizations any one matrix has had
        self.qr_rows = 1
        self._per_name: dict[str, int] = {}

    def ops(self, names: list[str]) -> float:
        return float(self.world) + max(1, self.qr_steps) * math.sqrt(self.qr_rows * self.opts["rank"])

    def orth(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Reduced QR's Q, recording the factor's condition number (computed in float64)."""
        cond = float(torch.linalg.cond(x.double()))
        if math.isfinite(cond):  # an all-zero factor (unused parameter) has no condition
            self.cond = max(self.cond, cond)
        self._per_name[name] = self._per_name.get(name, 0) + 1
        self.qr_steps = max(self.qr_steps, self._per_name[name])
        self.qr_rows = max(self.qr_rows, x.shape[0])
        return torch.linalg.qr(x)[0]

    def init(self, name: str, rows: int, r: int, salt: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(factor_seed(self.opts.get("seed", 0), self.index[name], salt))
        return torch.randn(rows, r, generator=g)

    def compressible(self, name: str) -> bool:
        shape = self.shapes[name]
        if len(shape) < 2:
            return False
        n, m = shape[0], math.prod(shape[1:])
        r = min(self.opts["rank"], n, m)
        return (n + m) * r * self.opts.get("min_compression_rate", 2.0) < n * m


class PowerSGDRef(LowRank):
    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.q: dict[str, torch.Tensor] = {}

    def __call__(self, xs: list[torch.Tensor], names: list[str]) -> torch.Tensor:
        out = torch.stack(xs).mean(0)
        self._summed(xs)
        scales = list(self.scale.split(self.sizes(names)))
        parts = [list(x.split(self.sizes(names))) for x in xs]
        res = list(out.split(self.sizes(names)))
        for j, name in enumerate(names):
            if not self.compressible(name):
                continue
            n = self.shapes[name][0]
            ms = [(p[j] + self.mem[r].get(name, torch.zeros_like(p[j]))).view(n, -1) for r, p in enumerate(parts)]
            rk = min(self.opts["rank"], *ms[0].shape)
            q = self.q.get(name, self.init(name, ms[0].shape[1], rk, 0))
            p_sum = sum(m @ q for m in ms)
            p_hat = self.orth(name, p_sum)
            q_sum = sum(m.T @ p_hat for m in ms)
            approx = p_hat @ q_sum.T / self.world
            self.q[name] = q_sum
            for r, m in enumerate(ms):
                self.mem[r][name] = (m - approx).reshape(-1)
            res[j] = approx.reshape(-1)
            scales[j] = approx.abs().reshape(-1)
        self.scale = torch.cat(scales)
        return torch.cat(res)


class ACPSGDRef(LowRank):
    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.p: dict[str, torch.Tensor] = {}
        self.q: dict[str, torch.Tensor] = {}
        self.calls: dict[str, int] = {}

    def __call__(self, xs: list[torch.Tensor], names: list[str]) -> torch.Tensor:
        out = torch.stack(xs).mean(0)
        self._summed(xs)
        scales = list(self.scale.split(self.sizes(names)))
        parts = [list(x.split(self.sizes(names))) for x in xs]
        res = list(out.split(self.sizes(names)))
        for j, name in enumerate(names):
            if not self.compressible(name):
                continue
            p_step = self.calls.get(name, 0) % 2 == 0
            self.calls[name] = self.calls.get(name, 0) + 1
            n = self.shapes[name][0]
            ms = [(p[j] + self.mem[r].get(name, torch.zeros_like(p[j]))).view(n, -1) for r, p in enumerate(parts)]
            rk = min(self.opts["rank"], *ms[0].shape)
            if p_step:
                q = self.orth(name, self.q.get(name, self.init(name, ms[0].shape[1], rk, 0)))
                ps = [m @ q for m in ms]
                for r, (m, p) in enumerate(zip(ms, ps)):
                    self.mem[r][name] = (m - p @ q.T).reshape(-1)
                self.p[name] = sum(ps)
                approx = self.p[name] @ q.T / self.world
            else:
                p = self.orth(name, self.p.get(name, self.init(name, n, rk, 1)))
                qs = [m.T @ p for m in ms]
                for r, (m, q) in enumerate(zip(ms, qs)):
                    self.mem[r][name] = (m - p @ q.T).reshape(-1)
                self.q[name] = sum(qs)
                approx = p @ self.q[name].T / self.world
            res[j] = approx.reshape(-1)
            scales[j] = approx.abs().reshape(-1)
        self.scale = torch.cat(scales)
        return torch.cat(res)


#: central references of the original methods, from the options dataclass ``o`` (None for
#: ssgd); a later compressor brings its ``Reference`` in ``tests/test_codec_<name>.py``.
#: Which methods need a reference is never read from here: :func:`has_reference` and
#: :func:`reference_for` start from the registry (``ssgd`` + :data:`CODECS`), and
#: :func:`table_problems` finds entries the registry no longer has or a module duplicates.
REFERENCES: dict[str, Any] = {
    "ssgd": lambda w, sh, ix, o: Mean(w, sh, ix),
    "fp16": lambda w, sh, ix, o: Cast(w, sh, ix, dtype=torch.float16),
    "bf16": lambda w, sh, ix, o: Cast(w, sh, ix, dtype=torch.bfloat16),
    "signsgd": lambda w, sh, ix, o: SignEF(w, sh, ix, ef=o.error_feedback),
    "signum": lambda w, sh, ix, o: Signum(w, sh, ix, beta=o.momentum),
    "topk": lambda w, sh, ix, o: TopKRef(w, sh, ix, density=o.density),
    "gtopk": lambda w, sh, ix, o: GTopKRef(w, sh, ix, density=o.density),
    "powersgd": lambda w, sh, ix, o: PowerSGDRef(w, sh, ix, rank=o.rank, seed=o.seed,
                                                 min_compression_rate=o.min_compression_rate),
    "acpsgd": lambda w, sh, ix, o: ACPSGDRef(w, sh, ix, rank=o.rank, seed=o.seed,
                                             min_compression_rate=o.min_compression_rate),
}


def _module_reference(name: str) -> type[Reference] | None:
    """``Reference`` of ``tests/test_codec_<name>.py``, if that module exists: a new
    compressor brings its central reference in its own test module. Such a class is built
    as ``Reference(world, shapes, index, options=<the options dataclass>)``."""
    module = codec_test_module(name)
    ref = getattr(module, "Reference", None)
    return ref if isinstance(ref, type) and issubclass(ref, Reference) else None


def _reference_factory(name: str) -> Any:
    """How to build ``name``'s reference as ``f(world, shapes, index, o)``, or None. Only a
    registered method (``ssgd`` or a codec of :data:`CODECS`) has one; its own test module's
    ``Reference`` comes first, the table of the original methods second."""
    if name != "ssgd" and name not in CODECS.names():
        return None
    cls = _module_reference(name)
    if cls is not None:
        return lambda w, sh, ix, o: cls(w, sh, ix, options=o)
    return REFERENCES.get(name)


def has_reference(name: str) -> bool:
    """Whether registered method ``name`` has a central reference (its test module or the table)."""
    return _reference_factory(name) is not None


def table_problems() -> list[str]:
    """What is wrong with :data:`REFERENCES` against the registry: entries for a method that
    is no longer registered, and entries a codec's own test module duplicates."""
    registered = {"ssgd", *CODECS.names()}
    return ([f"{n}: in REFERENCES but not a registered method" for n in REFERENCES if n not in registered]
            + [f"{n}: both in REFERENCES and in tests/test_codec_{n}.py" for n in REFERENCES
               if n in registered and _module_reference(n) is not None])


def reference_for(method: str, options: dict[str, Any], world: int, *, extra_unused: bool = False,
                  model: nn.Module | None = None) -> Reference:
    """The central reference of ``method`` on ``model``'s parameters (default :func:`make_model`)."""
    model = model if model is not None else make_model(extra_unused)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    o = options_for(method, **options) if method in HOOKS else None
    factory = _reference_factory(method)
    if factory is None:
        raise KeyError(f"no central reference for {method!r}: add tests/test_codec_{method}.py with a Reference")
    return factory(world, shapes, index, o)  # type: ignore[no-any-return]


def check_against_reference(method: str, options: dict[str, Any], results: list[dict[str, Any]]) -> int:
    """Replay every step centrally; assert each rank's synchronized gradients match.

    The bound per parameter is the reference's own round-off model (``Reference.ops``,
    ``cond``, ``dtype``; see ``tests/tolerance.py``) at the scale of the summed terms:
    ``max|got - expected| <= ops * cond * eps(dtype) * max(scale)``.
    Returns the number of buckets compared (so tests can assert several were used)."""
    world = len(results)
    extra = "unused.weight" in results[0]["log"][0]["out"]
    ref = reference_for(method, options, world, extra_unused=extra)
    start = options_for(method, **options).__dict__.get("start_iter", 0)
    # DGC's local clipping comes first in the codec, on warm-up steps too: the references see
    # each rank's input clipped per tensor (clip_segments_ is checked against the formula in
    # test_dgc.py)
    clip = clip_threshold(float(options_for(method, **options).__dict__.get("clip", 0.0)), world)
    warm = Mean(world, ref.shapes, ref.index)
    max_buckets = 0
    for s in range(len(results[0]["log"])):
        buckets = [res["log"][s]["buckets"] for res in results]
        max_buckets = max(max_buckets, len(buckets[0]))
        for b, (names, _) in enumerate(buckets[0]):
            assert all(bk[b][0] == names for bk in buckets), "bucket layouts differ across ranks"
            xs = [bk[b][1] for bk in buckets]
            if clip > 0:
                xs = [clip_segments_(x.clone(), ref.sizes(names), clip) for x in xs]
            current = warm if s < start else ref
            expected = current(xs, names)
            tol = tolerance(current.dtype, ops=current.ops(names), cond=current.cond)
            for n, piece, scale in zip(names, expected.split(ref.sizes(names)), current.scale.split(ref.sizes(names))):
                for r, res in enumerate(results):
                    got = res["log"][s]["out"][n]
                    if got is None:  # globally unused parameter: DDP leaves .grad unset
                        continue
                    err = float((got - piece).abs().max())
                    assert err <= tol * float(scale.max()), (
                        f"{method} step {s} bucket {b} param {n} rank {r}: max err {err:.3g}, "
                        f"bound {tol:.3g} * {float(scale.max()):.3g}"
                    )
    return max_buckets
