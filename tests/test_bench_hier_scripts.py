"""The hierarchical benchmarks' scripts: the workload they build and the tables they render
(re-rendering a recorded JSON must not need a cluster)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def _script(name: str) -> ModuleType:
    path = REPO / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_resnet50_gradients_are_fused_into_ddp_buckets() -> None:
    hier = _script("hier_allreduce")
    sizes = hier.bucket_sizes("resnet50_imagenet", 25.0, 1.0, 1.0)
    assert sum(sizes) == 25_557_032  # every parameter once
    # DDP's rule: a bucket closes once it reaches its cap (1 MiB first, then 25 MiB); the last may not
    assert sizes[0] * 4 >= 1 << 20 and all(s * 4 >= 25 << 20 for s in sizes[1:-1])
    assert len(sizes) == 5


def _algs(flat: float, hier: float, hybrid: float) -> dict[str, dict[str, float]]:
    p_inter = {"flat": 1.5e8 / 2, "hier": 1e8 / 2, "hybrid": 1e8 / 2}
    return {a: {"median_s": t, "inter_node_bytes_per_worker_per_iter": p_inter[a], "correct": True,
                "hierarchical_buckets": 6} for a, t in (("flat", flat), ("hier", hier), ("hybrid", hybrid))}


def test_hier_table_puts_targets_limits_and_predictions_beside_the_figures() -> None:
    hier = _script("hier_allreduce")
    doc = {"machine": {"cpu": "Test CPU", "cpu_count": 2, "torch": "2"}, "params": 25.6e6, "buckets": 6, "iters": 10,
           "net": "1gbit", "layouts": {
               "2x2": {"status": "ok", "nodes": 2, "nproc_per_node": 2, "workers": 4, "bucket_elems": [1] * 6,
                       "network": {"emulated": True}, "algorithms": _algs(1.2, 0.8, 0.85),
                       "predicted_s": {"flat": 1.2, "hier": 0.85, "hybrid": 0.85}},
               "2x4": {"status": "failed", "nodes": 2, "nproc_per_node": 4, "error": "worker rank 3 failed"}}}
    table = hier.render(doc)
    assert "Test CPU, 2 cores" in table
    row = next(line for line in table.splitlines() if line.startswith("| 2x2 | hier |"))
    assert "1.50x | >= 1.3x met" in row and "1.50x (1.50x)" in row and "0.85 (1.41x)" in row
    assert "| 2x4 | failed: worker rank 3 failed" in table
    assert "4 workers shared the machine's 2 cores" in table


def test_hitopk_table_checks_the_one_over_g_target_against_topk() -> None:
    hb = _script("hitopk_bench")
    runs = [{"method": f"{m}:density=0.01", "status": "ok", "iter_time_s_median": t,
             "inter_node_bytes_per_worker_per_iter": b, "bytes_per_worker_per_iter": 2 * b}
            for m, t, b in (("topk", 0.5, 4e5), ("gtopk", 0.6, 3e5), ("hitopk", 0.4, 1e5))]
    result = {"machine": {"cpu": "Test CPU", "cpu_count": 2}, "nodes": 2, "nproc_per_node": 2, "world_size": 4,
              "network": {"emulated": True, "label": "1 Gbit/s", "measured_bits_per_s": 9.5e8}, "runs": runs,
              "bench_command": ["bench", "--nodes", "2"]}
    table = hb.render(result)
    row = next(line for line in table.splitlines() if line.startswith("| hitopk"))
    assert "| 1.25x |" in row and "met (0.250 <= 0.500)" in row
    assert "`lowcomm bench --nodes 2`" in table


@pytest.mark.parametrize("text", ["2x", "0x2", "2y2"])
def test_bad_layouts_are_refused(text: str) -> None:
    with pytest.raises(SystemExit, match="NODESxWORKERS"):
        _script("hier_allreduce").parse_layouts(text)
