"""PyTorch's own DDP comm hooks in the simulator: ``torch_fp16`` and ``torch_powersgd``.

Why lowcomm's codecs carry them: each hook sends what one of lowcomm's codecs sends.
``fp16_compress_hook`` all-reduces each bucket once in half precision, as ``fp16`` does;
``powerSGD_hook`` all-reduces the tensors it does not compress, then the P factors, then the Q
factors, as ``powersgd`` does with the hook's options (rank, which tensors to compress, error
feedback, warm start; no momentum correction and no clipping, which the hook lacks). The hook
issues the uncompressed tensors as an all-reduce of their own, started before the P factors;
``powersgd`` sends them with the P factors, the same bytes in one collective fewer.

Only the price differs: the hooks are torch code, not lowcomm's kernels, so they take the
hook's own time measured by the profiler (:mod:`lowcomm.sim.hook_timing`: the whole hook, put
where it starts, at the encode; ``torch_powersgd`` at the measured rank only), and where a
profile has none (a profile from before, a GPU profile built from published figures, another
rank) their declared work priced with the profile's kernel constants (:meth:`~.base.Sim.price`),
never lowcomm's own measured codec times. Buckets are DDP's; on gloo ``torch_powersgd`` runs
one bucket (:class:`lowcomm.methods.reference.TorchPowerSGD`), which a run reports as its
``bucket_cap_mb`` and the bench passes on.
"""

from __future__ import annotations

from typing import Any

from lowcomm.compress.codec import codec_class
from lowcomm.sim.hook_timing import FP16_KEY, powersgd_key
from lowcomm.sim.schedules.codec import CodecPlan
from lowcomm.sim.schedules.ddp import CodecSchedule


class TorchFP16(CodecSchedule):
    """DDP with PyTorch's ``fp16_compress_hook``: ``fp16``'s payload at the hook's own cost."""

    name = "torch_fp16"
    summary = "PyTorch's fp16_compress_hook on DDP (reference implementation)"
    caveat = "PyTorch's reference hook; lowcomm's fp16 sends the same bytes."
    advised = False

    def __init__(self, options: Any = None, codec: CodecPlan | None = None) -> None:
        super().__init__(options, CodecPlan("fp16", codec_class("fp16").Options(), timed_as=FP16_KEY))


def _powersgd_options(hook: Any) -> Any:
    """``powersgd``'s options doing what PyTorch's ``PowerSGDState`` with ``hook``'s options does."""
    cls = codec_class("powersgd").Options
    return cls(rank=hook.rank, start_iter=hook.start_iter, error_feedback=hook.error_feedback,
               min_compression_rate=hook.min_compression_rate, warm_start=hook.warm_start,
               momentum_correction=False, momentum_masking=False, clip=0.0)


class TorchPowerSGD(CodecSchedule):
    """DDP with PyTorch's ``powerSGD_hook``: ``powersgd``'s rounds at the hook's own cost."""

    name = "torch_powersgd"
    summary = "PyTorch's powerSGD_hook on DDP (reference implementation)"
    caveat = "PyTorch's reference hook: no momentum correction; one DDP bucket on gloo."
    advised = False

    def __init__(self, options: Any = None, codec: CodecPlan | None = None) -> None:
        from lowcomm.methods.reference import TorchPowerSGDOptions

        hook = options if options is not None else TorchPowerSGDOptions()
        super().__init__(hook, CodecPlan("powersgd", _powersgd_options(hook), timed_as=powersgd_key(hook.rank)))


#: the methods whose payload a lowcomm codec carries here (their kernel bound is that codec's)
HOOKS = (TorchFP16.name, TorchPowerSGD.name)
