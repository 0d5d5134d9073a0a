"""The Flower side of ``benchmarks/fl_vs_flower.py``: FedAvg on Flower's simulation engine (Ray).

Why a separate script: flwr and Ray are never dependencies of lowcomm, so this file runs only
in the benchmark's own environment (``benchmarks/fl_env.sh``), as a subprocess of the
orchestrator, which measures its memory from outside (Ray's daemons and actors included).

Same setup as the lowcomm side, by construction rather than by copying numbers: lowcomm is
installed editable in that environment and this script builds the data, the partition, the
initial weights and each round's sampled clients with the very same lowcomm functions
(``lowcomm.fl.workload.load_data`` / ``build_partition`` / ``initial_model`` and
``lowcomm.fl.partition.sample_clients``) from the same setup file. A client's local training is
``lowcomm.fl.local.local_sgd`` (plain SGD, momentum 0, a new shuffle each epoch, mean CE loss),
and the server averages the returned weights by ``num-examples``: FedAvg as lowcomm runs it.

The modern Flower API is used (``ServerApp`` + ``ClientApp`` + ``flwr.simulation.run_simulation``,
the message-based ``FedAvg`` strategy with a server-side ``evaluate_fn``). Each Ray actor gets
``num_cpus`` = ``--cpus-per-client`` (default 1) of the ``--cpus`` Ray may use (default all
cores), so on a 2-core machine 2 actors train clients at once, and torch in each actor uses that
many threads (no oversubscription), like lowcomm's 2 worker processes with 1 thread each.

Flower samples the round's nodes itself; the strategy below replaces that by lowcomm's sampled
client ids (carried in each message's config), so both sides train the same clients each round.

    python benchmarks/flower_app.py --setup SETUP.json --out RESULT.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

_CACHE: dict[str, Any] = {}


# --- the shared workload (runs in the server process and in every Ray actor) ------------------


def workload(setup: dict[str, Any]) -> dict[str, Any]:
    """Data, partition and initial model for ``setup``, built once per process with lowcomm's
    own functions (so they are identical to the lowcomm side's)."""
    key = json.dumps(setup, sort_keys=True)
    if _CACHE.get("key") == key:
        return _CACHE
    from lowcomm.fl.workload import build_partition, initial_model, load_data

    bundle = load_data(setup["data"], data_dir=setup.get("data_dir"), data_args=setup.get("data_args", {}),
                       clients=setup["clients"], samples_per_client=setup.get("samples_per_client"))
    part = build_partition(bundle, setup["partition"], clients=setup["clients"], seed=setup["seed"])
    x, y = _stack(bundle.train)
    xt, yt = _stack(bundle.test)
    model = initial_model(setup["model"], setup.get("model_args", {}), bundle, seed=setup["seed"])
    _CACHE.clear()
    _CACHE.update(key=key, partition=part, x=x, y=y, x_test=xt, y_test=yt, model=model,
                  initial=[t.detach().clone() for t in model.state_dict().values()])
    return _CACHE


def _stack(ds: Any) -> tuple[Tensor, Tensor]:
    """A dataset as two tensors (TensorDataset directly, anything else item by item)."""
    if hasattr(ds, "tensors"):
        x, y = ds.tensors[0], ds.tensors[1]
    else:
        xs, ys = zip(*(ds[i] for i in range(len(ds))))
        x, y = torch.stack(list(xs)), torch.as_tensor(ys)
    return x.float(), y.long()


def train_client(setup: dict[str, Any], state: dict[str, Tensor], client_id: int,
                 round: int) -> tuple[dict[str, Tensor], int]:
    """One client's local training from the global ``state``: lowcomm.fl.local.local_sgd on the
    client's samples, batch order from lowcomm's own per-(seed, round, client) generator, so
    the batches are those the lowcomm engine draws. ``round`` counts from 0 as lowcomm's do.
    Returns the trained weights and the client's number of samples."""
    from lowcomm.fl.api import ClientContext, LocalTraining
    from lowcomm.fl.engine import client_generator
    from lowcomm.fl.local import local_sgd

    w = workload(setup)
    model: nn.Module = w["model"]
    model.load_state_dict(state)
    idx = torch.tensor(w["partition"].client(client_id), dtype=torch.long)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).float()
    ctx = ClientContext(
        client_id=client_id, round=round, model=model, x=w["x"][idx], y=w["y"][idx],
        global_params=params, server={}, state={},
        train=LocalTraining(lr=setup["lr"], local_epochs=setup["local_epochs"], batch_size=setup["batch_size"]),
        generator=client_generator(setup["seed"], round, client_id),
        loss_fn=nn.functional.cross_entropy)
    model.train()
    local_sgd(ctx)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, int(idx.numel())


@torch.no_grad()
def evaluate(setup: dict[str, Any], state: dict[str, Tensor]) -> tuple[float, float]:
    """Test accuracy (fraction) and mean CE loss of ``state`` on the whole test set."""
    w = workload(setup)
    model: nn.Module = w["model"]
    model.load_state_dict(state)
    model.eval()
    logits = model(w["x_test"])
    loss = float(nn.functional.cross_entropy(logits, w["y_test"]))
    acc = int((logits.argmax(1) == w["y_test"]).sum()) / len(w["y_test"])  # exact, as lowcomm counts
    return acc, loss


def sampled_clients(setup: dict[str, Any], round: int) -> list[int]:
    """The clients of ``round`` (from 0, as lowcomm counts): lowcomm's reproducible sampler,
    so both sides train the same clients."""
    from lowcomm.fl.partition import sample_clients

    return [int(c) for c in sample_clients(setup["clients"], setup["per_round"], seed=setup["seed"],
                                           round=round)]


# --- Flower ------------------------------------------------------------------------------------


def build_apps(setup: dict[str, Any], record: dict[str, Any]) -> tuple[Any, Any]:
    """The ClientApp and the ServerApp; the server fills ``record`` (per-round timings,
    accuracies) as it runs."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        cfg = msg.content["config"]
        client_setup = json.loads(str(cfg["setup"]))
        torch.set_num_threads(max(1, int(client_setup["cpus_per_client"])))
        state = msg.content["arrays"].to_torch_state_dict()
        # Flower counts rounds from 1, lowcomm from 0
        new_state, n = train_client(client_setup, state, int(cfg["client-id"]), int(cfg["server-round"]) - 1)
        content = RecordDict({"arrays": ArrayRecord(new_state),
                              "metrics": MetricRecord({"num-examples": n})})
        return Message(content=content, reply_to=msg)

    class SampledFedAvg(FedAvg):  # type: ignore[misc]
        """FedAvg whose round sends lowcomm's sampled client ids (one per message) instead of
        Flower's own node sampling; node ids only pick which virtual node runs a client."""

        def configure_train(self, server_round: int, arrays: Any, config: Any,
                            grid: Any) -> Iterable[Any]:
            record["_t_round_start"] = time.perf_counter()
            nodes = sorted(grid.get_node_ids())
            clients = sampled_clients(setup, server_round - 1)  # lowcomm counts rounds from 0
            messages = []
            for i, cid in enumerate(clients):
                cfg = ConfigRecord(dict(config))
                cfg["server-round"] = server_round
                cfg["client-id"] = cid
                content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: cfg})
                messages.append(Message(content=content, message_type="train",
                                        dst_node_id=nodes[i % len(nodes)]))
            return messages

    def evaluate_fn(server_round: int, arrays: Any) -> Any:
        # round_time_s is measured like lowcomm's: from sampling the round to the new global
        # model (local training and aggregation), test evaluation left out; elapsed_s has it
        t_round_end = time.perf_counter()
        acc, loss = evaluate(setup, arrays.to_torch_state_dict())
        now = time.perf_counter()
        if server_round == 0:
            record["_t0"] = now  # elapsed_s counts rounds only, as lowcomm's does
        else:
            start = record.pop("_t_round_start")
            record["history"].append({
                "round": server_round - 1, "test_accuracy": acc, "test_loss": loss,
                "round_time_s": t_round_end - start, "round_with_eval_s": now - start,
                "clients": setup["per_round"], "elapsed_s": now - record["_t0"]})
            print(f"flower round {server_round}: acc {acc:.4f} loss {loss:.4f} "
                  f"round {t_round_end - start:.2f} s", file=sys.stderr, flush=True)
        return MetricRecord({"accuracy": acc, "loss": loss})

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        w = workload(setup)
        initial = ArrayRecord(w["model"].state_dict())
        strategy = SampledFedAvg(fraction_train=1.0, fraction_evaluate=0.0,
                                 min_available_nodes=setup["clients"], weighted_by_key="num-examples")
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=setup["rounds"],
                       train_config=ConfigRecord({"setup": json.dumps(setup, sort_keys=True)}),
                       evaluate_fn=evaluate_fn)

    return client_app, server_app


def run(setup: dict[str, Any]) -> dict[str, Any]:
    """Run the whole simulation; the Flower side's result (C5-like history plus versions)."""
    import importlib.metadata as md

    from flwr.simulation import run_simulation

    record: dict[str, Any] = {"history": []}
    client_app, server_app = build_apps(setup, record)
    cpus = int(setup.get("cpus") or os.cpu_count() or 1)
    backend = {"client_resources": {"num_cpus": float(setup["cpus_per_client"]), "num_gpus": 0.0},
               "init_args": {"num_cpus": cpus, "include_dashboard": False}}
    t0 = time.perf_counter()
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=setup["clients"],
                   backend_config=backend)
    wall = time.perf_counter() - t0
    record.pop("_t0", None)
    hist = record["history"]
    if len(hist) != setup["rounds"]:
        raise RuntimeError(f"Flower finished {len(hist)} of {setup['rounds']} rounds (see its log above)")
    return {"side": "flower", "history": hist, "wall_s": wall,
            "final_test_accuracy": hist[-1]["test_accuracy"],
            "actors": int(cpus // float(setup["cpus_per_client"])), "ray_num_cpus": cpus,
            "versions": {p: md.version(p) for p in ("flwr", "ray", "torch")}}


def main(argv: list[str] | None = None) -> int:
    """Read the setup file, run, write the result file."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setup", required=True, help="setup JSON written by fl_vs_flower.py")
    ap.add_argument("--out", required=True, help="where to write the result JSON")
    args = ap.parse_args(argv)
    setup = json.loads(Path(args.setup).read_text())
    result = run(setup)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
