# Two entry points: `make demo` (the main job; installs qkv and what it runs on) and `make test` (the
# whole suite: tests/unit and tests/e2e; installs the test dependencies too); `make test-fast` runs the
# unit layer alone (under a minute, no training, no subprocess). Each creates the virtual environment
# in .venv on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# PyTorch goes in first, so that pip keeps it rather than choosing a build itself (on Linux, PyPI's
# torch is a multi-GB CUDA build). Left empty, the recipe picks: a wheel pip finds on this machine
# without any index (this project's machines hold a CPU one), else PyPI's CUDA build when nvidia-smi
# is there, else the CPU build from PyTorch's own index. To choose yourself, for example:
#   make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" test
TORCH ?=

.PHONY: demo test test-fast venv venv-dev clean

venv: $(VENV)/.installed
venv-dev: $(VENV)/.installed-dev

$(VENV)/.torch:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "PyTorch: already in $(VENV)"; \
	elif [ -n "$(TORCH)" ]; then \
		echo "PyTorch: $(TORCH)"; $(BIN)/pip install --quiet $(TORCH); \
	elif $(BIN)/pip install --quiet --no-index --no-deps torch==$(TORCH_VERSION) 2>/dev/null; then \
		echo "PyTorch $(TORCH_VERSION): the wheel on this machine"; $(BIN)/pip install --quiet torch==$(TORCH_VERSION); \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
		echo "PyTorch $(TORCH_VERSION): PyPI's CUDA build (nvidia-smi is here)"; $(BIN)/pip install --quiet torch==$(TORCH_VERSION); \
	else \
		echo "PyTorch $(TORCH_VERSION): the CPU build (no nvidia-smi here), from $(TORCH_CPU_INDEX)"; \
		$(BIN)/pip install --quiet torch==$(TORCH_VERSION) --index-url $(TORCH_CPU_INDEX); \
	fi
	touch $@

# qkv and what it needs to run: what `make demo` installs.
$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	$(BIN)/pip install --quiet -e .
	touch $@

# The test stack on top (the [dev] extra): only for the tests.
$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/qkv demo

# The suite runs in two worker processes (pytest-xdist; TEST_WORKERS=1 runs it in one): most of its
# time is commands started as subprocesses and small models, which one core alone leaves half idle.
TEST_WORKERS ?= 2
test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

test-fast: $(VENV)/.installed-dev
	$(BIN)/python -m pytest tests/unit

clean:
	rm -rf $(VENV) .pytest_cache
