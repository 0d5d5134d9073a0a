"""The lower bound and the derived bench columns."""

from __future__ import annotations

import pytest

from lowcomm.bench import bounds


def test_wire_time_is_bytes_times_eight_over_bandwidth() -> None:
    assert bounds.wire_time_s(12.5e6, 100e6) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        bounds.wire_time_s(1, 0)


def test_lower_bound_is_max_of_compute_and_wire_plus_compression() -> None:
    # communication-bound: 44.7 MB (ResNet-18 fp32 all-reduce) at 100 Mbit/s = 3.576 s
    assert bounds.lower_bound_s(compute_only_s=0.8, bytes_per_iter=44.7e6, bits_per_s=100e6,
                                compress_s=0.1) == pytest.approx(3.576 + 0.1)
    # compute-bound: the same bytes at 10 Gbit/s take 35.8 ms < 0.8 s of compute
    assert bounds.lower_bound_s(compute_only_s=0.8, bytes_per_iter=44.7e6, bits_per_s=10e9) == pytest.approx(0.8)


def test_derive_fills_speedup_samples_and_bound_ratio() -> None:
    run = {"method": "powersgd", "iter_time_s_median": 0.5, "bytes_per_worker_per_iter": 1.25e6,
           "breakdown_s": {"forward": 0.1, "backward": 0.2, "compress": 0.05}}
    out = bounds.derive(run, batch_size=32, world_size=4, bits_per_s=100e6, compute_only_s=0.3, ssgd_iter_s=2.0)
    assert out["samples_per_s"] == pytest.approx(128 / 0.5)
    assert out["speedup_vs_ssgd"] == pytest.approx(4.0)
    assert out["wire_time_s"] == pytest.approx(0.1)
    assert out["lower_bound_s"] == pytest.approx(0.3 + 0.05)
    assert out["bound_ratio"] == pytest.approx(0.5 / 0.35)


def test_derive_without_ssgd_or_compute_reference_leaves_those_columns_empty() -> None:
    run = {"method": "fp16", "iter_time_s_median": 1.0, "bytes_per_worker_per_iter": 10.0, "breakdown_s": {}}
    out = bounds.derive(run, batch_size=8, world_size=2, bits_per_s=1e6, compute_only_s=None, ssgd_iter_s=None)
    assert out["speedup_vs_ssgd"] is None and out["lower_bound_s"] is None


def test_on_emulated_nodes_the_bound_uses_the_node_links_bytes() -> None:
    from lowcomm.bench.bounds import derive

    run = {"iter_time_s_median": 1.0, "bytes_per_worker_per_iter": 8e6, "inter_node_bytes_per_worker_per_iter": 2e6,
           "breakdown_s": {}}
    out = derive(run, batch_size=8, world_size=8, bits_per_s=1e9, compute_only_s=0.01, ssgd_iter_s=None,
                 nproc_per_node=4)
    assert out["wire_time_s"] == pytest.approx(4 * 2e6 * 8 / 1e9)  # G workers' inter bytes share the link
    flat = derive(run, batch_size=8, world_size=8, bits_per_s=1e9, compute_only_s=0.01, ssgd_iter_s=None)
    assert flat["wire_time_s"] == pytest.approx(8e6 * 8 / 1e9)
