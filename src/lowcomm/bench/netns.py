"""An emulated cluster on one machine: one network namespace per node, shaped with ``tc``.

Why namespaces: on loopback every worker shares one fast kernel path, so communication costs
almost nothing and compression never pays off. With one namespace per worker, each with its
own veth to a shared bridge, and a token-bucket (``tbf``) shaper on *both* ends of each veth
(namespace side: what the worker uploads; bridge side: what it downloads), every worker gets
a full-duplex link of the requested rate, as behind a real switch. An optional ``netem``
delay is added on the namespace-side egress only, so the one-way latency between two workers
is ``delay`` and the round trip about ``2 * delay``.

**Nodes of several workers** (``nproc_per_node`` G > 1, ``lowcomm bench --nodes N
--nproc-per-node G``): the namespace, its veth and its shapers belong to a *node*, and the G
workers of that node all run inside it, as G GPUs share one host's NIC. They reach each other
over the node's own address; the kernel routes traffic to a local address through the
namespace's loopback device, which has no shaper, so intra-node traffic is as fast as the
machine's memory copies and only what leaves the node crosses the shaped link
(:func:`lowcomm.bench.probe.probe_intra_node` measures both). With G = 1 (the default) a
node is one worker: the per-worker cluster of the earlier benchmarks, unchanged.

Everything this module creates carries the prefix ``lcb`` plus the owning process id, so
stale objects of a crashed run (its pid no longer alive) can be removed at start without
touching a cluster another live process is using. Addresses come from the benchmarking range
198.18.0.0/15 (RFC 2544); the host itself gets no address, so host routing is never changed.
Clean-up runs on normal exit, on exceptions, on SIGINT/SIGTERM and from ``atexit``.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any, Callable

from lowcomm.errors import UsageError
from lowcomm.runtime.launch import node_layout

PREFIX = "lcb"
#: Interface name of each worker's veth end inside its namespace (gloo binds to it).
WORKER_IFNAME = "lcbif"
SUBNET = "198.18.0"  # /24 inside the RFC 2544 benchmarking range 198.18.0.0/15
MAX_WORKERS = 250

_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
MIN_RATE = 1e5  # 100 kbit/s: below this even a probe takes minutes
MAX_RATE = 100e9  # beyond what a software veth can carry on any machine


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be created here (not root, no iproute2, no tc, a sandbox refusing)."""


@dataclass(frozen=True)
class NetSpec:
    """A parsed ``--net`` value: ``none`` (plain loopback) or ``RATE[,delay=MS][,jitter=MS]``."""

    requested: str
    rate_bits_per_s: float | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0

    @property
    def loopback(self) -> bool:
        """``--net none``: no shaping, the workers talk over loopback."""
        return self.rate_bits_per_s is None

    def label(self) -> str:
        """Human-readable rate and delay, for table titles and log lines."""
        if self.rate_bits_per_s is None:
            return "loopback"
        text = format_rate(self.rate_bits_per_s)
        if self.delay_ms:
            text += f", {self.delay_ms:g} ms delay"
        return text


def format_rate(bits_per_s: float) -> str:
    """``1e8 -> '100 Mbit/s'`` (for tables and plot titles)."""
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.3g} {unit}"
    return f"{bits_per_s:.3g} bit/s"


def parse_rate(text: str) -> float:
    """``'100mbit' -> 1e8``; tc's spelling (``kbit``, ``mbit``, ``gbit``), bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        hint = " ('mbps' would mean megaBYTES/s in tc; write e.g. 100mbit)" if unit.endswith("bps") else ""
        raise UsageError(
            f"bad network rate {text!r}{hint}; use a number with one of {', '.join(_UNITS)}, "
            "e.g. 100mbit, 1gbit, 10gbit"
        )
    rate = float(m.group(1)) * _UNITS[unit]
    if not MIN_RATE <= rate <= MAX_RATE:
        raise UsageError(
            f"network rate {text!r} is unreachable for an emulated link; "
            f"valid: {format_rate(MIN_RATE)} to {format_rate(MAX_RATE)}"
        )
    return rate


def parse_net(text: str) -> NetSpec:
    """Parse ``none`` | ``RATE[,delay=MS][,jitter=MS]`` (e.g. ``10gbit,delay=0.5``)."""
    text = text.strip()
    if text.lower() in ("none", "loopback", "lo"):
        return NetSpec(requested="none")
    head, *opts = [s.strip() for s in text.split(",")]
    rate = parse_rate(head)
    values = {"delay": 0.0, "jitter": 0.0}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep or key not in values:
            raise UsageError(f"bad --net option {opt!r} in {text!r}; valid: delay=MS, jitter=MS")
        try:
            values[key] = float(value)
        except ValueError:
            raise UsageError(f"--net {key} must be a number of milliseconds, got {value!r}") from None
        if not 0 <= values[key] <= 10_000:
            raise UsageError(f"--net {key} must be in [0, 10000] ms, got {value}")
    if values["jitter"] and not values["delay"]:
        raise UsageError("--net jitter needs a delay (e.g. 100mbit,delay=5,jitter=1)")
    return NetSpec(requested=text, rate_bits_per_s=rate, delay_ms=values["delay"], jitter_ms=values["jitter"])


def parse_net_list(text: str) -> list[NetSpec]:
    """``--sweep-net 100mbit,1gbit,10gbit``: commas separate networks unless they start ``key=``."""
    specs: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" in part and specs:
            specs[-1] += "," + part
        else:
            specs.append(part)
    if not specs:
        raise UsageError("--sweep-net needs at least one network, e.g. 100mbit,1gbit")
    return [parse_net(s) for s in specs]


# --- shell helpers -------------------------------------------------------------------------


def _run(cmd: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def netns_support() -> str | None:
    """``None`` when namespaces can be used here, else the reason why not (for the message)."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return "network namespaces need Linux"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "network namespaces need root (run as root, or with CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_pid(name: str) -> int | None:
    m = re.match(rf"{PREFIX}(\d+)", name)
    return int(m.group(1)) if m else None


def list_namespaces() -> list[str]:
    """Our namespaces that exist now (by prefix): what a crashed run may have left behind."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def list_links() -> list[str]:
    """Our host-side links that exist now (by prefix), for the same clean-up."""
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith(PREFIX)]


def clean_stale(*, only_dead: bool = True) -> list[str]:
    """Remove namespaces and links with our prefix whose owning process is gone; return them."""
    removed = []
    for ns in list_namespaces():
        pid = _owner_pid(ns)
        if only_dead and pid is not None and _pid_alive(pid):
            continue
        if _run(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
    for link in list_links():
        pid = _owner_pid(link)
        if only_dead and pid is not None and _pid_alive(pid):
            continue
        if _run(["ip", "link", "del", link], check=False).returncode == 0:
            removed.append(link)
    return removed


# --- the cluster ---------------------------------------------------------------------------


def _tbf(rate: float) -> list[str]:
    """A tbf shaper; burst covers one timer tick at HZ=250 so high rates are reachable."""
    rate_bytes = rate / 8
    burst = int(max(rate_bytes / 250, 16 * 1514))
    limit = int(max(rate_bytes * 0.1, 4 * burst))  # ~100 ms of queue: TCP fills the link
    return ["tbf", "rate", f"{int(rate)}bit", "burst", str(burst), "limit", str(limit)]


@dataclass
class Cluster:
    """``with Cluster(n, spec) as c:`` — ``n`` workers in ``n / nproc_per_node`` shaped
    namespaces; see the module docstring.

    ``c.namespaces[k]`` and ``c.addresses[k]`` are node ``k``'s namespace and address (with one
    worker per node, rank ``k``'s); :meth:`exec_prefix` and :meth:`address_of` take a rank.
    Ranks are placed like torchrun's: node ``rank // nproc_per_node``.
    """

    world_size: int
    spec: NetSpec
    nproc_per_node: int = 1
    namespaces: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    bridge: str = ""
    _created: list[tuple[str, str]] = field(default_factory=list, repr=False)
    _old_handlers: dict[int, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.spec.loopback:
            raise ValueError("Cluster needs a shaped NetSpec; `none` means plain loopback")
        if not 1 <= self.world_size <= MAX_WORKERS:
            raise UsageError(f"world size {self.world_size} does not fit the emulated subnet; valid: 1-{MAX_WORKERS}")
        node_layout(self.world_size, self.nproc_per_node)  # G must divide the world

    @property
    def nodes(self) -> int:
        """Emulated nodes (one namespace and one shaped link each)."""
        return self.world_size // self.nproc_per_node

    def node_of(self, rank: int) -> int:
        """The node rank ``rank`` runs on (torchrun's contiguous layout)."""
        return rank // self.nproc_per_node

    def address_of(self, rank: int) -> str:
        """The address rank ``rank`` is reached at: its node's."""
        return self.addresses[self.node_of(rank)]

    @property
    def ifname(self) -> str:
        """The workers' interface inside each namespace (gloo must bind to it)."""
        return WORKER_IFNAME

    def exec_prefix(self, rank: int) -> list[str]:
        """Command prefix that runs a program inside rank ``rank``'s (node's) namespace."""
        return self.node_prefix(self.node_of(rank))

    def node_prefix(self, node: int) -> list[str]:
        """Command prefix that runs a program inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node]]

    # life cycle ----------------------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        self.up()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.down()

    def up(self) -> None:
        """Create the namespaces, links and shapers; anything half-built is removed on failure."""
        reason = netns_support()
        if reason:
            raise NetnsUnavailable(reason)
        clean_stale()
        self._install_handlers()
        atexit.register(self.down)
        try:
            self._build()
        except BaseException as e:
            self.down()
            if isinstance(e, RuntimeError):
                raise NetnsUnavailable(f"could not build the emulated network: {e}") from e
            raise

    def _build(self) -> None:
        pid = os.getpid()
        tag = f"{PREFIX}{pid}"
        self.bridge = f"{tag}br"
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._created.append(("link", self.bridge))
        _run(["ip", "link", "set", self.bridge, "up"])
        rate = float(self.spec.rate_bits_per_s or 0)
        for r in range(self.nodes):
            ns, host_if, peer_if = f"{tag}-{r}", f"{tag}v{r}", f"{tag}p{r}"
            addr = f"{SUBNET}.{r + 1}"
            _run(["ip", "netns", "add", ns])
            self._created.append(("netns", ns))
            _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", peer_if])
            self._created.append(("link", host_if))
            _run(["ip", "link", "set", peer_if, "netns", ns])
            inside = ["ip", "netns", "exec", ns]
            _run(inside + ["ip", "link", "set", peer_if, "name", WORKER_IFNAME])
            _run(inside + ["ip", "addr", "add", f"{addr}/24", "dev", WORKER_IFNAME])
            _run(inside + ["ip", "link", "set", WORKER_IFNAME, "up"])
            _run(inside + ["ip", "link", "set", "lo", "up"])
            _run(["ip", "link", "set", host_if, "master", self.bridge])
            _run(["ip", "link", "set", host_if, "up"])
            # upload: shaped (and delayed) where it leaves the worker
            if self.spec.delay_ms:
                netem = ["netem", "delay", f"{self.spec.delay_ms}ms"]
                if self.spec.jitter_ms:
                    netem += [f"{self.spec.jitter_ms}ms", "distribution", "normal"]
                netem += ["limit", "100000"]
                made = _run(inside + ["tc", "qdisc", "replace", "dev", WORKER_IFNAME, "root", "handle", "1:"] + netem, check=False)
                if made.returncode != 0:
                    raise UsageError(
                        f"--net {self.spec.requested!r}: delay/jitter need tc's netem qdisc (kernel module "
                        f"sch_netem), which this kernel refused ({made.stderr.strip()}); drop delay= to "
                        "emulate the rate alone"
                    )
                _run(inside + ["tc", "qdisc", "add", "dev", WORKER_IFNAME, "parent", "1:1", "handle", "10:"] + _tbf(rate))
            else:
                _run(inside + ["tc", "qdisc", "replace", "dev", WORKER_IFNAME, "root"] + _tbf(rate))
            # download: shaped where the bridge hands it to the worker
            _run(["tc", "qdisc", "replace", "dev", host_if, "root"] + _tbf(rate))
            self.namespaces.append(ns)
            self.addresses.append(addr)

    def down(self) -> None:
        """Remove everything this cluster created (idempotent; safe from signal handlers)."""
        while self._created:
            kind, name = self._created.pop()
            if kind == "netns":
                _run(["ip", "netns", "del", name], check=False)
            else:
                _run(["ip", "link", "del", name], check=False)
        self.namespaces, self.addresses = [], []
        self._restore_handlers()
        try:
            atexit.unregister(self.down)
        except Exception:  # noqa: BLE001 - interpreter shutting down
            pass

    # signals -------------------------------------------------------------------------------
    def _install_handlers(self) -> None:
        """SIGTERM/SIGHUP become SystemExit so ``finally``/``__exit__`` run and clean up."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: FrameType | None) -> None:
            self.down()
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):
                pass

    def _restore_handlers(self) -> None:
        for sig, old in list(self._old_handlers.items()):
            try:
                signal.signal(sig, old)
            except (ValueError, OSError, TypeError):
                pass
        self._old_handlers.clear()


def rank_prefix_fn(cluster: Cluster) -> Callable[[int], list[str]]:
    """The launcher's ``rank_prefix`` for ``cluster``: run each rank in its own namespace."""
    return cluster.exec_prefix
