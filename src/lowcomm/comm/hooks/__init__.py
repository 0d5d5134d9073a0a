"""DDP comm hooks for every compressor: one :class:`CodecHook` drives any registered codec.

:data:`HOOKS` maps a method name to its :class:`HookKind` (``ssgd`` plus every name of
:data:`~lowcomm.compress.codec.CODECS`, read at look-up time: a new codec needs no edit
here). Use :func:`lowcomm.hooks.register`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from lowcomm.comm.hooks.state import CodecHook, SSGDOptions, run_hook
from lowcomm.compress.codec import CODECS, Codec, codec_class

#: the method that compresses nothing: the plain mean all-reduce, counted like the others
SSGD = "ssgd"


@dataclass(frozen=True)
class HookKind:
    """How to build the hook of one method: its options and its codec class (None: ssgd)."""

    name: str
    Options: type
    codec: type[Codec] | None

    def __call__(self, ddp: nn.Module, options: Any, *, process_group: dist.ProcessGroup | None = None) -> CodecHook:
        """A hook state for ``ddp`` (not registered yet: ``ddp.register_comm_hook(state, run_hook)``)."""
        codec = None
        if self.codec is not None:
            codec = self.codec(options, world=dist.get_world_size(process_group), rank=dist.get_rank(process_group))
        return CodecHook(ddp, self.name, options, codec, process_group=process_group)


class _Hooks(Mapping[str, HookKind]):
    """``ssgd`` and every registered codec, read from :data:`CODECS` on each access."""

    def __getitem__(self, name: str) -> HookKind:
        if name == SSGD:
            return HookKind(SSGD, SSGDOptions, None)
        if name not in CODECS:
            raise KeyError(name)
        cls = codec_class(name)
        return HookKind(name, cls.Options, cls)

    def __iter__(self) -> Iterator[str]:
        return iter([SSGD, *CODECS.names()])

    def __len__(self) -> int:
        return 1 + len(CODECS.names())


#: method name -> :class:`HookKind`
HOOKS: Mapping[str, HookKind] = _Hooks()

__all__ = ["HOOKS", "CodecHook", "HookKind", "SSGD", "run_hook"]
