"""``lowcomm elastic search`` and ``lowcomm elastic extract``: sub-networks under a latency limit.

How a sub-network is judged: OFA's protocol. Its latency comes from a lookup table measured on
this machine (:mod:`lowcomm.elastic.latency`); its accuracy on held-out data after BN
re-calibration (``--score direct``), or from an accuracy predictor trained on sampled
sub-networks (``--score predictor``, OFA's way, cheap enough for a large evolution). The
random baseline draws ``--random`` sub-networks under the same budget and keeps the best by
the same held-out score measured directly (the strongest form of that baseline). Both
answers are then measured on the test set, which neither search has seen.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from lowcomm.elastic.space import Config
from lowcomm.elastic.supernet import Supernet, recalibrate_bn
from lowcomm.errors import UsageError, check_count
from lowcomm.runtime.distributed import Dist
from lowcomm.runtime.evaluation import evaluate
from lowcomm.runtime.workload import Batches


def _float_list(flag: str, text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: give milliseconds, e.g. 2.5 or 1,2,4") from None
    if not values or any(not (v > 0 and v < float("inf")) for v in values):
        raise UsageError(f"{flag} {text!r}: budgets must be positive milliseconds")
    return values


def _shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise UsageError(f"--latency-shape {text!r}: give a per-sample shape like 6,256,512") from None
    if not shape or any(s < 1 for s in shape):
        raise UsageError(f"--latency-shape {text!r}: every size must be >= 1")
    return shape


class SubnetScorer:
    """Sub-networks of one trained supernet measured on data: BN re-calibrated on fixed
    training batches, evaluated on the held-out set (``score``) or the test set (``test``)."""

    def __init__(self, net: Supernet, bundle: Any, *, valid_size: int, bn_batches: int, batch_size: int,
                 seed: int) -> None:
        self.net = net.eval()
        self.bundle = bundle
        self.task = str(bundle.task)
        self.bn_batches = bn_batches
        self.batch_size = batch_size
        self.seed = seed
        train: Dataset[Any] = bundle.train
        if bundle.valid is not None:
            self.valid: Dataset[Any] = bundle.valid
        else:  # OFA: a fixed subset of the training images stands in for validation data
            n = len(train)  # type: ignore[arg-type]
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: min(valid_size, n)]
            self.valid = Subset(train, order.tolist())
        self.max_disp = float(getattr(net, "max_disp", 0.0)) or None
        self.evaluations = 0

    def _calibration(self) -> list[torch.Tensor]:
        batches = Batches(self.bundle.train, self.batch_size, 0, 1, self.seed)
        return [batches.fetch(idx)[0] for idx in batches.plan(0)[: self.bn_batches]]

    def calibrated(self, model: nn.Module) -> nn.Module:
        """``model`` with BN statistics re-computed on the calibration batches (OFA)."""
        if self.bn_batches:
            recalibrate_bn(model, self._calibration(), num_batches=self.bn_batches)
        return model

    def metrics(self, config: Config, data: Dataset[Any]) -> dict[str, float]:
        """Metrics of ``config`` (extracted, BN re-calibrated) on ``data``."""
        sub = self.calibrated(self.net.extract(config))
        self.evaluations += 1
        return evaluate(sub, data, task=self.task, dist_info=Dist(), batch_size=512, amp=None,
                        target_is_input=False, max_disp=self.max_disp)

    def score_of(self, metrics: dict[str, float]) -> float:
        """Higher is better: accuracy, or minus the end-point error."""
        return metrics["test_accuracy"] if self.task == "classification" else -metrics["test_epe"]

    def score(self, config: Config) -> float:
        """The held-out score of ``config``."""
        return self.score_of(self.metrics(config, self.valid))

    def test(self, config: Config) -> dict[str, float]:
        """The test-set metrics of ``config`` (keys without the ``test_`` prefix)."""
        return {k.removeprefix("test_"): v for k, v in self.metrics(config, self.bundle.test).items()}


def load_for_search(args: argparse.Namespace) -> tuple[Supernet, dict[str, Any], Any]:
    """The supernet, its file's metadata, and its data (``--data-dir`` may point elsewhere)."""
    from lowcomm import data as data_registry
    from lowcomm.elastic.artifacts import load_supernet

    net, blob = load_supernet(args.supernet)
    data_dir = args.data_dir if args.data_dir is not None else blob.get("data_dir")
    bundle = data_registry.create(blob["data"], data_dir=data_dir, seed=int(blob.get("seed", 0)),
                                  **blob.get("data_args", {}))
    return net, blob, bundle


def latency_table(args: argparse.Namespace, net: Supernet, shape: tuple[int, ...]) -> Any:
    """The table in ``--latency-table`` (measured now and saved there if the file is missing)."""
    from pathlib import Path

    from lowcomm.elastic.latency import LatencyTable

    space = net.space
    if args.latency_table and Path(args.latency_table).is_file():
        table = LatencyTable.load(args.latency_table, sample_shape=shape, supernet=net)
        for line in table.host_differences():
            print(f"lowcomm: warning: latency table measured elsewhere ({line})", file=sys.stderr)
        return table
    calibrate = [space.max_config(), space.min_config()]
    table = LatencyTable.measure(net, space, shape, repeats=args.latency_repeats, samples=args.latency_samples,
                                 seed=args.seed, threads=args.latency_threads, stat=args.latency_stat,
                                 rounds=args.latency_rounds,
                                 calibrate=calibrate if args.latency_fit != "none" else (),
                                 fit=args.latency_fit if args.latency_fit != "none" else "offset")
    if args.latency_table:
        table.save(args.latency_table)
    return table


def score_function(args: argparse.Namespace, scorer: SubnetScorer) -> tuple[Any, dict[str, Any]]:
    """``--score direct``: the scorer itself; ``predictor``: an accuracy predictor trained on
    ``--predictor-samples`` directly scored random sub-networks (its held-out rank correlation
    reported)."""
    if args.score == "direct":
        return scorer.score, {"kind": "direct"}
    from lowcomm.elastic.predictor import AccuracyPredictor, rank_correlation

    space = scorer.net.space
    rng = random.Random(args.seed + 2)
    seen: dict[str, Config] = {}
    while len(seen) < args.predictor_samples:
        c = space.canonical(space.sample(rng))
        seen.setdefault(json.dumps(c, sort_keys=True), c)
    configs = list(seen.values())
    scores = [scorer.score(c) for c in configs]
    split = max(1, len(configs) * 4 // 5)
    predictor = AccuracyPredictor(space)
    predictor.fit(configs[:split], scores[:split], seed=args.seed)
    held = rank_correlation(predictor.predict(configs[split:]), scores[split:]) if len(configs) - split > 2 else None
    predictor.fit(configs, scores, seed=args.seed)  # then on every sample for the search
    return predictor, {"kind": "predictor", "samples": len(configs), "holdout_rank_correlation": held}


class _Recorder:
    """``fn`` with every ``(config, score)`` it returned kept: the candidates to verify."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.scored: dict[str, tuple[Config, float]] = {}

    def __call__(self, config: Config) -> float:
        value = float(self.fn(config))
        self.scored[json.dumps(config, sort_keys=True)] = (config, value)
        return value

    def under(self, table: Any, budget: float) -> list[tuple[Config, float]]:
        """The scored configs the table predicts within ``budget``."""
        return [cs for cs in self.scored.values() if table.predict(cs[0]) <= budget]


def _limit(args: argparse.Namespace, budget: float) -> float:
    """The predicted latency the search may use: the budget less ``--latency-margin``."""
    return budget * (1.0 - args.latency_margin)


def _answer(scorer: SubnetScorer, table: Any, config: Config, valid_score: float | None,
            args: argparse.Namespace, candidates: _Recorder, budget: float,
            direct: bool) -> dict[str, Any]:
    """One answer's row: verified by timing (``--verify``) and measured on the test set.

    ``valid_score``: ``config``'s held-out score, or None to measure it here (once, for the
    config finally chosen). ``direct``: the recorded scores are held-out scores (else
    predictions)."""
    from lowcomm.elastic.verify import verify_by_timing

    check: dict[str, Any] | None = None
    if args.verify:
        chosen, score, measured, rows = verify_by_timing(
            candidates.under(table, _limit(args, budget)), table.time_whole, budget, top=args.verify,
            max_timed=4 * args.verify)
        check = {"top": args.verify, "timed": len(rows),
                 "meets_budget": measured is not None, "changed_answer": chosen != config,
                 "rows": rows}
        if measured is None:
            print(f"lowcomm: warning: none of the {len(rows)} best candidates under {_limit(args, budget):.4g} ms "
                  f"(predicted) ran within {budget:g} ms when timed whole; keeping the fastest of them (a larger "
                  f"--latency-margin leaves room)", file=sys.stderr)
        config = chosen
        valid_score = score if direct else None
    if valid_score is None:
        valid_score = scorer.score(config)
    row: dict[str, Any] = {"config": config, "score": valid_score, "predicted_ms": table.predict(config),
                           "test": scorer.test(config)}
    if check is not None:
        row["measured_ms"] = next(r["measured_ms"] for r in check["rows"] if r["config"] == config)
        row["verify"] = check
    elif args.measure:
        row["measured_ms"] = table.time_whole([config])[0]  # timed as the table's units were
    return row


def search_budgets(args: argparse.Namespace, budgets: list[float]) -> dict[str, Any]:
    """The search (and the random baseline) for every budget; the JSON of ``elastic search``."""
    from lowcomm.elastic.latency import device_name
    from lowcomm.elastic.search import evolution_search, random_search

    if args.threads:
        torch.set_num_threads(args.threads)
    net, blob, bundle = load_for_search(args)
    shape = _shape(args.latency_shape) or tuple(bundle.input_shape)
    scorer = SubnetScorer(net, bundle, valid_size=args.valid_size, bn_batches=args.bn_batches,
                          batch_size=int(blob.get("batch_size", 64)), seed=args.seed)
    table = latency_table(args, net, shape)
    score_fn, score_info = score_function(args, scorer)
    rows = []
    for budget in budgets:
        rng = random.Random(args.seed)
        searched = _Recorder(score_fn)
        best, best_score, history = evolution_search(net.space, searched, table.predict, _limit(args, budget),
                                                     population=args.population, iterations=args.iterations,
                                                     rng=rng)
        direct = args.score == "direct"
        found = _answer(scorer, table, best, best_score if direct else None, args, searched, budget, direct)
        found["history"] = history
        row: dict[str, Any] = {"budget_ms": budget, "search": found}
        if args.random:
            drawn = _Recorder(scorer.score)
            rbest, rscore, _ = random_search(net.space, drawn, table.predict, _limit(args, budget), n=args.random,
                                             rng=random.Random(args.seed + 3))
            row["random"] = _answer(scorer, table, rbest, rscore, args, drawn, budget, True)
            key = "accuracy" if scorer.task == "classification" else "epe"
            better = (found["test"][key] > row["random"]["test"][key] if key == "accuracy"
                      else found["test"][key] < row["random"]["test"][key])
            row["search_beats_random_on_test"] = bool(better)
        rows.append(row)
    return {"command": "elastic search", "supernet": args.supernet, "model": blob["model"], "data": blob["data"],
            "sample_shape": list(shape), "device": device_name("cpu"), "threads": args.latency_threads,
            "latency_stat": args.latency_stat, "latency_repeats": args.latency_repeats,
            "latency_rounds": args.latency_rounds,
            "latency_table": args.latency_table, "latency_units_measured_lazily": table.measured_lazily,
            "score": score_info, "population": args.population, "iterations": args.iterations,
            "random_samples": args.random, "verify": args.verify, "latency_margin": args.latency_margin,
            "subnet_evaluations": scorer.evaluations, "budgets": rows}


def _check(args: argparse.Namespace) -> None:
    check_count("--population", args.population)
    check_count("--iterations", args.iterations)
    check_count("--random", args.random, minimum=0)
    check_count("--valid-size", args.valid_size)
    check_count("--bn-batches", args.bn_batches, minimum=0)
    check_count("--predictor-samples", args.predictor_samples, minimum=5)
    check_count("--latency-repeats", args.latency_repeats)
    check_count("--latency-rounds", args.latency_rounds)
    check_count("--latency-samples", args.latency_samples, minimum=0)
    if args.threads is not None:
        check_count("--threads", args.threads)
    check_count("--latency-threads", args.latency_threads)
    check_count("--verify", args.verify, minimum=0)
    if not 0.0 <= args.latency_margin < 1.0:
        raise UsageError(f"--latency-margin must be a fraction in [0, 1), got {args.latency_margin!r}")


def run_search(args: argparse.Namespace) -> int:
    """``lowcomm elastic search``."""
    _check(args)
    budgets = _float_list("--latency-ms", args.latency_ms)
    result = search_budgets(args, budgets)
    _write_json(args.json, result)
    if not args.quiet:
        _print_search(result)
    return 0


def run_extract(args: argparse.Namespace) -> int:
    """``lowcomm elastic extract``: ``--config`` or the search's answer under ``--latency-ms``."""
    from lowcomm.elastic.artifacts import load_supernet, save_subnet
    from lowcomm.elastic.cli import parse_config_spec

    _check(args)
    if (args.config is None) == (args.latency_ms is None):
        raise UsageError("give exactly one of --config (max, min, JSON) and --latency-ms")
    from lowcomm.runtime.config import check_writable

    check_writable("--out", args.out, is_dir=False)
    if args.latency_ms is not None:
        budgets = _float_list("--latency-ms", args.latency_ms)
        if len(budgets) != 1:
            raise UsageError("extract takes one --latency-ms budget")
        args.random = 0
        found = search_budgets(args, budgets)["budgets"][0]["search"]
        config = found["config"]
    else:
        net, _ = load_supernet(args.supernet)
        spec = parse_config_spec(args.config)
        config = (net.space.max_config() if spec == "max" else net.space.min_config() if spec == "min"
                  else net.space.validate(spec))  # type: ignore[arg-type]
    net, blob, bundle = load_for_search(args)
    scorer = SubnetScorer(net, bundle, valid_size=args.valid_size, bn_batches=args.bn_batches,
                          batch_size=int(blob.get("batch_size", 64)), seed=args.seed)
    sub = scorer.calibrated(net.extract(config))
    test = {k.removeprefix("test_"): v for k, v in evaluate(
        sub, bundle.test, task=scorer.task, dist_info=Dist(), batch_size=512, amp=None, target_is_input=False,
        max_disp=scorer.max_disp).items()}
    meta: dict[str, Any] = {k: blob[k] for k in ("model", "model_args", "data", "data_dir", "data_args", "seed") if k in blob}
    save_subnet(args.out, sub, config, {**meta, "supernet": args.supernet, "test": test})
    result = {"command": "elastic extract", "supernet": args.supernet, "config": config, "out": args.out,
              "params": sum(p.numel() for p in sub.parameters()), "test": test}
    _write_json(args.json, result)
    if not args.quiet:
        metric = (f"{100 * test['accuracy']:.2f} %" if "accuracy" in test else f"EPE {test['epe']:.3f} px")
        print(f"lowcomm elastic extract: {json.dumps(config)} -> {args.out} ({result['params']:,} parameters, "
              f"test {metric})")
    return 0


def _write_json(path: str | None, obj: dict[str, Any]) -> None:
    if path:
        from lowcomm.runtime.checkpoint import atomic_write_json

        atomic_write_json(obj, path)


def _print_search(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"lowcomm elastic search: {result['model']} ({result['device']}, "
                        f"{result['threads']} threads, input {tuple(result['sample_shape'])})")
    for col in ("budget (ms)", "answer", "predicted (ms)", "measured (ms)", "held-out score", "test"):
        table.add_column(col, justify="left" if col == "answer" else "right")
    for row in result["budgets"]:
        for label in ("search", "random"):
            if label not in row:
                continue
            r = row[label]
            test = r["test"]
            metric = f"{100 * test['accuracy']:.2f} %" if "accuracy" in test else f"EPE {test['epe']:.3f}"
            measured = f"{r['measured_ms']:.2f}" if "measured_ms" in r else "-"
            table.add_row(f"{row['budget_ms']:g}", label, f"{r['predicted_ms']:.2f}", measured,
                          f"{r['score']:.4f}", metric)
    Console().print(table)
