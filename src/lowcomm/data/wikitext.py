"""WikiText-2 (word level), as PyTorch's ``word_language_model`` example reads it.

Each line is split on whitespace and ends with ``<eos>``; the vocabulary is every word in
train, valid and test in order of first appearance (33,278 words for WikiText-2, the
``lstm_lm`` default). The token stream of each split is cut into non-overlapping windows of
``bptt`` tokens: sample ``i`` is ``(ids[i*bptt : (i+1)*bptt], ids[i*bptt+1 : (i+1)*bptt+1])``.
Samples are independent (no hidden state is carried between batches), so they may be
shuffled and sharded across ranks like any dataset.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from lowcomm.data import DataBundle, register_dataset
from lowcomm.errors import UsageError

EOS = "<eos>"
_NAMES = {
    "train": ("wiki.train.tokens", "train.txt"),
    "valid": ("wiki.valid.tokens", "valid.txt"),
    "test": ("wiki.test.tokens", "test.txt"),
}
_EXPECTED = "wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens (or train.txt, valid.txt, test.txt)"


def _find(root: Path, split: str) -> Path | None:
    for name in _NAMES[split]:
        if (root / name).is_file():
            return root / name
    return None


def _resolve(data_dir: Path | None) -> Path:
    where = str(data_dir) if data_dir is not None else "--data-dir (none given)"
    if data_dir is not None:
        for root in (data_dir, data_dir / "wikitext-2"):
            if _find(root, "train") and _find(root, "test"):
                return root
    raise UsageError(f"wikitext2: expected {_EXPECTED} under {where}; see docs/data.md")


def read_words(path: Path) -> list[str]:
    """All words of a file, one ``<eos>`` after every line."""
    words: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            words.extend(line.split())
            words.append(EOS)
    return words


def windows(ids: torch.Tensor, bptt: int) -> TensorDataset:
    """Non-overlapping ``(input, target)`` windows of ``bptt`` tokens (target = next token)."""
    n = (len(ids) - 1) // bptt
    if n < 1:
        raise UsageError(f"wikitext2: a split has {len(ids)} tokens, fewer than bptt+1={bptt + 1}")
    x = ids[: n * bptt].view(n, bptt)
    y = ids[1: n * bptt + 1].view(n, bptt)
    return TensorDataset(x.clone(), y.clone())


@register_dataset("wikitext2")
def wikitext2(*, data_dir: Path | None, seed: int, bptt: int = 35) -> DataBundle:
    """Word-level WikiText-2 from ``data_dir`` (or ``data_dir/wikitext-2``)."""
    if bptt < 1:
        raise UsageError(f"wikitext2: bptt must be >= 1, got {bptt}")
    root = _resolve(data_dir)
    paths = {split: _find(root, split) for split in _NAMES}
    words = {split: read_words(p) for split, p in paths.items() if p is not None}
    vocab: dict[str, int] = {}
    for split in ("train", "valid", "test"):
        for w in words.get(split, []):
            if w not in vocab:
                vocab[w] = len(vocab)
    ids = {split: torch.tensor([vocab[w] for w in ws], dtype=torch.int64)
           for split, ws in words.items()}
    has_valid = "valid" in ids and len(ids["valid"]) > bptt  # optional; never an error
    return DataBundle(
        name="wikitext2", train=windows(ids["train"], bptt), test=windows(ids["test"], bptt),
        valid=windows(ids["valid"], bptt) if has_valid else None,
        task="language_model", input_shape=(bptt,), vocab_size=len(vocab),
    )
