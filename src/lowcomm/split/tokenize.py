"""WordPiece tokenization of text batches into fixed-length id and mask tensors.

Why the ``tokenizers`` library (Rust) and not ``transformers``: it reads both files a BERT
checkpoint may ship (``tokenizer.json``, or the older ``vocab.txt``) and nothing else is
needed from the HF stack. Every batch is padded to exactly ``max_len`` so the tensors that
cross the edge-cloud link have one shape per step (the cloud can post its receive before
the edge has tokenized anything).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, Union

import torch
from torch import Tensor

from lowcomm.errors import UsageError, check_count

INSTALL_HINT = "pip install 'lowcomm[split]'"

#: a sentence, or a sentence pair (as :data:`lowcomm.split.data.Text`)
Text = Union[str, tuple[str, str]]


def _is_text(item: object) -> bool:
    if isinstance(item, str):
        return True
    return (isinstance(item, tuple) and len(item) == 2
            and all(isinstance(s, str) for s in item))


def require_tokenizers() -> Any:
    """The ``tokenizers`` module, or a one-line UsageError naming the extra to install."""
    try:
        import tokenizers
    except ImportError:
        raise UsageError(f"split fine-tuning needs the 'tokenizers' package: {INSTALL_HINT}") from None
    return tokenizers


@dataclass
class Encoded:
    """One tokenized batch, each ``(B, max_len)`` int64."""

    input_ids: Tensor
    attention_mask: Tensor
    token_type_ids: Tensor


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with BERT's [CLS] ... [SEP] template and fixed-length output.

    ``max_positions`` (the model's ``max_position_embeddings``) bounds ``max_len``, so a too
    long request is refused here, in one line, instead of failing inside the embedding.
    """

    def __init__(self, backend: Any, *, source: str, max_positions: int | None = None) -> None:
        self.backend = backend
        self.source = source
        self.max_positions = max_positions
        pad = backend.token_to_id("[PAD]")
        self.pad_id = 0 if pad is None else int(pad)

    @classmethod
    def from_tokenizer_json(cls, path: str | Path) -> Tokenizer:
        """A ``tokenizer.json`` (its normalizer decides lowercasing, as it did in training)."""
        tokenizers = require_tokenizers()
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception on bad JSON
            raise UsageError(f"cannot read tokenizer {path}: {str(e).splitlines()[0]}") from None
        return cls(backend, source=str(path))

    @classmethod
    def from_vocab(cls, path: str | Path, *, lowercase: bool = True) -> Tokenizer:
        """BERT's WordPiece from a ``vocab.txt`` (one token a line, [PAD] [UNK] [CLS] [SEP])."""
        tokenizers = require_tokenizers()
        vocab = Path(path)
        try:
            tokens = vocab.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read {vocab}: {e}") from None
        missing = [t for t in ("[UNK]", "[CLS]", "[SEP]", "[PAD]") if t not in tokens]
        if missing:
            raise UsageError(f"{vocab} is not a BERT vocabulary: no {', '.join(missing)} token")
        backend = tokenizers.implementations.BertWordPieceTokenizer(str(vocab), lowercase=lowercase)
        return cls(backend, source=str(vocab))

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        """``tokenizer.json`` if the directory has one, else ``vocab.txt`` lowercased as its
        ``tokenizer_config.json`` says (``do_lower_case``, default True as in BERT)."""
        d = Path(directory)
        if (d / "tokenizer.json").is_file():
            return cls.from_tokenizer_json(d / "tokenizer.json")
        if (d / "vocab.txt").is_file():
            lowercase = True
            cfg = d / "tokenizer_config.json"
            if cfg.is_file():
                try:
                    lowercase = bool(json.loads(cfg.read_text()).get("do_lower_case", True))
                except (json.JSONDecodeError, AttributeError) as e:
                    raise UsageError(f"{cfg} is not a JSON object: {e}") from None
            return cls.from_vocab(d / "vocab.txt", lowercase=lowercase)
        raise UsageError(f"{d} has no tokenizer: a BERT checkpoint directory needs tokenizer.json "
                         "or vocab.txt")

    @property
    def vocab_size(self) -> int:
        """Number of token ids this tokenizer can produce (added tokens included)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a tokenizer that belongs to another model: its ids would index the wrong
        (or no) rows of the embedding table, silently or with an index error mid-training."""
        if self.vocab_size != vocab_size:
            raise UsageError(
                f"mismatched tokenizer: {self.source} has {self.vocab_size} tokens but the model's "
                f"vocab_size is {vocab_size}; use the tokenizer that ships with the model"
            )

    def _check_max_len(self, max_len: int) -> None:
        limit = self.max_positions if self.max_positions is not None else 2**31 - 1
        check_count("max length", max_len, minimum=2, maximum=limit)

    def encode(self, texts: Sequence[Text], max_len: int,
               pairs: Sequence[str] | None = None) -> Encoded:
        """Tokenize, truncate and pad every text to exactly ``max_len`` tokens, [CLS] and
        [SEP] included. A sample may be a sentence pair (GLUE's MRPC, QNLI, RTE), given as a
        ``(a, b)`` tuple (:data:`lowcomm.split.data.Text`) or as ``pairs[i]``: it is encoded as
        ``[CLS] a [SEP] b [SEP]`` with token types 0 then 1, the longer text truncated first."""
        self._check_max_len(max_len)
        items: list[Text] = list(texts)
        if pairs is not None:
            pairs = list(pairs)
            if len(pairs) != len(items):
                raise UsageError(f"{len(items)} texts but {len(pairs)} pairs: they go one to one")
            items = [(t, p) if isinstance(t, str) else t for t, p in zip(items, pairs)]
        bad = next((t for t in items if not _is_text(t)), None)
        if bad is not None:
            raise UsageError(f"texts must be strings or (str, str) pairs, got "
                             f"{type(bad).__name__}: {bad!r:.60}")
        if not items:
            empty = torch.zeros(0, max_len, dtype=torch.int64)
            return Encoded(empty, empty.clone(), empty.clone())
        self.backend.enable_truncation(max_length=max_len)
        self.backend.enable_padding(length=max_len, pad_id=self.pad_id,
                                    pad_token=self.backend.id_to_token(self.pad_id) or "[PAD]")
        try:
            batch = self.backend.encode_batch(items)
        except Exception as e:  # the Rust side raises a bare Exception (e.g. truncation)
            raise UsageError(f"cannot tokenize to max length {max_len}: "
                             f"{str(e).splitlines()[0]}") from None

        def tensor(rows: list[list[int]]) -> Tensor:
            return torch.tensor(rows, dtype=torch.int64)

        return Encoded(tensor([e.ids for e in batch]), tensor([e.attention_mask for e in batch]),
                       tensor([e.type_ids for e in batch]))

    def encode_batch(self, texts: Sequence[Text], max_len: int) -> tuple[Tensor, Tensor]:
        """``(input_ids, attention_mask)``, each ``(len(texts), max_len)`` int64 (pairs'
        token types: :meth:`encode`)."""
        enc = self.encode(texts, max_len)
        return enc.input_ids, enc.attention_mask
