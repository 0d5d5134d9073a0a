#!/usr/bin/env bash
# The Flower comparison's own environment: torch (CPU build, pinned like the Makefile's), lowcomm
# from this checkout (editable, so the Flower side builds the very same data, partition and
# initial weights through lowcomm.fl.workload), and flwr[simulation] with the Ray it pins.
# flwr and Ray are never dependencies of lowcomm: they live only here, for
# benchmarks/fl_vs_flower.py's Flower rows.
#
#   benchmarks/fl_env.sh [VENV_DIR]
#
# VENV_DIR defaults to .bench-fl-venv (git-ignored). torch goes in first so that pip never
# resolves a CUDA build for it. flwr 1.41.0 is the version the issue's anchor numbers used; it
# pins ray==2.55.1 for its simulation extra.
# Then: .venv/bin/python benchmarks/fl_vs_flower.py --flower-python VENV_DIR/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.bench-fl-venv}
FLWR=${FLWR_VERSION:-1.41.0}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e .
"$VENV/bin/python" -m pip install -q "flwr[simulation]==$FLWR"
"$VENV/bin/python" -c "import importlib.metadata as m; print(*(f'{p} {m.version(p)}' for p in ('flwr', 'ray', 'torch')))"
