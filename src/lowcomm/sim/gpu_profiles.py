"""Build the shipped GPU compute profiles from public per-model training throughput.

``advise``/``simulate`` on a laptop would otherwise profile the laptop's CPU and recommend what
suits a CPU. These profiles say what a V100, A100 or H100 computes instead, without a GPU:

1. **Step time** of a cell (device x model) at batch ``B`` = ``B / throughput``. Throughput is
   a published figure (:data:`ANCHORS`: NVIDIA DeepLearningExamples' ResNet-50 v1.5 PyTorch
   training, one GPU, fp32/tf32) or, where no figure is published/found, *derived*: another
   device's figure times the ratio of peak FLOP/s (H100), or the same device's ResNet-50
   FLOP rate carried to another model by the ratio of FLOPs per sample (VGG-16, BERT-base,
   LSTM LM). Every derived cell says so in its ``notes`` (and in docs/simulator.md).
   Step time is taken as linear in the batch (throughput at the published batch).
2. **Optimizer**: an SGD-with-momentum step is memory-bound: 20 bytes per parameter (read
   weight, gradient, momentum; write weight, momentum) at the device's memory bandwidth.
3. **Layers**: the rest is split forward:backward = 1:2 and spread over the parameterized
   modules in forward order by FLOPs (``torch.utils.flop_counter`` on the ``meta`` device),
   where a layer's FLOPs run from its forward start to the next layer's start, exactly the
   profiler's attribution (non-parameter work is credited to the layer before it).
4. **Costs** of compression kernels from the memory bandwidth (see :func:`device_costs`).
5. ResNet-50 and the LSTM LM also get ``factorized`` (Pufferfish's default hybrid through
   :func:`lowcomm.lowrank.factorize` on the ``meta`` device), its step time scaled by its FLOPs.

Deterministic: FLOPs and shapes only, no timing. Regenerate with
``python -m lowcomm.sim.gpu_profiles [--out DIR]``; replace by a measured profile whenever a
GPU is at hand (``lowcomm profile --device cuda``). The H100 cells are such measurements
(:data:`MEASURED_DEVICES`, ``benchmarks/gpu_profiles_measured.py`` on an H100 80GB HBM3,
2026-11-25): :func:`write_all` leaves them alone, and :func:`build_profile` still derives an
H100 cell on request, to compare the derivation with the measurement (docs/simulator.md).
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from lowcomm.errors import UsageError
from lowcomm.sim.profile import ComputeCosts, LayerProfile, Profile

PROFILE_DIR = Path(__file__).with_name("profiles")

#: SGD-with-momentum update traffic per parameter (bytes): 3 fp32 reads + 2 writes.
OPTIMIZER_BYTES_PER_PARAM = 20


@dataclass(frozen=True)
class Device:
    """A GPU's datasheet numbers (dense fp32 / tf32 tensor-core peak and HBM bandwidth)."""
    name: str
    peak_flops: float
    mem_bytes_per_s: float
    precision: str


#: Datasheet figures: V100-SXM2 15.7 TFLOP/s fp32, 900 GB/s; A100-SXM4-80GB 156 TFLOP/s tf32
#: (dense), 2039 GB/s; H100-SXM5 494.7 TFLOP/s tf32 (dense), 3.35 TB/s.
DEVICES: dict[str, Device] = {
    "v100": Device("NVIDIA V100-SXM2-16GB", 15.7e12, 900e9, "fp32"),
    "a100": Device("NVIDIA A100-SXM4-80GB", 156e12, 2039e9, "tf32"),
    "h100": Device("NVIDIA H100-SXM5-80GB", 494.7e12, 3350e9, "tf32"),
}

_DLE_R50 = ("NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "
            "'Training performance results' (pytorch-21.03 NGC container), 1 GPU; batch from "
            "PyTorch/Classification/ConvNets/configs.yml")


@dataclass(frozen=True)
class Anchor:
    """One published training throughput: samples/s at a batch and precision, with source."""
    samples_per_s: float
    batch_size: int
    source: str


#: Published ResNet-50 throughput per device (None: derived, see :func:`resnet50_rate`).
ANCHORS: dict[str, Anchor | None] = {
    "v100": Anchor(367.0, 112, f"{_DLE_R50}: DGX-1 16GB, FP32, 367 img/s at batch 112"),
    "a100": Anchor(938.0, 256, f"{_DLE_R50}: DGX A100 80GB, TF32, 938 img/s at batch 256"),
    "h100": None,
}


@dataclass(frozen=True)
class ModelSpec:
    """How to build a model for counting and what batch its shipped profile uses."""
    make: Callable[[], nn.Module]
    example: Callable[[int], torch.Tensor]
    batch_size: int
    factorize: bool
    describe: str
    #: the ``model`` field: the ``lowcomm.models`` name where the registry has the model
    model_name: str


def _registry(name: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from lowcomm import models

        torch.manual_seed(0)
        return models.create(name)
    return make


def _vgg16() -> nn.Module:
    from lowcomm.sim.gpu_models import VGG16

    return VGG16()


def _bert() -> nn.Module:
    from lowcomm.sim.gpu_models import BertBase

    return BertBase()


def _images(b: int) -> torch.Tensor:
    return torch.empty(b, 3, 224, 224, device="meta")


def _tokens(t: int) -> Callable[[int], torch.Tensor]:
    return lambda b: torch.zeros(b, t, dtype=torch.long, device="meta")


#: Profile name -> model. Batches: ResNet-50 64 (ACP-SGD, DeAR), VGG-16 64, BERT-base 32 at
#: sequence 128 (ACP-SGD), LSTM LM 20 x 35 tokens (Pufferfish's WikiText-2).
MODELS: dict[str, ModelSpec] = {
    "resnet50": ModelSpec(_registry("resnet50_imagenet"), _images, 64, True,
                          "ImageNet ResNet-50 (lowcomm resnet50_imagenet), 224x224", "resnet50_imagenet"),
    "vgg16": ModelSpec(_vgg16, _images, 64, False, "ImageNet VGG-16 (torchvision layout), 224x224",
                       "vgg16"),
    "bert-base": ModelSpec(_bert, _tokens(128), 32, False,
                           "BERT-base pre-training (MLM+NSP), sequence 128", "bert_base"),
    "lstm-lm": ModelSpec(_registry("lstm_lm"), _tokens(35), 20, True,
                         "2-layer 1500-unit tied LSTM LM (lowcomm lstm_lm), 35 tokens", "lstm_lm"),
}


def shipped_names() -> list[str]:
    """Every ``DEVICE-MODEL`` profile name this module builds (and the package ships)."""
    return [f"{d}-{m}" for d in DEVICES for m in MODELS]


def layer_flops(model: nn.Module, example: torch.Tensor) -> list[tuple[str, float, list[list[int]]]]:
    """``(name, forward FLOPs, param shapes)`` per parameterized module, in forward order.

    A layer's FLOPs are those counted from its forward start to the next layer's start (the
    last one's to the end of the forward), as the profiler attributes time.
    """
    from torch.utils.flop_counter import FlopCounterMode

    from lowcomm.sim.profiler import parameter_layers

    layers = {name: [list(p.shape) for p in params] for name, _, params in parameter_layers(model)}
    model = model.to("meta")
    order: list[tuple[str, float]] = []
    counter = FlopCounterMode(display=False)

    def total() -> float:
        return float(sum(counter.get_flop_counts().get("Global", {}).values()))

    def pre_hook(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if all(n != name for n, _ in order):
                order.append((name, total()))
        return hook

    handles = [mod.register_forward_pre_hook(pre_hook(name))
               for name, mod in model.named_modules() if name in layers]
    try:
        with torch.no_grad(), counter:
            model(example)
        end = total()
    finally:
        for h in handles:
            h.remove()
    out = []
    for i, (name, start) in enumerate(order):
        stop = order[i + 1][1] if i + 1 < len(order) else end
        out.append((name, stop - start, layers[name]))
    missing = [n for n in layers if all(n != m for m, _ in order)]
    out += [(n, 0.0, layers[n]) for n in missing]  # parameters the forward never reached
    return out


def device_costs(dev: Device) -> ComputeCosts:
    """Compression kernel constants from the memory bandwidth (GPU kernels are memory-bound).

    Elementwise: 12 bytes per element (2 fp32 reads, 1 write). Matmul ``M @ Q`` with rank-4 Q
    reads M once (4 bytes per 8 FLOPs), so per FLOP ``0.5 / bandwidth`` (or the peak if
    slower); larger ranks are over-priced by up to ``r / 4``. QR of an ``m x r`` factor: one
    pass per column over it (``4·r·2`` bytes per element at r = 4). Top-k (radix select):
    8 passes over the input. Scatter-add: 16 bytes per (value, index) pair.
    """
    bw = dev.mem_bytes_per_s
    return ComputeCosts(elementwise_s_per_elem=12 / bw,
                        matmul_s_per_flop=max(0.5 / bw, 1 / dev.peak_flops),
                        orthogonalize_s_per_elem=32 / bw,
                        topk_s_per_elem=32 / bw,
                        scatter_s_per_elem=16 / bw)


def _on_meta(spec: ModelSpec) -> nn.Module:
    """The model with no storage: counting needs shapes only (VGG-16 alone is 550 MB)."""
    with torch.device("meta"):
        return spec.make()


@functools.lru_cache(maxsize=None)
def _forward_flops_per_sample(model: str) -> float:
    spec = MODELS[model]
    return sum(f for _, f, _ in layer_flops(_on_meta(spec), spec.example(1)))


def resnet50_rate(device: str) -> tuple[float, str]:
    """ResNet-50 samples/s on ``device`` and where the number comes from."""
    anchor = ANCHORS[device]
    if anchor is not None:
        return anchor.samples_per_s, anchor.source
    base = ANCHORS["a100"]
    assert base is not None
    ratio = DEVICES[device].peak_flops / DEVICES["a100"].peak_flops
    return (base.samples_per_s * ratio,
            f"DERIVED: no published figure used; A100's {base.samples_per_s:g} img/s x peak "
            f"FLOP/s ratio {ratio:.2f} ({DEVICES[device].peak_flops / 1e12:g} / "
            f"{DEVICES['a100'].peak_flops / 1e12:g} TFLOP/s); likely optimistic, since "
            "ResNet-50 is partly memory-bound and HBM grew only 1.6x")


def throughput(device: str, model: str) -> tuple[float, str]:
    """Training samples/s of ``model`` on ``device`` (one GPU) and its provenance."""
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}; valid: {', '.join(DEVICES)}")
    if model not in MODELS:
        raise UsageError(f"unknown model {model!r}; valid: {', '.join(MODELS)}")
    r50, source = resnet50_rate(device)
    if model == "resnet50":
        return r50, source
    ratio = _forward_flops_per_sample("resnet50") / _forward_flops_per_sample(model)
    return (r50 * ratio,
            f"DERIVED: ResNet-50's rate on this device ({r50:.0f} img/s; {source}) carried by "
            f"the FLOPs-per-sample ratio {ratio:.4f} (same achieved FLOP/s assumed)")


def _spread(flops: list[tuple[str, float, list[list[int]]]], compute_s: float
            ) -> list[LayerProfile]:
    total = sum(f for _, f, _ in flops) or 1.0
    fwd = compute_s / 3.0
    return [LayerProfile(name, fwd * f / total, 2.0 * fwd * f / total, shapes)
            for name, f, shapes in flops]


def build_profile(device: str, model: str, batch_size: int | None = None) -> Profile:
    """The profile of ``model`` on ``device`` at ``batch_size`` (default: the shipped one)."""
    rate, source = throughput(device, model)
    spec, dev = MODELS[model], DEVICES[device]
    b = spec.batch_size if batch_size is None else int(batch_size)
    if b < 1:
        raise UsageError(f"batch_size must be >= 1, got {b}")
    step = b / rate
    flops = layer_flops(_on_meta(spec), spec.example(b))
    numel = sum(sum(_prod(s) for s in shapes) for _, _, shapes in flops)
    opt = OPTIMIZER_BYTES_PER_PARAM * numel / dev.mem_bytes_per_s
    notes = (f"built by lowcomm.sim.gpu_profiles from public throughput, not measured: "
             f"{spec.describe}; {rate:.1f} samples/s ({dev.precision}); source: {source}; "
             f"step = batch / throughput, optimizer = {OPTIMIZER_BYTES_PER_PARAM} B/param at "
             f"{dev.mem_bytes_per_s / 1e9:g} GB/s, rest forward:backward 1:2 spread by FLOPs")
    prof = Profile(model=spec.model_name, batch_size=b, layers=_spread(flops, step - opt),
                   device=f"{dev.name} (published-throughput profile)", optimizer_s=opt,
                   costs=device_costs(dev), notes=notes)
    if spec.factorize:
        prof.factorized = _factorized(spec, b, step, flops, opt_bw=dev.mem_bytes_per_s)
        prof.factorized.costs = prof.costs
    return prof


def _prod(shape: list[int]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _factorized(spec: ModelSpec, b: int, full_step: float,
                full: list[tuple[str, float, list[list[int]]]], *, opt_bw: float) -> Profile:
    """Pufferfish's default hybrid of the model, its step time scaled by its FLOPs."""
    from lowcomm.lowrank import factorize

    small = factorize(_on_meta(spec), inplace=True)  # shapes only: no SVD work on meta
    flops = layer_flops(small, spec.example(b))
    ratio = sum(f for _, f, _ in flops) / sum(f for _, f, _ in full)
    numel = sum(sum(_prod(s) for s in shapes) for _, _, shapes in flops)
    opt = OPTIMIZER_BYTES_PER_PARAM * numel / opt_bw
    full_opt = OPTIMIZER_BYTES_PER_PARAM * sum(sum(_prod(s) for s in sh) for _, _, sh in full) / opt_bw
    return Profile(model=f"{spec.model_name}:pufferfish", batch_size=b,
                   layers=_spread(flops, (full_step - full_opt) * ratio),
                   optimizer_s=opt, notes=f"Pufferfish hybrid; compute scaled by FLOPs ratio {ratio:.3f}")


#: Devices whose shipped profiles were measured on the GPU itself (not rebuilt from figures).
MEASURED_DEVICES: tuple[str, ...] = ("h100",)


def write_all(out: Path = PROFILE_DIR) -> list[Path]:
    """Regenerate every derived shipped profile JSON under ``out`` (measured ones are kept)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in DEVICES:
        if d in MEASURED_DEVICES:
            continue
        for m in MODELS:
            p = out / f"{d}-{m}.json"
            build_profile(d, m).save(p)
            paths.append(p)
    return paths


def main(argv: list[str] | None = None) -> int:
    """``python -m lowcomm.sim.gpu_profiles [--out DIR]``: rewrite the derived shipped profiles."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(PROFILE_DIR))
    args = ap.parse_args(argv)
    for p in write_all(Path(args.out)):
        prof = Profile.load(p)
        print(f"{p.name}: {prof.compute_s * 1e3:.1f} ms/step at batch {prof.batch_size}, "
              f"{prof.numel:,} params, {len(prof.layers)} layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
