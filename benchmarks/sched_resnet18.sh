#!/usr/bin/env bash
# Issue 5 comparison: the scheduling engine (wfbp, mgwfbp, dear, lee18) against PyTorch DDP
# (ssgd) and FSDP2 shard-grad-op (torch_fsdp) on ResNet-18 (CIFAR form, synthetic 3x32x32
# input, timing only), 4 emulated workers at 100 Mbit/s and 1 Gbit/s. Needs root for the
# network namespaces (otherwise loopback, and the JSON says emulated: false).
#
#   benchmarks/sched_resnet18.sh [METHODS] [BATCH] [ITERS]
#
# Writes docs/bench/sched_resnet18_4w.{json,md,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
METHODS=${1:-ssgd,torch_fsdp,wfbp,mgwfbp,dear,lee18}
BATCH=${2:-8}
ITERS=${3:-4}
OUT=docs/bench
mkdir -p "$OUT"
"$PY" -m lowcomm bench --nproc 4 --model resnet18 --input-shape 3,32,32 --batch-size "$BATCH" \
  --methods "$METHODS" --sweep-net 100mbit,1gbit --iters "$ITERS" --warmup "${WARMUP:-2}" \
  --work-dir "$OUT/work" --json "$OUT/sched_resnet18_4w.json" --markdown "$OUT/sched_resnet18_4w.md" \
  --plot "$OUT/sched_resnet18_4w.png"
