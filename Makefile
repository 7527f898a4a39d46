# Two commands for a newcomer on a fresh machine:
#   make demo   set up the virtual environment, then run the daemon on the embedded default (tiny) config
#   make test   set up the virtual environment, then run every test (unit, integration, e2e)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
EXTRAS ?= test        # .ci/run adds `interop` (torch 2.13.0 + transformers for the reference comparisons)

.PHONY: demo test test-fast bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(strip $(EXTRAS))]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/llm-pretrain run $(ARGS)

# every test once: the fast tiers where MindSpore cannot be imported (they must never need it), then e2e
test: $(VENV)/.installed
	PYTHONPATH="$(CURDIR)/tests/without_mindspore" $(BIN)/python -m pytest tests/unit tests/integration
	$(BIN)/python -m pytest tests/e2e

# the fast tier by path, so tests/e2e is not even collected: it runs where MindSpore cannot be imported
test-fast: $(VENV)/.installed
	PYTHONPATH="$(CURDIR)/tests/without_mindspore" $(BIN)/python -m pytest tests/unit tests/integration

bench: $(VENV)/.installed
	$(BIN)/python bench/engine_throughput.py
	$(BIN)/python bench/vs_pytorch.py --recompute
	$(BIN)/python bench/data_throughput.py
	$(BIN)/python bench/checkpoint_stall.py
	$(BIN)/python bench/ram_tier.py
	$(BIN)/python bench/recovery.py
	$(BIN)/python bench/memory_model.py
	$(BIN)/python bench/dp_scaling.py
	$(BIN)/python bench/goodput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
