"""Sweep methods and worker counts; pick the fastest method and say what it may cost in accuracy.

The candidates are read from the registries, not listed here: ``ssgd``, the engine
schedules, every registered codec (:data:`lowcomm.compress.codec.CODECS`) and
``pufferfish``, so a new compressor is advised the day it registers. The caveats are the
conditions under which each method is known to keep accuracy, declared where the method is
(``Codec.caveat``, ``Schedule.caveat``); the simulator predicts speed only, never accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lowcomm.compress.codec import CODECS, codec_class
from lowcomm.sim.network import NetworkModel
from lowcomm.sim.predict import Prediction, predict_iteration_time
from lowcomm.sim.profile import Profile
from lowcomm.sim.schedules import SCHEDULES

#: A lossy method is recommended only if it beats the best exact one by more than this.
LOSSY_MARGIN = 0.05


def candidates(profile: Profile | None = None) -> list[str]:
    """Methods the advisor compares: every advised schedule and every registered codec
    (``pufferfish`` only when ``profile`` is None or has a factorized model)."""
    schedules = [n for n, cls in SCHEDULES.items() if cls.advised]
    pufferfish = [n for n in schedules if n == "pufferfish"]
    out = [n for n in schedules if n not in pufferfish] + CODECS.names() + pufferfish
    if profile is not None and profile.factorized is None:
        out = [n for n in out if n not in pufferfish]
    return out


def _parts(spec: str) -> tuple[str, str | None]:
    """(method name, codec carried or None) of a method spec."""
    name, _, opts = spec.partition(":")
    name = name.strip()
    if name in CODECS and name not in SCHEDULES:
        return name, name
    for item in opts.split(","):
        key, _, value = item.partition("=")
        if key.strip() == "compress" and value.strip().lower() not in ("", "none"):
            return name, value.strip().lower()
    return name, None


def is_exact(spec: str) -> bool:
    """Same updates as synchronous SGD: an exact schedule carrying no codec."""
    name, codec = _parts(spec)
    cls = SCHEDULES.get(name)
    return codec is None and cls is not None and cls.exact


def caveat(spec: str) -> str:
    """What the method may cost in accuracy: its schedule's and its codec's caveats."""
    name, codec = _parts(spec)
    texts = []
    if name in SCHEDULES:
        texts.append(SCHEDULES[name].caveat)
    if codec is not None and codec in CODECS:
        texts.append(codec_class(codec).caveat)
    return " ".join(t for t in texts if t)


@dataclass
class Advice:
    """The ranking at one scale and the recommendation drawn from it."""

    workers: int
    network: dict[str, Any]
    ranking: list[Prediction]
    baseline: Prediction
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def best(self) -> Prediction:
        """The fastest method, unless an exact one is within :data:`LOSSY_MARGIN` of it."""
        fastest = self.ranking[0]
        exact = next((p for p in self.ranking if is_exact(p.method)), None)
        if exact is not None and exact.iter_time_s <= fastest.iter_time_s * (1 + LOSSY_MARGIN):
            return exact
        return fastest

    def speedup(self, p: Prediction) -> float:
        """Predicted speed-up of ``p`` over ``ssgd`` at the same scale."""
        return self.baseline.iter_time_s / p.iter_time_s

    def as_dict(self) -> dict[str, Any]:
        """JSON form (``lowcomm advise --json``)."""
        return {
            "workers": self.workers,
            "network": self.network,
            "recommended": self.best.method,
            "predicted_speedup_vs_ssgd": self.speedup(self.best),
            "caveat": caveat(self.best.method),
            "ranking": [dict(p.as_dict(), speedup_vs_ssgd=self.speedup(p), caveat=caveat(p.method))
                        for p in self.ranking],
            "skipped": self.skipped,
        }


def advise(profile: Profile, *, workers: int, network: NetworkModel,
           methods: tuple[str, ...] | list[str] | None = None, bucket_mb: float = 25.0) -> Advice:
    """Predict every applicable method and rank them by iteration time (fastest first).

    ``methods``: default :func:`candidates`. ``dear`` is simulated with its tuner on
    (``dear:tune=true``) unless options are given.
    """
    specs = ["dear:tune=true" if m == "dear" else m for m in (methods or candidates())]
    preds: list[Prediction] = []
    skipped: dict[str, str] = {}
    for m in specs:
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
