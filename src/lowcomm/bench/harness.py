"""``lowcomm bench``: run several methods one after another on the same model, data shape,
batch and network, each as real worker processes, and collect comparable rows.

Why out of process: each method runs exactly as a user would run it (``lowcomm train`` in N
workers, each in its own shaped namespace), so the measured time includes everything the
real run pays: gloo over TCP, the shaper, the Python overhead of the hooks. The harness only
reads each run's summary JSON (rank 0 writes it) and adds the derived columns
(:mod:`lowcomm.bench.bounds`). The compute-only reference is the ``nocomm`` method, measured
once per invocation and reused for every network (it sends nothing, so the link does not
matter).

A method that fails becomes a row with ``status: "failed"`` and the last lines of its log as
the reason; the remaining methods still run. A network the machine cannot shape to within
15% of the request marks its rows failed with the measured rate. Namespaces are removed by
:class:`lowcomm.bench.netns.Cluster` whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from lowcomm.bench import bounds, collprobe, netns, prediction, repeats, schedule_bound, trained
from lowcomm.bench.compress_probe import measure_shared
from lowcomm.bench.compute_profile import bench_profile, compute_label, gloo_contention
from lowcomm.bench.environment import machine, network
from lowcomm.bench.runner import BenchConfig, Launcher, run_method
from lowcomm.errors import UsageError

#: Measured bandwidth below this fraction of the request: the rate is unreachable here.
REACHABLE_FRACTION = 0.85


# --- validation (before anything starts) ----------------------------------------------------


def validate_methods(specs: list[str]) -> list[str]:
    """Every name must be registered and its options valid; refuse otherwise (nothing ran)."""
    from lowcomm import methods

    if not specs:
        raise UsageError("--methods needs at least one method, e.g. ssgd,fp16,powersgd")
    valid = methods.names(include_timing_only=True)
    unknown = [s for s in specs if methods.split_spec(s)[0] not in valid]
    if unknown:
        raise UsageError(f"unknown method(s) {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")
    for s in specs:
        methods.create(s)  # options are parsed and checked here
    seen: list[str] = []
    for s in specs:
        if s in seen:
            raise UsageError(f"method {s!r} is listed twice in --methods")
        seen.append(s)
    return specs


def _param_count(model: str) -> int | None:
    try:
        from lowcomm import models

        return sum(p.numel() for p in models.create(model).parameters())
    except UsageError:
        raise
    except Exception:  # noqa: BLE001 - the trainer will report a model that cannot be built
        return None


def check_capacity(nproc: int, model: str, *, cpus: int | None = None, available_bytes: int | None = None) -> None:
    """Refuse a world size this machine cannot hold: too many processes per core, or more
    memory than is available (each worker holds the model, its gradients, optimizer state
    and communication buffers, plus ~400 MB for Python and PyTorch)."""
    cpus = cpus or os.cpu_count() or 1
    if nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {nproc}")
    if nproc > netns.MAX_WORKERS:
        raise UsageError(f"--nproc {nproc} is more workers than the emulated subnet holds; valid: 1-{netns.MAX_WORKERS}")
    if nproc > 8 * cpus:
        raise UsageError(
            f"--nproc {nproc} is more than this machine can hold: {cpus} CPU core(s) allow at most "
            f"{8 * cpus} workers (8 per core)"
        )
    if available_bytes is None:
        try:
            import psutil

            available_bytes = int(psutil.virtual_memory().available)
        except Exception:  # noqa: BLE001
            return
    params = _param_count(model)
    per_worker = 400e6 + (params or 0) * 4 * 6
    if nproc * per_worker > available_bytes:
        raise UsageError(
            f"--nproc {nproc} with model {model!r} needs about {nproc * per_worker / 1e9:.1f} GB "
            f"({per_worker / 1e9:.2f} GB per worker) but only {available_bytes / 1e9:.1f} GB is available; "
            f"use at most {max(1, int(available_bytes // per_worker))} workers"
        )


# --- the whole benchmark ------------------------------------------------------------------


def _reference_of(spec: str) -> str:
    """The compute reference of one method spec (``nocomm`` where the spec cannot be read)."""
    try:
        return trained.compute_reference(spec)
    except UsageError:
        return "nocomm"


def _compute_references(methods: list[str]) -> dict[str, str]:
    """method -> the run that measures its computation alone (:mod:`lowcomm.bench.trained`)."""
    return {m: _reference_of(m) for m in methods}


def _collectives(cfg: BenchConfig, cluster: netns.Cluster | None, bits_per_s: float | None, work: Path) -> dict[str, Any]:
    return collprobe.run(cfg.nproc, bits_per_s=bits_per_s, threads=cfg.threads or 1, cluster=cluster,
                         work_dir=work, nproc_per_node=cfg.nproc_per_node)


def _run_round(cfg: BenchConfig, order: list[str], *, work: Path, tag: str, row_fields: dict[str, Any],
               cluster: netns.Cluster | None, launcher: Launcher | None, say: Callable[[str], None],
               round_no: int, references: frozenset[str] = frozenset({"nocomm"})) -> list[dict[str, Any]]:
    """Run ``order`` once on one network: one row per method, each given ``row_fields`` (a second
    run of a compute reference in ``references`` replaces the first when faster, both times kept
    in ``nocomm_runs_s``, or ``compute_runs_s`` for a model-axis reference such as
    ``pufferfish:then=nocomm``). ``round_no`` (1-based) names the round in the logs when the
    bench runs several."""
    rows: list[dict[str, Any]] = []
    several = cfg.repeat > 1
    suffix = f"-r{round_no}" if several else ""
    for k, m in enumerate(order):
        say(f"  running {m} on {cfg.nproc} workers" + (f" (round {round_no} of {cfg.repeat})" if several else "") + " ...")
        again = m in references and m in order[:k]
        run_tag = f"{tag}-{re.sub(r'[^A-Za-z0-9_.=-]', '_', m)}" + ("-again" if again else "") + suffix
        try:
            row = run_method(cfg, m, work=work, tag=run_tag, cluster=cluster, launcher=launcher)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # noqa: BLE001 - one broken method must not stop the others
            row = {"method": m, "status": "failed", "reason": f"{type(e).__name__}: {e}"}
        row.update(row_fields)
        say(f"    {m}: " + (f"{row['iter_time_s_median']:.3g} s/iter" if row["status"] == "ok"
                             else f"FAILED ({row['reason']})"))
        if again:
            first = next(r for r in rows if r["method"] == m)
            times = [r["iter_time_s_median"] for r in (first, row) if r["status"] == "ok"]
            if row["status"] == "ok" and (first["status"] != "ok" or row["iter_time_s_median"] < first["iter_time_s_median"]):
                rows[rows.index(first)] = row
                first = row
            first["nocomm_runs_s" if m == "nocomm" else "compute_runs_s"] = times
            continue
        rows.append(row)
    return rows


def run_bench(
    cfg: BenchConfig,
    *,
    launcher: Launcher | None = None,
    log: Callable[[str], None] | None = None,
    profiler: Callable[[BenchConfig], Any] | None = None,
    collective_probe: Callable[..., dict[str, Any]] | None = None,
    contention_probe: Callable[[BenchConfig, netns.Cluster | None], dict[str, float]] | None = None,
    compress_probe: Callable[..., dict[str, dict[str, float]]] | None = None,
) -> dict[str, Any]:
    """Run every method on every network; return the result dict (see DESIGN.md section 3).

    With ``cfg.predict`` (timing mode only) the model is profiled once and every network's
    collectives are probed, and each row gets the simulator's ``predicted_iter_time_s``
    (:mod:`lowcomm.bench.prediction`). ``profiler``/``collective_probe`` replace the real
    measurements in tests; so does ``compress_probe`` the codecs' times with ``nproc``
    processes at once (:func:`lowcomm.bench.compress_probe.measure_shared`), taken with
    emulated compute, where it prices the rows' compression.
    """
    say = log or (lambda s: None if cfg.quiet else print(s, file=sys.stderr, flush=True))
    work = Path(cfg.work_dir or tempfile.mkdtemp(prefix="lowcomm-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    methods = list(cfg.methods)
    result: dict[str, Any] = {
        "command": "bench",
        "model": cfg.model + "".join(
            f" {a}" for i, a in enumerate(cfg.extra_train_args) if i and cfg.extra_train_args[i - 1] == "--model-arg"
        ),
        "data": cfg.data,
        "data_label": (f"synthetic {cfg.input_shape} input" if cfg.data == "synthetic" else cfg.data),
        "input_shape": cfg.input_shape if cfg.data == "synthetic" else None,
        "world_size": cfg.nproc,
        "nodes": cfg.nodes,
        "nproc_per_node": cfg.nproc_per_node or 1,
        "batch_size": cfg.batch_size,
        "iters": cfg.iters,
        "warmup_iters": cfg.warmup,
        "repeat": cfg.repeat,
        "epochs": cfg.epochs,
        "threads_per_worker": cfg.threads,
        "machine": machine(),
        "compute": compute_label(cfg),  # "real" or "emulated:<what>" (every row says it too)
        "work_dir": str(work),
        "networks": [],
        "runs": [],
        "lower_bound_note": (
            "lower bound = max(compute-only time of the model as trained [nocomm, or the method's own "
            "compute reference], bytes/iter at the measured bandwidth) + the compression kernels' bound; "
            "schedule bound = the method's own schedule simulated with that compute on a zero-latency link "
            "at the measured bandwidth + the kernels' bound"
        ),
    }
    compute_only: float | None = None
    started = time.perf_counter()
    rates = None
    if cfg.compute_only and not cfg.tta:  # the kernel bound's denominators, measured once
        rates = trained.machine_rates(cfg.threads, workers=cfg.nproc)  # every worker runs on this machine
        result["kernel_bound_rates"] = rates
        if "shared_error" in rates:
            say(f"  kernels' bound at one process's rates (the workers' share not measured: {rates['shared_error']})")
    references = _compute_references(methods)
    profile = None
    predict = cfg.predict and not cfg.tta
    if predict:
        say("lowcomm bench: profiling the model for the simulator's predictions ...")
        try:
            profile = (profiler or bench_profile)(cfg)
            result["prediction"] = {"profile": {"model": profile.model, "batch_size": profile.batch_size,
                                                "forward_s": profile.forward_s, "backward_s": profile.backward_s,
                                                "optimizer_s": profile.optimizer_s,
                                                "threads": cfg.threads, "device": profile.device},
                                    "profile_path": str(work / "profile.json")}
            profile.save(work / "profile.json")
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # noqa: BLE001 - predictions are an extra; the bench still runs
            result["prediction"] = {"error": f"{type(e).__name__}: {e}"}
            say(f"  no predictions: {result['prediction']['error']}")
    if profile is not None and result["compute"] != "real":
        say(f"lowcomm bench: timing the codecs with {cfg.nproc} processes at once (compute emulated) ...")
        try:
            result["prediction"]["shared_compressors"] = (compress_probe or measure_shared)(
                profile.param_shapes, cfg.nproc, threads=cfg.threads or 1)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # noqa: BLE001 - the one-process times scaled by the core share remain
            say(f"  codecs not timed together ({type(e).__name__}: {e}); their one-process times scaled")
    for n_idx, spec in enumerate(cfg.nets):
        say(f"lowcomm bench: network {spec.label()}")
        try:
            with network(spec, cfg.nproc, say, cfg.nproc_per_node or 1) as (cluster, info):
                result["networks"].append(info)
                bw = info.get("measured_bits_per_s")
                say(f"  link probe: {netns.format_rate(bw) if bw else '?'}, RTT {info.get('rtt_ms', 0):.3g} ms"
                    + ("" if info["emulated"] else " (loopback)"))
                if info["emulated"] and spec.rate_bits_per_s and bw and bw < REACHABLE_FRACTION * spec.rate_bits_per_s:
                    info["error"] = (f"requested {netns.format_rate(spec.rate_bits_per_s)} is unreachable on this "
                                     f"machine: the probe measured {netns.format_rate(bw)}")
                    say(f"  {info['error']}")
                    for m in methods:
                        result["runs"].append({"method": m, "net": spec.requested, "status": "failed",
                                               "reason": info["error"], "compute": result["compute"]})
                    continue
                if profile is not None:
                    say("  probing gloo collectives (latency and bandwidth per kind) ...")
                    try:
                        info["collectives"] = (collective_probe or _collectives)(cfg, cluster, bw, work)
                    except (KeyboardInterrupt, SystemExit):
                        raise
                    except Exception as e:  # noqa: BLE001
                        info["collectives"] = {"error": f"{type(e).__name__}: {e}"}
                    if info["collectives"].get("error"):
                        say(f"  {info['collectives']['error']}; predictions use alpha = RTT/2")
                contention: dict[str, float] = {}
                if profile is not None:
                    # measured on this network's links: the CPU a byte costs through the emulated
                    # links (veth, bridge, shaping, TCP at the shaped rate) is 3x loopback's at
                    # 1 Gbit/s and 40x at 100 Mbit/s here (docs/simulator.md 5.2); with emulated
                    # compute it slows the host work beside the transfers (5.3)
                    say("  measuring the CPU gloo's threads take from compute on this network ...")
                    try:
                        contention = (contention_probe or gloo_contention)(cfg, cluster)
                    except (KeyboardInterrupt, SystemExit):
                        raise
                    except Exception as e:  # noqa: BLE001 - predictions are an extra
                        say(f"  no contention term: {type(e).__name__}: {e}")
                order = list(methods)
                # compute-only is measured on every network, right before its methods: on a shared
                # machine the load drifts, and a reference from minutes ago is not comparable.
                if cfg.compute_only and not cfg.tta and "nocomm" not in order:
                    order.insert(0, "nocomm")
                    if len(order) > 2 and cfg.repeat == 1:
                        # measured again after the methods: the faster of the two is the reference
                        # (a load spike during one nocomm run would skew every bound and prediction);
                        # with rounds, each round's nocomm run is one more such measurement
                        order.append("nocomm")
                if cfg.compute_only and not cfg.tta:  # model-axis methods: their own model, no communication
                    own = [r for r in dict.fromkeys(references.values()) if r != "nocomm" and r not in order]
                    order[1:1] = own
                    if order.count("nocomm") == 2:  # measured again after the methods, as nocomm
                        order.extend(own)
                fields = {"net": spec.requested, "compute": result["compute"]}
                compute_refs = frozenset({"nocomm", *references.values()})
                rounds = [_run_round(cfg, order, work=work, tag=f"net{n_idx}", row_fields=fields, cluster=cluster,
                                     launcher=launcher, say=say, round_no=i + 1, references=compute_refs)
                          for i in range(cfg.repeat)]
                rows = rounds[0] if cfg.repeat == 1 else repeats.combine_rounds(rounds, references=set(compute_refs))
                compute_only = next((r["iter_time_s_median"] for r in rows
                                     if r["method"] == "nocomm" and r["status"] == "ok"), None)
                ssgd = next((r for r in rows if r["method"] == "ssgd" and r["status"] == "ok"), None)
                measured = {r["method"]: r["iter_time_s_median"] for r in rows if r["status"] == "ok"}
                for r in rows:
                    if r["status"] == "ok":
                        ref = references.get(r["method"]) or _reference_of(r["method"])
                        r["compute_reference"] = ref
                        r.update(bounds.derive(
                            r, batch_size=cfg.batch_size, world_size=cfg.nproc, bits_per_s=bw,
                            compute_only_s=compute_only if ref == "nocomm" else measured.get(ref),
                            ssgd_iter_s=ssgd["iter_time_s_median"] if ssgd else None,
                            nproc_per_node=cfg.nproc_per_node or 1,
                            compress_bound_s=trained.row_compression_bound_s(r, world=cfg.nproc, rates=rates),
                            compute_full_model_s=compute_only,
                        ))
                        if rates and "one_process" in rates:  # the bound had the workers' shares; kept: one's own
                            r["compress_bound_one_process_s"] = trained.row_compression_bound_s(
                                r, world=cfg.nproc, rates=rates["one_process"])
                    r.pop("grad_shapes", None)  # used; 100s of shapes per row would bury the JSON
                if profile is not None:
                    try:
                        from lowcomm.sim.calibrate import core_share

                        share = core_share(workers=cfg.nproc, threads_per_worker=cfg.threads or 1,
                                           cpus=os.cpu_count() or 1)  # every worker runs on this machine
                        info["prediction"] = prediction.add_predictions(rows, profile, info, workers=cfg.nproc,
                                                                        nproc_per_node=cfg.nproc_per_node or 1,
                                                                        contention_s_per_byte=contention.get("cpu_s_per_wire_byte", 0.0),
                                                                        contention_s_per_collective=contention.get("cpu_s_per_collective", 0.0),
                                                                        cpu_share=share,
                                                                        shared_compressors=result["prediction"].get("shared_compressors"))
                    except (KeyboardInterrupt, SystemExit):
                        raise
                    except Exception as e:  # noqa: BLE001
                        info["prediction"] = {"error": f"{type(e).__name__}: {e}"}
                        say(f"  no predictions: {info['prediction']['error']}")
                    try:  # each method's own limit: its schedule on an ideal link (schedule_bound.py)
                        info["schedule_bound"] = schedule_bound.add_schedule_bounds(
                            rows, profile, info, workers=cfg.nproc, nproc_per_node=cfg.nproc_per_node or 1)
                    except (KeyboardInterrupt, SystemExit):
                        raise
                    except Exception as e:  # noqa: BLE001 - an extra column; the rows stand
                        info["schedule_bound"] = {"error": f"{type(e).__name__}: {e}"}
                        say(f"  no schedule bounds: {info['schedule_bound']['error']}")
                result["runs"].extend(rows)
        except UsageError as e:  # e.g. a delay this kernel cannot emulate
            if len(result["networks"]) == n_idx:
                result["networks"].append({"requested": spec.requested, "label": spec.label(), "emulated": False})
            result["networks"][n_idx]["error"] = str(e)
            say(f"  {e}")
            done = {r["method"] for r in result["runs"] if r.get("net") == spec.requested}
            for m in methods:
                if m not in done:
                    result["runs"].append({"method": m, "net": spec.requested, "status": "failed", "reason": str(e),
                                           "compute": result["compute"]})
    result["network"] = result["networks"][0] if result["networks"] else None
    result["total_wall_s"] = time.perf_counter() - started
    with contextlib.suppress(OSError):
        result["machine"]["load_avg_1m_at_end"] = os.getloadavg()[0]
    return result
