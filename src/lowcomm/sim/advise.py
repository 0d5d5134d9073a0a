"""Sweep methods and worker counts; pick the fastest method and say what it may cost in accuracy.

The caveats are the conditions under which each method is known to keep accuracy (from the
method papers and the project's own MNIST-1D benchmark when its results are in
``docs/``); the simulator predicts speed only, never accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lowcomm.sim.network import NetworkModel
from lowcomm.sim.predict import Prediction, predict_iteration_time
from lowcomm.sim.profile import Profile

#: Methods the advisor considers (nocomm is a measurement baseline, not a training method).
CANDIDATES = ("ssgd", "fp16", "bf16", "wfbp", "mgwfbp", "dear", "lee18", "powersgd", "acpsgd",
              "signsgd", "signum", "topk", "gtopk", "pufferfish")

#: Methods whose updates equal ssgd's (scheduling only).
EXACT = ("ssgd", "wfbp", "mgwfbp", "dear", "lee18")
#: A lossy method is recommended only if it beats the best exact one by more than this.
LOSSY_MARGIN = 0.05

CAVEATS: dict[str, str] = {
    "ssgd": "exact synchronous SGD: the accuracy reference.",
    "fp16": "fp16 gradients can overflow/underflow without loss scaling; usually accuracy-neutral.",
    "bf16": "bf16 keeps fp32's range but only 8 bits of mantissa; usually accuracy-neutral.",
    "wfbp": "same updates as ssgd (scheduling only).",
    "mgwfbp": "same updates as ssgd (scheduling only).",
    "dear": "same updates as ssgd (scheduling only); the update is applied in the next "
            "forward, so evaluation/checkpoints need a flush.",
    "lee18": "same updates as ssgd; optimizer state is sharded across workers.",
    "powersgd": "lossy: needs error feedback (on by default) and a few full-precision warm-up "
                "steps (start_iter); too small a rank can cost accuracy.",
    "acpsgd": "lossy like Power-SGD: needs error feedback and warm-up steps; alternating P/Q "
              "converges slightly differently, check the rank on your task.",
    "signsgd": "1-bit: needs error feedback to converge like SGD; traffic grows with P "
               "(all-gather).",
    "signum": "majority vote without error feedback: may lose accuracy, tune the momentum; "
              "traffic grows with P (all-gather).",
    "topk": "sparse: needs error feedback; very low density slows convergence; traffic grows "
            "with P (all-gather).",
    "gtopk": "global top-k: needs error feedback; keeps only k values worldwide per step.",
    "pufferfish": "trains a smaller low-rank model: needs full-rank warm-up epochs and may lose "
                  "some accuracy versus the full model.",
}


@dataclass
class Advice:
    workers: int
    network: dict[str, Any]
    ranking: list[Prediction]
    baseline: Prediction
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def best(self) -> Prediction:
        """The fastest method, unless an exact one is within :data:`LOSSY_MARGIN` of it."""
        fastest = self.ranking[0]
        exact = next((p for p in self.ranking if p.method.split(":")[0] in EXACT), None)
        if exact is not None and exact.iter_time_s <= fastest.iter_time_s * (1 + LOSSY_MARGIN):
            return exact
        return fastest

    def speedup(self, p: Prediction) -> float:
        return self.baseline.iter_time_s / p.iter_time_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "network": self.network,
            "recommended": self.best.method,
            "predicted_speedup_vs_ssgd": self.speedup(self.best),
            "caveat": CAVEATS.get(self.best.method.split(":")[0], ""),
            "ranking": [dict(p.as_dict(), speedup_vs_ssgd=self.speedup(p),
                             caveat=CAVEATS.get(p.method.split(":")[0], ""))
                        for p in self.ranking],
            "skipped": self.skipped,
        }


def advise(profile: Profile, *, workers: int, network: NetworkModel,
           methods: tuple[str, ...] | list[str] = CANDIDATES, bucket_mb: float = 25.0) -> Advice:
    """Predict every applicable method and rank them by iteration time (fastest first).

    ``dear`` is simulated with its tuner on (``dear:tune=true``) unless options are given.
    """
    methods = ["dear:tune=true" if m == "dear" else m for m in methods]
    preds: list[Prediction] = []
    skipped: dict[str, str] = {}
    for m in methods:
        if m.split(":")[0] == "pufferfish" and profile.factorized is None:
            skipped[m] = "profile has no factorized model"
            continue
        preds.append(predict_iteration_time(profile, m, workers=workers, network=network,
                                            bucket_mb=bucket_mb))
    baseline = next((p for p in preds if p.method == "ssgd"), None) or predict_iteration_time(
        profile, "ssgd", workers=workers, network=network, bucket_mb=bucket_mb)
    preds.sort(key=lambda p: p.iter_time_s)
    return Advice(workers=workers, network=network.describe(), ranking=preds, baseline=baseline,
                  skipped=skipped)
