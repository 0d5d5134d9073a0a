"""The ``--model`` namespace: a registry of workload models written for this project.

Use :func:`create` (``lowcomm.models.create("resnet18", num_classes=100)``) and
:func:`info` (task, default input shape, default classes/vocabulary) so the trainer can build
synthetic inputs and pick the loss without knowing the architecture.

Contract
--------
* ``task == "classification"``: ``model(x)`` with float ``x`` of shape ``(B, *input_shape)``
  returns logits ``(B, C)``; loss is cross-entropy.
* ``task == "language_model"``: ``model(tokens)`` with int64 ``tokens`` of shape ``(B, T)``
  returns logits ``(B, T, V)``; loss is token-level cross-entropy against the targets.

Every model built by :func:`create` carries ``model.lowcomm_name`` (the registry name) so
that name-keyed presets (e.g. Pufferfish's hybrid full-rank layers) can find themselves.

Module names (stable: low-rank presets select modules by these qualified names)
------------------------------------------------------------------------------
* ResNets (``resnet18/34/50`` CIFAR, ``resnet18_imagenet``, ``resnet50_imagenet``,
  ``wide_resnet50_2``), torchvision style: ``conv1``, ``bn1``, (``maxpool`` ImageNet only),
  ``layer1`` .. ``layer4`` (each an ``nn.Sequential`` of blocks ``layerK.i``), ``avgpool``,
  ``fc``. Blocks: ``conv1``, ``bn1``, ``conv2``, ``bn2`` (+ ``conv3``, ``bn3`` in
  bottlenecks) and ``downsample`` = ``Sequential(conv 1x1, BN)`` when the shape changes.
* ``vgg19``: ``features`` (``nn.Sequential``; conv layers at indices listed in
  :data:`lowcomm.models.vgg.VGG19_CONV_INDICES`), ``avgpool``, ``classifier``
  (``Sequential``: ``0`` Dropout, ``1`` Linear 512x512, ``2`` ReLU, ``3`` Dropout,
  ``4`` Linear 512x512, ``5`` ReLU, ``6`` Linear 512xC). ``vgg16``: the same names.
* ``vgg16_imagenet`` (torchvision layout): ``features``, ``avgpool`` (7x7), ``classifier``
  (Linear 25088x4096 at ``0``, 4096x4096 at ``3``, 4096xC at ``6``).
* ``lstm_lm``: ``encoder`` (Embedding), ``rnn`` (:class:`~lowcomm.models.lstm.LSTM`, with
  ``rnn.layers.K.ih`` / ``rnn.layers.K.hh`` as ``nn.Linear`` gate projections), ``drop``,
  ``decoder`` (Linear, weight tied to ``encoder``).
* ``transformer``: ``embedding`` (shared source/target Embedding), ``encoder.layers.K`` and
  ``decoder.layers.K`` with ``self_attn`` (and ``cross_attn`` in the decoder) as
  ``nn.MultiheadAttention``, ``linear1``/``linear2`` FFN, ``norm1..3``; ``encoder.norm``,
  ``decoder.norm``; ``lm_head`` (tied to ``embedding``).
* ``transformer_lm``: ``tok_emb``, ``pos_emb``, ``blocks.K`` (``norm1``, ``attn``,
  ``norm2``, ``linear1``, ``linear2``), ``norm``, ``lm_head`` (tied to ``tok_emb``).
* ``cnn1d``: ``conv1..3``, ``bn1..3``, ``fc``. ``mlp``: ``fc1``, ``fc2``, ``fc``.
* ``cnn2d``: ``conv1``, ``bn1``, ``conv2``, ``bn2``, ``pool``, ``fc`` (flat square inputs,
  e.g. digits' 64 features read as 8x8).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Literal

from torch import nn

from lowcomm.errors import UsageError
from lowcomm.registry import Registry

Task = Literal["classification", "language_model", "stereo"]

MODELS: Registry[nn.Module] = Registry(
    "model",
    modules=[
        "lowcomm.models.resnet",
        "lowcomm.models.vgg",
        "lowcomm.models.lstm",
        "lowcomm.models.transformer",
        "lowcomm.models.small",
        "lowcomm.elastic.classifier",
        "lowcomm.elastic.stereo.model",
    ],
)




@dataclass(frozen=True)
class ModelInfo:
    """What the trainer needs to know about a model without building it.

    ``default_input_shape`` is per sample: ``(C, H, W)`` / ``(features,)`` for classifiers,
    ``(T,)`` (sequence length of synthetic token batches) for language models.
    ``default_num_classes`` is set for classifiers, ``default_vocab_size`` for token models.
    ``lm_target`` says what a token model's logits predict at position t: ``"next"`` the
    dataset's target (next token), or ``"input"`` the input token itself (``transformer``'s
    copy task: its encoder sees the whole input, so next-token targets would leak).
    """

    task: Task
    default_input_shape: tuple[int, ...]
    default_num_classes: int | None = None
    default_vocab_size: int | None = None
    description: str = ""
    lm_target: Literal["next", "input"] = "next"

    @property
    def output_size(self) -> int:
        """Number of logits per prediction (classes or vocabulary)."""
        size = self.default_num_classes if self.task == "classification" else self.default_vocab_size
        assert size is not None
        return size


_INFO: dict[str, ModelInfo] = {}


def register_model(
    name: str, *, info: ModelInfo
) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """Decorator registering a factory ``(**kwargs) -> nn.Module`` under ``name``."""

    def decorate(factory: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        MODELS.register(name)(factory)
        _INFO[name] = info
        return factory

    return decorate



def create(name: str, **kwargs: Any) -> nn.Module:
    """Build model ``name``; unknown names or keyword arguments raise :class:`UsageError`."""
    factory = MODELS.get(name)
    params = inspect.signature(factory).parameters
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        valid = ", ".join(k for k in params if not k.startswith("_"))
        raise UsageError(f"model {name!r} has no option {', '.join(unknown)}; valid: {valid}")
    model = factory(**kwargs)
    vars(model)["lowcomm_name"] = name  # a plain attribute (nn.Module types only tensors/modules)
    return model


def names() -> list[str]:
    """All registered model names, sorted."""
    return MODELS.names()


def info(name: str) -> ModelInfo:
    """Metadata of model ``name`` (raises :class:`UsageError` for unknown names)."""
    MODELS.get(name)  # helpful error for unknown names
    return _INFO[name]


def kwargs_for_data(
    name: str,
    *,
    num_classes: int | None = None,
    vocab_size: int | None = None,
    input_shape: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """Map a dataset's description onto the keyword arguments of model ``name``.

    Saves the trainer from knowing that ``mlp`` takes ``input_dim`` while ResNets take
    ``in_channels``. Mismatches (a token model on image data) raise :class:`UsageError`.
    """
    meta = info(name)
    kw: dict[str, Any] = {}
    if meta.task == "classification":
        if vocab_size is not None and num_classes is None:
            raise UsageError(
                f"model {name!r} is a classifier but the data is a language-model corpus; "
                f"use a token model ({', '.join(n for n in names() if info(n).task == 'language_model')})"
            )
        if num_classes is not None:
            kw["num_classes"] = num_classes
        if input_shape is not None:
            if len(meta.default_input_shape) == 1:
                if len(input_shape) != 1:
                    raise UsageError(
                        f"model {name!r} takes flat (features,) inputs, got shape {tuple(input_shape)}"
                    )
                kw["input_dim"] = int(input_shape[0])
            else:
                if len(input_shape) != 3:
                    raise UsageError(
                        f"model {name!r} takes (C, H, W) images, got shape {tuple(input_shape)}"
                    )
                kw["in_channels"] = int(input_shape[0])
    else:
        if num_classes is not None and vocab_size is None:
            raise UsageError(
                f"model {name!r} is a language model but the data is a classification set; "
                f"use a classifier ({', '.join(n for n in names() if info(n).task == 'classification')})"
            )
        if vocab_size is not None:
            kw["vocab_size"] = vocab_size
    return kw


def count_parameters(model: nn.Module) -> int:
    """Number of distinct trainable numbers (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def non_embedding_parameters(model: nn.Module) -> int:
    """Parameters outside token embeddings and the output projection to the vocabulary.

    The definition Pufferfish reports for its Transformer (44,103,680 for 6+6 layers, d=512):
    every attention/FFN weight and bias and every LayerNorm (per-layer and the encoder's and
    decoder's own), but not ``nn.Embedding`` tables, learned position tables, or the
    vocabulary projection (the module named by ``model.output_projection_name``, tied or not).
    """
    excluded: set[int] = set()
    for _, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            excluded.update(id(p) for p in module.parameters())
    head_name = getattr(model, "output_projection_name", None)
    if head_name:
        head = model.get_submodule(head_name)
        excluded.update(id(p) for p in head.parameters())
    return sum(p.numel() for p in model.parameters() if id(p) not in excluded)


__all__ = [
    "MODELS",
    "ModelInfo",
    "count_parameters",
    "create",
    "info",
    "kwargs_for_data",
    "names",
    "non_embedding_parameters",
    "register_model",
]
