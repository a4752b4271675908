# Every target installs what it needs into .venv first (Python 3.11+ and pip are all it assumes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=

.PHONY: install train test stress bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# Train the Llama 3 debug model on the embedded corpus (the interpreter's standard library).
train: $(STAMP)
	$(VENV)/bin/titan-tpu train --config configs/llama3_debug.toml $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

# Every multi-process test (marked `multiprocess`) N times in a row, pass/fail per test: ARGS="-n 5 -k scan".
stress: $(STAMP)
	$(PY) tests/stress.py $(ARGS)

bench: $(STAMP)
	$(PY) bench/throughput.py $(ARGS)

clean:
	rm -rf $(VENV) outputs .pytest_cache
