# Two commands on a fresh machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-isa test-repeat mutants lint install clean bench gpu-check

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=python3)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: the CPU wheel on disk; an unpinned resolve would fetch a CUDA build
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/plait demo

# every failure reported (no -x): CI must show all of them
# two files at a time (--dist loadfile, tests/conftest.py: a file's tests, which share its
# /tmp folders and fixtures, on one worker; the files sharing one run too; the parity
# matrix's rows spread over both workers). The process-tree tests (launchers, signals,
# nodes, restarts, torchrun) and compile are `make test-slow`; CI runs both.
test: $(STAMP)
	$(PY) -m pytest tests -n 2 --dist loadfile -m "not slow" --durations=15

test-slow: $(STAMP)
	$(PY) -m pytest tests -n 2 --dist loadfile -m slow --durations=15

# every parity test under each CPU kernel path this CPU has (ATEN_CPU_CAPABILITY=default,
# avx2, avx512): the bounds hold on any of them; the table of worst errors by path is
# printed (docs/parity.md's is written by tests/measure_tolerances.py without --no-write)
test-isa: $(STAMP)
	$(PY) tests/measure_tolerances.py --no-write

# the suite N times in a row, failures counted per test (LOAD=k: k CPU burners beside it)
N ?= 20
LOAD ?= 0
test-repeat: $(STAMP)
	$(PY) tests/repeat.py $(N) --load $(LOAD)

# injected bugs (tests/mutants.py), each must fail a test; not part of `make test`
mutants: $(STAMP)
	$(PY) tests/mutants.py

lint: $(STAMP)
	$(VENV)/bin/ruff check plait tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/dp_vs_ddp.py

# on a machine with CUDA GPUs, from the source tree with the system python3 and its torch
# (no venv, nothing installed): one table, within 8 minutes on one H200 (docs/gpu.md)
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=. python3 benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
