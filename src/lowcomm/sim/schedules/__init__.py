"""One schedule per ``--method`` name: which tasks one training iteration issues, and when.

Each schedule adds the iteration's tasks to a :class:`~lowcomm.sim.timeline.Timeline` in the
order the training code issues them, with the same overlap rules as the code:

* DDP-style methods (``ssgd``, ``pufferfish`` and every registered codec, :mod:`.ddp`):
  gradient buckets of ``bucket_mb`` (first bucket 1 MiB) in reverse parameter order; a
  bucket's hook runs on the compute stream as soon as its last gradient is ready, its
  collectives run on the comm stream while backward continues; the optimizer waits for
  every bucket. A codec's payload is whatever its ``cost()`` declares (:mod:`.codec`).
* engine methods (:mod:`.engine`): ``wfbp`` (one group per layer), ``mgwfbp`` (layers merged
  by the α-β rule), ``dear`` (reduce-scatter in backward, all-gathers hidden behind the next
  forward), ``lee18`` (sharded update, parameters all-gathered in the next forward); each
  takes ``compress=<codec>`` with the codec's own options beside the engine's.
* PyTorch's own comm hooks, ``torch_fp16`` and ``torch_powersgd`` (:mod:`.reference`): the
  DDP schedule carrying the lowcomm codec of the same payload, priced as torch kernels.
* PyTorch's FSDP2, ``torch_fsdp`` (:mod:`.fsdp`): per-block all-gather before forward and
  reduce-scatter after backward, blocking the training thread on a CPU profile.
* ``hier`` (:mod:`.hier`): engine groups whose all-reduce is flat, hierarchical or hybrid on
  the network's two-level topology; codec rounds with a ``scope`` run on their node-level
  group (:meth:`~lowcomm.sim.network.NetworkModel.scoped`).

Why no list of compressors here: a method named like a registered codec
(:data:`lowcomm.compress.codec.CODECS`) is the DDP schedule carrying that codec, so a new
codec simulates without any edit in this package.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lowcomm.compress.codec import CODECS, codec_class
from lowcomm.errors import UsageError
from lowcomm.sim.schedules.base import MIB, Bucket, GradTensor, Schedule, Sim, ddp_buckets, layer_buckets
from lowcomm.sim.schedules.codec import CodecPlan
from lowcomm.sim.schedules.ddp import SSGD, BucketSchedule, CodecSchedule, NoComm, Pufferfish
from lowcomm.sim.schedules.engine import MGWFBP, WFBP, DeAR, forward_groups, mgwfbp_groups
from lowcomm.sim.schedules.lee18 import Lee18
from lowcomm.sim.schedules.hier import Hier
from lowcomm.sim.schedules.lee18_fc import Lee18FC
from lowcomm.sim.schedules.localsgd import DiLoCoSchedule, LocalSGDSchedule, StreamingDiLoCoSchedule
from lowcomm.sim.schedules.fsdp import TorchFSDP
from lowcomm.sim.schedules.reference import TorchFP16, TorchPowerSGD

#: schedules of the methods that are not a codec by itself
SCHEDULES: dict[str, type[Schedule]] = {
    cls.name: cls for cls in (SSGD, NoComm, Pufferfish, WFBP, MGWFBP, DeAR, Lee18, Hier)
}
SCHEDULES.update({cls.name: cls for cls in (LocalSGDSchedule, DiLoCoSchedule, StreamingDiLoCoSchedule)})
SCHEDULES[Lee18FC.name] = Lee18FC  # lee18 with its fc= option (model-parallel FC layers)
SCHEDULES.update({cls.name: cls for cls in (TorchFP16, TorchPowerSGD)})  # PyTorch's own hooks
SCHEDULES[TorchFSDP.name] = TorchFSDP  # PyTorch's FSDP2


def method_names() -> list[str]:
    """Every method the simulator can run: the schedules above and every registered codec."""
    return sorted(set(SCHEDULES) | set(CODECS.names()))


def _method_options(name: str, text: str, fallback: type) -> Any:
    """The training method's own options (same names, defaults and validation), or, for a
    name no method registers (a codec registered at run time), ``fallback`` parsed."""
    from lowcomm import methods
    from lowcomm.methods.base import parse_options

    if name in methods.names(include_timing_only=True):
        return methods.create(f"{name}:{text}" if text else name).options
    return parse_options(name, fallback, text)


def _split_codec_options(name: str, text: str) -> tuple[str, CodecPlan | None]:
    """Split an engine spec's options into the engine's own and ``compress=`` with the
    codec's options (a key is the codec's if its options declare it)."""
    from lowcomm.methods.base import parse_options, split_top_level

    items = [s.strip() for s in split_top_level(text) if s.strip()]
    compress = next((i.split("=", 1)[1].strip().lower() for i in items
                     if i.split("=", 1)[0].strip() == "compress"), "none")
    if compress == "none":
        return text, None
    cls = codec_class(compress)
    fields = {f.name for f in dataclasses.fields(cls.Options)}
    mine = [i for i in items if i.split("=", 1)[0].strip() in fields]
    own = [i for i in items if i not in mine and i.split("=", 1)[0].strip() != "compress"]
    return ",".join(own), CodecPlan(compress, parse_options(compress, cls.Options, ",".join(mine)))


def make_schedule(method_spec: str) -> Schedule:
    """The schedule of a ``--method`` spec, with the method's own options."""
    name, _, opts = method_spec.strip().partition(":")
    name = name.strip()
    if name in SCHEDULES:
        cls = SCHEDULES[name]
        # a schedule that parses compress= itself (a nested codec spec: diloco) gets it whole
        own, plan = (opts, None) if getattr(cls, "parses_compress", False) else _split_codec_options(name, opts)
        return cls(_method_options(name, own, cls.Options), plan)
    if name in CODECS:
        options = _method_options(name, opts, codec_class(name).Options)
        return CodecSchedule(options, CodecPlan(name, options))
    import difflib

    valid = method_names()
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UsageError(f"the simulator has no method {name!r}{hint}; valid: {', '.join(valid)}")


__all__ = [
    "MIB", "SCHEDULES", "Bucket", "BucketSchedule", "CodecPlan", "CodecSchedule", "DeAR",
    "GradTensor", "Hier", "Lee18", "MGWFBP", "NoComm", "Pufferfish", "SSGD", "Schedule", "Sim", "TorchFSDP", "WFBP",
    "ddp_buckets", "forward_groups", "layer_buckets", "make_schedule", "method_names",
    "mgwfbp_groups",
]
