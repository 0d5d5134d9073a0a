"""The bench harness: validation before anything starts, failing methods, derived rows.

Most tests use a stand-in launcher that writes the summary a trainer would, so the harness
logic is tested in milliseconds; one test runs the real trainer end to end.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from lowcomm import methods
from lowcomm.bench import harness, netns, runner
from lowcomm.bench.cli import split_methods
from lowcomm.errors import UsageError

# per-method (iteration seconds, bytes per iteration, compress seconds) for the fake trainer
FAKE = {"nocomm": (0.2, 0.0, 0.0), "ssgd": (1.0, 8e6, 0.0), "fp16": (0.6, 4e6, 0.01)}


def fake_launcher(worker_args: list[str], nproc: int, **kw: Any) -> int:
    method = worker_args[worker_args.index("--method") + 1]
    path = Path(worker_args[worker_args.index("--json") + 1])
    if method not in FAKE:
        os.write(1, b"RuntimeError: worker blew up in backward\n")  # as a worker process would
        return 1
    it, b, comp = FAKE[method]
    path.write_text(json.dumps({
        "method": method, "iter_time_s_median": it, "bytes_per_worker_per_iter": b,
        "breakdown_s": {"forward": it / 3, "backward": it / 3, "compress": comp}, "history": [],
    }))
    return 0


def config(tmp_path: Path, methods: list[str], net: str = "none", **kw: Any) -> harness.BenchConfig:
    kw.setdefault("predict", False)
    return harness.BenchConfig(methods=methods, nets=[netns.parse_net(net)], nproc=2, model="cnn1d",
                               batch_size=16, work_dir=str(tmp_path), quiet=True, **kw)


def test_failing_method_becomes_a_failed_row_and_others_are_reported(tmp_path: Path) -> None:
    result = harness.run_bench(config(tmp_path, ["ssgd", "signum", "fp16"]), launcher=fake_launcher)
    rows = {r["method"]: r for r in result["runs"]}
    assert rows["signum"]["status"] == "failed"
    assert "worker blew up" in rows["signum"]["reason"]
    assert rows["ssgd"]["status"] == rows["fp16"]["status"] == "ok"
    assert rows["fp16"]["speedup_vs_ssgd"] == pytest.approx(1.0 / 0.6)
    bw = result["network"]["measured_bits_per_s"]
    assert rows["fp16"]["lower_bound_s"] == pytest.approx(max(0.2, 4e6 * 8 / bw) + 0.01)
    assert rows["nocomm"]["iter_time_s_median"] == 0.2  # compute-only reference measured first
    assert result["network"]["emulated"] is False


def test_unknown_method_is_refused_before_anything_runs() -> None:
    with pytest.raises(UsageError, match="unknown method.*'nosuch'.*valid:"):
        harness.validate_methods(["ssgd", "nosuch"])


def test_method_list_keeps_options_together() -> None:
    assert split_methods("ssgd,topk:density=0.01,k=2,fp16") == ["ssgd", "topk:density=0.01,k=2", "fp16"]


def test_world_size_the_machine_cannot_hold_is_refused() -> None:
    with pytest.raises(UsageError, match="CPU core"):
        harness.check_capacity(17, "cnn1d", cpus=2, available_bytes=10**12)
    with pytest.raises(UsageError, match="GB"):
        harness.check_capacity(4, "cnn1d", cpus=64, available_bytes=int(1e9))
    harness.check_capacity(4, "cnn1d", cpus=2, available_bytes=int(16e9))


def test_cli_refuses_unknown_method_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from lowcomm.cli import main

    assert main(["bench", "--methods", "ssgd,bogus", "--net", "none"]) == 2
    assert "bogus" in capsys.readouterr().err


@pytest.mark.skipif(netns.netns_support() is not None, reason="needs root and iproute2 for netns")
def test_unreachable_rate_marks_rows_failed_and_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "REACHABLE_FRACTION", 10.0)  # no link can reach 10x its rate
    result = harness.run_bench(config(tmp_path, ["ssgd"], net="100mbit"), launcher=fake_launcher)
    assert result["runs"][0]["status"] == "failed" and "unreachable" in result["runs"][0]["reason"]
    assert not [n for n in netns.list_namespaces() if n.startswith(f"lcb{os.getpid()}")]


def test_time_to_accuracy_mode_records_curves_per_method(tmp_path: Path) -> None:
    def tta_launcher(worker_args: list[str], nproc: int, **kw: Any) -> int:
        assert "--epochs" in worker_args and "--no-eval" not in worker_args
        path = Path(worker_args[worker_args.index("--json") + 1])
        hist = [{"event": "eval", "epoch": e, "wall_s": 2.0 * e, "test_accuracy": 0.3 + 0.1 * e} for e in (1, 2)]
        path.write_text(json.dumps({"iter_time_s_median": 0.1, "bytes_per_worker_per_iter": 1e3,
                                    "breakdown_s": {}, "history": hist}))
        return 0

    cfg = config(tmp_path, ["ssgd", "fp16"], epochs=2)
    result = harness.run_bench(cfg, launcher=tta_launcher)
    assert [r["method"] for r in result["runs"]] == ["ssgd", "fp16"]  # no nocomm run in this mode
    assert result["runs"][1]["accuracy_curve"] == [
        {"epoch": 1, "wall_s": 2.0, "test_accuracy": 0.4}, {"epoch": 2, "wall_s": 4.0, "test_accuracy": 0.5}]
    from lowcomm.bench import report

    names = [f.name for f in report.plot(result, tmp_path / "tta.png")]
    assert names == ["tta.png", "tta_accuracy.png"]


def test_real_workers_run_end_to_end_on_the_emulated_network(tmp_path: Path) -> None:
    """Two real `lowcomm train` workers (namespaces when root, loopback otherwise)."""
    cfg = harness.BenchConfig(methods=["ssgd"], nets=[netns.parse_net("100mbit")], nproc=2, model="mlp",
                              data="mnist1d", input_shape=None, batch_size=16, iters=2, warmup=1, threads=1,
                              compute_only=False, work_dir=str(tmp_path), quiet=True, timeout_s=120)
    result = harness.run_bench(cfg)
    run = result["runs"][0]
    assert run["status"] == "ok", run.get("reason")
    assert run["bytes_per_worker_per_iter"] > 0 and run["iter_time_s_median"] > 0
    assert run["speedup_vs_ssgd"] == pytest.approx(1.0)
    assert result["network"]["emulated"] is (netns.netns_support() is None)
    # the simulator's prediction, from a profile and a real probe of the gloo collectives
    coll = result["network"]["collectives"]
    assert not coll.get("error"), coll.get("error")
    assert coll["workers"] == 2 and coll["small_s"]["all_reduce"] > 0 and coll["large"]["all_gather"][1] > 0
    assert set(coll["beside_s"]) == {"all_reduce", "reduce_scatter", "all_gather"} and min(coll["beside_s"].values()) >= 0
    assert run["predicted_iter_time_s"] > 0 and run["prediction_error"] is not None
    assert run["predicted_bytes_per_worker_per_iter"] == pytest.approx(run["bytes_per_worker_per_iter"], rel=0.01)
    assert not [n for n in netns.list_namespaces() if n.startswith(f"lcb{os.getpid()}")]


def test_timing_runs_time_the_steady_state_unless_told_otherwise(tmp_path: Path) -> None:
    cfg = config(tmp_path, ["ssgd"], warmup=3)
    assert runner.timing_spec("powersgd:rank=2", cfg) == "powersgd:rank=2,start_iter=3"
    # the sparse codecs at their final density from the first timed step (no sparsity warm-up)
    assert runner.timing_spec("topk", cfg) == "topk:start_iter=3,sparsity_warmup=0"
    assert runner.timing_spec("gtopk:density=0.1", cfg) == "gtopk:density=0.1,start_iter=3,sparsity_warmup=0"
    assert runner.timing_spec("topk:start_iter=7", cfg) == "topk:start_iter=7,sparsity_warmup=0"
    assert runner.timing_spec("topk:sparsity_warmup=2,start_iter=7", cfg) == "topk:sparsity_warmup=2,start_iter=7"
    codec = methods.create(runner.timing_spec("topk", cfg)).options
    assert codec.sparsity_warmup == 0 and codec.start_iter == 3
    assert runner.timing_spec("ssgd", cfg) == "ssgd"
    assert runner.timing_spec("powersgd", config(tmp_path, ["ssgd"], epochs=1)) == "powersgd"
    # engine schedules: start_iter belongs to the chosen compressor, if it has one
    assert runner.timing_spec("wfbp", cfg) == "wfbp"
    assert runner.timing_spec("wfbp:compress=powersgd,rank=2", cfg) == "wfbp:compress=powersgd,rank=2,start_iter=3"
    assert runner.timing_spec("wfbp:compress=topk", cfg) == "wfbp:compress=topk,start_iter=3,sparsity_warmup=0"
    for spec in ("dear", "dear:compress=fp16", "lee18", "pufferfish"):
        methods.create(runner.timing_spec(spec, cfg))  # what the workers will parse is valid


def test_timing_runs_leave_out_the_steps_a_method_spends_measuring_itself(tmp_path: Path) -> None:
    cfg = config(tmp_path, ["ssgd"], warmup=3, iters=4)
    assert runner.timing_warmup("ssgd", cfg) == runner.timing_warmup("dear", cfg) == 3
    # mgwfbp profiles its layers before it plans the fusion; dear/lee18:tune=true time their trials
    assert runner.timing_warmup("mgwfbp", cfg) == methods.create("mgwfbp").warmup_steps() == 6
    assert runner.timing_warmup("mgwfbp:profile_iters=1", cfg) == 3  # the bench's own is larger
    assert runner.timing_warmup("dear:tune=true,tune_trials=3,tune_iters=2", cfg) == 3 * 4 + 1
    assert runner.timing_warmup("lee18:tune=true,tune_trials=3,tune_iters=2", cfg) == 3 * 4 + 1
    assert runner.timing_warmup("lee18", cfg) == 3
    args = runner.train_args(cfg, "mgwfbp", tmp_path / "m.json")
    assert args[args.index("--steps") + 1] == "10" and args[args.index("--warmup-steps") + 1] == "6"
    # time-to-accuracy runs train every step and keep the bench's warm-up
    tta = config(tmp_path, ["ssgd"], warmup=3, epochs=1)
    args = runner.train_args(tta, "mgwfbp", tmp_path / "m.json")
    assert args[args.index("--warmup-steps") + 1] == "3"
    result = harness.run_bench(config(tmp_path, ["ssgd"], warmup=3), launcher=fake_launcher)
    assert result["runs"][-1]["warmup_iters"] == 3


def test_timing_runs_leave_out_the_first_compressed_steps(tmp_path: Path) -> None:
    cfg = config(tmp_path, ["ssgd"], warmup=3, iters=4)
    first = runner.FIRST_COMPRESSED_STEPS
    assert first >= 2  # ACP-SGD alternates P- and Q-steps: the first of each is left out
    for spec in ("acpsgd", "powersgd", "topk", "signsgd", "wfbp:compress=qsgd", "lee18:compress=signsgd"):
        assert runner.timing_warmup(runner.timing_spec(spec, cfg), cfg) == 3 + first, spec
    assert runner.timing_warmup("topk:start_iter=7", cfg) == 7 + first  # an explicit start counts from there
    assert runner.timing_warmup("topk:start_iter=0", cfg) == 3  # the bench's own warm-up is longer
    # a start given as a duration resolves only in a run; timing runs always give a step count
    assert runner.timing_warmup("topk", cfg) == 3
    for spec in ("ssgd", "fp16", "dear", "nocomm"):  # nothing to compress: the bench's warm-up
        assert runner.timing_warmup(runner.timing_spec(spec, cfg), cfg) == 3, spec
    args = runner.train_args(cfg, runner.timing_spec("acpsgd", cfg), tmp_path / "a.json")
    assert args[args.index("--steps") + 1] == str(4 + 3 + first)
    assert args[args.index("--warmup-steps") + 1] == str(3 + first)
    result = harness.run_bench(config(tmp_path, ["acpsgd"], warmup=3), launcher=fake_launcher)
    row = next(r for r in result["runs"] if r["method"] == "acpsgd")  # (failed: the stand-in knows no codec)
    assert row["spec_run"] == "acpsgd:start_iter=3" and row["warmup_iters"] == 3 + first


def test_without_namespace_support_runs_on_loopback_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "netns_support", lambda: "network namespaces need root")
    result = harness.run_bench(config(tmp_path, ["ssgd"], net="100mbit"), launcher=fake_launcher)
    net = result["network"]
    assert net["emulated"] is False and "need root" in net["note"] and net["requested"] == "100mbit"
    assert net["measured_bits_per_s"] > 0  # the loopback link was still probed
    assert result["runs"][-1]["status"] == "ok"
    from lowcomm.bench import report

    assert "loopback, not emulated" in report.markdown(result)


def test_rows_get_the_simulators_prediction_calibrated_by_nocomm(tmp_path: Path) -> None:
    from lowcomm.bench import report
    from lowcomm.sim import LayerProfile, Profile

    prof = Profile(model="cnn1d", batch_size=16, optimizer_s=0.0,
                   layers=[LayerProfile("a", 0.01, 0.02, [[500, 1000]]), LayerProfile("b", 0.01, 0.01, [[1000]])])
    probe_calls = []

    def probe(cfg: harness.BenchConfig, cluster: Any, bits: float, work: Path) -> dict[str, Any]:
        probe_calls.append(bits)
        return {"workers": 2, "small_s": {"all_reduce": 2e-3}, "large": {"all_reduce": [4_000_000, 0.5]}}

    def launcher(worker_args: list[str], nproc: int, **kw: Any) -> int:
        method = worker_args[worker_args.index("--method") + 1]
        if method == "torch_fp16":
            Path(worker_args[worker_args.index("--json") + 1]).write_text(json.dumps(
                {"iter_time_s_median": 0.5, "bytes_per_worker_per_iter": 2e6, "breakdown_s": {}}))
            return 0
        return fake_launcher(worker_args, nproc, **kw)

    cfg = config(tmp_path, ["ssgd", "torch_fp16"], predict=True)
    result = harness.run_bench(cfg, launcher=launcher, profiler=lambda c: prof, collective_probe=probe,
                               contention_probe=lambda c, cluster: {"cpu_s_per_wire_byte": 0.0})
    rows = {r["method"]: r for r in result["runs"]}
    assert len(probe_calls) == 1
    pred = result["network"]["prediction"]
    assert pred["compute_scale"] == pytest.approx(0.2 / 0.05)  # nocomm measured 0.2 s, profile 0.05 s
    assert rows["nocomm"]["predicted_iter_time_s"] == pytest.approx(0.2)
    assert rows["nocomm"]["prediction_error"] == pytest.approx(0.0, abs=1e-9)
    ssgd = rows["ssgd"]
    # one bucket (2 MB < 25 MB, first bucket closes at 1 MiB: two buckets), all-reduces at the
    # fitted all-reduce cost; the prediction must at least exceed compute and match its own error
    assert ssgd["predicted_iter_time_s"] > 0.2
    assert ssgd["prediction_error"] == pytest.approx((ssgd["predicted_iter_time_s"] - 1.0) / 1.0)
    assert ssgd["predicted_bytes_per_worker_per_iter"] == pytest.approx(2 * 1 / 2 * 501000 * 4)
    # PyTorch's fp16 hook: lowcomm's fp16 payload, half of ssgd's bytes
    assert rows["torch_fp16"]["predicted_bytes_per_worker_per_iter"] == pytest.approx(
        ssgd["predicted_bytes_per_worker_per_iter"] / 2)
    md = report.markdown(result)
    assert "| pred ms | pred err |" in md and "simulator: profile compute x4.00" in md
    # each method's own limit: its schedule on a zero-latency link, never below the universal bound
    assert result["network"]["schedule_bound"]["network_model"]["alpha_s"] == 0.0
    assert ssgd["lower_bound_s"] <= ssgd["schedule_bound_s"] < ssgd["predicted_iter_time_s"]
    assert ssgd["schedule_bound_ratio"] == pytest.approx(1.0 / ssgd["schedule_bound_s"])
    assert rows["torch_fp16"]["schedule_bound_s"] > 0  # its schedule, the fp16 payload
    assert "| iter/bound | sched bound ms | iter/sched bound |" in md
    assert f"{ssgd['predicted_iter_time_s'] * 1e3:.1f}" in md


def test_a_failing_profile_leaves_the_bench_running_without_predictions(tmp_path: Path) -> None:
    def broken(cfg: harness.BenchConfig) -> Any:
        raise RuntimeError("no profile today")

    result = harness.run_bench(config(tmp_path, ["ssgd"], predict=True), launcher=fake_launcher, profiler=broken)
    assert "no profile today" in result["prediction"]["error"]
    assert all(r["status"] == "ok" and "predicted_iter_time_s" not in r for r in result["runs"])


def test_compute_only_is_measured_before_and_after_and_the_faster_run_is_the_reference(tmp_path: Path) -> None:
    nocomm_times = iter([0.5, 0.2])

    def launcher(worker_args: list[str], nproc: int, **kw: Any) -> int:
        if worker_args[worker_args.index("--method") + 1] != "nocomm":
            return fake_launcher(worker_args, nproc, **kw)
        it = next(nocomm_times)
        Path(worker_args[worker_args.index("--json") + 1]).write_text(json.dumps(
            {"iter_time_s_median": it, "bytes_per_worker_per_iter": 0.0, "breakdown_s": {"forward": it}}))
        return 0

    result = harness.run_bench(config(tmp_path, ["ssgd", "fp16"]), launcher=launcher)
    nocomm = [r for r in result["runs"] if r["method"] == "nocomm"]
    assert len(nocomm) == 1 and nocomm[0]["iter_time_s_median"] == 0.2 and nocomm[0]["nocomm_runs_s"] == [0.5, 0.2]
    assert [r["method"] for r in result["runs"]] == ["nocomm", "ssgd", "fp16"]
    assert all(r["compute_only_s"] == 0.2 for r in result["runs"])


# --- emulated nodes ----------------------------------------------------------------------------


@pytest.mark.parametrize(("nproc", "nodes", "per_node", "expect"), [
    (None, None, None, (4, None)), (6, None, None, (6, None)), (None, 2, 4, (8, 4)), (8, 2, 4, (8, 4)),
    (None, None, 2, (4, 2)), (8, 4, None, (8, 2)), (6, None, 3, (6, 3))])
def test_bench_layout_from_any_two_of_nproc_nodes_and_nproc_per_node(
        nproc: int | None, nodes: int | None, per_node: int | None, expect: tuple[int, int | None]) -> None:
    from lowcomm.bench.cli import node_layout

    assert node_layout(nproc, nodes, per_node) == expect


@pytest.mark.parametrize(("argv", "message"), [
    (["--nproc", "6", "--nodes", "2", "--nproc-per-node", "2"], "disagrees with --nodes 2 x --nproc-per-node 2"),
    (["--nproc", "6", "--nodes", "4"], "--nodes 4 does not divide 6 workers; valid: 1, 2, 3, 6"),
    (["--nodes", "2", "--nproc-per-node", "0"], "--nproc-per-node"),
])
def test_cli_refuses_a_node_layout_that_does_not_add_up(argv: list[str], message: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from lowcomm.cli import main

    assert main(["bench", *argv, "--methods", "ssgd"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_node_layout_reaches_the_launcher_and_every_row(tmp_path: Path) -> None:
    seen: list[Any] = []

    def launcher(worker_args: list[str], nproc: int, **kw: Any) -> int:
        seen.append((nproc, kw.get("nproc_per_node")))
        code = fake_launcher(worker_args, nproc, **kw)
        path = Path(worker_args[worker_args.index("--json") + 1])
        if code == 0:
            summary = json.loads(path.read_text())
            path.write_text(json.dumps({**summary, "inter_node_bytes_per_worker_per_iter": summary[
                "bytes_per_worker_per_iter"] / 2, "measured_tx_bytes_per_iter": 123.0}))
        return code

    cfg = harness.BenchConfig(methods=["ssgd"], nets=[netns.parse_net("none")], nproc=4, nproc_per_node=2,
                              model="cnn1d", batch_size=16, work_dir=str(tmp_path), quiet=True, predict=False)
    result = harness.run_bench(cfg, launcher=launcher)
    assert set(seen) == {(4, 2)}
    assert (result["nodes"], result["nproc_per_node"]) == (2, 2)
    row = next(r for r in result["runs"] if r["method"] == "ssgd")
    assert (row["nodes"], row["nproc_per_node"]) == (2, 2)
    assert row["inter_node_bytes_per_worker_per_iter"] == pytest.approx(4e6)
    # the node's interface is shared by its workers: its count is the node's, not a worker's
    assert row["measured_node_tx_bytes_per_iter"] == 123.0 and "measured_tx_bytes_per_iter" not in row


def test_without_a_node_layout_a_cluster_worker_is_its_own_node() -> None:
    opts = runner.launch_options(None, 29500)
    assert opts["nproc_per_node"] is None  # loopback: one node, as before nodes existed
    for per_node in (2, None):  # clusters not brought up: the layout only
        cluster = netns.Cluster(4, netns.parse_net("100mbit"), per_node or 1)
        cluster.addresses = ["198.18.0.1", "198.18.0.2"]
        assert runner.launch_options(cluster, 29500)["nproc_per_node"] == (per_node or 1)


def test_contention_is_measured_on_each_network_where_its_rows_run(tmp_path: Path) -> None:
    """The CPU a wire byte costs depends on the path (loopback, or veth + bridge + shaping at the
    link's rate), so the constant is measured per network, on that network's cluster, and each
    network's rows are predicted with their own."""
    from lowcomm.sim import LayerProfile, Profile

    prof = Profile(model="cnn1d", batch_size=16, optimizer_s=0.0,
                   layers=[LayerProfile("a", 0.01, 0.02, [[500, 1000]]), LayerProfile("b", 0.01, 0.01, [[1000]])])
    calls: list[Any] = []

    def contention(cfg: harness.BenchConfig, cluster: Any) -> dict[str, float]:
        calls.append(cluster)
        return {"cpu_s_per_wire_byte": 1e-9 * len(calls), "cpu_s_per_collective": 1e-3 * len(calls)}

    def probe(cfg: harness.BenchConfig, cluster: Any, bits: float, work: Path) -> dict[str, Any]:
        return {"workers": 2, "small_s": {"all_reduce": 2e-3}, "large": {"all_reduce": [4_000_000, 0.5]}}

    cfg = config(tmp_path, ["ssgd"], predict=True)
    cfg.nets = [netns.parse_net("none"), netns.parse_net("none")]
    result = harness.run_bench(cfg, launcher=fake_launcher, profiler=lambda c: prof, collective_probe=probe,
                               contention_probe=contention)
    assert calls == [None, None]  # loopback: no cluster to measure on
    ks = [info["prediction"]["contention_s_per_wire_byte"] for info in result["networks"]]
    assert ks == [pytest.approx(1e-9), pytest.approx(2e-9)]
    floors = [info["prediction"]["contention_s_per_collective"] for info in result["networks"]]
    assert floors == [pytest.approx(1e-3), pytest.approx(2e-3)]


def test_with_emulated_compute_the_codecs_are_timed_together_and_price_the_rows(tmp_path: Path) -> None:
    from lowcomm.sim import LayerProfile, Profile

    prof = Profile(model="cnn1d", batch_size=16, optimizer_s=0.0,
                   layers=[LayerProfile("a", 0.01, 0.02, [[500, 1000]]), LayerProfile("b", 0.01, 0.01, [[1000]])])
    calls: list[tuple[list[list[int]], int]] = []
    table = {"fp16": {"encode_s_per_elem": 1e-7, "decode_s_per_elem": 1e-7}}

    def compress_probe(shapes: list[list[int]], workers: int, **kw: Any) -> dict[str, dict[str, float]]:
        calls.append(([list(s) for s in shapes], workers))
        return table

    def probe(cfg: harness.BenchConfig, cluster: Any, bits: float, work: Path) -> dict[str, Any]:
        return {"workers": 2, "small_s": {"all_reduce": 2e-3}, "large": {"all_reduce": [4_000_000, 0.5]}}

    contention: list[Any] = []

    def contention_probe(cfg: harness.BenchConfig, cluster: Any) -> dict[str, float]:
        contention.append(cluster)  # measured for emulated compute too: it slows the host work
        return {"cpu_s_per_wire_byte": 0.0, "cpu_s_per_collective": 0.0}

    cfg = config(tmp_path, ["fp16"], predict=True, extra_train_args=["--compute", "emulated:scale=5"])
    result = harness.run_bench(cfg, launcher=fake_launcher, profiler=lambda c: prof, collective_probe=probe,
                               compress_probe=compress_probe, contention_probe=contention_probe)
    assert calls == [([[500, 1000], [1000]], 2)]  # the profiled model's gradients, one process per worker
    assert contention == [None]
    assert result["prediction"]["shared_compressors"] == table
    fp16 = next(r for r in result["runs"] if r["method"] == "fp16")
    assert fp16["predicted_breakdown_s"]["compress"] == pytest.approx(501000 * 2e-7)
    assert result["network"]["prediction"]["emulated_compressors"].startswith("measured with every worker")


def test_on_crowded_cores_the_kernel_bound_takes_each_workers_share_and_keeps_one_processs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lowcomm.bench import trained

    one = {"copy_bytes_per_s": 1e10, "matmul_flops_per_s": 1e11}
    shared = {"copy_bytes_per_s": 5e9, "matmul_flops_per_s": 5e10, "one_process": one, "workers_at_once": 2}
    monkeypatch.setattr(trained, "machine_rates", lambda threads, workers=1, cpus=None: shared)

    def launcher(worker_args: list[str], nproc: int, **kw: Any) -> int:
        code = fake_launcher(worker_args, nproc, **kw)
        path = Path(worker_args[worker_args.index("--json") + 1])
        path.write_text(json.dumps({**json.loads(path.read_text()), "grad_shapes": [[1000, 100]]}))
        return code

    result = harness.run_bench(config(tmp_path, ["fp16"]), launcher=launcher)
    fp16 = next(r for r in result["runs"] if r["method"] == "fp16")
    assert result["kernel_bound_rates"] is shared
    # fp16 reads 4 and writes 2 bytes per element to encode, as many to decode
    assert fp16["compress_bound_s"] == pytest.approx(12 * 100_000 / 5e9)
    assert fp16["compress_bound_one_process_s"] == pytest.approx(12 * 100_000 / 1e10)


def test_a_model_axis_reference_is_measured_before_and_after_too(tmp_path: Path) -> None:
    """Pufferfish's own compute (``pufferfish:then=nocomm``) is its bound's compute: one slow
    run of it put a row below its bound (docs/benchmarks.md, "Real compute, fourteenth run"),
    so it is measured twice, as ``nocomm`` is, and the faster run kept."""
    ref = "pufferfish:then=nocomm"
    ref_times = iter([0.45, 0.3])

    def launcher(worker_args: list[str], nproc: int, **kw: Any) -> int:
        method = worker_args[worker_args.index("--method") + 1]
        if method not in (ref, "pufferfish"):
            return fake_launcher(worker_args, nproc, **kw)
        it = next(ref_times) if method == ref else 0.8
        Path(worker_args[worker_args.index("--json") + 1]).write_text(json.dumps(
            {"iter_time_s_median": it, "bytes_per_worker_per_iter": 0.0, "breakdown_s": {"forward": it}}))
        return 0

    result = harness.run_bench(config(tmp_path, ["pufferfish", "ssgd"]), launcher=launcher)
    rows = {r["method"]: r for r in result["runs"]}
    assert [r["method"] for r in result["runs"]].count(ref) == 1
    assert rows[ref]["iter_time_s_median"] == 0.3 and rows[ref]["compute_runs_s"] == [0.45, 0.3]
    assert rows["pufferfish"]["compute_only_s"] == 0.3
