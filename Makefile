# Two commands for a newcomer on a fresh machine:
#   make demo   set up the virtual environment, then run the daemon on the embedded default (tiny) config
#   make test   set up the virtual environment, then run every test (unit, integration, e2e)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
# the optional dependencies installed (pyproject.toml): `test`, and `interop` (torch 2.13.0 +
# transformers, for the reference comparisons), `docs` (mkdocs); commas or spaces between them: EXTRAS="test interop"
EXTRAS ?= test
comma := ,
empty :=
space := $(empty) $(empty)
EXTRAS_LIST := $(subst $(space),$(comma),$(strip $(subst $(comma),$(space),$(EXTRAS))))
# one stamp per set of extras: asking for another set installs it into the same venv
INSTALLED := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS_LIST))

.PHONY: demo test test-fast bench docs clean

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS_LIST)]'
	touch $@

demo: $(INSTALLED)
	$(BIN)/llm-pretrain run $(ARGS)

# every test once: the fast tiers where MindSpore cannot be imported (they must never need it), then e2e
# and ends with one line: what both sessions skipped, and why
SKIP_LOG := $(VENV)/.skipped.jsonl
test: $(INSTALLED)
	rm -f $(SKIP_LOG)
	LLM_PRETRAIN_SKIP_LOG=$(SKIP_LOG) PYTHONPATH="$(CURDIR)/tests/without_mindspore" $(BIN)/python -m pytest tests/unit tests/integration
	LLM_PRETRAIN_SKIP_LOG=$(SKIP_LOG) $(BIN)/python -m pytest tests/e2e
	@$(BIN)/python -m tests.skips $(SKIP_LOG)

# the fast tier by path, so tests/e2e is not even collected: it runs where MindSpore cannot be imported
test-fast: $(INSTALLED)
	PYTHONPATH="$(CURDIR)/tests/without_mindspore" $(BIN)/python -m pytest tests/unit tests/integration

bench: $(INSTALLED)
	$(BIN)/python bench/engine_throughput.py
	$(BIN)/python bench/vs_pytorch.py --recompute
	$(BIN)/python bench/step_dispatch.py
	$(BIN)/python bench/data_throughput.py
	$(BIN)/python bench/checkpoint_stall.py
	$(BIN)/python bench/ram_tier.py
	$(BIN)/python bench/recovery.py
	$(BIN)/python bench/memory_model.py
	$(BIN)/python bench/dp_scaling.py
	$(BIN)/python bench/goodput.py
	$(BIN)/python bench/goodput.py --mix
	$(BIN)/python bench/validation_cost.py
	$(BIN)/python bench/fingerprint_cost.py
	$(BIN)/python bench/multinode_scale.py
	$(BIN)/python bench/multinode_recovery.py
	$(BIN)/python bench/ram_tier_replay.py
	$(BIN)/python bench/client_overhead.py
	$(BIN)/python bench/performance_table.py --write

# the documentation site: docs/ as mkdocs.yml names it, built into site/ with --strict (a broken link, or a
# page missing from the nav, fails it); installs the `docs` extra beside the EXTRAS asked for
DOCS_EXTRAS := $(if $(filter docs,$(subst $(comma),$(space),$(EXTRAS_LIST))),$(EXTRAS_LIST),$(EXTRAS_LIST)$(comma)docs)
docs:
	$(MAKE) --no-print-directory $(VENV)/.installed-$(subst $(comma),-,$(DOCS_EXTRAS)) EXTRAS=$(DOCS_EXTRAS)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) runs .pytest_cache
