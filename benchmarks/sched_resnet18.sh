#!/usr/bin/env bash
# Issue 5 comparison: the scheduling engine (wfbp, mgwfbp, dear, lee18) against PyTorch DDP
# (ssgd) and FSDP2 shard-grad-op (torch_fsdp): the same ResNet-18 run as bench_resnet18.sh
# (4 emulated workers, 100 Mbit/s and 1 Gbit/s, synthetic input, timing only).
#
#   benchmarks/sched_resnet18.sh [METHODS] [BATCH] [ITERS]
#
# Writes docs/bench/sched_resnet18_4w.{json,md,png}.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=sched_resnet18_4w exec benchmarks/bench_resnet18.sh \
  "${1:-ssgd,torch_fsdp,wfbp,mgwfbp,dear,lee18}" "${2:-8}" "${3:-4}"
