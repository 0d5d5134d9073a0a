"""Pufferfish's hybrid architectures, keyed by the registry name of each model.

A preset says which layers stay full rank (a regex over qualified module names; a module is
kept when its own name or any ancestor's name matches it completely) and which linear layers
hold several independent gate blocks that are factorized one block at a time (the LSTM
``4h x in`` gate matrices, which Pufferfish factorizes per gate). Models built by
:func:`lowcomm.models.create` carry ``model.lowcomm_name``, which is how
``factorize(model, full_rank=None)`` finds the preset.

Counts at rank ratio 1/4 (checked in ``tests/test_lowrank_presets.py``):

===================  ============  ===========  ===========================================
model                full          factorized   full-rank layers
===================  ============  ===========  ===========================================
resnet18 (CIFAR)     11,173,962    3,336,266    conv1, layer1.0, shortcuts, fc (paper code:
                                                11,173,834 -> 3,336,138; same 128 offset)
vgg19 (CIFAR)        20,560,330    8,370,634    conv 1-9, last Linear
resnet50_imagenet    25,557,032    15,202,344   conv1, layer1-3, fc (layer4 incl. shortcut
                                                factorized)
wide_resnet50_2      68,883,240    40,047,400   as resnet50_imagenet
lstm_lm              85,962,278    67,962,278   none (tied embedding/decoder never touched)
transformer (non-    44,103,680    21,821,440   encoder/decoder layer 0
embedding)
===================  ============  ===========  ===========================================
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lowcomm.errors import UsageError


@dataclass(frozen=True)
class Preset:
    """``full_rank``: regex of modules kept dense; ``gate_blocks``: regex -> block count."""

    full_rank: str | None = None
    gate_blocks: dict[str, int] = field(default_factory=dict)
    note: str = ""


def _vgg19_full_rank() -> str:
    from lowcomm.models.vgg import VGG19_CONV_INDICES

    first9 = "|".join(str(i) for i in VGG19_CONV_INDICES[:9])
    return rf"features\.({first9})|classifier\.6"


_RESNET_IMAGENET = Preset(
    full_rank=r"conv1|layer[123]|fc",
    note="Pufferfish: only layer4 of the ImageNet ResNet-50 / WRN-50-2 is factorized",
)

PRESETS: dict[str, Preset] = {
    "resnet18": Preset(
        full_rank=r"conv1|layer1\.0|layer\d\.\d+\.downsample|fc",
        note="Pufferfish CIFAR ResNet-18: conv1, the first block, shortcuts and fc stay full rank",
    ),
    "resnet34": Preset(full_rank=r"conv1|layer1\.0|layer\d\.\d+\.downsample|fc", note="as resnet18"),
    "resnet50": Preset(full_rank=r"conv1|layer[123]|fc", note="as resnet50_imagenet"),
    "resnet18_imagenet": Preset(full_rank=r"conv1|layer[123]|fc", note="as resnet50_imagenet"),
    "resnet50_imagenet": _RESNET_IMAGENET,
    "wide_resnet50_2": _RESNET_IMAGENET,
    "lstm_lm": Preset(
        full_rank=None,
        gate_blocks={r"rnn\.layers\.\d+\.(ih|hh)": 4},
        note="Pufferfish LSTM: every gate matrix factorized per gate; tied embeddings stay",
    ),
    "transformer": Preset(
        full_rank=r"encoder\.layers\.0|decoder\.layers\.0",
        note="Pufferfish Transformer: layer 0 of encoder and decoder full rank",
    ),
    "transformer_lm": Preset(full_rank=r"blocks\.0", note="by analogy with transformer"),
    "cnn1d": Preset(full_rank=r"conv1|fc", note="first conv and classifier full rank"),
    "mlp": Preset(full_rank=r"fc", note="classifier full rank"),
}


def get_preset(name: str | None) -> Preset | None:
    """The preset of model ``name`` (None when there is none)."""
    if name is None:
        return None
    if name == "vgg19":
        return Preset(
            full_rank=_vgg19_full_rank(),
            note="Pufferfish CIFAR VGG-19: conv 1-9 and the classifier full rank",
        )
    return PRESETS.get(name)


def require_preset(name: str) -> Preset:
    """The preset of ``name``, or a UsageError listing the models that have one."""
    preset = get_preset(name)
    if preset is None:
        valid = ", ".join(sorted([*PRESETS, "vgg19"]))
        raise UsageError(f"no low-rank preset for model {name!r}; presets exist for: {valid}")
    return preset
