"""Client state store on local disk: one fixed-size fp32 row per client, keyed by client id.

Why on disk: stateful algorithms keep a model-sized vector per client (SCAFFOLD's control
variate, FedDyn's dual vector). 10,000 clients of an 80k-parameter MLP is 3.2 GB, most of it
for clients that are sampled once in a while; held in memory it would dominate the run. Here
the states live in one file, a client's row is read when it is trained and written back
after, and the process holds one row at a time: memory does not grow with the number of
registered or visited clients.

Layout of ``root/``::

    meta.json              {"version", "num_clients", "spec": [[name, numel], ...], "dtype", "row_numel"}
    states.bin             num_clients x row_numel float32, client i's row at byte i * row_bytes;
                           created sparse (truncated to full size), so an unvisited row costs no
                           disk and reads as zeros
    visited.bin            one byte per client: 1 once a state of that client was applied
    applied-w{rank}.json   {"round": R}: the newest round whose journal of that rank was applied
    journal/r{round:06d}-w{rank}.bin   one worker's new rows of one round, not applied yet
    journal/.tmp-*         a journal being written: never read, removed by :meth:`recover`

The journal format is in :mod:`lowcomm.fl.journal`.

A row is read through a memory map of that row alone, copied into a tensor and unmapped at
once (never the whole file mapped: the kernel would count every touched page to the process).
Rows are written with positional writes (``os.pwrite``) and one ``fsync`` per journal.

**Protocol** (the engine's order per round R, on every rank; it is what makes a resume exact):

1. ``w = store.writer(R, rank)``; per client ``store.get(cid)``, train, ``w.put(cid, state)``;
   ``w.close()``: the journal is durable and complete (temporary name, fsync, rename) or
   absent. ``states.bin`` is untouched, so every ``get`` of round R sees the states of R-1.
2. Rank 0 writes the checkpoint of round R (model, server state, RNG) atomically.
3. After every rank closed its journal and the checkpoint exists (a barrier, or the next
   round's broadcast from rank 0, which follows the reduce every rank joins after closing):
   apply the round's journals, and all of them before any rank calls ``get`` in round R+1 (a
   rank may train a client whose row another rank wrote in round R). Either every rank calls
   ``commit(R, rank)`` (its own journal) and then a barrier, or every rank calls
   ``commit(R)`` (all ranks' journals; no barrier needed: several processes applying one
   journal at once write the same bytes at the same places). :meth:`writer` refuses to start
   round R+1 while a journal of an earlier round is pending: a missing step is an error, not
   a silently stale state.

A journal of round R is never applied before the checkpoint of round R exists (the caller's
order above). A crash at any point therefore leaves ``states.bin`` at the last checkpointed
round, plus complete journals; on ``--resume`` from the checkpoint of round C, rank 0 calls
``recover(C)`` before any rank reads: journals of rounds <= C are applied (applying writes
whole rows at fixed places, so applying twice gives the same bytes), later ones are deleted
(their round is redone), and half-written temporaries are removed. Hence the checkpoint must
be written every round while a store is in use; a store newer than the checkpoint is refused.
"""

from __future__ import annotations

import json
import mmap
import operator
import os
import re
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lowcomm.errors import UsageError
from lowcomm.fl.journal import JournalWriter, read_journal
from lowcomm.runtime.checkpoint import atomic_write_json, fsync_dir

VERSION = 1
DTYPE = "float32"
_ITEM = 4  # bytes per float32
_JOURNAL = re.compile(r"^r(\d{6,})-w(\d+)\.bin$")
_CHUNK = 1 << 20  # bytes read at once when counting visited clients


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def _check_spec(spec: dict[str, int]) -> list[tuple[str, int]]:
    if not isinstance(spec, dict) or not spec:
        raise UsageError(
            f"a client state store needs a non-empty spec {{name: numel}}, got {spec!r} "
            "(stateless algorithms need no store)"
        )
    items = []
    for name, numel in spec.items():
        if not isinstance(name, str) or not name:
            raise UsageError(f"state names must be non-empty strings, got {name!r}")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
            raise UsageError(f"state {name!r}: numel must be an integer >= 1, got {numel!r}")
        items.append((name, int(numel)))
    return items


class ClientStateStore:
    """Per-client fp32 state on local disk; see the module docstring for layout and protocol.

    Several worker processes of one machine open the same ``root``; each reads any row and
    writes the rows of the clients it trained (a client is trained once per round, so the rows
    of one round never collide).
    """

    def __init__(self, root: str | Path, *, num_clients: int, spec: dict[str, int]) -> None:
        if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
            raise UsageError(f"num_clients must be an integer >= 1, got {num_clients!r}")
        self.root = Path(root)
        self.num_clients = num_clients
        self._items = _check_spec(spec)
        self.spec = dict(self._items)
        self.row_numel = sum(n for _, n in self._items)
        self.row_bytes = self.row_numel * _ITEM
        if self.root.exists() and not self.root.is_dir():
            raise UsageError(f"client state store {self.root} exists and is not a folder")
        self.journal_dir = self.root / "journal"
        self.journal_dir.mkdir(parents=True, exist_ok=True)
        meta = {
            "version": VERSION,
            "num_clients": num_clients,
            "spec": [[name, n] for name, n in self._items],
            "dtype": DTYPE,
            "row_numel": self.row_numel,
        }
        meta_path = self.root / "meta.json"
        fresh = not meta_path.exists()  # meta.json is written last: without it, nothing is stored
        if not fresh:
            try:
                old = json.loads(meta_path.read_text())
            except (OSError, ValueError) as e:
                raise UsageError(f"client state store {self.root}: meta.json unreadable ({e}); "
                                 "delete the folder to start afresh") from None
            self._check_meta(old, meta)
        self._fds: list[int] = []
        self._finalizer = weakref.finalize(self, _close_fds, self._fds)
        self._states = self._open_sized("states.bin", num_clients * self.row_bytes, fresh)
        self._visited = self._open_sized("visited.bin", num_clients, fresh)
        if fresh:
            atomic_write_json(meta, str(meta_path))

    def _check_meta(self, old: dict[str, Any], new: dict[str, Any]) -> None:
        diffs = [f"{k}={old.get(k)!r} (this run: {new[k]!r})" for k in new if old.get(k) != new[k]]
        if diffs:
            raise UsageError(
                f"client state store {self.root} belongs to another run: " + ", ".join(diffs)
                + "; use another state folder, or delete this one to start afresh"
            )

    def _open_sized(self, name: str, size: int, fresh: bool) -> int:
        fd = os.open(self.root / name, os.O_RDWR | os.O_CREAT, 0o644)
        self._fds.append(fd)
        have = os.fstat(fd).st_size
        if fresh and have not in (0, size):
            os.ftruncate(fd, 0)  # left by a store whose creation was interrupted
            have = 0
        if have == 0:
            os.ftruncate(fd, size)  # sparse: no disk used until a row is written
        elif have != size:
            raise UsageError(
                f"client state store {self.root}: {name} has {have} bytes, expected {size} "
                "(damaged store); delete the folder to start afresh"
            )
        return fd

    def close(self) -> None:
        """Close the store's files (also done when the store is garbage-collected)."""
        self._finalizer()

    def __enter__(self) -> ClientStateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_client(self, client_id: Any) -> int:
        """``client_id`` as an int, or :class:`UsageError` naming the valid range."""
        try:
            if isinstance(client_id, bool):
                raise TypeError
            cid = operator.index(client_id)
        except TypeError:
            raise UsageError(f"client id must be an integer, got {client_id!r}") from None
        if not 0 <= cid < self.num_clients:
            raise UsageError(f"client id {cid} out of range: valid ids are 0..{self.num_clients - 1}")
        return cid

    def _is_visited(self, cid: int) -> bool:
        return os.pread(self._visited, 1, cid) == b"\x01"

    def get(self, client_id: int, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """The stored state of one client, ``{name: flat fp32 tensor}``; zeros on first visit.

        The tensors are fresh copies (the row's mapping is closed before returning), so the
        caller may modify them in place; new states are stored only through :meth:`writer`.
        """
        cid = self.check_client(client_id)
        if not self._is_visited(cid):
            row = torch.zeros(self.row_numel, dtype=torch.float32, device=device)
        else:
            row = torch.empty(self.row_numel, dtype=torch.float32)
            self._read_row(cid, row.numpy())
            row = row.to(device)
        return dict(zip(self.spec, row.split([n for _, n in self._items])))

    def _read_row(self, cid: int, out: np.ndarray) -> None:
        """Map this row alone (from the page boundary below it), copy it, unmap at once."""
        offset = cid * self.row_bytes
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        mm = mmap.mmap(self._states, offset - start + self.row_bytes, access=mmap.ACCESS_READ,
                       offset=start)
        src = None
        try:
            src = np.frombuffer(mm, dtype=np.float32, count=self.row_numel, offset=offset - start)
            np.copyto(out, src)
        finally:
            src = None  # release the buffer export before closing the map
            mm.close()

    def writer(self, round: int, rank: int) -> JournalWriter:
        """Start this rank's journal of ``round``; see the module docstring for the protocol."""
        for r, w, path in self._journals():
            if r < round:
                raise UsageError(
                    f"round {round} starts while the journal of round {r} (rank {w}) is not "
                    f"applied ({path}): before any rank reads in the next round, every "
                    f"journal of round {r} must be applied (commit({r}) on every rank, then a "
                    f"barrier; or commit({r}) without a rank, which applies all ranks' journals)"
                )
        return JournalWriter(self, round, rank)

    def _journals(self) -> list[tuple[int, int, Path]]:
        """Complete journals as (round, rank, path), oldest round first."""
        found = []
        for path in self.journal_dir.iterdir():
            m = _JOURNAL.match(path.name)
            if m:
                found.append((int(m.group(1)), int(m.group(2)), path))
        return sorted(found)

    def commit(self, round: int, rank: int | None = None) -> None:
        """Apply the journals of rounds <= ``round`` (of ``rank``, or of all ranks) to the
        states and delete them. Only after the checkpoint of ``round`` exists (module docstring)."""
        for r, w, path in self._journals():
            if r <= round and (rank is None or w == rank):
                self._apply(r, w, path)

    def recover(self, committed_round: int) -> None:
        """On resume from the checkpoint of ``committed_round``: apply the complete journals of
        rounds <= it, delete later ones and half-written temporaries. Rank 0, before any read.

        Raises :class:`UsageError` when the store already holds states of a later round (it
        belongs to a later checkpoint, so the resumed run could not continue exactly).
        """
        for marker in self.root.glob("applied-w*.json"):
            applied = int(json.loads(marker.read_text())["round"])
            if applied > committed_round:
                raise UsageError(
                    f"client state store {self.root} holds client states of round {applied}, "
                    f"newer than the checkpoint's round {committed_round}; resume from the "
                    "newest checkpoint, or delete the store and the checkpoints to start afresh"
                )
        for path in [*self.journal_dir.glob(".tmp-*"), *self.root.glob(".tmp-*")]:
            path.unlink(missing_ok=True)
        for r, w, path in self._journals():
            if r <= committed_round:
                self._apply(r, w, path)
            else:
                path.unlink(missing_ok=True)
        fsync_dir(self.journal_dir)

    def clear(self) -> None:
        """Forget every state (a fresh run reusing the folder): rows and visited flags become
        holes again, journals and markers are deleted. Rank 0, before the others read."""
        for path in [*self.journal_dir.iterdir(), *self.root.glob("applied-w*.json")]:
            path.unlink(missing_ok=True)
        for fd, size in ((self._states, self.num_clients * self.row_bytes),
                         (self._visited, self.num_clients)):
            os.ftruncate(fd, 0)
            os.ftruncate(fd, size)
            os.fsync(fd)
        fsync_dir(self.journal_dir)
        fsync_dir(self.root)

    def visited(self) -> int:
        """How many clients have a stored state (reads the flags a chunk at a time)."""
        count, offset = 0, 0
        while offset < self.num_clients:
            chunk = os.pread(self._visited, min(_CHUNK, self.num_clients - offset), offset)
            if not chunk:
                break
            count += len(chunk) - chunk.count(0)
            offset += len(chunk)
        return count

    def _apply(self, round: int, rank: int, path: Path) -> None:
        """Write a journal's rows into place, fsync, record the round, delete the journal.

        Idempotent (whole rows at fixed offsets), so a crash part-way is repaired by applying
        it again; the journal is deleted only after its rows are durable.
        """
        try:
            f = open(path, "rb")
        except FileNotFoundError:  # applied and deleted meanwhile by another process
            return
        with f:
            for cid, row in read_journal(f, round=round, rank=rank, row_numel=self.row_numel,
                                         path=path):
                self.check_client(cid)
                os.pwrite(self._states, row, cid * self.row_bytes)
                os.pwrite(self._visited, b"\x01", cid)
        os.fsync(self._states)
        os.fsync(self._visited)
        marker = self.root / f"applied-w{rank}.json"
        try:
            previous = int(json.loads(marker.read_text())["round"])
        except (FileNotFoundError, ValueError, KeyError):
            previous = -1
        if round > previous:
            atomic_write_json({"round": round}, str(marker))
        path.unlink(missing_ok=True)
        fsync_dir(self.journal_dir)
