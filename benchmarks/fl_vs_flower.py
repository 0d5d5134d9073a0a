"""lowcomm's federated simulation against Flower (flwr[simulation] + Ray), same setup, same machine.

Why: issue 15's targets are relative to the simulator most users pick — at 1000 clients per
round on 2 worker processes, lowcomm must be >= 10x faster per round and hold >= 10x less
memory than Flower *in the same run*, with final accuracy within 1 point after the same rounds.
Numbers measured elsewhere cannot show that, so this script runs both, one after the other:

* **lowcomm**: ``lowcomm fl ... --json FILE`` (a subprocess of this script's interpreter).
* **Flower**: ``benchmarks/flower_app.py`` on the benchmark's own interpreter (``fl_env.sh``
  builds it: flwr 1.41 + Ray, torch CPU, lowcomm editable). It imports lowcomm to build the
  same data, partition, initial weights and per-round client sample from the same setup (see
  :func:`same_setup`), and trains each client with lowcomm's own ``local_sgd``.

Both sides: 1000 MNIST-1D clients of 40 training samples, Dirichlet(0.5) by label, the MLP
40-256-256-10 (``mlp`` with ``hidden=256``), FedAvg weighted by samples, 1 local epoch, batch
16, plain SGD; 100 and 1000 clients per round. lowcomm runs 2 worker processes, Flower 2 Ray
actors (``num_cpus=1`` each of the 2 that Ray may use); each uses 1 torch thread per worker.

Memory is measured from outside, the same way for both sides: every ``--sample-interval``
seconds the RSS and the PSS of every process of the run are summed, and the peak over time of
each sum is kept. "Every process of the run" is the side's process tree *plus* every process
that carries this run's marker in its environment (a variable set for the side's subprocess,
which Ray's raylet, GCS, agents and actor workers inherit even where they are not
descendants). PSS counts each shared page (torch's libraries) once; RSS once per process.
Processes of the run still alive after its end are ended by pid and counted in the result.

Round time is each side's own per-round wall clock, measured alike: from sampling the round's
clients to the new global model (broadcast, local training, aggregation); the server-side test
evaluation after it is left out of it (it is in ``elapsed_s``, the x-axis of the wall-clock
plot). The median over rounds is the headline; the first round, which also pays Ray's actor
start-up, is shown apart.

    benchmarks/fl_env.sh                                   # once: .bench-fl-venv
    .venv/bin/python benchmarks/fl_vs_flower.py            # both scenarios, both sides
    .venv/bin/python benchmarks/fl_vs_flower.py --table-only   # re-render Markdown and plot

Results: ``benchmarks/results/fl_vs_flower.json`` (each run saved as it ends), the Markdown
block ``fl-vs-flower`` (``docs/bench/fl_vs_flower.md``, and ``docs/fl.md`` when it has the
block) and the plot ``docs/bench/fl_vs_flower.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy as acc  # noqa: E402  (the sibling script: machine, git commit, doc blocks)
from fl_vs_flower_report import compare, gb, plot, render_markdown  # noqa: E402

REPO = acc.REPO
RESULTS = REPO / "benchmarks" / "results" / "fl_vs_flower.json"
MARKDOWN = REPO / "docs" / "bench" / "fl_vs_flower.md"
PLOT = REPO / "docs" / "bench" / "fl_vs_flower.png"
DOC = REPO / "docs" / "fl.md"
BLOCK = "fl-vs-flower"
FLOWER_APP = REPO / "benchmarks" / "flower_app.py"
MARKER = "LOWCOMM_FL_BENCH_RUN"
SIDES = ("lowcomm", "flower")


# --- the setup both sides share ----------------------------------------------------------------


def same_setup(args: argparse.Namespace, per_round: int) -> dict[str, Any]:
    """Everything that defines the experiment, once: the Flower side reads it from a file, the
    lowcomm command is derived from it (:func:`lowcomm_command`), so they cannot drift."""
    return {"data": "mnist1d", "data_dir": args.data_dir, "data_args": {}, "clients": args.clients,
            "samples_per_client": args.samples_per_client, "partition": args.partition,
            "seed": args.seed, "model": "mlp", "model_args": {"hidden": args.hidden},
            "algorithm": "fedavg", "rounds": args.rounds, "per_round": per_round,
            "local_epochs": args.local_epochs, "batch_size": args.batch_size, "lr": args.lr,
            "nproc": args.nproc, "cpus": args.nproc, "cpus_per_client": 1}


def lowcomm_command(setup: dict[str, Any], json_path: Path) -> list[str]:
    """The ``lowcomm fl`` command of ``setup`` (run with this script's interpreter)."""
    cmd = [sys.executable, "-m", "lowcomm", "fl", "--clients", str(setup["clients"]),
           "--per-round", str(setup["per_round"]), "--nproc", str(setup["nproc"]),
           "--algorithm", setup["algorithm"], "--model", setup["model"],
           *[a for k, v in setup["model_args"].items() for a in ("--model-arg", f"{k}={v}")],
           "--data", setup["data"], "--partition", setup["partition"],
           "--rounds", str(setup["rounds"]), "--local-epochs", str(setup["local_epochs"]),
           "--batch-size", str(setup["batch_size"]), "--lr", str(setup["lr"]),
           "--seed", str(setup["seed"]), "--samples-per-client", str(setup["samples_per_client"]),
           "--threads", str(setup["cpus_per_client"]), "--eval-every", "1", "--device", "cpu", "--quiet",
           "--json", str(json_path)]
    if setup.get("data_dir"):
        cmd += ["--data-dir", str(setup["data_dir"])]
    return cmd


def flower_command(python: str, setup_path: Path, out_path: Path) -> list[str]:
    """The Flower side's command on the benchmark environment's interpreter."""
    return [python, str(FLOWER_APP), "--setup", str(setup_path), "--out", str(out_path)]


# --- memory of every process of a run ----------------------------------------------------------


class RunMemorySampler:
    """Peak over time of the summed RSS and PSS of a run's processes: the tree under ``root_pid``
    plus every process whose environment holds ``MARKER=token`` (Ray's daemons included)."""

    def __init__(self, root_pid: int, token: str, interval_s: float) -> None:
        self.root_pid, self.token, self.interval_s = root_pid, token, interval_s
        self._known: dict[tuple[int, float], bool] = {}  # (pid, create_time) -> belongs to the run
        self.peak = {"rss_bytes": 0, "pss_bytes": 0, "processes": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def members(self) -> list[Any]:
        """The run's live processes now."""
        import psutil

        found: dict[int, Any] = {}
        try:
            root = psutil.Process(self.root_pid)
            for p in [root, *root.children(recursive=True)]:
                found[p.pid] = p
        except psutil.Error:
            pass
        for p in psutil.process_iter():
            try:
                key = (p.pid, p.create_time())
                if key not in self._known:
                    self._known[key] = p.environ().get(MARKER) == self.token
                if self._known[key]:
                    found.setdefault(p.pid, p)
            except psutil.Error:
                continue
        return list(found.values())

    def sample(self) -> None:
        """One sample folded into the peaks."""
        import psutil

        rss = pss = n = 0
        for p in self.members():
            try:
                full = p.memory_full_info()
            except psutil.Error:
                continue
            rss += int(full.rss)
            pss += int(getattr(full, "pss", full.rss))
            n += 1
        for key, value in (("rss_bytes", rss), ("pss_bytes", pss), ("processes", n)):
            self.peak[key] = max(self.peak[key], value)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> None:
        """Sample now and then in the background."""
        self.sample()
        self._thread.start()

    def stop(self) -> dict[str, int]:
        """Stop sampling; the peaks."""
        self._stop.set()
        self._thread.join()
        return dict(self.peak)

    def end_leftovers(self, grace_s: float = 10.0) -> int:
        """End the run's processes still alive ``grace_s`` after its end (Ray daemons that a
        driver left behind), by pid; how many had to be ended."""
        import psutil

        left = [p for p in self.members() if p.pid != self.root_pid]
        _, alive = psutil.wait_procs(left, timeout=grace_s)
        for p in alive:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, stuck = psutil.wait_procs(alive, timeout=5)
        for p in stuck:
            try:
                p.kill()
            except psutil.Error:
                pass
        return len(alive)


def run_measured(cmd: list[str], interval_s: float, timeout_s: float) -> dict[str, Any]:
    """Run ``cmd`` with a fresh marker, sampling memory; returncode, wall time, peaks, log tail."""
    token = uuid.uuid4().hex
    env = {**os.environ, MARKER: token}
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        sampler = RunMemorySampler(proc.pid, token, interval_s)
        sampler.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        wall = time.perf_counter() - t0
        peak = sampler.stop()
        leftovers = sampler.end_leftovers()
        log.seek(0)
        tail = log.read()[-3000:]
    return {"returncode": rc, "wall_s": round(wall, 2), "peak_memory": peak,
            "leftover_processes_ended": leftovers, "log_tail": tail, "command": " ".join(cmd)}


# --- one side, one scenario --------------------------------------------------------------------


def summarize(history: list[dict[str, Any]]) -> dict[str, Any]:
    """Headline numbers of a per-round history (C5 records)."""
    times = [float(r["round_time_s"]) for r in history]
    return {"rounds": len(history), "round_time_s_median": statistics.median(times) if times else None,
            "first_round_s": times[0] if times else None,
            "round_time_s_median_after_first": statistics.median(times[1:]) if len(times) > 1 else None,
            "final_test_accuracy": float(history[-1]["test_accuracy"]) if history else None}


def run_side(side: str, setup: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Run one side of one scenario; its record (``status`` ok or failed with the log tail)."""
    out = work / f"{side}-{setup['per_round']}.json"
    out.unlink(missing_ok=True)
    if side == "lowcomm":
        cmd = lowcomm_command(setup, out)
    else:
        if not Path(args.flower_python).exists():
            return {"status": "failed", "returncode": None,
                    "error": f"no interpreter at {args.flower_python}: run benchmarks/fl_env.sh first"}
        setup_path = work / f"setup-{setup['per_round']}.json"
        setup_path.write_text(json.dumps(setup, indent=1))
        cmd = flower_command(args.flower_python, setup_path, out)
    run = run_measured(cmd, args.sample_interval, args.timeout)
    if run["returncode"] != 0 or not out.exists():
        return {"status": "failed", **run}
    result = json.loads(out.read_text())
    history = [{k: r.get(k) for k in ("round", "test_accuracy", "test_loss", "round_time_s",
                                      "round_with_eval_s", "train_makespan_s", "elapsed_s")}
               for r in result["history"]]
    extra = {k: result[k] for k in ("versions", "actors", "ray_num_cpus", "peak_memory",
                                    "bytes_per_round_per_worker") if k in result}
    if "peak_memory" in extra:
        extra["self_reported_peak_memory"] = extra.pop("peak_memory")
    run.pop("log_tail")
    return {"status": "ok", **run, **summarize(history), **extra, "history": history}


def scenario_key(setup: dict[str, Any]) -> str:
    """Result key of a scenario: every setting that changes the numbers."""
    return (f"c{setup['clients']}x{setup['samples_per_client']}-k{setup['per_round']}-r{setup['rounds']}"
            f"-e{setup['local_epochs']}-b{setup['batch_size']}-lr{setup['lr']}-h{setup['model_args'].get('hidden')}"
            f"-{setup['partition']}-s{setup['seed']}-n{setup['nproc']}")


def write_outputs(doc: dict[str, Any], args: argparse.Namespace) -> None:
    """Markdown file, the block in docs/fl.md when it has one, and the plot."""
    body = render_markdown(doc)
    md = Path(args.markdown)
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(f"<!-- {BLOCK}:begin -->\n{body}<!-- {BLOCK}:end -->\n")
    doc_path = Path(args.doc)
    if doc_path.exists() and f"<!-- {BLOCK}:begin -->" in doc_path.read_text():
        acc.write_doc(doc_path, BLOCK, body)
    plot(doc, Path(args.plot))


# --- command line ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's options (defaults: the issue's comparison)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flower-python", default=str(REPO / ".bench-fl-venv" / "bin" / "python"),
                    help="interpreter of the benchmark environment (benchmarks/fl_env.sh)")
    ap.add_argument("--per-round", type=int, nargs="+", default=[100, 1000], metavar="K")
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--samples-per-client", type=int, default=40)
    ap.add_argument("--partition", default="dirichlet:alpha=0.5")
    ap.add_argument("--hidden", type=int, default=256, help="MLP width (40-H-H-10)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nproc", type=int, default=2, help="lowcomm workers = Ray CPUs (1 per actor)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    ap.add_argument("--sample-interval", type=float, default=0.5, help="memory sampling period (s)")
    ap.add_argument("--timeout", type=float, default=3600, help="per run (s)")
    ap.add_argument("--force", action="store_true", help="re-run sides already in the results")
    ap.add_argument("--table-only", action="store_true", help="only re-render Markdown and plot")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--markdown", default=str(MARKDOWN))
    ap.add_argument("--doc", default=str(DOC))
    ap.add_argument("--plot", default=str(PLOT))
    args = ap.parse_args(argv)
    for name in ("clients", "samples_per_client", "rounds", "local_epochs", "batch_size", "nproc"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(k < 1 or k > args.clients for k in args.per_round):
        ap.error(f"--per-round values must be in 1..--clients ({args.clients}), got {args.per_round}")
    if not args.lr > 0 or not args.sample_interval > 0:
        ap.error("--lr and --sample-interval must be > 0")
    return args


def load(path: Path) -> dict[str, Any]:
    """The result document (empty when there is none yet)."""
    if path.exists():
        return dict(json.loads(path.read_text()))
    return {"benchmark": "fl_vs_flower", "scenarios": {}}


def save(path: Path, doc: dict[str, Any]) -> None:
    """Atomic write: an interrupted run keeps the sides already measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    """Run the missing sides of every scenario, saving after each; then render."""
    args = parse_args(argv)
    results = Path(args.results)
    doc = load(results)
    if not args.table_only:
        with tempfile.TemporaryDirectory(prefix="fl-vs-flower-") as tmp:
            for k in args.per_round:
                setup = same_setup(args, k)
                sc = doc["scenarios"].setdefault(scenario_key(setup), {})
                sc["setup"] = setup
                for side in args.sides:
                    if sc.get(side, {}).get("status") == "ok" and not args.force:
                        print(f"{k}/round {side}: already measured (--force to re-run)", file=sys.stderr)
                        continue
                    print(f"{k}/round {side}: running ...", file=sys.stderr, flush=True)
                    sc[side] = run_side(side, setup, args, Path(tmp))
                    sc["machine"], sc["git_commit"] = acc.machine(), acc._git_commit()
                    save(results, doc)
                    r = sc[side]
                    print(f"{k}/round {side}: {r['status']}"
                          + (f", median round {r['round_time_s_median']:.3f} s, peak PSS "
                             f"{gb(r['peak_memory']['pss_bytes'])}" if r["status"] == "ok"
                             else f"\n{r.get('log_tail') or r.get('error', '')}"), file=sys.stderr)
                sc["comparison"] = compare(sc)
                save(results, doc)
    write_outputs(doc, args)
    print(render_markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
