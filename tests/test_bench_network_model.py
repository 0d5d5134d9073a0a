"""The network model a bench prediction uses, built from the bench's probes."""

from __future__ import annotations

import pytest


def test_on_one_link_per_worker_no_collective_beats_the_probed_link_rate() -> None:
    """A β scale below 1 from the collective probe (its small-message latency subtracted from a
    short large run) is raised to 1 on a flat network; emulated nodes keep lower scales
    (half their hops are loopback)."""
    from lowcomm.bench.prediction import network_model

    bits = 1e9
    wire = 3 * 4_000_000 // 2  # a 4 MB all-reduce's ring wire bytes at P = 4
    info = {"measured_bits_per_s": bits, "rtt_ms": 0.01,
            "collectives": {"workers": 4, "small_s": {"all_reduce": 0.006},
                            "large": {"all_reduce": [4_000_000, 0.006 + 0.9 * wire * 8 / bits]}},
            "intra_node_bits_per_s": 2e10}
    assert network_model(info, 4).collective_beta_scale["all_reduce"] == 1.0
    assert network_model(info, 4, nproc_per_node=2).collective_beta_scale["all_reduce"] == pytest.approx(0.9)
