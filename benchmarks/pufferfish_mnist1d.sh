#!/usr/bin/env bash
# Pufferfish vs vanilla data-parallel SGD on MNIST-1D, 4 workers (results: docs/pufferfish.md).
# Usage: benchmarks/pufferfish_mnist1d.sh [OUT_DIR] [EPOCHS] [SEEDS]
set -euo pipefail
out=${1:-benchmarks/results/pufferfish}
epochs=${2:-20}
seeds=${3:-"0 1"}
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
common=(--model cnn1d --data mnist1d --nproc 4 --epochs "$epochs" --batch-size 32 --lr 0.05
        --threads 1 --no-progress --quiet)
for seed in $seeds; do
  $py -m lowcomm train "${common[@]}" --seed "$seed" --method ssgd --json "$out/ssgd_s$seed.json"
  $py -m lowcomm train "${common[@]}" --seed "$seed" \
      --method "pufferfish:rank_ratio=0.25,warmup_epochs=4" --json "$out/pufferfish_s$seed.json"
  $py -m lowcomm train "${common[@]}" --seed "$seed" \
      --method "pufferfish:rank_ratio=0.25,warmup_epochs=4,full_rank=conv1" --json "$out/pufferfish_fc_s$seed.json"
done
$py - "$out" <<'PY'
import glob, json, os, sys
rows = []
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    s = json.load(open(path))
    rows.append((os.path.basename(path), s["final_test_accuracy"], s["params"], s["params_initial"],
                 s["bytes_per_worker_per_iter"], s["bytes_sent_per_worker"]))
print("| run | final test acc | params (final / initial) | bytes/worker/iter (median) | bytes/worker total |")
print("|---|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {100*r[1]:.2f} % | {r[2]:,} / {r[3]:,} | {r[4]:,.0f} | {r[5]:,} |")
PY
