"""The training loop of the edge and of the cloud, and the run's summary (written by the edge).

Why the two roles loop separately instead of sharing one loop: the edge owns the data (the
texts never leave it; only the cut activations, the mask and the labels cross) and decides
what happens next (a training batch, an evaluation batch, the end); the cloud only answers.
The unsplit baseline (``--unsplit``) runs the same batches through the whole model in one
process, so the three rows of ``docs/split.md`` differ in nothing but the split.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting
from lowcomm.comm.ledger import ledger
from lowcomm.split.checkpoint import build_classifier, load_bert
from lowcomm.split.config import PROFILE_STEPS, SplitConfig, split_compute
from lowcomm.split.data import TextDataset, load_text_data
from lowcomm.split.emulate import CloudReplay, EdgeReplay
from lowcomm.split.model import SplitCloud, SplitEdge
from lowcomm.split.transport import BACKWARD_TAG, FORWARD_TAG

EDGE, CLOUD = 0, 1


def _join(cfg: SplitConfig) -> tuple[torch.device, bool]:
    """This process's device and, with two processes (edge = rank 0, cloud = rank 1), the
    process group; True when we created it (and must destroy it)."""
    from lowcomm.errors import UsageError
    from lowcomm.runtime.distributed import join_world

    world = int(os.environ.get("WORLD_SIZE", 1))
    if not cfg.unsplit and world != 2:
        raise UsageError(f"split fine-tuning runs on exactly 2 processes (edge and cloud), not {world}")
    joined = join_world(cfg.device)
    return joined.device, joined.owns_group


def batches(data: TextDataset, batch_size: int, *, seed: int, epoch: int | None) -> Iterator[np.ndarray]:
    """Indices of each batch: a seeded permutation per training epoch, in order for evaluation."""
    n = len(data)
    order = np.arange(n) if epoch is None else np.random.default_rng([seed, epoch]).permutation(n)
    for start in range(0, n, batch_size):
        yield order[start:start + batch_size]


def _encode(tokenizer: Any, data: TextDataset, idx: np.ndarray, max_len: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(input_ids, attention_mask, labels, token_type_ids)``; the token types only for
    sentence pairs (GLUE's MRPC, QNLI, RTE), where the second segment is type 1."""
    enc = tokenizer.encode([data.texts[i] for i in idx], max_len)
    labels = torch.from_numpy(data.labels[idx])
    types = enc.token_type_ids.to(device) if data.is_pair else None
    return enc.input_ids.to(device), enc.attention_mask.to(device), labels.to(device), types


def _training_batches(cfg: SplitConfig, train: TextDataset) -> Iterator[np.ndarray]:
    steps = 0
    for epoch in range(cfg.epochs if cfg.steps is None else 10**9):
        for idx in batches(train, cfg.batch_size, seed=cfg.seed, epoch=epoch):
            yield idx
            steps += 1
            if cfg.steps is not None and steps >= cfg.steps:
                return


def _optimizer(cfg: SplitConfig, params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def run_split(cfg: SplitConfig) -> dict[str, Any] | None:
    """Run this process's role (or the unsplit baseline); the edge returns the summary."""
    # edge and cloud take turns (each waits for the other's half of the step), so each may use
    # every core while it computes
    torch.set_num_threads(cfg.threads or max(1, os.cpu_count() or 1))
    config, weights, tokenizer = load_bert(cfg.model)
    device, owns = _join(cfg)
    if cfg.unsplit:
        return _run_unsplit(cfg, config, weights, tokenizer, device)
    try:
        role = dist.get_rank()
        if role == EDGE:
            return _run_edge(cfg, config, weights, tokenizer, device)
        _run_cloud(cfg, config, weights, device)
        return None
    finally:
        if owns and dist.is_initialized():
            dist.destroy_process_group()


def _classifier(cfg: SplitConfig, config: Any, weights: Any, num_classes: int) -> nn.Module:
    torch.manual_seed(cfg.seed)  # the head's init: identical on both sides and in the baseline
    return build_classifier(config, weights, num_classes)


def _load(cfg: SplitConfig) -> tuple[TextDataset, TextDataset]:
    return load_text_data(cfg.data, data_dir=cfg.data_dir, max_train=cfg.max_train, max_test=cfg.max_test)


def _run_edge(cfg: SplitConfig, config: Any, weights: Any, tokenizer: Any, device: torch.device) -> dict[str, Any]:
    train, test = _load(cfg)
    setup = torch.tensor([train.num_classes], dtype=torch.int64, device=device)
    accounting.broadcast(setup, EDGE, tag="split.setup")
    split = SplitEdge(_classifier(cfg, config, weights, train.num_classes).to(device),
                      split_layer=cfg.split_layer, rank=cfg.rank, keep_residual=cfg.keep_residual,
                      compress=cfg.compress, wire=cfg.wire)
    opt = _optimizer(cfg, split.parameters())
    step_s: list[float] = []
    comm_before = split.comm_s
    replay = _edge_replay(cfg)
    split.train()
    log = open(cfg.log, "a") if cfg.log else None
    try:
        for idx in _training_batches(cfg, train):
            if replay is not None and not replay.measuring:
                step_s.append(replay.replay(split))
            else:
                start = time.perf_counter()
                ids, mask, labels, types = _encode(tokenizer, train, idx, cfg.max_len, device)
                comm0 = split.comm_s
                out = split(ids, mask, labels, types)
                middle, comm1 = time.perf_counter(), split.comm_s
                split.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                end = time.perf_counter()
                step_s.append(end - start)
                if replay is not None:
                    replay.record((middle - start) - (comm1 - comm0),
                                  (end - middle) - (split.comm_s - comm1), step_s[-1],
                                  list(out) if isinstance(out, tuple) else [out], mask, labels)
            if log is not None:
                log.write(json.dumps({"event": "step", "step": len(step_s), "step_s": step_s[-1]}) + "\n")
                log.flush()
    finally:
        if log is not None:
            log.close()
    comm_s = split.comm_s - comm_before
    forward_bytes = ledger().by_tag[FORWARD_TAG].wire_bytes
    if replay is None:  # emulated compute: the replayed steps trained nothing, so no evaluation
        split.eval()
        with torch.no_grad():
            for idx in batches(test, cfg.eval_batch_size, seed=cfg.seed, epoch=None):
                split(*_encode(tokenizer, test, idx, cfg.max_len, device))
    split.stop()
    report = torch.zeros(5, dtype=torch.float64, device=device)
    accounting.broadcast(report, CLOUD, tag="split.report")
    correct, count, loss_sum, backward_bytes, cloud_s = report.tolist()
    steps = len(step_s)
    summary = _summary(cfg, params=sum(p.numel() for p in split.parameters()), steps=steps,
                       step_s=step_s, comm_s=comm_s, accuracy=correct / max(count, 1), loss=loss_sum / max(count, 1),
                       train=train, test=test, bytes_per_step={
                           "edge_to_cloud": forward_bytes / max(steps, 1),
                           "cloud_to_edge": backward_bytes / max(steps, 1)})
    if replay is not None:
        summary.update(final_test_accuracy=None, test_loss=None, compute_measured=replay.measured(cloud_s),
                       step_time_s_median=statistics.median(step_s[PROFILE_STEPS:]),
                       timed_steps=steps - PROFILE_STEPS)
    return summary


def _edge_replay(cfg: SplitConfig) -> EdgeReplay | None:
    spec = split_compute(cfg.compute, unsplit=cfg.unsplit, steps=cfg.steps)
    return EdgeReplay(spec.scale or 1.0) if spec.emulated else None


def _run_cloud(cfg: SplitConfig, config: Any, weights: Any, device: torch.device) -> None:
    setup = torch.zeros(1, dtype=torch.int64, device=device)
    accounting.broadcast(setup, EDGE, tag="split.setup")
    split = SplitCloud(_classifier(cfg, config, weights, int(setup.item())).to(device),
                       split_layer=cfg.split_layer, rank=cfg.rank, keep_residual=cfg.keep_residual,
                       compress=cfg.compress, wire=cfg.wire)
    opt = _optimizer(cfg, split.parameters())
    loss_fn = nn.CrossEntropyLoss()
    stats = torch.zeros(3, dtype=torch.float64, device=device)  # correct, count, loss sum
    spec = split_compute(cfg.compute, unsplit=cfg.unsplit, steps=cfg.steps)
    replay = CloudReplay(spec.scale or 1.0) if spec.emulated else None
    while True:
        if replay is not None and not replay.measuring:
            replay.serve(split, device)
            break
        start, comm0 = time.perf_counter(), split.comm_s
        batch = split()
        if batch is None:
            break
        assert batch.labels is not None
        labels = batch.labels.long()
        if batch.train:
            loss = loss_fn(batch.logits, labels)
            loss.backward()
            before, comm1 = time.perf_counter(), split.comm_s
            split.backward()
            after = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if replay is not None:  # the part after the send overlaps the edge's backward
                replay.record((before - start) - (comm1 - comm0), time.perf_counter() - after)
        else:
            stats[0] += (batch.logits.argmax(-1) == labels).sum()
            stats[1] += labels.numel()
            stats[2] += nn.functional.cross_entropy(batch.logits.float(), labels, reduction="sum").double()
    backward = float(ledger().by_tag[BACKWARD_TAG].wire_bytes)
    cloud_s = sum(replay.median_s) if replay is not None else 0.0
    accounting.broadcast(torch.cat([stats, torch.tensor([backward, cloud_s], dtype=torch.float64, device=device)]),
                         CLOUD, tag="split.report")


def _run_unsplit(cfg: SplitConfig, config: Any, weights: Any, tokenizer: Any, device: torch.device) -> dict[str, Any]:
    train, test = _load(cfg)
    model = _classifier(cfg, config, weights, train.num_classes).to(device)
    opt = _optimizer(cfg, model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    step_s: list[float] = []
    model.train()
    for idx in _training_batches(cfg, train):
        start = time.perf_counter()
        ids, mask, labels, types = _encode(tokenizer, train, idx, cfg.max_len, device)
        loss_fn(model(ids, mask, types), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - start)
    model.eval()
    correct = count = 0
    loss_sum = 0.0
    with torch.no_grad():
        for idx in batches(test, cfg.eval_batch_size, seed=cfg.seed, epoch=None):
            ids, mask, labels, types = _encode(tokenizer, test, idx, cfg.max_len, device)
            logits = model(ids, mask, types).float()
            correct += int((logits.argmax(-1) == labels).sum())
            count += labels.numel()
            loss_sum += float(nn.functional.cross_entropy(logits, labels, reduction="sum"))
    return _summary(cfg, params=sum(p.numel() for p in model.parameters()), steps=len(step_s),
                    step_s=step_s, comm_s=0.0, accuracy=correct / max(count, 1), loss=loss_sum / max(count, 1),
                    train=train, test=test, bytes_per_step={"edge_to_cloud": 0.0, "cloud_to_edge": 0.0})


def _summary(cfg: SplitConfig, *, params: int, steps: int, step_s: list[float],
             comm_s: float, accuracy: float, loss: float, train: TextDataset, test: TextDataset,
             bytes_per_step: dict[str, float]) -> dict[str, Any]:
    timed = step_s[1:] or step_s  # the first step pays one-time allocations
    return {
        "command": "split", "model": cfg.model, "mode": _mode(cfg), "split_layer": cfg.split_layer,
        "rank": cfg.rank if cfg.compress and not cfg.unsplit else None, "wire": cfg.wire,
        "keep_residual": cfg.keep_residual, "data": cfg.data, "train_samples": len(train),
        "test_samples": len(test), "epochs": cfg.epochs, "steps": steps, "batch_size": cfg.batch_size,
        "max_len": cfg.max_len, "lr": cfg.lr, "seed": cfg.seed, "final_test_accuracy": accuracy,
        "test_loss": loss, "bytes_per_step": bytes_per_step,
        "bytes_per_step_total": sum(bytes_per_step.values()),
        "step_time_s_median": statistics.median(timed) if timed else None,
        "comm_s_per_step": comm_s / max(steps, 1), "edge_params": params,
        "network": {"requested": cfg.net or "none", "emulated": bool(cfg.net)},
        "compute": split_compute(cfg.compute, unsplit=cfg.unsplit, steps=cfg.steps).label,
    }


def _mode(cfg: SplitConfig) -> str:
    if cfg.unsplit:
        return "unsplit"
    return "split" if cfg.compress else "split-uncompressed"
