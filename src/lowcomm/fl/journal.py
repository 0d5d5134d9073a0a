"""The round journals of the client state store: one rank's new client rows of one round.

Why a journal: a round's new client states must not reach the store before the checkpoint of
that round exists, or a crash between the two would leave states one round ahead of the model
(see :mod:`lowcomm.fl.store` for the protocol). So a rank writes them first to its own file,
sequentially, and the store applies the file once the round is checkpointed.

File format (little-endian)::

    header   b"LCFLJNL1", round (int64), rank (int64), row_numel (int64)
    rows     client id (int64), row_numel float32 values   -- repeated
    footer   b"LCFLEND1", number of rows (int64)

It is written to ``.tmp-*`` in the journal folder, fsynced and renamed to
``r{round:06d}-w{rank}.bin``: a journal under its final name is durable and complete, any
other file is ignored. The footer and size check catch a file damaged on disk.
"""

from __future__ import annotations

import io
import os
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Iterator

import torch
from torch import Tensor

from lowcomm.errors import UsageError
from lowcomm.runtime.checkpoint import fsync_dir

if TYPE_CHECKING:
    from lowcomm.fl.store import ClientStateStore

_MAGIC = b"LCFLJNL1"
_END = b"LCFLEND1"
_HEADER = struct.Struct("<8sqqq")  # magic, round, rank, row_numel
_FOOTER = struct.Struct("<8sq")  # end marker, number of rows
_CID = struct.Struct("<q")
TMP_PREFIX = ".tmp-"


def journal_name(round: int, rank: int) -> str:
    """The final file name of the journal of ``round`` written by ``rank``."""
    return f"r{round:06d}-w{rank}.bin"


def read_journal(f: io.BufferedIOBase, *, round: int, rank: int, row_numel: int,
                 path: Path) -> Iterator[tuple[int, memoryview]]:
    """Yield ``(client_id, row bytes)`` of an open journal after checking header, footer and
    size. The row buffer is reused: the caller must consume it before the next row."""
    row_bytes = row_numel * 4
    size = os.fstat(f.fileno()).st_size
    header = f.read(_HEADER.size)
    f.seek(max(size - _FOOTER.size, 0))
    footer = f.read(_FOOTER.size)
    ok = len(header) == _HEADER.size and len(footer) == _FOOTER.size
    count = 0
    if ok:
        magic, r, w, numel = _HEADER.unpack(header)
        end, count = _FOOTER.unpack(footer)
        ok = (magic == _MAGIC and end == _END and (r, w) == (round, rank) and numel == row_numel
              and count >= 0
              and size == _HEADER.size + count * (_CID.size + row_bytes) + _FOOTER.size)
    if not ok:
        raise UsageError(f"journal {path} is damaged or belongs to another store; "
                         "delete it to drop that round's client states")
    buf = bytearray(row_bytes)
    view = memoryview(buf)
    f.seek(_HEADER.size)
    for _ in range(count):
        (cid,) = _CID.unpack(f.read(_CID.size))
        if f.readinto(buf) != row_bytes:
            raise UsageError(f"journal {path} is truncated (damaged store)")
        yield cid, view


class JournalWriter:
    """One rank's new client states of one round, written sequentially to a temporary file.

    :meth:`close` makes the journal durable and complete (fsync, rename); nothing reaches the
    states until :meth:`ClientStateStore.commit`. As a context manager, an exception inside
    the block discards the journal instead.
    """

    def __init__(self, store: ClientStateStore, round: int, rank: int) -> None:
        for name, value in (("round", round), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"{name} must be an integer >= 0, got {value!r}")
        self.store = store
        self.round = round
        self.rank = rank
        self.path = store.journal_dir / journal_name(round, rank)
        fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}r{round:06d}-w{rank}-",
                                   dir=store.journal_dir)
        self._tmp = Path(tmp)
        self._file: BinaryIO | None = os.fdopen(fd, "wb")
        self._file.write(_HEADER.pack(_MAGIC, round, rank, store.row_numel))
        self._seen: set[int] = set()

    def put(self, client_id: int, state: dict[str, Tensor]) -> None:
        """Append one client's new state (any device and float dtype; stored as fp32)."""
        if self._file is None:
            raise UsageError(f"journal of round {self.round} (rank {self.rank}) is closed")
        cid = self.store.check_client(client_id)
        if cid in self._seen:
            raise UsageError(f"client {cid} was already stored in round {self.round}")
        spec = self.store.spec
        if set(state) != set(spec):
            raise UsageError(f"client {cid}: state has entries {sorted(state)}, the store "
                             f"expects {sorted(spec)}")
        rows = []
        for name, numel in spec.items():
            value = state[name]
            if value.numel() != numel:
                raise UsageError(f"client {cid}: state {name!r} has {value.numel()} elements, "
                                 f"expected {numel}")
            rows.append(value.detach().to("cpu", torch.float32).contiguous().reshape(-1).numpy())
        self._file.write(_CID.pack(cid))
        for row in rows:
            self._file.write(row.data)
        self._seen.add(cid)

    def close(self) -> None:
        """Seal the journal: footer, fsync, rename to its final name (replacing the journal of
        a round being redone). From here on the round's states of this rank survive a crash."""
        if self._file is None:
            return
        f, self._file = self._file, None
        f.write(_FOOTER.pack(_END, len(self._seen)))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(self._tmp, self.path)
        fsync_dir(self.store.journal_dir)

    def abort(self) -> None:
        """Discard the journal: this rank's states of the round are not kept."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> JournalWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
