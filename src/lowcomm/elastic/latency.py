"""Latency lookup table: predict a sub-network's run time from per-block measurements.

Once-for-All's efficiency predictor: timing every sub-network of a supernet is impossible (there
are billions), but a sub-network is a chain of pieces (stem, blocks, heads) whose cost depends
only on the piece's own config and input shape. So each distinct piece
(:class:`~lowcomm.elastic.supernet.LatencyUnit` key) is timed once, on the device the network will
run on, and a config's latency is the sum of its pieces. The whole network also pays a little
that no piece does (the top-level forward, allocator and cache effects); :meth:`LatencyTable.calibrate`
fits that as an overhead term (and optionally a scale) by least squares on a few networks timed
whole; :func:`validate` says, per unseen config, how far the prediction is from direct timing.

Keys the table has not seen (a config outside the sampled ones) are measured lazily the first
time :meth:`LatencyTable.predict` needs them; :attr:`LatencyTable.measured_lazily` counts them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lowcomm.elastic.latency_timer import (
    Timer,
    WallTimer,
    device_name,
    measure_network,
    time_interleaved,
)
from lowcomm.elastic.space import Config, SearchSpace
from lowcomm.errors import UsageError

if TYPE_CHECKING:  # only duck-typed here: anything with .space, latency_units() and extract()
    from lowcomm.elastic.supernet import LatencyUnit, Supernet

__all__ = ["LatencyTable", "Timer", "WallTimer", "measure_network", "validate", "device_name"]

FORMAT = "lowcomm.elastic.latency/1"
#: How :meth:`LatencyTable.calibrate` may correct the sum of unit times.
FITS = ("offset", "scale", "affine")


def _configs_from(
    supernet: Supernet, configs: SearchSpace | Sequence[Config], samples: int, seed: int
) -> list[Config]:
    if not isinstance(configs, SearchSpace):
        return [supernet.space.validate(c) for c in configs]
    if samples < 0:
        raise UsageError(f"samples must be >= 0, got {samples}")
    rng = random.Random(seed)
    # The extremes always: they bound every key's input widths and the search's range.
    return [configs.max_config(), configs.min_config()] + [
        configs.sample(rng) for _ in range(samples)
    ]


class LatencyTable:
    """Milliseconds per latency-unit key, measured on one device for one input shape.

    ``predict(config)`` needs the supernet (to split a config into units): :meth:`measure` keeps
    it; after :meth:`load`, pass it to ``load`` or :meth:`attach` it.
    """

    def __init__(
        self,
        sample_shape: Sequence[int],
        units: dict[str, float] | None = None,
        *,
        device: str = "cpu",
        repeats: int = 20,
        warmup: int = 5,
        threads: int | None = None,
        timer: Timer | None = None,
        supernet: Supernet | None = None,
        stat: str = "median",
        rounds: int = 1,
    ) -> None:
        self.sample_shape = tuple(int(s) for s in sample_shape)
        self.units: dict[str, float] = dict(units or {})
        self.device = device
        self.device_name = device_name(device)
        self.torch_version = torch.__version__
        self.threads = threads if threads is not None else torch.get_num_threads()
        self.repeats, self.warmup, self.stat = repeats, warmup, stat
        if rounds < 1:
            raise UsageError(f"rounds must be >= 1, got {rounds}")
        self.rounds = rounds
        self.timer: Timer = timer or WallTimer(repeats, warmup, threads, device, stat)
        self.overhead_ms = 0.0
        self.scale = 1.0
        self.calibration: list[dict[str, Any]] = []
        self.lazy_keys: list[str] = []
        self.supernet = supernet
        self.space_json: dict[str, Any] | None = supernet.space.to_json() if supernet else None

    @property
    def measured_lazily(self) -> int:
        """How many keys :meth:`predict` had to time because measure() had not seen them."""
        return len(self.lazy_keys)

    # ---- building -------------------------------------------------------------------------
    @classmethod
    def measure(
        cls,
        supernet: Supernet,
        configs: SearchSpace | Sequence[Config],
        sample_shape: Sequence[int],
        *,
        repeats: int = 20,
        warmup: int = 5,
        threads: int | None = None,
        samples: int = 20,
        seed: int = 0,
        device: str = "cpu",
        timer: Timer | None = None,
        calibrate: Sequence[Config] = (),
        fit: str = "offset",
        stat: str = "median",
        rounds: int = 1,
    ) -> LatencyTable:
        """Time every distinct unit key of ``configs`` once.

        ``configs`` is a list of configs (e.g. the ones sampled in training) or a SearchSpace,
        from which the max, the min and ``samples`` random configs (``seed``) are taken: all
        distinct keys of a space can be very many, and unseen ones are timed lazily later.
        ``calibrate``: configs to time whole and fit the overhead on (see :meth:`calibrate`).
        ``stat``: ``"median"`` or ``"min"`` of the repeats (see :class:`WallTimer`), and of the
        ``rounds``: every key is timed once per round, round-robin (see
        :func:`~lowcomm.elastic.latency_timer.time_interleaved`).
        """
        table = cls(
            sample_shape, device=device, repeats=repeats, warmup=warmup, threads=threads,
            timer=timer, supernet=supernet, stat=stat, rounds=rounds,
        )
        distinct: dict[str, LatencyUnit] = {}
        for config in _configs_from(supernet, configs, samples, seed):
            for unit in supernet.latency_units(config, table.sample_shape):
                distinct.setdefault(unit.key, unit)
        items = [(unit.build(), unit.inputs) for unit in distinct.values()]
        table.units.update(zip(distinct, time_interleaved(table.timer, items, rounds, stat)))
        if calibrate:
            table.calibrate(calibrate, fit=fit)
        return table

    def _time_unit(self, unit: LatencyUnit) -> float:
        return time_interleaved(self.timer, [(unit.build(), unit.inputs)], self.rounds, self.stat)[0]

    def time_whole(self, configs: Sequence[Config]) -> list[float]:
        """Each config's extracted network timed whole, as the units were (interleaved rounds)."""
        if self.supernet is None:
            raise UsageError("timing whole networks needs the supernet: pass it to load() or attach()")
        shapes = [(1, *self.sample_shape)]
        items = [(self.supernet.extract(c), shapes) for c in configs]
        return time_interleaved(self.timer, items, self.rounds, self.stat)

    def attach(self, supernet: Supernet) -> None:
        """Use ``supernet`` to split configs into units; refuses one of another search space."""
        theirs = supernet.space.to_json()
        if self.space_json is not None and theirs != self.space_json:
            raise UsageError(
                "the latency table was measured for another search space: "
                f"table {self.space_json}, supernet {theirs}"
            )
        self.supernet, self.space_json = supernet, theirs

    def _units_of(self, config: Config) -> list[LatencyUnit]:
        if self.supernet is None:
            raise UsageError("LatencyTable.predict needs the supernet: pass it to load() or attach()")
        return self.supernet.latency_units(self.supernet.space.validate(config), self.sample_shape)

    # ---- prediction -----------------------------------------------------------------------
    def unit_sum(self, config: Config) -> float:
        """Sum of the table's times of ``config``'s units (unseen keys timed now), ms."""
        total = 0.0
        for unit in self._units_of(config):
            if unit.key not in self.units:
                self.units[unit.key] = self._time_unit(unit)
                self.lazy_keys.append(unit.key)
            total += self.units[unit.key]
        return total

    def predict(self, config: Config) -> float:
        """Predicted latency of ``config`` in ms: scale * (sum of its units) + overhead."""
        return self.scale * self.unit_sum(config) + self.overhead_ms

    def calibrate(self, configs: Sequence[Config], *, fit: str = "offset") -> list[dict[str, Any]]:
        """Time ``configs``' extracted networks whole and fit ``measured ~ scale*sum + overhead``.

        ``fit="offset"`` fits the overhead only (scale 1; least squares of a constant = the mean
        gap), robust with 1-3 networks; ``"scale"`` fits the scale only (through the origin: a
        machine running uniformly slower or faster than when the units were timed); ``"affine"``
        fits both by least squares (needs >= 2 networks of different sizes, and amplifies their
        timing noise when they are few). Returns the calibration rows (also kept in the table).
        """
        if fit not in FITS:
            raise UsageError(f"fit must be one of {', '.join(FITS)}, got {fit!r}")
        if not configs:
            raise UsageError("calibrate needs at least one config to time whole")
        if self.supernet is None:
            raise UsageError("calibrate needs the supernet: pass it to load() or attach()")
        sums = [self.unit_sum(config) for config in configs]
        rows: list[dict[str, Any]] = [
            {"config": c, "sum_ms": x, "measured_ms": y}
            for c, x, y in zip(configs, sums, self.time_whole(configs))
        ]
        xs = [float(r["sum_ms"]) for r in rows]
        ys = [float(r["measured_ms"]) for r in rows]
        n, mean_x, mean_y = len(rows), sum(xs) / len(xs), sum(ys) / len(ys)
        var_x = sum((x - mean_x) ** 2 for x in xs)
        if fit == "affine" and n >= 2 and var_x > 0:
            self.scale = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var_x
            self.overhead_ms = mean_y - self.scale * mean_x
        elif fit == "affine":
            raise UsageError("fit='affine' needs >= 2 calibration networks of different latency")
        elif fit == "scale":
            self.scale, self.overhead_ms = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs), 0.0
        else:
            self.scale, self.overhead_ms = 1.0, mean_y - mean_x
        self.calibration = rows
        return rows

    def host_differences(self) -> list[str]:
        """What differs between where the table was measured and this process (empty: none)."""
        now = {
            "device": device_name(self.device),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        }
        was = {"device": self.device_name, "torch": self.torch_version, "threads": self.threads}
        return [f"{k}: table {was[k]!r}, here {now[k]!r}" for k in now if now[k] != was[k]]

    # ---- persistence ----------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """Everything needed to predict again elsewhere, plus where it was measured."""
        return {
            "format": FORMAT,
            "sample_shape": list(self.sample_shape),
            "device": self.device,
            "device_name": self.device_name,
            "torch": self.torch_version,
            "threads": self.threads,
            "repeats": self.repeats,
            "warmup": self.warmup,
            "stat": self.stat,
            "rounds": self.rounds,
            "allocator": getattr(self.timer, "allocator", "injected timer"),
            "overhead_ms": self.overhead_ms,
            "scale": self.scale,
            "space": self.space_json,
            "units": self.units,
            "lazy_keys": self.lazy_keys,
            "calibration": self.calibration,
        }

    def save(self, path: str | Path) -> None:
        """Write the table as JSON."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        sample_shape: Sequence[int] | None = None,
        supernet: Supernet | None = None,
        timer: Timer | None = None,
    ) -> LatencyTable:
        """Read a table; refuses one measured for another ``sample_shape`` or search space."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read latency table {path}: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise UsageError(f"{path} is not a latency table (format {FORMAT!r} expected)")
        shape = tuple(data["sample_shape"])
        if sample_shape is not None and tuple(sample_shape) != shape:
            raise UsageError(
                f"latency table {path} was measured for input shape {shape}, "
                f"not {tuple(sample_shape)}: measure a table for this shape"
            )
        table = cls(
            shape, {str(k): float(v) for k, v in data["units"].items()},
            device=data["device"], repeats=data["repeats"], warmup=data["warmup"],
            threads=data["threads"], timer=timer, stat=data.get("stat", "median"),
            rounds=int(data.get("rounds", 1)),
        )
        table.device_name, table.torch_version = data["device_name"], data["torch"]
        table.overhead_ms, table.scale = float(data["overhead_ms"]), float(data["scale"])
        table.space_json, table.lazy_keys = data["space"], list(data["lazy_keys"])
        table.calibration = list(data["calibration"])
        if supernet is not None:
            table.attach(supernet)
        return table


def validate(
    table: LatencyTable,
    supernet: Supernet,
    configs: Sequence[Config],
    sample_shape: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """Predicted vs directly measured latency of ``configs``' extracted networks.

    Rows ``{config, predicted_ms, measured_ms, rel_error, measured_lazily}``; ``rel_error`` is
    (predicted - measured) / measured; ``measured_lazily`` counts the keys this config added
    to the table (0: every unit was already known, a fair test of the lookup).
    """
    if sample_shape is not None and tuple(sample_shape) != table.sample_shape:
        raise UsageError(
            f"the table is for input shape {table.sample_shape}, not {tuple(sample_shape)}"
        )
    if table.supernet is not supernet:
        table.attach(supernet)
    rows = []
    predictions = []
    for config in configs:
        before = table.measured_lazily
        predictions.append((table.predict(config), table.measured_lazily - before))
    for config, (predicted, lazily), measured in zip(configs, predictions, table.time_whole(configs)):
        rows.append({
            "config": config,
            "predicted_ms": predicted,
            "measured_ms": measured,
            "rel_error": (predicted - measured) / measured if measured > 0 else float("inf"),
            "measured_lazily": lazily,
        })
    return rows
