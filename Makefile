PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint check clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PY) -m venv $(VENV)
	@$(BIN)/pip install --quiet --upgrade pip
	@$(BIN)/pip install --quiet -e '.[dev]'
	@bash .ci/check-java
	@touch $(STAMP)

demo: venv
	$(BIN)/python bench/demo.py

test: venv
	$(BIN)/ruff check edge_agent hub_ingest tests bench
	$(BIN)/ruff format --check edge_agent hub_ingest tests bench
	$(BIN)/mypy
	$(BIN)/pytest

lint: venv
	$(BIN)/ruff check edge_agent hub_ingest tests bench
	$(BIN)/ruff format --check edge_agent hub_ingest tests bench
	$(BIN)/mypy

clean:
	rm -rf $(VENV) demo-state .pytest_cache .mypy_cache .ruff_cache
