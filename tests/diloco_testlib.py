"""Resume checks shared by tests/test_diloco.py and tests/test_diloco_inner.py: train the
trainer in process on this rank, straight and stopped then resumed, and compare the outer
sync's state bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.runtime import checkpoint


def train_in_process(ckpt: str, method: str, *, stop_after_steps: int | None = None, resume: bool = False,
                     **config: Any) -> None:
    """One in-process run of the trainer on this rank (as ``lowcomm train`` runs it): an mlp
    on MNIST-1D for one epoch, lr 0.05, checkpoints in ``ckpt``; ``config`` adds or overrides
    :class:`~lowcomm.runtime.config.TrainConfig` fields (``nproc`` at least)."""
    from lowcomm.runtime.config import TrainConfig
    from lowcomm.runtime.trainer import Trainer

    fields: dict[str, Any] = dict(model="mlp", data="mnist1d", batch_size=64, lr=0.05, epochs=1, eval=False,
                                  progress=False, threads=1)
    fields.update(config)
    cfg = TrainConfig(method=method, checkpoint_dir=ckpt, stop_after_steps=stop_after_steps, resume=resume,
                      **fields)
    trainer = Trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()


def resume_matches(tmp_path: Path, method: str, stop: int, **config: Any) -> dict[str, Any]:
    """Train straight and stopped at ``stop`` then resumed (:func:`train_in_process` with
    ``config``); the two end alike bit for bit on this rank: every local weight and every
    global copy of the outer sync. Returns the checkpoint's method state at ``stop``."""
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    rank = dist.get_rank()
    train_in_process(straight, method, **config)
    train_in_process(resumed, method, stop_after_steps=stop, **config)
    mid = checkpoint.load_rank(resumed, stop, rank)["method"]
    assert mid["step"] == stop
    train_in_process(resumed, method, resume=True, **config)
    latest = checkpoint.latest(straight)
    assert latest is not None and latest["step"] > stop
    a = checkpoint.load_rank(straight, latest["step"], rank)["method"]
    b = checkpoint.load_rank(resumed, latest["step"], rank)["method"]
    for k in a["local"]:
        assert torch.equal(a["local"][k], b["local"][k]), (rank, k)
    for ga, gb in zip(a["sync"]["global"], b["sync"]["global"]):
        assert torch.equal(ga, gb)
    return dict(mid)
