# Every target installs what it needs into .venv first (Python 3.11+ and pip are all it assumes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=

.PHONY: install train test lint stress bench tpu-check clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# Train the Llama 3 debug model on the embedded corpus (the interpreter's standard library).
train: $(STAMP)
	$(VENV)/bin/titan-tpu train --config configs/llama3_debug.toml $(ARGS)

# Two pytest-xdist workers: every multiprocess test on one of them, in order; the other tests a file at
# a time on whichever is free (tests/conftest.py). ARGS="-n 0" runs it all in one process (pdb, -s).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

# Style and import order (ruff, configured in pyproject.toml): line length 120, pyflakes, isort.
lint: $(STAMP)
	$(VENV)/bin/ruff check titan_tpu tests bench skills

# Every multi-process test (marked `multiprocess`) N times in a row, pass/fail per test: ARGS="-n 5 -k scan".
stress: $(STAMP)
	$(PY) tests/stress.py $(ARGS)

bench: $(STAMP)
	$(PY) bench/throughput.py $(ARGS)

# The TPU path checked against the real torch-tpu package on this CPU (tests/tpu/, docs/tpu.md):
# API conformance of every torch_tpu call, the jax_op kernels' numerics in Pallas TPU interpret
# mode, the tpu compile backend as far as a machine without a TPU goes. Its own environment, the
# one docs/tpu.md installs on a TPU VM plus pytest: torch-tpu aborts `import torch` where libtpu is
# missing, so it never enters .venv.
TPU_VENV := .venv-tpu
TPU_STAMP := $(TPU_VENV)/.installed-stamp

$(TPU_STAMP): pyproject.toml constraints-tpu.txt
	$(PYTHON) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(TPU_VENV)/bin/python -m pip install -q -c constraints-tpu.txt -e ".[tpu,hf,wandb,eval,tpu-check]"
	touch $(TPU_STAMP)

# A crash inside XLA (an abort) ends the log with the process's stack: the test that ran is printed last.
tpu-check: $(TPU_STAMP)
	@mkdir -p .cache && rm -f .cache/tpu-check-current
	TITAN_TPU_CHECK=1 TITAN_TPU_CHECK_CURRENT=.cache/tpu-check-current \
		PYTHONWARNINGS="ignore:<TorchTpu/Performance/TcMalloc/" \
		$(TPU_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/tpu $(ARGS) || \
		{ status=$$?; echo "make tpu-check: exit $$status; the test running last: $$(cat .cache/tpu-check-current 2>/dev/null || echo none)"; \
		  exit $$status; }

clean:
	rm -rf $(VENV) $(TPU_VENV) outputs .pytest_cache
