"""Where ``lowcomm bench`` runs: the machine's description and the (emulated) network.

:func:`network` shapes the requested link with :class:`lowcomm.bench.netns.Cluster` (or falls
back to loopback, saying why) and probes what it really delivers, because rows are only
interpreted against the measured bandwidth, never the requested one. With nodes of several
workers (``nproc_per_node`` > 1) it also measures what two processes of one node get from
each other (``intra_node_bits_per_s``): the proof that only the node's link is shaped.
"""

from __future__ import annotations

import contextlib
import os
import platform
from typing import Any, Callable, Iterator

from lowcomm.bench import netns, probe
from lowcomm.bench.netns import NetSpec
from lowcomm.runtime.host import cpu_name


def machine() -> dict[str, Any]:
    """The machine a result was measured on (CPU, load, versions): timings are only comparable
    between runs on like machines."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        info["load_avg_1m_at_start"] = os.getloadavg()[0]  # other work on the machine skews timings
    except OSError:
        pass
    info["cpu"] = cpu_name()
    return info


@contextlib.contextmanager
def network(spec: NetSpec, nproc: int, log: Callable[[str], None],
            nproc_per_node: int = 1) -> Iterator[tuple[netns.Cluster | None, dict[str, Any]]]:
    """Set up ``spec`` (or loopback) for ``nproc`` workers in nodes of ``nproc_per_node``,
    probe it, yield ``(cluster or None, network dict)``."""
    info: dict[str, Any] = {"requested": spec.requested, "label": spec.label(), "emulated": False,
                            "requested_bits_per_s": spec.rate_bits_per_s, "delay_ms": spec.delay_ms,
                            "nodes": nproc // nproc_per_node, "nproc_per_node": nproc_per_node}
    if spec.loopback:
        info["note"] = "--net none: plain loopback"
        info.update(_probe_dict(probe.probe_loopback()))
        yield None, info
        return
    reason = netns.netns_support()
    if reason:
        info["note"] = f"not emulated: {reason}; ran on loopback"
        log(f"lowcomm bench: cannot emulate {spec.label()} ({reason}); running on loopback instead")
        info.update(_probe_dict(probe.probe_loopback()))
        yield None, info
        return
    cluster = netns.Cluster(nproc, spec, nproc_per_node)
    try:
        cluster.up()
    except netns.NetnsUnavailable as e:
        info["note"] = f"not emulated: {e}; ran on loopback"
        log(f"lowcomm bench: cannot emulate {spec.label()} ({e}); running on loopback instead")
        info.update(_probe_dict(probe.probe_loopback()))
        yield None, info
        return
    try:
        info["emulated"] = True
        info["namespaces"] = list(cluster.namespaces)
        between, inside = probe.probe_cluster(cluster)
        info.update(_probe_dict(between))
        if inside is not None:
            info["intra_node_bits_per_s"] = inside.measured_bits_per_s
            info["intra_node_rtt_ms"] = inside.rtt_ms
            log(f"  inside a node (loopback, not shaped): {netns.format_rate(inside.measured_bits_per_s)}")
        yield cluster, info
    finally:
        cluster.down()


def _probe_dict(p: probe.ProbeResult) -> dict[str, Any]:
    return {"measured_bits_per_s": p.measured_bits_per_s, "rtt_ms": p.rtt_ms, "probe_directions": p.directions}
