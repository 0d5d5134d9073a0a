"""Peak memory of a whole SCAFFOLD run with 1,000 against 10,000 registered clients (issue 15).

Why: the target is that 10,000 registered clients with a stateful algorithm grow peak memory
by less than 20 % over 1,000 clients, because the per-client state lives in the on-disk store
(``lowcomm.fl.store``), not in memory. The store alone is measured by
``benchmarks/fl_store_memory.py``; this runs ``lowcomm fl`` end to end (launcher + workers,
the launcher's PSS/RSS sampler) with everything equal but ``--clients``: the same MNIST-1D
data (``num_samples=50000``: 40 samples per client at 1,000, 4 at 10,000), the same clients
per round, rounds and model (MLP 40-256-256-10, 78,858 floats of state per client).

    .venv/bin/python benchmarks/fl_clients_memory.py            # the recorded setup
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy as acc  # noqa: E402  (the sibling script: machine, git commit)

RESULTS = acc.REPO / "benchmarks" / "results" / "fl_clients_memory.json"
TARGET_GROWTH = 0.20


def run(clients: int, args: argparse.Namespace) -> dict[str, Any]:
    """One ``lowcomm fl`` run; its summary without the per-round history."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fl.json"
        cmd = [sys.executable, "-m", "lowcomm", "fl", "--clients", str(clients), "--per-round", str(args.per_round),
               "--nproc", "2", "--algorithm", "scaffold", "--model", "mlp", "--model-arg", "hidden=256",
               "--data", "mnist1d", "--data-arg", "num_samples=50000", "--partition", "iid",
               "--rounds", str(args.rounds), "--batch-size", "16", "--lr", "0.05", "--seed", "0",
               "--state-dir", str(Path(tmp) / "state"), "--eval-every", str(args.rounds), "--quiet",
               "--json", str(out)]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        summary = json.loads(out.read_text())
        disk = sum(p.stat().st_blocks * 512 for p in (Path(tmp) / "state").rglob("*") if p.is_file())
    summary.pop("history")
    summary["state_store_disk_bytes"] = disk
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--clients", type=int, nargs=2, default=[1000, 10000])
    ap.add_argument("--per-round", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    runs = {str(n): run(n, args) for n in args.clients}
    small, large = (runs[str(n)]["peak_memory"] for n in args.clients)
    growth = {k: large[k] / small[k] - 1.0 for k in ("rss_bytes", "pss_bytes")}
    doc = {"machine": acc.machine(), "commit": acc._git_commit(), "per_round": args.per_round,
           "rounds": args.rounds, "runs": runs, "peak_growth": growth, "target_growth": TARGET_GROWTH,
           "met": all(g < TARGET_GROWTH for g in growth.values())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    for n in args.clients:
        m = runs[str(n)]["peak_memory"]
        print(f"{n:>6} clients: peak PSS {m['pss_bytes'] / 2**20:7.1f} MiB, RSS {m['rss_bytes'] / 2**20:7.1f} MiB, "
              f"store on disk {runs[str(n)]['state_store_disk_bytes'] / 2**20:7.1f} MiB, "
              f"round {runs[str(n)]['round_time_s_median']:.2f} s")
    print(f"growth: PSS {growth['pss_bytes']:+.1%}, RSS {growth['rss_bytes']:+.1%} (target < {TARGET_GROWTH:.0%})")
    return 0 if doc["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
