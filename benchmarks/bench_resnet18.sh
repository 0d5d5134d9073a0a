#!/usr/bin/env bash
# Regenerates the tables and plots in docs/benchmarks.md: ResNet-18 (CIFAR form, synthetic
# 3x32x32 input) on 4 emulated workers at 100 Mbit/s and 1 Gbit/s. Needs root for the network
# namespaces (otherwise it runs on loopback and the JSON says emulated: false).
#
#   benchmarks/bench_resnet18.sh [METHODS] [BATCH] [ITERS]
#
# Writes docs/bench/$NAME.{json,md,png} (+ _speedup.png; NAME defaults to resnet18_4w) and
# per-method logs in docs/bench/work/ (not committed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
METHODS=${1:-ssgd,fp16,signsgd,topk,powersgd,acpsgd}
BATCH=${2:-16}
ITERS=${3:-5}
OUT=docs/bench
NAME=${NAME:-resnet18_4w}
mkdir -p "$OUT"
"$PY" -m lowcomm bench --nproc 4 --model resnet18 --input-shape 3,32,32 --batch-size "$BATCH" \
  --methods "$METHODS" --sweep-net 100mbit,1gbit --iters "$ITERS" --warmup "${WARMUP:-2}" \
  --work-dir "$OUT/work" --json "$OUT/$NAME.json" --markdown "$OUT/$NAME.md" \
  --plot "$OUT/$NAME.png"
