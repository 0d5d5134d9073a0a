#!/usr/bin/env bash
# The K-FAC benchmark's own environment: torch (CPU build, pinned like the Makefile's), lowcomm
# from this checkout, and kfac-pytorch from its public repository. kfac-pytorch is never a
# dependency of lowcomm: it lives only here, for benchmarks/kfac_iteration.py's comparison rows.
#
#   benchmarks/kfac_env.sh [VENV_DIR] [KFAC_SOURCE]
#
# VENV_DIR defaults to .bench-venv (git-ignored); KFAC_SOURCE to the repository at the commit
# the published numbers used (a local clone works too, e.g. on a machine without GitHub).
# Then: .venv/bin/python benchmarks/kfac_iteration.py --python VENV_DIR/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.bench-venv}
SRC=${2:-git+https://github.com/gpauloski/kfac-pytorch@869cf110334e5a6e9ea054bafdc4558313a821e8}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e .
"$VENV/bin/python" -m pip install -q "$SRC"
"$VENV/bin/python" -c "import importlib.metadata as m; print('kfac-pytorch', m.version('kfac_pytorch'))"
