"""``--data stdlib``: the Python standard library's sources as a byte-level LM corpus with a
fixed split by file, capped in size, usable by ``transformer_lm`` and by any method."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lowcomm import data, methods
from lowcomm.data.stdlib_corpus import source_files, split_of, stdlib_root
from lowcomm.errors import UsageError
from lowcomm.testing import distributed

methods.names()  # load the method modules before forking


def test_the_split_is_fixed_by_each_files_path() -> None:
    # the hash of the relative path decides: the same on every machine and Python version
    assert [
        split_of(p) for p in ("json/decoder.py", "os.py", "collections/__init__.py", "ast.py")
    ] == ["test", "valid", "train", "train"]
    files = [p.relative_to(stdlib_root()).as_posix() for p in source_files(stdlib_root())]
    assert files == sorted(files) and "os.py" in files
    assert not any(
        part in ("site-packages", "dist-packages") for f in files for part in f.split("/")
    )
    shares = {
        s: sum(split_of(f) == s for f in files) / len(files) for s in ("train", "valid", "test")
    }
    assert shares["train"] > 0.8 and shares["valid"] > 0.02 and shares["test"] > 0.02


def test_windows_are_next_byte_targets_of_the_concatenated_files() -> None:
    bundle = data.create("stdlib", bptt=32, max_bytes=5000, eval_bytes=700)
    assert (
        bundle.task == "language_model" and bundle.vocab_size == 256 and bundle.input_shape == (32,)
    )
    x0, y0 = bundle.train[0]
    x1, _ = bundle.train[1]
    assert torch.equal(x0[1:], y0[:-1]) and y0[-1] == x1[0]
    first = next(
        p
        for p in source_files(stdlib_root())
        if split_of(p.relative_to(stdlib_root()).as_posix()) == "train"
    )
    assert bytes(x0.tolist()) == first.read_bytes()[:32]
    assert len(bundle.train) == (5000 - 1) // 32 and len(bundle.test) == (700 - 1) // 32
    assert bundle.valid is not None and len(bundle.valid) == (700 - 1) // 32


def test_evaluation_can_read_the_validation_split() -> None:
    bundle = data.create("stdlib", bptt=32, max_bytes=3000, eval_bytes=700, eval_split="valid")
    assert bundle.valid is not None and torch.equal(bundle.test[0][0], bundle.valid[0][0])
    assert not torch.equal(
        bundle.test[0][0], data.create("stdlib", bptt=32, max_bytes=3000, eval_bytes=700).test[0][0]
    )


def test_default_evaluation_slices_are_a_tenth_of_the_training_bytes() -> None:
    bundle = data.create("stdlib", bptt=16, max_bytes=16_000)
    assert len(bundle.test) == (1600 - 1) // 16


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"bptt": 0}, "bptt"),
        ({"max_bytes": 0}, "max_bytes"),
        ({"eval_bytes": -1}, "eval_bytes"),
        ({"bptt": 64, "max_bytes": 10}, "fewer than bptt+1"),
        ({"vocab": 3}, "no option vocab"),
        ({"eval_split": "train"}, "eval_split must be test or valid"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(kwargs: dict[str, int], words: str) -> None:
    with pytest.raises(UsageError) as e:
        data.create("stdlib", **kwargs)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("method", ["ssgd", "topk:density=0.1,start_iter=0", "diloco:sync_every=2"])
@distributed(world_size=2, timeout=240)
def test_transformer_lm_trains_on_it_with_any_method_and_reports_perplexity(
    method: str, tmp_path: Path
) -> None:
    from lowcomm.runtime.config import TrainConfig
    from lowcomm.runtime.trainer import Trainer

    cfg = TrainConfig(
        model="transformer_lm",
        data="stdlib",
        method=method,
        nproc=2,
        batch_size=4,
        steps=2,
        lr=0.003,
        optimizer="adamw",
        threads=1,
        progress=False,
        data_args={"bptt": 32, "max_bytes": 6000, "eval_bytes": 800},
        model_args={"d_model": 32, "nhead": 2, "num_layers": 2, "max_len": 32},
    )
    trainer = Trainer(cfg)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    last = result["history"][-1]
    assert result["metric_name"] == "perplexity" and result["steps"] == 2
    assert math.isclose(result["final_test_metric"], math.exp(last["test_loss"]), rel_tol=1e-6)
    assert (
        last["test_loss"] < math.log(256) + 0.5
    )  # near or below uniform over 256 bytes after 2 steps
    assert result["bytes_sent_per_worker"] > 0
    gathered = [torch.empty(1) for _ in range(2)]
    dist.all_gather(gathered, torch.tensor([result["final_test_metric"]]))
    assert gathered[0] == gathered[1]  # one evaluation over both ranks' shards
