"""The client state store (lowcomm.fl.store): exact round trips, journals applied only on
commit, crash recovery, meta checks, several writers, sparse files and flat memory.

Stored values are copied bytes, never recomputed, so every comparison is exact (no tolerance).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from lowcomm.errors import UsageError
from lowcomm.fl.store import ClientStateStore
from lowcomm.testing import distributed

SPEC = {"c": 5, "h": 3}


def _state(seed: int, spec: dict[str, int] = SPEC) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(n, generator=g) for name, n in spec.items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _zeros(spec: dict[str, int] = SPEC) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(n) for name, n in spec.items()}


def _round(store: ClientStateStore, round: int, clients: list[int], rank: int = 0) -> None:
    with store.writer(round, rank) as w:
        for cid in clients:
            w.put(cid, _state(1000 * round + cid))


def test_first_visit_reads_zeros_and_a_committed_state_round_trips_exactly(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path / "s", num_clients=10, spec=SPEC)
    assert _equal(store.get(3), _zeros()) and store.visited() == 0
    _round(store, 0, [3, 7, 9])  # 9: the last row ends the file
    store.commit(0, 0)
    assert all(_equal(store.get(c), _state(c)) for c in (3, 7, 9))
    assert _equal(store.get(4), _zeros()) and store.visited() == 3
    assert [t.dtype for t in store.get(3).values()] == [torch.float32, torch.float32]


def test_get_returns_copies_that_the_caller_may_modify(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path, num_clients=4, spec=SPEC)
    _round(store, 0, [1])
    store.commit(0)
    got = store.get(1)
    got["c"].add_(1.0)
    assert _equal(store.get(1), _state(1))


def test_a_closed_journal_is_not_visible_before_commit(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path, num_clients=4, spec=SPEC)
    _round(store, 0, [2])
    assert _equal(store.get(2), _zeros()) and store.visited() == 0
    store.commit(0, rank=1)  # another rank's journal: not this one
    assert store.visited() == 0
    store.commit(0, rank=0)
    assert _equal(store.get(2), _state(2)) and not list((tmp_path / "journal").iterdir())


def test_a_later_round_overwrites_and_states_of_other_dtypes_are_stored_as_fp32(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path, num_clients=4, spec=SPEC)
    _round(store, 0, [1])
    store.commit(0)
    with store.writer(1, 0) as w:
        w.put(1, {k: v.double().requires_grad_() for k, v in _state(77).items()})
    store.commit(1)
    assert _equal(store.get(1), _state(77))


def test_recover_applies_a_checkpointed_round_and_drops_a_later_one(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path, num_clients=8, spec=SPEC)
    _round(store, 0, [1, 2])
    store.commit(0)
    _round(store, 1, [2, 3])  # checkpoint of round 1 written, then a crash before the commit
    store.close()
    again = ClientStateStore(tmp_path, num_clients=8, spec=SPEC)
    again.recover(1)
    assert _equal(again.get(1), _state(1)) and _equal(again.get(2), _state(1002))
    assert _equal(again.get(3), _state(1003)) and again.visited() == 3
    _round(again, 2, [1, 4])  # a crash before the checkpoint of round 2
    again.close()
    third = ClientStateStore(tmp_path, num_clients=8, spec=SPEC)
    third.recover(1)
    assert _equal(third.get(1), _state(1)) and _equal(third.get(4), _zeros())
    assert third.visited() == 3 and not list((tmp_path / "journal").iterdir())


def test_applying_a_journal_twice_gives_the_same_bytes(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path, num_clients=8, spec=SPEC)
    _round(store, 0, [1, 5])
    journal = next((tmp_path / "journal").iterdir())
    saved = journal.read_bytes()
    store.commit(0)
    once = (tmp_path / "states.bin").read_bytes()
    journal.write_bytes(saved)  # as if the crash came after the rows, before the unlink
    store.recover(0)
    assert (tmp_path / "states.bin").read_bytes() == once and store.visited() == 2


def test_a_half_written_journal_is_ignored_and_removed(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path, num_clients=4, spec=SPEC)
    w = store.writer(0, 0)
    w.put(1, _state(1))
    w._file.flush()  # type: ignore[union-attr]  # killed here: never closed, never renamed
    store.commit(0)
    assert store.visited() == 0
    store.recover(0)
    assert store.visited() == 0 and not list((tmp_path / "journal").iterdir())


def test_an_exception_inside_the_writer_block_discards_the_journal(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path, num_clients=4, spec=SPEC)
    with pytest.raises(RuntimeError):
        with store.writer(0, 0) as w:
            w.put(1, _state(1))
            raise RuntimeError("client training failed")
    assert not list((tmp_path / "journal").iterdir())


def test_a_damaged_journal_is_refused_with_its_name(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path, num_clients=4, spec=SPEC)
    _round(store, 0, [1, 2])
    journal = next((tmp_path / "journal").iterdir())
    journal.write_bytes(journal.read_bytes()[:-20])
    with pytest.raises(UsageError, match=journal.name):
        store.commit(0)


def test_reopening_keeps_the_states_and_checks_the_meta(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path, num_clients=6, spec=SPEC)
    _round(store, 0, [5])
    store.commit(0)
    store.close()
    assert _equal(ClientStateStore(tmp_path, num_clients=6, spec=SPEC).get(5), _state(5))
    with pytest.raises(UsageError, match=r"num_clients=6 \(this run: 7\)"):
        ClientStateStore(tmp_path, num_clients=7, spec=SPEC)
    with pytest.raises(UsageError, match="spec="):
        ClientStateStore(tmp_path, num_clients=6, spec={"c": 8})
    with pytest.raises(UsageError, match="spec="):
        ClientStateStore(tmp_path, num_clients=6, spec={"h": 3, "c": 5})  # order is layout


@pytest.mark.parametrize("bad", [-1, 6, 2.0, True, "1"])
def test_a_bad_client_id_is_refused_with_the_valid_range(tmp_path: Path, bad: object) -> None:
    store = ClientStateStore(tmp_path, num_clients=6, spec=SPEC)
    with pytest.raises(UsageError, match=r"0\.\.5|integer"):
        store.get(bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"0\.\.5|integer"):
        store.writer(0, 0).put(bad, _state(0))  # type: ignore[arg-type]


def test_numpy_and_tensor_client_ids_are_accepted(tmp_path: Path) -> None:
    import numpy as np

    store = ClientStateStore(tmp_path, num_clients=6, spec=SPEC)
    with store.writer(0, 0) as w:
        w.put(np.int64(4), _state(4))  # type: ignore[arg-type]
    store.commit(0)
    assert _equal(store.get(torch.tensor(4)), _state(4))  # type: ignore[arg-type]


def test_put_refuses_wrong_entries_sizes_and_a_client_twice(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path, num_clients=6, spec=SPEC)
    w = store.writer(0, 0)
    with pytest.raises(UsageError, match="expects"):
        w.put(1, {"c": torch.zeros(5)})
    with pytest.raises(UsageError, match="expected 3"):
        w.put(1, {"c": torch.zeros(5), "h": torch.zeros(4)})
    w.put(1, _state(1))
    with pytest.raises(UsageError, match="already stored"):
        w.put(1, _state(1))
    w.close()
    with pytest.raises(UsageError, match="closed"):
        w.put(2, _state(2))


@pytest.mark.parametrize("kwargs", [{"num_clients": 0, "spec": SPEC}, {"num_clients": 3, "spec": {}},
                                    {"num_clients": 3, "spec": {"c": 0}}])
def test_bad_store_arguments_are_refused(tmp_path: Path, kwargs: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(UsageError):
        ClientStateStore(tmp_path, **kwargs)


def test_two_ranks_write_disjoint_clients_of_one_round_then_each_commits(tmp_path: Path) -> None:
    a = ClientStateStore(tmp_path, num_clients=10, spec=SPEC)
    b = ClientStateStore(tmp_path, num_clients=10, spec=SPEC)
    _round(a, 0, [0, 4, 8], rank=0)
    _round(b, 0, [1, 5], rank=1)
    a.commit(0, 0)
    b.commit(0, 1)
    for cid in (0, 4, 8, 1, 5):
        assert _equal(a.get(cid), _state(cid)) and _equal(b.get(cid), _state(cid))
    assert a.visited() == 5


def test_the_next_round_is_refused_while_a_journal_of_an_earlier_round_is_pending(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path, num_clients=4, spec=SPEC)
    _round(store, 0, [1], rank=1)
    with pytest.raises(UsageError, match="commit"):
        store.writer(1, 0)
    store.commit(0)  # rank=None: every rank's journals
    store.writer(1, 0).abort()


def test_recover_refuses_a_store_newer_than_the_checkpoint(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path, num_clients=4, spec=SPEC)
    _round(store, 3, [1])
    store.commit(3)
    with pytest.raises(UsageError, match="round 3"):
        store.recover(2)
    store.recover(3)


def test_clear_forgets_every_state(tmp_path: Path) -> None:
    store = ClientStateStore(tmp_path, num_clients=4, spec=SPEC)
    _round(store, 0, [1, 2])
    store.commit(0)
    _round(store, 1, [3])
    store.clear()
    assert store.visited() == 0 and _equal(store.get(1), _zeros())
    assert not list((tmp_path / "journal").iterdir())
    store.recover(0)  # no marker of round 0 left


def _disk_bytes(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_a_large_store_is_sparse_and_memory_does_not_grow_with_visited_rows(tmp_path: Path) -> None:
    clients, numel, visits, per_round = 10_000, 1000, 2000, 200
    store = ClientStateStore(tmp_path, num_clients=clients, spec={"c": numel})
    row_bytes = 4 * numel
    assert os.path.getsize(tmp_path / "states.bin") == clients * row_bytes
    assert _disk_bytes(tmp_path / "states.bin") < 64 * row_bytes  # ~0 of 40 MB
    proc = psutil.Process()

    def visit(first: int, count: int, round: int, fresh: bool) -> int:
        """Read, check and rewrite ``count`` rows from ``first``, ``per_round`` per round."""
        for start in range(first, first + count, per_round):
            with store.writer(round, 0) as w:
                for cid in range(start, start + per_round):
                    state = store.get(cid)
                    assert float(state["c"][-1]) == (0.0 if fresh else cid)
                    w.put(cid, {"c": state["c"].fill_(cid)})
            store.commit(round)
            round += 1
        return round

    next_round = visit(0, per_round, 0, True)  # warm-up: allocator pools, lazy imports
    gc.collect()
    before = proc.memory_info().rss
    next_round = visit(per_round, visits, next_round, True)  # first visits: zeros
    visit(per_round, visits, next_round, False)  # second visits: rows read from the file
    gc.collect()
    grown = proc.memory_info().rss - before
    touched = visits * row_bytes  # 8 MB: what keeping the rows (or their mappings) would cost
    assert grown < touched // 4, f"RSS grew {grown} bytes over {visits} visited rows"
    written = _disk_bytes(tmp_path / "states.bin")
    assert written < 2 * (visits + per_round) * row_bytes  # only visited rows use disk


@distributed(world_size=2)
def test_worker_processes_share_one_store_and_may_commit_each_others_journals(tmp_path: Path) -> None:
    rank = dist.get_rank()
    store = ClientStateStore(tmp_path, num_clients=20, spec=SPEC)  # both create it at once
    for r in range(3):
        mine = [c for c in range(20) if (c + r) % 2 == rank]
        _round(store, r, mine, rank=rank)
        dist.barrier()  # every journal of round r is final (in the engine: the reduce)
        store.commit(r)  # every rank applies every rank's journal, concurrently: no barrier after
        for cid in range(20):
            assert _equal(store.get(cid), _state(1000 * r + cid))
    assert store.visited() == 20
