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
from lowcomm.errors import UsageError
from lowcomm.methods.base import DDP_BUCKET_MB
from lowcomm.sim.network import NetworkModel
from lowcomm.sim.predict import Prediction, ddp_caps, predict_iteration_time
from lowcomm.sim.profile import Profile
from lowcomm.sim.schedules import SCHEDULES

#: A lossy method is recommended only if it beats the best exact one by more than this.
LOSSY_MARGIN = 0.05
#: Semi-synchronous methods (local steps between syncs) change the optimization more than a
#: payload compressor does (H local steps; the final loss must be checked), so they are a
#: separate branch of the advice, named only when they beat the recommended synchronous
#: method by more than this (predicted iteration time).
SEMI_SYNC_MARGIN = 0.2
#: the semi-synchronous methods the advice's separate branch tries, at their defaults
SEMI_SYNC = ("localsgd", "diloco", "streaming_diloco")


def candidates(profile: Profile | None = None) -> list[str]:
    """Methods the advisor compares: every advised schedule and every registered codec
    (``pufferfish`` only when ``profile`` is None or has a factorized model)."""
    schedules = [n for n, cls in SCHEDULES.items() if cls.advised and not getattr(cls, "semi_synchronous", False)]
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
    #: semi-synchronous methods predicted faster than :attr:`best` by SEMI_SYNC_MARGIN, fastest first
    semi_synchronous: list[Prediction] = field(default_factory=list)
    #: lee18 with model-parallel FC layers against data-parallel ones (:func:`model_parallel_fc`)
    fc: dict[str, Any] | None = None

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
            **({"semi_synchronous": [dict(p.as_dict(), speedup_vs_ssgd=self.speedup(p), caveat=caveat(p.method))
                                     for p in self.semi_synchronous]} if self.semi_synchronous else {}),
            **({"model_parallel_fc": self.fc} if self.fc is not None else {}),
        }


#: schedules the advisor simulates with ``tune=true`` when given without options
TUNED = ("dear", "lee18")


def advised_spec(method: str) -> str:
    """The spec the advisor simulates for ``method``: a :data:`TUNED` schedule named without
    options runs with its fusion tuner on."""
    return f"{method}:tune=true" if method in TUNED else method


def advise(profile: Profile, *, workers: int, network: NetworkModel,
           methods: tuple[str, ...] | list[str] | None = None, bucket_mb: float | None = None,
           semi_sync: bool = True) -> Advice:
    """Predict every applicable method and rank them by iteration time (fastest first).

    ``methods``: default :func:`candidates`. ``dear`` and ``lee18`` are simulated with their
    fusion tuner on (``dear:tune=true``) unless options are given: what a user who asks
    which method is fastest would run. ``semi_sync``: also try the semi-synchronous methods,
    reported apart (:attr:`Advice.semi_synchronous`).
    """
    specs = [advised_spec(m) for m in (methods or candidates())]
    cap, first = ddp_caps(bucket_mb)
    preds: list[Prediction] = []
    skipped: dict[str, str] = {}
    for m in specs:
        if m.split(":")[0] == "pufferfish" and profile.factorized is None:
            skipped[m] = "profile has no factorized model"
            continue
        preds.append(predict_iteration_time(profile, m, workers=workers, network=network,
                                            bucket_mb=cap, first_bucket_mb=first))
    baseline = next((p for p in preds if p.method == "ssgd"), None) or predict_iteration_time(
        profile, "ssgd", workers=workers, network=network, bucket_mb=cap, first_bucket_mb=first)
    preds.sort(key=lambda p: p.iter_time_s)
    adv = Advice(workers=workers, network=network.describe(), ranking=preds, baseline=baseline,
                 skipped=skipped)
    if any(p.method.startswith("lee18") for p in preds):
        adv.fc = model_parallel_fc(profile, workers=workers, network=network, bucket_mb=cap)
    if semi_sync:
        adv.semi_synchronous = _semi_synchronous(profile, adv, workers=workers, network=network)
    return adv


def _semi_synchronous(profile: Profile, adv: Advice, *, workers: int, network: NetworkModel) -> list[Prediction]:
    """The separate branch: :data:`SEMI_SYNC` methods that beat the synchronous recommendation
    by :data:`SEMI_SYNC_MARGIN` (fastest first); one too finely split for the profile is skipped."""
    out = []
    for m in SEMI_SYNC:
        try:
            p = predict_iteration_time(profile, m, workers=workers, network=network)
        except UsageError as e:
            adv.skipped[m] = str(e)
            continue
        if p.iter_time_s * (1 + SEMI_SYNC_MARGIN) < adv.best.iter_time_s:
            out.append(p)
    return sorted(out, key=lambda p: p.iter_time_s)


def model_parallel_fc(profile: Profile, *, workers: int, network: NetworkModel,
                      bucket_mb: float = DDP_BUCKET_MB) -> dict[str, Any] | None:
    """When Lee et al.'s model-parallel FC layers win: lee18 with every evenly splittable
    Linear model-parallel against all data-parallel, and the layers ``fc=auto`` picks at the
    profile's batch. None when the profile has no such layer. Model parallelism moves
    ``batch x (in + out)`` activations and errors per layer instead of ``in x out`` weights,
    so it wins for wide layers at small batches (VGG's head), not for small heads."""
    from lowcomm.sim.schedules.lee18_fc import model_parallel_layers

    layers = model_parallel_layers(profile, workers, "model_parallel", profile.batch_size)
    if not layers:
        return None
    dp, mp = (predict_iteration_time(profile, f"lee18:fc={fc}", workers=workers, network=network,
                                     bucket_mb=bucket_mb) for fc in ("data_parallel", "model_parallel"))
    auto = model_parallel_layers(profile, workers, "auto", profile.batch_size)
    names = [profile.layers[i].name for i in auto]
    wins = mp.iter_time_s < dp.iter_time_s
    return {
        "wins": wins,
        "auto_layers": names,
        "data_parallel_iter_time_s": dp.iter_time_s,
        "model_parallel_iter_time_s": mp.iter_time_s,
        "data_parallel_wire_bytes_per_worker": dp.wire_bytes_per_worker,
        "model_parallel_wire_bytes_per_worker": mp.wire_bytes_per_worker,
        "advice": (f"run lee18 with model-parallel FC layers ({', '.join(names) or 'all Linear layers'}): "
                   f"{dp.iter_time_s / mp.iter_time_s:.2f}x faster than data-parallel FC" if wins else
                   "keep FC layers data-parallel (lee18:fc=data_parallel): at this batch, moving "
                   "activations costs more than averaging the weights"),
    }
