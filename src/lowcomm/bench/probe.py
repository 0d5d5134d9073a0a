"""Check an emulated network before trusting it: TCP bandwidth and round-trip time.

A shaper that silently does nothing (or a rate the machine cannot push through its veths)
would make every number in the benchmark wrong, so the harness measures the link first and
prints the result next to the table. Bandwidth is one bulk TCP stream per direction between
ranks 0 and 1 (both directions: upload and download are shaped separately); the first
``warmup_s`` of the stream are not counted so tbf's initial burst does not inflate the figure.
RTT is the median of small request/response exchanges on a ``TCP_NODELAY`` socket.

The server and client run as ``python -m lowcomm.bench.probe ...`` inside the namespaces
(``ip netns exec``), or directly on loopback.

On a cluster of nodes with several workers each, :func:`probe_cluster` measures the shaped
link between nodes 0 and 1 and, inside node 0, two processes talking to the node's own
address: what the node's workers get from each other. That second figure is the check that
intra-node traffic stays on the namespace's loopback and is not shaped.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Sequence

from lowcomm.runtime.launch import free_port

if TYPE_CHECKING:
    from lowcomm.bench.netns import Cluster

CHUNK = 1 << 16


@dataclass
class ProbeResult:
    """What the network section of the JSON reports."""

    measured_bits_per_s: float
    rtt_ms: float
    directions: dict[str, float]  # "0->1" -> bits/s

    def as_dict(self) -> dict[str, object]:
        """Plain dict for the result JSON."""
        return asdict(self)


# --- the two ends (run inside a namespace) --------------------------------------------------


def _serve(port: int, warmup_s: float) -> dict[str, float]:
    """Accept one bulk stream then one ping-pong connection; report what was received."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(2)
    print("ready", flush=True)
    conn, _ = srv.accept()
    t_first = None
    counted = 0
    t_count_start = 0.0
    t_last = 0.0
    while True:
        data = conn.recv(1 << 20)
        if not data:
            break
        now = time.perf_counter()
        if t_first is None:
            t_first = now
            t_count_start = now + warmup_s
        if now >= t_count_start:
            counted += len(data)
            t_last = now
    conn.close()
    # ping-pong: echo until the peer closes
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        data = conn.recv(64)
        if not data:
            break
        conn.sendall(data)
    conn.close()
    srv.close()
    span = max(t_last - t_count_start, 1e-9)
    return {"bytes": float(counted), "seconds": span}


def _send(host: str, port: int, seconds: float, pings: int) -> dict[str, float]:
    payload = b"\0" * CHUNK
    deadline = time.perf_counter() + 10.0
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=10)
            break
        except OSError:
            if time.perf_counter() > deadline:
                raise
            time.sleep(0.05)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        conn.sendall(payload)
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)  # wait until the server has read everything and closed
    conn.close()
    conn = socket.create_connection((host, port), timeout=10)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(pings):
        t0 = time.perf_counter()
        conn.sendall(b"p")
        if conn.recv(64) != b"p":
            raise RuntimeError("probe server closed the ping-pong connection early")
        rtts.append(time.perf_counter() - t0)
    conn.close()
    return {"rtt_s": statistics.median(rtts[1:] or rtts)}


# --- orchestration (runs in the harness process) ---------------------------------------------


def measure_pair(
    server_prefix: list[str],
    client_prefix: list[str],
    server_addr: str,
    *,
    port: int = 29411,
    seconds: float = 1.5,
    warmup_s: float = 0.3,
    pings: int = 30,
) -> tuple[float, float]:
    """Bits/s from client to server, and the RTT in seconds, measured with two subprocesses.

    Inside a namespace nothing else listens, so the fixed ``port`` is safe; on the host's own
    network (no prefix) a port that is free right now is used instead.
    """
    if not server_prefix:
        port = free_port()
    py = [sys.executable, "-m", "lowcomm.bench.probe"]
    server = subprocess.Popen(
        server_prefix + py + ["serve", "--port", str(port), "--warmup", str(warmup_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"probe server did not start: {line}{server.stderr.read() if server.stderr else ''}")
        client = subprocess.run(
            client_prefix + py + ["send", "--host", server_addr, "--port", str(port),
                                  "--seconds", str(seconds), "--pings", str(pings)],
            capture_output=True, text=True, timeout=seconds + 60,
        )
        if client.returncode != 0:
            raise RuntimeError(f"probe client failed: {client.stderr.strip()[-500:]}")
        out, err = server.communicate(timeout=30)
        if server.returncode != 0:
            raise RuntimeError(f"probe server failed: {err.strip()[-500:]}")
        got = json.loads(out.strip().splitlines()[-1])
        rtt = json.loads(client.stdout.strip().splitlines()[-1])["rtt_s"]
        return got["bytes"] * 8 / got["seconds"], float(rtt)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def probe(
    prefixes: Sequence[list[str]],
    addresses: Sequence[str],
    *,
    seconds: float = 1.5,
    port: int = 29411,
) -> ProbeResult:
    """Measure ranks 0 -> 1 and 1 -> 0; the slower direction is the link's bandwidth."""
    if len(addresses) < 2:
        prefixes, addresses = [prefixes[0]] * 2, [addresses[0]] * 2
    directions: dict[str, float] = {}
    rtts = []
    for a, b in ((0, 1), (1, 0)):
        bw, rtt = measure_pair(prefixes[b], prefixes[a], addresses[b], port=port + a, seconds=seconds)
        directions[f"{a}->{b}"] = bw
        rtts.append(rtt)
    return ProbeResult(
        measured_bits_per_s=min(directions.values()),
        rtt_ms=statistics.median(rtts) * 1e3,
        directions=directions,
    )


def probe_loopback(*, seconds: float = 0.5) -> ProbeResult:
    """The same measurement on 127.0.0.1 (for ``--net none`` and the fallback); each
    direction picks a free port (see :func:`measure_pair`)."""
    return probe([[]], ["127.0.0.1"], seconds=seconds)


def probe_cluster(cluster: Cluster, *, seconds: float = 1.5,
                  intra_seconds: float = 0.5) -> tuple[ProbeResult, ProbeResult | None]:
    """``(between nodes, inside node 0)`` of an emulated cluster; the second is None with one
    worker per node (no intra-node traffic to check)."""
    nodes = range(min(cluster.nodes, 2))
    between = probe([cluster.node_prefix(k) for k in nodes], [cluster.addresses[k] for k in nodes],
                    seconds=seconds)
    if cluster.nproc_per_node < 2:
        return between, None
    inside = [cluster.node_prefix(0)] * 2
    return between, probe(inside, [cluster.addresses[0]] * 2, seconds=intra_seconds)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the probe's server and client processes (``python -m lowcomm.bench.probe``)."""
    p = argparse.ArgumentParser(prog="python -m lowcomm.bench.probe")
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--warmup", type=float, default=0.3)
    c = sub.add_parser("send")
    c.add_argument("--host", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--seconds", type=float, default=1.5)
    c.add_argument("--pings", type=int, default=30)
    args = p.parse_args(argv)
    if args.role == "serve":
        print(json.dumps(_serve(args.port, args.warmup)), flush=True)
    else:
        print(json.dumps(_send(args.host, args.port, args.seconds, args.pings)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
