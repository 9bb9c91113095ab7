# The README's quick start: `make demo` and `make test`, each from a fresh clone.
# torch is pinned to the CPU build this project is developed and tested with;
# an unpinned torch would pull gigabytes of CUDA packages onto a CPU machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(TORCH) -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/stabmon demo

lint: $(STAMP)
	$(BIN)/ruff check stabmon tests bench
	$(BIN)/ruff format --check stabmon tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
