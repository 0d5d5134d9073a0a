"""The latency lookup table's bookkeeping, with an injected timer (never a measured speed).

A fake supernet splits a config into units whose modules carry their "cost"; the fake timer
returns it and records what it timed, so the tests check the arithmetic (prediction = sum of
unit entries, + fitted overhead), that shared keys are timed once, lazy timing of unseen keys,
and the JSON round trip.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import nn

from lowcomm.elastic.latency import LatencyTable, WallTimer, measure_network, validate
from lowcomm.elastic.space import Config, Dimension, SearchSpace
from lowcomm.errors import UsageError

SHAPE = (1, 16)


@dataclass(frozen=True)
class Unit:
    key: str
    build: Callable[[], nn.Module]
    inputs: tuple[tuple[int, ...], ...]


class Costly(nn.Identity):
    def __init__(self, key: str, cost: float) -> None:
        super().__init__()
        self.key, self.cost = key, cost


class Net(nn.Sequential):
    """What the fake extract returns: its modules' costs plus a fixed 'whole network' overhead."""

    def __init__(self, units: list[Unit]) -> None:
        super().__init__(*[u.build() for u in units])


class FakeSupernet:
    """3 blocks with kernel {3,5,7}, depth {1,2,3} (first d blocks), a stem and a head."""

    def __init__(self) -> None:
        self.space = SearchSpace(
            [Dimension("kernel", (3, 5, 7), 3), Dimension("depth", (1, 2, 3), 1)],
            depth_groups=[[0, 1, 2]],
        )

    def latency_units(self, config: Config, sample_shape: Sequence[int]) -> list[Unit]:
        shape = (1, *sample_shape)

        def unit(key: str, cost: float) -> Unit:
            return Unit(key, lambda: Costly(key, cost), (shape,))

        units = [unit(f"stem{list(sample_shape)}", 1.0)]
        for i in range(config["depth"][0]):
            k = config["kernel"][i]
            # blocks 1 and 2 are identical modules at equal kernels: one key for both
            units.append(unit(f"block{min(i, 1)}-k{k}", k / 10))
        units.append(unit("head", 0.5))
        return units

    def extract(self, config: Config) -> nn.Module:
        return Net(self.latency_units(config, SHAPE))


class FakeTimer:
    def __init__(self, whole_overhead: float = 0.0) -> None:
        self.timed: list[str] = []
        self.whole_overhead = whole_overhead

    def __call__(self, module: nn.Module, input_shapes: Sequence[tuple[int, ...]]) -> float:
        if isinstance(module, Net):
            self.timed.append("net")
            return sum(m.cost for m in module) + self.whole_overhead
        assert isinstance(module, Costly) and list(input_shapes) == [(1, *SHAPE)]
        self.timed.append(module.key)
        return module.cost


def expected_sum(config: Config) -> float:
    return 1.0 + sum(k / 10 for k in config["kernel"][: config["depth"][0]]) + 0.5


def test_prediction_is_the_sum_of_the_unit_entries() -> None:
    net, timer = FakeSupernet(), FakeTimer()
    table = LatencyTable.measure(net, net.space, SHAPE, samples=10, timer=timer)
    rng = random.Random(3)
    for config in [net.space.max_config(), net.space.min_config()] + [net.space.sample(rng) for _ in range(10)]:
        assert table.predict(config) == pytest.approx(expected_sum(config))
        units = net.latency_units(config, SHAPE)
        assert table.predict(config) == pytest.approx(sum(table.units[u.key] for u in units))


def test_keys_shared_across_configs_are_timed_once() -> None:
    net, timer = FakeSupernet(), FakeTimer()
    configs = [{"kernel": [3, 5, 5], "depth": [3]}, {"kernel": [3, 5, 7], "depth": [2]},
               {"kernel": [5, 3, 3], "depth": [3]}]
    table = LatencyTable.measure(net, configs, SHAPE, timer=timer)
    assert sorted(timer.timed) == sorted(set(timer.timed))
    assert set(timer.timed) == {"stem[1, 16]", "head", "block0-k3", "block1-k5", "block0-k5", "block1-k3"}
    assert table.measured_lazily == 0


def test_an_unseen_key_is_timed_lazily_and_counted() -> None:
    net, timer = FakeSupernet(), FakeTimer()
    table = LatencyTable.measure(net, [{"kernel": [3, 3, 3], "depth": [1]}], SHAPE, timer=timer)
    assert table.predict({"kernel": [7, 7, 3], "depth": [2]}) == pytest.approx(1.0 + 1.4 + 0.5)
    assert table.measured_lazily == 2 and table.lazy_keys == ["block0-k7", "block1-k7"]
    table.predict({"kernel": [7, 7, 7], "depth": [3]})
    assert table.measured_lazily == 2  # nothing new


def test_calibration_fits_the_whole_network_overhead() -> None:
    net, timer = FakeSupernet(), FakeTimer(whole_overhead=0.25)
    space = net.space
    table = LatencyTable.measure(net, space, SHAPE, samples=5, timer=timer,
                                 calibrate=[space.max_config(), space.min_config()])
    assert table.overhead_ms == pytest.approx(0.25) and table.scale == 1.0
    rows = validate(table, net, [space.sample(random.Random(i)) for i in range(5)])
    assert all(abs(r["rel_error"]) < 1e-9 for r in rows)
    assert {"config", "predicted_ms", "measured_ms", "rel_error", "measured_lazily"} <= set(rows[0])
    # affine: measured = 2 * sum + 1 is recovered exactly
    timer2 = FakeTimer()
    table2 = LatencyTable.measure(net, space, SHAPE, samples=0, timer=timer2)

    def doubled(module: nn.Module, shapes: Sequence[tuple[int, ...]]) -> float:
        base = timer2(module, shapes)
        return 2 * base + 1.0 if isinstance(module, Net) else base

    table2.timer = doubled
    table2.calibrate([space.max_config(), space.min_config()], fit="affine")
    assert table2.scale == pytest.approx(2.0) and table2.overhead_ms == pytest.approx(1.0)
    with pytest.raises(UsageError, match="affine"):
        table2.calibrate([space.max_config()], fit="affine")


def test_save_load_round_trip_and_refuses_another_shape(tmp_path) -> None:
    net = FakeSupernet()
    table = LatencyTable.measure(net, net.space, SHAPE, samples=4, timer=FakeTimer(), threads=1)
    table.overhead_ms = 0.125
    path = tmp_path / "lut.json"
    table.save(path)
    data = json.loads(path.read_text())
    assert data["threads"] == 1 and data["torch"] == torch.__version__ and data["device_name"]
    again = LatencyTable.load(path, sample_shape=SHAPE, supernet=net, timer=FakeTimer())
    assert again.units == table.units
    config = net.space.max_config()
    assert again.predict(config) == table.predict(config)
    with pytest.raises(UsageError, match=r"measured for input shape \(1, 16\), not \(1, 32\)"):
        LatencyTable.load(path, sample_shape=(1, 32))
    other = FakeSupernet()
    other.space = SearchSpace([Dimension("kernel", (3, 5), 3), Dimension("depth", (1, 2, 3), 1)])
    with pytest.raises(UsageError, match="another search space"):
        LatencyTable.load(path, supernet=other)
    with pytest.raises(UsageError, match="needs the supernet"):
        LatencyTable.load(path).predict(config)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UsageError, match="not a latency table"):
        LatencyTable.load(tmp_path / "bad.json")


def test_wall_timer_runs_in_eval_mode_and_restores_threads_and_mode() -> None:
    seen = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((self.training, torch.is_grad_enabled(), torch.get_num_threads(), x.shape))
            return x

    before = torch.get_num_threads()
    probe = Probe().train()
    ms = WallTimer(repeats=3, warmup=1, threads=1)(probe, [(1, *SHAPE)])
    assert ms >= 0 and len(seen) == 4
    assert all(s == (False, False, 1, torch.Size([1, 1, 16])) for s in seen)
    assert probe.training and torch.get_num_threads() == before
    assert measure_network(probe, SHAPE, 2, warmup=0) >= 0
    with pytest.raises(UsageError, match="repeats"):
        WallTimer(repeats=0)


def test_min_stat_is_recorded_and_bad_stats_refused(tmp_path) -> None:
    net = FakeSupernet()
    table = LatencyTable.measure(net, net.space, SHAPE, samples=0, timer=FakeTimer(), stat="min")
    table.save(tmp_path / "t.json")
    assert LatencyTable.load(tmp_path / "t.json").stat == "min"
    assert WallTimer(repeats=2, warmup=0, stat="min")(nn.Identity(), [(1, 4)]) >= 0
    with pytest.raises(UsageError, match="stat must be one of"):
        WallTimer(stat="mean")


def _size(module: nn.Module, shapes: Sequence[tuple[int, ...]]) -> float:
    """A deterministic stand-in for time: parameters + buffers of what is timed."""
    return float(sum(p.numel() for p in module.parameters()) + sum(b.numel() for b in module.buffers()))


def test_elastic_cnn1d_units_add_up_to_the_extracted_network() -> None:
    from lowcomm.elastic.classifier import elastic_cnn1d

    net = elastic_cnn1d()
    space = net.space
    table = LatencyTable.measure(net, space, (40,), samples=3, timer=_size)
    rows = validate(table, net, [space.sample(random.Random(i)) for i in range(4)] + [space.min_config()])
    # every module of extract(config) is in exactly one unit: the "times" add up exactly
    assert all(r["rel_error"] == 0.0 for r in rows)
    assert rows[-1]["measured_lazily"] == 0  # the min config was measured up front


def test_real_timer_smoke_on_elastic_cnn1d(tmp_path) -> None:
    from lowcomm.elastic.classifier import elastic_cnn1d

    net = elastic_cnn1d()
    config = net.space.min_config()
    table = LatencyTable.measure(net, [config], (40,), repeats=1, warmup=0, threads=1, stat="min")
    assert table.predict(config) > 0 and table.threads == 1
    table.save(tmp_path / "t.json")
    again = LatencyTable.load(tmp_path / "t.json", sample_shape=(40,), supernet=net)
    assert again.predict(config) == table.predict(config)
    assert measure_network(net.extract(config), (40,), 1, warmup=0) > 0


class SpellTimer(FakeTimer):
    """A FakeTimer whose every call in ``slow_calls`` (by call index) takes 3x: a slow spell."""

    def __init__(self, slow_calls: set[int]) -> None:
        super().__init__()
        self.slow_calls, self.calls = slow_calls, 0

    def __call__(self, module: nn.Module, input_shapes: Sequence[tuple[int, ...]]) -> float:
        ms = super().__call__(module, input_shapes)
        self.calls += 1
        return 3 * ms if self.calls - 1 in self.slow_calls else ms


def test_rounds_time_every_key_round_robin_and_reject_a_slow_spell(tmp_path) -> None:
    net = FakeSupernet()
    configs = [{"kernel": [3, 5, 7], "depth": [3]}]
    timer = SpellTimer(slow_calls={0, 1, 2, 3, 4})  # the whole first round is slow
    table = LatencyTable.measure(net, configs, SHAPE, timer=timer, rounds=3, stat="min")
    # round-robin: each round visits every distinct key once, in the same order
    assert timer.timed[:5] == timer.timed[5:10] == timer.timed[10:15] and len(timer.timed) == 15
    assert set(timer.timed) == {"stem[1, 16]", "block0-k3", "block1-k5", "block1-k7", "head"}
    assert table.predict(configs[0]) == pytest.approx(expected_sum(configs[0]))
    table.save(tmp_path / "t.json")
    assert LatencyTable.load(tmp_path / "t.json").rounds == 3
    with pytest.raises(UsageError, match="rounds must be >= 1"):
        LatencyTable.measure(net, configs, SHAPE, timer=FakeTimer(), rounds=0)


def test_validation_times_networks_in_the_same_interleaved_rounds() -> None:
    net = FakeSupernet()
    space = net.space
    configs = [space.max_config(), space.min_config()]
    timer = SpellTimer(slow_calls=set())
    table = LatencyTable.measure(net, configs, SHAPE, timer=timer, rounds=2, stat="min")
    timer.timed.clear()
    timer.slow_calls = {timer.calls}  # the first whole-network timing is slow
    rows = validate(table, net, configs)
    assert timer.timed == ["net", "net", "net", "net"]
    assert all(abs(r["rel_error"]) < 1e-9 for r in rows)


def test_scale_fit_goes_through_the_origin() -> None:
    net, timer = FakeSupernet(), FakeTimer()
    space = net.space
    table = LatencyTable.measure(net, space, SHAPE, samples=0, timer=timer)

    def slower(module: nn.Module, shapes: Sequence[tuple[int, ...]]) -> float:
        base = timer(module, shapes)
        return 1.5 * base if isinstance(module, Net) else base

    table.timer = slower
    table.calibrate([space.max_config(), space.min_config(), space.sample(random.Random(1))], fit="scale")
    assert table.scale == pytest.approx(1.5) and table.overhead_ms == 0.0
    with pytest.raises(UsageError, match="fit must be one of offset, scale, affine"):
        table.calibrate([space.max_config()], fit="ratio")


def test_the_cpu_timer_keeps_memory_steady_and_the_table_records_how(tmp_path) -> None:
    from lowcomm.elastic.latency_timer import steady_allocator

    first = steady_allocator()
    assert first == steady_allocator()  # once per process
    assert first.startswith(("glibc:", "system default"))
    assert WallTimer(repeats=1, warmup=0).allocator == first
    net = FakeSupernet()
    LatencyTable.measure(net, net.space, SHAPE, samples=0, timer=FakeTimer()).save(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())["allocator"] == "injected timer"
