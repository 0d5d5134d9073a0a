"""The files ``lowcomm elastic`` writes and reads: a trained supernet, an extracted sub-network.

Why not pickled modules: a file holds the registry name, the model's arguments, the search
space and a ``state_dict``; reading it rebuilds the network from lowcomm's own code
(``torch.load(weights_only=True)``), so a file never runs code and survives refactors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowcomm import models as model_registry
from lowcomm.elastic.space import Config, SearchSpace
from lowcomm.elastic.supernet import Supernet
from lowcomm.errors import UsageError
from lowcomm.runtime.checkpoint import atomic_save

FORMAT = "lowcomm.elastic/1"


def build_supernet(model: str, model_args: dict[str, Any]) -> Supernet:
    """The registered elastic model ``model``; a model that is not a supernet is refused."""
    net = model_registry.create(model, **model_args)
    if not isinstance(net, Supernet):
        elastic = [n for n in model_registry.names() if n.startswith("elastic_")]
        raise UsageError(f"model {model!r} is not an elastic supernet; valid: {', '.join(elastic)}")
    return net


def save_supernet(path: str, net: Supernet, meta: dict[str, Any]) -> None:
    """Write the supernet's weights and how to rebuild it (atomically)."""
    atomic_save({"format": FORMAT, "kind": "supernet", "space": net.space.to_json(),
                 "state_dict": {k: v.detach().cpu() for k, v in net.state_dict().items()}, **meta}, path)


def save_subnet(path: str, subnet: nn.Module, config: Config, meta: dict[str, Any]) -> None:
    """Write an extracted (or from-scratch) sub-network: its config and plain weights."""
    atomic_save({"format": FORMAT, "kind": "subnet", "config": config,
                 "state_dict": {k: v.detach().cpu() for k, v in subnet.state_dict().items()}, **meta}, path)


def read(path: str | Path, kind: str) -> dict[str, Any]:
    """The contents of a ``lowcomm elastic`` file of ``kind`` ("supernet" or "subnet")."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"no such file: {str(p)!r} (a file written by `lowcomm elastic train --out`)")
    try:
        blob = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        raise UsageError(f"{str(p)!r} is not a lowcomm elastic file ({type(e).__name__})") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise UsageError(f"{str(p)!r} is not a lowcomm elastic file (format {FORMAT})")
    if blob.get("kind") != kind:
        raise UsageError(f"{str(p)!r} holds a {blob.get('kind')}, not a {kind}")
    return blob


def load_supernet(path: str | Path) -> tuple[Supernet, dict[str, Any]]:
    """The supernet in ``path`` with its weights, and the file's metadata."""
    blob = read(path, "supernet")
    net = build_supernet(blob["model"], blob.get("model_args", {}))
    net.load_state_dict(blob["state_dict"])
    saved = SearchSpace.from_json(blob["space"])
    if saved.to_json() != net.space.to_json():
        raise UsageError(f"{str(path)!r}: its search space differs from {blob['model']!r}'s in this lowcomm")
    return net, blob


def load_subnet(path: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """The sub-network in ``path`` rebuilt (its supernet's ``extract`` of the config) with its weights."""
    blob = read(path, "subnet")
    net = build_supernet(blob["model"], blob.get("model_args", {}))
    subnet = net.extract(net.space.validate(blob["config"]))
    subnet.load_state_dict(blob["state_dict"])
    return subnet, blob
