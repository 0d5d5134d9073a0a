"""The CPU-contention model: its arithmetic, how the simulator charges it, and its probe."""

from __future__ import annotations

import pytest

from lowcomm.errors import UsageError
from lowcomm.sim import LayerProfile, NetworkModel, Profile, predict_iteration_time
from lowcomm.bench.contention import measure_contention
from lowcomm.sim.calibrate import fit_contention


def test_fit_contention_is_compute_time_lost_per_wire_byte() -> None:
    # 100 iterations/s alone; beside collectives 150 iterations took 2 s instead of 1.5 s
    k = fit_contention(alone_iters=100, alone_s=1.0, with_iters=150, with_s=2.0, wire_bytes_moved=1e8)
    assert k == pytest.approx(0.5 / 1e8, rel=1e-12)
    # faster beside collectives than alone (noise) is no negative cost
    assert fit_contention(alone_iters=100, alone_s=1.0, with_iters=300, with_s=2.0, wire_bytes_moved=1e8) == 0.0
    with pytest.raises(ValueError):
        fit_contention(alone_iters=0, alone_s=1.0, with_iters=1, with_s=1.0, wire_bytes_moved=1.0)


def _profile() -> Profile:
    return Profile(model="toy", batch_size=8, optimizer_s=1e-3,
                   layers=[LayerProfile(f"l{i}", 1e-2, 2e-2, [[1024, 256]]) for i in range(4)])


def test_simulator_charges_k_per_wire_byte_to_compute_and_nothing_without_it() -> None:
    net = NetworkModel.preset("10gbit")
    k = 2e-9
    plain = predict_iteration_time(_profile(), "ssgd", workers=4, network=net)
    loaded = predict_iteration_time(_profile(), "ssgd", workers=4, network=net.with_contention(k))
    assert plain.breakdown_s["contention"] == 0.0
    assert loaded.breakdown_s["contention"] == pytest.approx(k * loaded.wire_bytes_per_worker, rel=1e-9)
    assert loaded.wire_bytes_per_worker == plain.wire_bytes_per_worker
    # the wire is unchanged; compute got longer, so the iteration cannot get shorter
    assert loaded.breakdown_s["comm"] == pytest.approx(plain.breakdown_s["comm"], rel=1e-12)
    assert loaded.iter_time_s >= plain.iter_time_s
    assert predict_iteration_time(_profile(), "nocomm", workers=4, network=net.with_contention(k)
                                  ).iter_time_s == pytest.approx(plain.breakdown_s["forward"]
                                                                 + plain.breakdown_s["backward"] + 1e-3)


def test_contention_must_be_a_non_negative_number() -> None:
    with pytest.raises(UsageError):
        NetworkModel.preset("1gbit").with_contention(-1e-9)
    with pytest.raises(UsageError, match="cpu_s_per_collective"):
        NetworkModel.preset("1gbit").with_contention(1e-9, float("nan"))
    assert NetworkModel.preset("1gbit").with_contention(1e-9).describe()["cpu_s_per_wire_byte"] == 1e-9
    assert NetworkModel.preset("1gbit").with_contention(1e-9, 2e-3).describe()["cpu_s_per_collective"] == 2e-3


def test_a_collective_costs_at_least_the_per_collective_floor_and_large_ones_per_byte() -> None:
    net = NetworkModel.preset("10gbit").with_contention(2e-9, 1e-3)
    assert net.contention_s(1000) == 1e-3  # 2 µs per byte would say
    assert net.contention_s(10**7) == pytest.approx(2e-2)
    assert NetworkModel.preset("10gbit").contention_s(10**7) == 0.0


def test_per_layer_collectives_pay_the_floor_each_in_the_simulator() -> None:
    # wfbp: one all-reduce per layer of 256K params (1.5 MB on the wire at P = 4): per byte
    # 1.5 ms each; a 10 ms floor makes it 10 ms each, four of them
    net = NetworkModel.preset("10gbit")
    k = 1e-9
    per_byte = predict_iteration_time(_profile(), "wfbp", workers=4, network=net.with_contention(k))
    floored = predict_iteration_time(_profile(), "wfbp", workers=4, network=net.with_contention(k, 1e-2))
    assert per_byte.breakdown_s["contention"] == pytest.approx(k * per_byte.wire_bytes_per_worker, rel=1e-9)
    assert floored.breakdown_s["contention"] == pytest.approx(4 * 1e-2, rel=1e-9)


def test_a_callbacks_work_takes_compute_time_when_the_callback_runs() -> None:
    """Power-SGD's orthogonalization, Q product and decode run in its collectives' callbacks, on
    the comm chain; their seconds are charged to compute as well, on shared cores (a core) as
    without contention (a GPU's stream, emulated compute's device work), and not before the
    callback runs (an emulated ResNet-50 run had powersgd 10.5 % fast when they were free)."""
    from lowcomm.sim.predict import simulate
    from lowcomm.sim.profile import ComputeCosts

    prof = _profile()
    prof.costs = ComputeCosts(elementwise_s_per_elem=1e-9, matmul_s_per_flop=1e-11, orthogonalize_s_per_elem=1e-8)
    net = NetworkModel.preset("10gbit")
    spec = "powersgd:start_iter=0"
    for loaded in (net, net.with_contention(1e-30)):
        sim, _ = simulate(prof, spec, workers=4, network=loaded)
        side = [t for t in sim.tl.tasks if t.stream == "comm" and t.kind == "compress" and t.duration > 0]
        charged = {(t.name, t.iteration): t for t in sim.tl.tasks if t.kind == "contention" and t.name.startswith("cpu.")}
        assert side  # the decode and the round between the two all-reduces
        for t in side:
            cpu = charged[(f"cpu.{t.name}", t.iteration)]
            assert cpu.stream == "compute" and cpu.duration == pytest.approx(t.duration)
            assert cpu.start >= t.start  # when the callback runs, not when its collective was issued


def test_measure_contention_runs_on_two_workers() -> None:
    res = measure_contention(2, seconds=0.3, payload_mb=0.5, small_kb=16, matmul_n=64)
    assert res["workers"] == 2 and len(res["per_rank"]) == 2
    assert res["cpu_s_per_wire_byte"] >= 0.0 and res["cpu_s_per_collective"] >= 0.0
    assert res["small_payload_bytes"] == 16 * 1024
    assert all(r["all_reduces"] >= 3 and r["small_all_reduces"] >= 3 for r in res["per_rank"])


def test_with_emulated_compute_a_transfers_cpu_slows_only_the_host_work_beside_it() -> None:
    """Emulated layers wait and need no core; the codecs and the optimizer are CPU work of the
    process whose gloo threads move the bytes, so they progress at 1 - r while collectives
    taking r of a core per second run (8 workers on two cores: fp16 and PyTorch's fp16 hook
    were predicted 15-17 % fast without it)."""
    from lowcomm.sim.timeline import Timeline

    tl = Timeline()
    tl.host_kinds = frozenset({"compress"})
    tl.add("ar", "comm", 1.0, kind="comm", iteration=0, cpu_s=0.5)  # half a core for its whole second
    wait = tl.add("bwd", "compute", 0.25, kind="backward", iteration=0)
    assert wait.duration == pytest.approx(0.25)  # a wait: untouched
    enc = tl.add("enc", "compute", 0.5, kind="compress", iteration=0)
    # from 0.25 to 1.0 at half speed (0.375 s of work), the last 0.125 s at full speed
    assert (enc.start, enc.end) == (pytest.approx(0.25), pytest.approx(1.125))
    after = tl.add("dec", "compute", 0.5, kind="compress", iteration=0)
    assert after.duration == pytest.approx(0.5)  # nothing in flight any more
    assert Timeline().host_seconds(0.0, 0.3) == 0.3  # nothing placed: no change


def test_host_contention_lengthens_the_codecs_beside_transfers_and_not_the_layers() -> None:
    from lowcomm.sim.predict import simulate
    from lowcomm.sim.profile import ComputeCosts

    prof = _profile()
    prof.costs = ComputeCosts(elementwise_s_per_elem=1e-7)  # codecs long enough to meet transfers
    net = NetworkModel.from_probe(1e8, 1e-4)  # 100 Mbit/s: each bucket still in flight at the next encode
    host = net.with_contention(5e-9, on="host")
    assert host.describe()["contention_on"] == "host"
    plain = predict_iteration_time(prof, "fp16", workers=4, network=net, bucket_mb=1.0)
    loaded = predict_iteration_time(prof, "fp16", workers=4, network=host, bucket_mb=1.0)
    assert loaded.breakdown_s["compress"] > plain.breakdown_s["compress"]  # encodes beside transfers
    assert loaded.iter_time_s >= plain.iter_time_s
    for phase in ("forward", "backward"):
        assert loaded.breakdown_s[phase] == pytest.approx(plain.breakdown_s[phase])
    sim, _ = simulate(prof, "fp16", workers=4, network=host, bucket_mb=1.0)
    collectives = {t.name for t in sim.tl.tasks if t.kind == "comm"}
    assert all(t.cpu_s > 0 for t in sim.tl.tasks if t.kind == "comm")
    # carried by the collectives, not charged to the compute stream as with real compute
    assert not [t for t in sim.tl.tasks if t.kind == "contention" and t.name[len("cpu."):] in collectives]
    assert predict_iteration_time(prof, "nocomm", workers=4, network=host).iter_time_s == pytest.approx(
        predict_iteration_time(prof, "nocomm", workers=4, network=net).iter_time_s)
    with pytest.raises(UsageError, match="valid: compute, host"):
        net.with_contention(1e-9, on="gpu")
