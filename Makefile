# Two set-up commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lowcomm-installed

.PHONY: demo test test-gpu install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned, so pip never pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,split,elastic,fast]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lowcomm demo

test: $(STAMP)
	$(PY) -m pytest

# GPU smoke suite (tests marked `cuda`; `make test` runs them too, skipped without a GPU).
# Needs a CUDA build of torch in .venv: the pinned install above may be CPU-only.
test-gpu: $(STAMP)
	$(PY) -m pytest -m cuda

clean:
	rm -rf $(VENV) build src/*.egg-info .mypy_cache .ruff_cache
