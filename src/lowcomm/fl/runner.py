"""The round loop of one worker, and the run's summary (rank 0).

Why apart from :mod:`lowcomm.fl.engine`: the engine knows how to play a round; this module
decides how many, when to evaluate, checkpoint, log and stop, and what the summary holds
(the JSON keys of ``docs/fl.md``).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from lowcomm.fl.config import FLConfig
from lowcomm.fl.engine import Federation, join


def run_fl(cfg: FLConfig) -> dict[str, Any] | None:
    """Run (or continue) the federation on this worker; rank 0 returns the summary.

    Under ``lowcomm fl --nproc N`` or torchrun every worker calls this; with one process it
    runs in place (no process group).
    """
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    me = join(cfg)
    try:
        fed = Federation(cfg, me)
        if cfg.resume:
            fed.restore()
        summary = _loop(cfg, fed)
    finally:
        if me.owns_group and dist.is_initialized():
            dist.destroy_process_group()
    return summary


def _loop(cfg: FLConfig, fed: Federation) -> dict[str, Any] | None:
    me = fed.me
    display = None
    if me.is_server and not cfg.quiet and not cfg.no_progress:
        from lowcomm.fl.report import RoundDisplay

        display = RoundDisplay(total_rounds=cfg.rounds, start_round=fed.next_round)
    log = open(cfg.log, "a") if (me.is_server and cfg.log) else None
    played = 0
    try:
        if display is not None:
            display.__enter__()
        for r in range(fed.next_round, cfg.rounds):
            started = time.perf_counter()
            record = fed.play_round(r)
            if me.is_server:
                last = r == cfg.rounds - 1
                if (r + 1) % cfg.eval_every == 0 or last:
                    record.update(fed.evaluate())
                else:
                    record.update(test_accuracy=None, test_loss=None)
                fed.elapsed_s += time.perf_counter() - started
                record["elapsed_s"] = fed.elapsed_s
                fed.history.append(record)
                if cfg.checkpoint_dir:
                    fed.save(r + 1)
                if log is not None:
                    log.write(json.dumps({"event": "round", **record}) + "\n")
                    log.flush()
                if display is not None:
                    display.update(record)
            played += 1
            if cfg.stop_after_rounds is not None and played >= cfg.stop_after_rounds:
                break
        fed.finish()
    finally:
        if display is not None:
            display.__exit__(None, None, None)
        if log is not None:
            log.close()
    if not me.is_server:
        return None
    summary = summarize(cfg, fed)
    if cfg.json:
        from lowcomm.runtime.checkpoint import atomic_write_json

        atomic_write_json(summary, cfg.json)
    return summary


def summarize(cfg: FLConfig, fed: Federation) -> dict[str, Any]:
    """The run's JSON summary (``docs/fl.md`` lists the keys)."""
    history = fed.history
    times = [h["round_time_s"] for h in history]
    accs = [h["test_accuracy"] for h in history if h.get("test_accuracy") is not None]
    per_round_bytes = [h["bytes_per_worker"] for h in history]
    return {
        "command": "fl",
        "algorithm": cfg.algorithm,
        "clients": cfg.clients,
        "per_round": cfg.clients if cfg.cross_silo else cfg.per_round,
        "world_size": fed.me.world,
        "device": str(fed.me.device),
        "model": cfg.model,
        "params": fed.num_params,
        "data": fed.bundle.label,
        "train_samples": int(fed.partition.sizes.sum()),
        "partition": cfg.partition,
        "partition_stats": fed.partition_stats(),
        "rounds": len(history),
        "local_epochs": cfg.local_epochs,
        "batch_size": cfg.batch_size,
        "lr": cfg.lr,
        "schedule": cfg.schedule,
        "slowdown": cfg.slowdown,
        "seed": cfg.seed,
        "final_test_accuracy": accs[-1] if accs else None,
        "round_time_s_median": statistics.median(times) if times else None,
        "elapsed_s": fed.elapsed_s,
        "bytes_per_round_per_worker": statistics.median(per_round_bytes) if per_round_bytes else None,
        "bytes_sent_per_worker": sum(per_round_bytes),
        "peak_memory": {"rss_bytes": int(getattr(fed, "workers_peak_rss", 0)), "pss_bytes": None,
                        "processes": fed.me.world, "source": "sum of the workers' own peak RSS"},
        "history": history,
    }
