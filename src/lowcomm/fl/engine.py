"""One federated worker: the rounds of a Parrot-style simulation on ``torch.distributed``.

Every worker process holds ONE model. Each round, rank 0 (the server, which trains clients
too) samples the clients, plans which worker trains which (:mod:`lowcomm.fl.schedule`) and
broadcasts the plan and the global model; each worker trains its clients one after another,
loading the global weights into its model before each, and adds every client's (already
weighted) contribution to a local sum; ONE reduce brings the sums to rank 0, which applies the
algorithm's server update and evaluates. Stateful algorithms read and write their per-client
state in the on-disk store (:mod:`lowcomm.fl.store`), never all in memory.

Why clients are seeded by ``(seed, round, client)`` and not by the worker: a client's local
training is then the same whichever worker the scheduler gives it to, so plans (and
``--slowdown``) change times, never results beyond float summation order.

Cross-silo (``--cross-silo``): one client per process, client ``i`` on rank ``i`` every round
(torchrun across machines); the same algorithms, store and engine.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lowcomm.comm import accounting
from lowcomm.errors import UsageError
from lowcomm.comm.ledger import ledger
from lowcomm.fl import checkpoint as fl_checkpoint
from lowcomm.fl.algorithms import create_algorithm, load_algorithm_module
from lowcomm.fl.api import Algorithm, ClientContext, LocalTraining
from lowcomm.fl.config import FLConfig
from lowcomm.fl.local import flat_params, load_flat_
from lowcomm.fl.partition import Partition, client_stats, sample_clients
from lowcomm.fl.schedule import Plan, Scheduler, parse_slowdown, slow_down
from lowcomm.fl.store import ClientStateStore
from lowcomm.fl.workload import build_partition, initial_model, load_data, test_tensors, train_tensors

#: test samples scored per forward pass on the server
EVAL_BATCH = 4096


@dataclass
class Worker:
    """This process's place in the federation."""

    rank: int
    world: int
    device: torch.device
    #: True when :func:`join` created the process group (and so must destroy it)
    owns_group: bool = False

    @property
    def is_server(self) -> bool:
        """Rank 0 samples, plans, aggregates, evaluates and checkpoints."""
        return self.rank == 0


def join(cfg: FLConfig) -> Worker:
    """Join the process group torchrun's variables describe (gloo on CPU, NCCL + gloo on CUDA)."""
    from lowcomm.runtime.distributed import join_world

    joined = join_world(cfg.device)
    return Worker(joined.rank, joined.world, joined.device, joined.owns_group)


def client_generator(seed: int, round_: int, client: int) -> torch.Generator:
    """The batch-order generator of one client in one round (independent of the worker)."""
    mixed = np.random.SeedSequence([seed, round_, client]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(mixed) & (2**63 - 1))


def _cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


class Federation:
    """The state one worker keeps across rounds, and the round itself (:meth:`play_round`)."""

    def __init__(self, cfg: FLConfig, me: Worker) -> None:
        self.cfg = cfg
        self.me = me
        if cfg.cross_silo and cfg.clients != me.world:
            raise UsageError(f"--cross-silo puts one client on each worker: --clients {cfg.clients} "
                             f"must equal the number of workers ({me.world})")
        self.slowdown = parse_slowdown(",".join(str(s) for s in cfg.slowdown), me.world) \
            if cfg.slowdown else [1.0] * me.world
        self.bundle = load_data(cfg.data, data_dir=cfg.data_dir, data_args=cfg.data_args,
                                clients=cfg.clients, samples_per_client=cfg.samples_per_client)
        self.partition: Partition = build_partition(self.bundle, cfg.partition, clients=cfg.clients, seed=cfg.seed)
        x, y = train_tensors(self.bundle)
        self.x, self.y = x.to(me.device), y.to(me.device)
        self.model = initial_model(cfg.model, cfg.model_args, self.bundle, seed=cfg.seed).to(me.device)
        self.model.train()
        for module in cfg.algorithm_modules:
            load_algorithm_module(module)
        self.algorithm: Algorithm = create_algorithm(cfg.algorithm)
        self.global_flat = flat_params(self.model).detach().clone()
        self.num_params = self.global_flat.numel()
        self.algorithm.setup(self.num_params, me.device)
        self.contribution_spec = self.algorithm.contribution_spec(self.num_params)
        self.broadcast_spec = self.algorithm.server_broadcast_spec(self.num_params)
        state_spec = self.algorithm.client_state_spec(self.num_params)
        self.store: ClientStateStore | None = None
        if state_spec:
            self.store = ClientStateStore(self._state_dir(), num_clients=cfg.clients, spec=state_spec)
            if me.is_server and not cfg.resume:
                self.store.clear()  # a fresh run starts from zero states (before round 0's broadcast)
        self.scheduler = Scheduler(me.world, policy=cfg.schedule, warmup_rounds=cfg.warmup_rounds)
        self.train_hp = LocalTraining(lr=cfg.lr, local_epochs=cfg.local_epochs, batch_size=cfg.batch_size,
                                      momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        self.history: list[dict[str, Any]] = []
        self.next_round = 0
        self.elapsed_s = 0.0
        self.pending_commit: int | None = None

    def _state_dir(self) -> str:
        """The client store's folder. Across machines (simulation), a client moves between
        ranks of different machines, so its state must be on a filesystem all of them see."""
        cfg = self.cfg
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.me.world))
        if local_world < self.me.world and not cfg.cross_silo and not cfg.state_dir:
            raise UsageError(f"algorithm {cfg.algorithm!r} keeps state per client and this run spans several "
                             "machines: give --state-dir on a filesystem every machine mounts (or use "
                             "--cross-silo, where each client stays on its process)")
        if cfg.state_dir:
            return cfg.state_dir
        if cfg.checkpoint_dir:
            return os.path.join(cfg.checkpoint_dir, "client_state")
        raise UsageError(f"algorithm {cfg.algorithm!r} keeps state per client on disk: give --state-dir "
                         "DIR (or --checkpoint-dir, which keeps it in DIR/client_state)")

    # ---- the round ----------------------------------------------------------------------
    def sampled_clients(self, round_: int) -> np.ndarray:
        """This round's clients (identical on every rank: seeded by ``(seed, round)``)."""
        if self.cfg.cross_silo:
            return np.arange(self.cfg.clients, dtype=np.int64)
        return sample_clients(self.cfg.clients, self.cfg.per_round, seed=self.cfg.seed, round=round_)

    def _plan(self, round_: int, clients: np.ndarray, samples: np.ndarray) -> tuple[np.ndarray, Plan | None]:
        """Rank 0 plans, everyone receives the assignment (one small broadcast)."""
        if self.cfg.cross_silo:
            return clients.copy(), Plan(assignment=clients.copy(), kind="silo")
        assignment = torch.zeros(len(clients), dtype=torch.int64)
        plan = None
        if self.me.is_server:
            plan = self.scheduler.plan(round_, clients, samples)
            assignment.copy_(torch.from_numpy(np.asarray(plan.assignment, dtype=np.int64)))
        if self.me.world > 1:
            accounting.broadcast(assignment, 0, tag="fl.plan")
        return assignment.numpy(), plan

    def _broadcast_global(self) -> None:
        """The global model (and the algorithm's server extras) from rank 0 to every worker."""
        names = list(self.broadcast_spec)
        if self.me.is_server:
            extras = self.algorithm.server_broadcast()
            parts = [self.global_flat] + [extras[n].reshape(-1).to(self.me.device, torch.float32) for n in names]
            buf = torch.cat(parts) if names else self.global_flat.clone()
        else:
            buf = torch.empty(self.num_params + sum(self.broadcast_spec.values()), device=self.me.device)
        if self.me.world > 1:
            accounting.broadcast(buf, 0, tag="fl.model")
        self.global_flat = buf[: self.num_params].clone()
        received: dict[str, torch.Tensor] = {}
        offset = self.num_params
        for n in names:
            size = self.broadcast_spec[n]
            received[n] = buf[offset: offset + size]
            offset += size
        self.server_extras = received
        if not self.me.is_server:
            self.algorithm.load_server_broadcast(received)

    def _train_clients(self, round_: int, mine: np.ndarray) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """Train ``mine`` one after another; return the local sum and per-client (samples, seconds)."""
        total = sum(self.contribution_spec.values())
        acc = torch.zeros(total, device=self.me.device)
        views = {}
        offset = 0
        for name, size in self.contribution_spec.items():
            views[name] = acc[offset: offset + size]
            offset += size
        writer = self.store.writer(round_, self.me.rank) if self.store is not None else None
        samples = np.zeros(len(mine), dtype=np.int64)
        seconds = np.zeros(len(mine), dtype=np.float64)
        factor = self.slowdown[self.me.rank]
        sync = self.me.device.type == "cuda"
        try:
            for i, cid in enumerate(mine.tolist()):
                start = time.perf_counter()
                load_flat_(self.model, self.global_flat)
                idx = torch.from_numpy(self.partition.client(cid)).to(self.me.device)
                state = self.store.get(cid, self.me.device) if self.store is not None else {}
                ctx = ClientContext(
                    client_id=cid, round=round_, model=self.model, x=self.x[idx], y=self.y[idx],
                    global_params=self.global_flat, server=self.server_extras, state=state,
                    train=self.train_hp, generator=client_generator(self.cfg.seed, round_, cid),
                    loss_fn=_cross_entropy)
                contribution = self.algorithm.client_update(ctx)
                for name, view in views.items():
                    view.add_(contribution[name].reshape(-1).to(view.dtype))
                if writer is not None:
                    writer.put(cid, ctx.state)
                if sync:
                    torch.cuda.synchronize(self.me.device)  # per client, outside any hook: honest timing
                slow_down(factor, time.perf_counter() - start)
                samples[i] = int(idx.numel())
                seconds[i] = time.perf_counter() - start
        except BaseException:
            if writer is not None:
                writer.abort()  # a partial round's journal is never published
            raise
        if writer is not None:
            writer.close()
        return acc, samples, seconds

    def _gather_timings(self, samples: np.ndarray, seconds: np.ndarray, per_round: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every worker's per-client (samples, seconds), fixed-size so one all-gather carries them."""
        rows = 3 + 2 * per_round
        mine = torch.zeros(rows, dtype=torch.float64)
        n = len(samples)
        mine[0] = n
        mine[1] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
        # this round's bytes, the all-gather that carries them included
        mine[2] = ledger().wire_bytes - self.bytes_at_round_start + accounting.wire_bytes(
            "all_gather", rows * 8, self.me.world)
        mine[3: 3 + n] = torch.from_numpy(samples.astype(np.float64))
        mine[3 + per_round: 3 + per_round + n] = torch.from_numpy(seconds)
        if self.me.world > 1:
            out = torch.zeros(rows * self.me.world, dtype=torch.float64)
            accounting.all_gather_into_tensor(out, mine, tag="fl.timing")
        else:
            out = mine
        result = []
        table = out.view(self.me.world, rows).numpy()
        self.workers_peak_rss = float(table[:, 1].sum())
        self.round_bytes_per_worker = float(table[:, 2].mean())
        for row in table:
            k = int(row[0])
            result.append((row[3: 3 + k].astype(np.int64), row[3 + per_round: 3 + per_round + k].copy()))
        return result

    def play_round(self, round_: int) -> dict[str, Any]:
        """One round on this worker; rank 0 returns the round's record (others an empty dict)."""
        start = time.perf_counter()
        self.bytes_at_round_start = ledger().wire_bytes
        clients = self.sampled_clients(round_)
        samples = self.partition.sizes[clients]
        assignment, plan = self._plan(round_, clients, samples)
        self._broadcast_global()
        self._commit_pending()
        mine = clients[assignment == self.me.rank]
        acc, my_samples, my_seconds = self._train_clients(round_, mine)
        if self.me.world > 1:
            accounting.reduce(acc, 0, tag="fl.aggregate")
        if self.me.is_server:
            sums = {}
            offset = 0
            for name, size in self.contribution_spec.items():
                sums[name] = acc[offset: offset + size]
                offset += size
            self.global_flat = self.algorithm.server_update(
                self.global_flat, sums, round=round_, num_sampled=len(clients), num_clients=self.cfg.clients
            ).detach().reshape(-1).clone()
        timings = self._gather_timings(my_samples, my_seconds, len(clients))
        round_time = time.perf_counter() - start
        self.pending_commit = round_ if self.store is not None else None
        if not self.me.is_server:
            return {}
        for w, (s, t) in enumerate(timings):
            if len(s):
                self.scheduler.observe(w, s, t)
        actual = [float(t.sum()) for _, t in timings]
        record: dict[str, Any] = {
            "round": round_,
            "round_time_s": round_time,
            "train_makespan_s": max(actual) if actual else 0.0,
            "predicted_makespan_s": None if plan is None else plan.predicted_makespan_s,
            "plan": plan.record(samples, actual, self.me.world) if plan is not None else None,
            "clients": int(len(clients)),
            "bytes_per_worker": self.round_bytes_per_worker,
        }
        return record

    def _commit_pending(self) -> None:
        """Apply the previous round's journal: its checkpoint exists once rank 0 broadcast again.

        The barrier after it: a client this rank trained last round may be another rank's
        this round, which must read the applied state, not the one before it.
        """
        if self.store is not None and self.pending_commit is not None:
            self.store.commit(self.pending_commit, self.me.rank)
            self.pending_commit = None
            if self.me.world > 1:
                dist.barrier()

    def finish(self) -> None:
        """Last round: wait until rank 0 checkpointed, then apply the journals."""
        if self.me.world > 1:
            dist.barrier()
        self._commit_pending()

    # ---- evaluation -------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Test loss and accuracy of the global model (rank 0, whole test set)."""
        load_flat_(self.model, self.global_flat)
        self.model.eval()
        x, y = test_tensors(self.bundle)
        loss = torch.zeros((), dtype=torch.float64, device=self.me.device)
        correct = torch.zeros((), dtype=torch.float64, device=self.me.device)
        for b in range(0, len(y), EVAL_BATCH):
            xb, yb = x[b: b + EVAL_BATCH].to(self.me.device), y[b: b + EVAL_BATCH].to(self.me.device)
            out = self.model(xb).float()
            loss += nn.functional.cross_entropy(out, yb, reduction="sum").double()
            correct += (out.argmax(-1) == yb).sum().double()
        self.model.train()
        n = max(1, len(y))
        return {"test_loss": float(loss) / n, "test_accuracy": float(correct) / n}

    def partition_stats(self) -> dict[str, Any]:
        """Per-client statistics of the partition (for the report)."""
        num_classes = int(self.bundle.num_classes or (int(self.y.max()) + 1))
        return client_stats(self.partition, self.y.cpu().numpy(), num_classes)

    # ---- checkpoint -------------------------------------------------------------------
    def save(self, completed_rounds: int) -> None:
        """Rank 0: the state after ``completed_rounds`` rounds, atomically."""
        fl_checkpoint.save(self.cfg.checkpoint_dir or "", completed_rounds, {
            "global": self.global_flat.cpu(),
            "algorithm": self.algorithm.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "history": self.history,
            "elapsed_s": self.elapsed_s,
        }, config=self.cfg)

    def restore(self) -> None:
        """Continue from the last complete round in ``--checkpoint-dir`` (every rank reads it)."""
        found = fl_checkpoint.load(self.cfg.checkpoint_dir or "", config=self.cfg)
        if found is None:  # nothing saved yet: a fresh start, with fresh client states
            if self.store is not None and self.me.is_server:
                self.store.clear()
            return
        completed, state = found
        self.global_flat = state["global"].to(self.me.device, torch.float32)
        self.algorithm.load_state_dict(state["algorithm"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.history = list(state["history"])
        self.elapsed_s = float(state["elapsed_s"])
        self.next_round = completed
        if self.store is not None:
            if self.me.is_server:
                self.store.recover(completed - 1)
            if self.me.world > 1:
                dist.barrier()
