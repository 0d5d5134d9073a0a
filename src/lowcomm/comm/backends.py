"""Which backend of a process group carries which device, checked before a collective runs.

A process group carries a tensor only if it has a backend for the tensor's device type:
``init_process_group("nccl")`` registers none for ``cpu``, and a CPU tensor then fails deep
inside c10d ("No backend type associated with device type cpu"), often on one code path that
only runs every few epochs. :mod:`lowcomm.comm.accounting` asks :func:`device_backend` before
every collective (once per group and device type, then a dictionary look-up) and raises
:class:`BackendDeviceError` naming the collective, the tag and the group's backends.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist


class BackendDeviceError(RuntimeError):
    """A collective was handed a tensor on a device its process group has no backend for."""


def parse_backend_config(config: str) -> dict[str, str]:
    """``{"cpu": "gloo", "cuda": "nccl"}`` from ``"cpu:gloo,cuda:nccl"``.

    The format is that of :func:`torch.distributed.get_backend_config` (lower case,
    ``device:backend`` pairs). A bare backend name (``"nccl"``) is expanded the way torch
    expands it (:class:`torch.distributed.BackendConfig`), so both spellings give one answer.
    """
    text = config.strip().lower()
    if text and ":" not in text:
        text = str(dist.BackendConfig(dist.Backend(text)))
    out: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        device, sep, backend = pair.partition(":")
        if not sep or not device or not backend:
            raise ValueError(f"malformed backend config {config!r}: expected 'device:backend,...'")
        out[device.strip()] = backend.strip()
    return out


def check_device_supported(
    config: str | dict[str, str], device_type: str, *, what: str = "collective"
) -> str:
    """The backend name that carries ``device_type`` tensors under ``config``, or raise.

    A pure function of the configuration (no process group needed), so the refusal is
    testable on a CPU-only machine with a config such as ``"cuda:nccl"``.

    Raises:
        BackendDeviceError: ``config`` has no backend for ``device_type``.
    """
    mapping = parse_backend_config(config) if isinstance(config, str) else config
    backend = mapping.get(device_type)
    if backend is None:
        have = ", ".join(f"{d}:{b}" for d, b in mapping.items()) or "none"
        hint = (
            "initialize the group with a backend for both devices, e.g. "
            "dist.init_process_group('cpu:gloo,cuda:nccl'), or "
            if device_type == "cpu"
            else ""
        )
        raise BackendDeviceError(
            f"{what}: a {device_type} tensor cannot travel on this process group, whose backends "
            f"are {have}; {hint}create the tensor on a device the group serves "
            f"({', '.join(mapping) or 'none'})"
        )
    return backend


# group -> {device type -> backend name}; weak keys, so a destroyed group's entry goes with it
_BACKENDS: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()
_BACKENDS_LOCK = threading.Lock()


def _group_backends(group: dist.ProcessGroup | None) -> dict[str, str] | None:
    """Device-type -> backend map of ``group`` (cached), or None where torch cannot say."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        return None
    try:
        return _BACKENDS[pg]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: never cached, still checked
        pass
    try:
        mapping = parse_backend_config(dist.get_backend_config(pg))
    except (ValueError, RuntimeError, AttributeError):
        # this rank is not in ``pg`` (the collective is then a no-op in torch), or a group
        # kind without a recorded config: leave the call to torch unchanged
        return None
    try:
        with _BACKENDS_LOCK:
            _BACKENDS[pg] = mapping
    except TypeError:
        pass
    return mapping


def device_backend(
    group: dist.ProcessGroup | None, device: torch.device | str, *, what: str = "collective"
) -> str | None:
    """Name of the backend that carries ``device`` tensors on ``group`` (None: not known).

    Checked once per (group, device type), then a dictionary look-up. Returns None when no
    process group is initialized (torch then raises its own, clear error).

    Raises:
        BackendDeviceError: the group has no backend for ``device``'s type.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mapping = _group_backends(group)
    if mapping is None:
        return None
    device_type = torch.device(device).type
    return check_device_supported(mapping, device_type, what=what)
