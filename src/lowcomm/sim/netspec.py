"""Parsing of the simulator's network flags: ``--net`` specs, ``--intra`` links and rates.

Why apart from :mod:`lowcomm.sim.network`: that module is the α-β model; this one turns
command-line text into it, refusing bad text in one line (``UsageError``) that names what is
valid.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

from lowcomm.errors import UsageError
from lowcomm.sim.network import INTRA_PRESETS, PRESET_ALIASES, PRESETS, Link, NetworkModel, _link

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|b)(?:/s)?\s*$", re.I)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """``"500mbit"`` -> 5e8 bits/s."""
    m = _RATE.match(text)
    if not m:
        raise UsageError(f"bad network rate {text!r}; use e.g. 100mbit, 1gbit, 10gbit")
    rate = float(m.group(1)) * _SCALE[m.group(2).lower()]
    if not math.isfinite(rate) or rate <= 0:
        raise UsageError(f"network rate must be a finite number > 0, got {text!r}")
    return rate


def parse_intra(text: str) -> Link:
    """``--intra``: an intra-node link preset (:data:`INTRA_PRESETS`), a network preset or a RATE."""
    key = text.strip().lower()
    if key in INTRA_PRESETS:
        return INTRA_PRESETS[key]
    key = PRESET_ALIASES.get(key, key)
    if key in PRESETS:
        return PRESETS[key]
    try:
        return _link(parse_rate(key), 5e-6)
    except UsageError:
        raise UsageError(f"bad --intra {text!r}; valid: {', '.join([*INTRA_PRESETS, *PRESETS])} "
                         "or a rate like 20gbit") from None


def _parse_seconds(key: str, text: str) -> float:
    m = re.match(r"^\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)?\s*$", text)
    if not m:
        raise UsageError(f"bad {key}={text!r}; use e.g. {key}=0.5ms or {key}=20us")
    unit = {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1e-3}[m.group(2)]
    return float(m.group(1)) * unit


def parse_network(spec: str) -> NetworkModel:
    """Parse ``--net``: ``PRESET|RATE[,delay=MS][,alpha=T][,algo=ring|tree|hierarchical|hybrid]
    [,intra=PRESET|RATE,gpus_per_node=G][,nic=gpu|node]``.

    ``delay`` is a one-way delay as given to ``tc netem`` (the emulated cluster's flag) and
    becomes α; ``alpha`` sets α directly. ``intra=`` with ``gpus_per_node=`` switches to the
    hierarchical all-reduce.
    """
    head, *opts = [s.strip() for s in spec.split(",") if s.strip()] or [""]
    if not head:
        raise UsageError("empty --net; valid presets: " + ", ".join(PRESETS))
    key = PRESET_ALIASES.get(head.lower(), head.lower())
    if key in PRESETS:
        link = PRESETS[key]
    else:
        link = _link(parse_rate(head), 50e-6)
    algo, intra, gpn, nic = "ring", None, 1, "gpu"
    for opt in opts:
        k, sep, v = (s.strip() for s in opt.partition("="))
        if not sep:
            raise UsageError(f"network option {opt!r} must look like key=value")
        if k in ("delay", "alpha"):
            link = replace(link, alpha_s=_parse_seconds(k, v))
        elif k == "algo":
            algo = v
        elif k == "intra":
            intra = parse_intra(v)
        elif k == "nic":
            nic = v
        elif k == "gpus_per_node":
            try:
                gpn = int(v)
            except ValueError:
                raise UsageError(f"gpus_per_node must be an integer, got {v!r}") from None
        else:
            raise UsageError(f"unknown network option {k!r}; valid: delay, alpha, algo, intra, "
                             "gpus_per_node, nic")
    if gpn < 1:
        raise UsageError(f"gpus_per_node must be >= 1, got {gpn}")
    if intra is not None and algo == "ring":
        algo = "hierarchical"
        if gpn < 2:
            gpn = 8
    if algo == "hybrid" and intra is None:
        raise UsageError("algo=hybrid needs intra=LINK,gpus_per_node=G (a two-level topology)")
    return NetworkModel(inter=link, algorithm=algo, intra=intra, gpus_per_node=gpn, name=spec, nic=nic)
