# Two entry points: `make demo` (the main job) and `make test` (the whole suite: tests/unit and
# tests/e2e); `make test-fast` runs the unit layer alone (under a minute, no training, no subprocess).
# Each creates the virtual environment in .venv on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of PyTorch: on this project's machines `torch==2.13.0` resolves to a local CPU wheel.
# Elsewhere, pick the build you want, for example:
#   make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" test
TORCH ?= torch==2.13.0

.PHONY: demo test test-fast venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

demo: venv
	$(BIN)/qkv demo

test: venv
	$(BIN)/python -m pytest

test-fast: venv
	$(BIN)/python -m pytest tests/unit

clean:
	rm -rf $(VENV) .pytest_cache
