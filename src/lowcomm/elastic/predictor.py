"""Accuracy predictor: a small MLP from a config's one-hot encoding to its score.

Once-for-All scores thousands of candidate sub-networks during evolution; evaluating each on
held-out data (with BN re-calibration) costs seconds, so OFA trains a 3-layer MLP (hidden 400)
on a few thousand (config, accuracy) pairs and searches with it. Here the same on
``space.encode(config)``; the score is "higher is better" (accuracy, or -EPE for stereo). Targets
are standardized for training and restored on prediction, so one learning rate fits scores of
any scale. What matters for search is ranking, hence :func:`rank_correlation` for the report.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowcomm.elastic.space import Config, SearchSpace
from lowcomm.errors import UsageError

__all__ = ["AccuracyPredictor", "rank_correlation", "split_configs"]


class AccuracyPredictor:
    """MLP ``encode(config) -> score`` (``layers`` linear layers, ReLU between)."""

    def __init__(self, space: SearchSpace, *, hidden: int = 128, layers: int = 3) -> None:
        if hidden < 1 or layers < 1:
            raise UsageError(f"hidden and layers must be >= 1, got {hidden} and {layers}")
        self.space, self.hidden, self.layers = space, hidden, layers
        widths = [space.num_features] + [hidden] * (layers - 1) + [1]
        mods: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            mods.append(nn.Linear(a, b))
            if i < layers - 1:
                mods.append(nn.ReLU())
        self.net = nn.Sequential(*mods)
        self.mean, self.std = 0.0, 1.0

    def _features(self, configs: Sequence[Config]) -> torch.Tensor:
        return torch.tensor([self.space.encode(c) for c in configs], dtype=torch.float32)

    def fit(
        self,
        configs: Sequence[Config],
        scores: Sequence[float],
        epochs: int = 200,
        seed: int = 0,
        *,
        lr: float = 1e-3,
        batch_size: int = 64,
        weight_decay: float = 0.0,
    ) -> list[float]:
        """Train with MSE (Adam) on the pairs; returns the mean training loss per epoch.

        The loss is on standardized scores (mean 0, std 1 over ``scores``).
        """
        if len(configs) != len(scores) or not configs:
            raise UsageError(
                f"fit needs as many scores as configs (> 0), got {len(configs)} and {len(scores)}"
            )
        if epochs < 1 or batch_size < 1:
            raise UsageError(f"epochs and batch_size must be >= 1, got {epochs} and {batch_size}")
        ys = [float(s) for s in scores]
        if not all(math.isfinite(y) for y in ys):
            raise UsageError("scores must be finite numbers")
        gen = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for m in self.net:
                if isinstance(m, nn.Linear):
                    m.reset_parameters()
        x = self._features(configs)
        y = torch.tensor(ys, dtype=torch.float32)
        self.mean = float(y.mean())
        self.std = float(y.std()) if len(ys) > 1 and float(y.std()) > 0 else 1.0
        y = (y - self.mean) / self.std
        opt = torch.optim.Adam(self.net.parameters(), lr=lr, weight_decay=weight_decay)
        losses = []
        self.net.train()
        for _ in range(epochs):
            order = torch.randperm(len(ys), generator=gen)
            total = 0.0
            for start in range(0, len(ys), batch_size):
                idx = order[start:start + batch_size]
                loss = nn.functional.mse_loss(self.net(x[idx]).squeeze(-1), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += float(loss.detach()) * len(idx)
            losses.append(total / len(ys))
        self.net.eval()
        return losses

    def predict(self, configs: Sequence[Config]) -> list[float]:
        """Predicted scores (in the units of the training scores)."""
        if not configs:
            return []
        with torch.no_grad():
            out = self.net(self._features(configs)).squeeze(-1) * self.std + self.mean
        return [float(v) for v in out]

    def __call__(self, config: Config) -> float:
        """One config's predicted score: usable directly as a search ``score_fn``."""
        return self.predict([config])[0]

    def state(self) -> dict[str, Any]:
        """What :meth:`save` writes: weights, target scaling, architecture and the space."""
        return {
            "format": "lowcomm.elastic.predictor/1",
            "state_dict": self.net.state_dict(),
            "mean": self.mean,
            "std": self.std,
            "hidden": self.hidden,
            "layers": self.layers,
            "space": self.space.to_json(),
        }

    def save(self, path: str | Path) -> None:
        """``torch.save`` of :meth:`state`."""
        torch.save(self.state(), Path(path))

    @classmethod
    def load(cls, path: str | Path, space: SearchSpace | None = None) -> AccuracyPredictor:
        """Read a saved predictor; refuses one trained for a different ``space`` if given."""
        try:
            data = torch.load(Path(path), map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, ValueError) as exc:
            raise UsageError(f"cannot read accuracy predictor {path}: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != "lowcomm.elastic.predictor/1":
            raise UsageError(f"{path} is not a saved accuracy predictor")
        saved = SearchSpace.from_json(data["space"])
        if space is not None and space != saved:
            raise UsageError(f"the predictor in {path} was trained for {saved}, not {space}")
        pred = cls(saved, hidden=int(data["hidden"]), layers=int(data["layers"]))
        pred.net.load_state_dict(data["state_dict"])
        pred.net.eval()
        pred.mean, pred.std = float(data["mean"]), float(data["std"])
        return pred


def _ranks(xs: Sequence[float]) -> list[float]:
    """Ranks 1..n, ties given their average rank (as scipy.stats.rankdata)."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _pearson(a: Sequence[float], b: Sequence[float]) -> float:
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    va = sum((x - ma) ** 2 for x in a)
    vb = sum((y - mb) ** 2 for y in b)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else float("nan")


def _kendall_tau_b(a: Sequence[float], b: Sequence[float]) -> float:
    concordant = discordant = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                concordant += 1
            else:
                discordant += 1
    denom = math.sqrt((concordant + discordant + ties_a) * (concordant + discordant + ties_b))
    return (concordant - discordant) / denom if denom > 0 else float("nan")


def rank_correlation(
    predicted: Sequence[float], actual: Sequence[float], method: str = "kendall"
) -> float:
    """Kendall's tau-b (default) or Spearman's rho between two score lists.

    Computed here (O(n^2) Kendall, fine for the few hundred held-out configs of a report), the
    same values as ``scipy.stats.kendalltau``/``spearmanr``; NaN when one list is constant.
    """
    if len(predicted) != len(actual) or len(predicted) < 2:
        raise UsageError(
            f"rank_correlation needs two lists of equal length >= 2, got {len(predicted)} "
            f"and {len(actual)}"
        )
    a, b = [float(x) for x in predicted], [float(x) for x in actual]
    if method == "kendall":
        return _kendall_tau_b(a, b)
    if method == "spearman":
        return _pearson(_ranks(a), _ranks(b))
    raise UsageError(f"method must be 'kendall' or 'spearman', got {method!r}")


def split_configs(
    configs: Sequence[Config], holdout: float, seed: int = 0
) -> tuple[list[int], list[int]]:
    """Indices of a random train/held-out split (``holdout`` fraction held out, >= 1 each)."""
    if not 0.0 < holdout < 1.0 or len(configs) < 2:
        raise UsageError(f"holdout must be in (0, 1) with >= 2 configs, got {holdout}, {len(configs)}")
    order = list(range(len(configs)))
    random.Random(seed).shuffle(order)
    n_test = min(len(order) - 1, max(1, int(round(holdout * len(order)))))
    return order[n_test:], order[:n_test]
