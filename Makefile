# The README's quick start: `make demo` and `make test`, each from a fresh clone.
# torch is pinned to the CPU build this project is developed and tested with;
# an unpinned torch would pull gigabytes of CUDA packages onto a CPU machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck tools dashboards clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(TORCH) -e '.[dev,dashboards]'
	touch $(STAMP)

# The real Prometheus and promtool (Debian's package) for the rule and end-to-end tests.
# Without root they are not installed here: those tests skip locally and fail in CI.
tools:
	@command -v promtool >/dev/null || { [ "$$(id -u)" = 0 ] && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } || \
		echo "make: promtool not found and not root: rule and end-to-end tests will skip"

dashboards: $(STAMP)
	$(BIN)/python dashboards/generate.py

demo: $(STAMP)
	$(BIN)/stabmon demo

lint: $(STAMP)
	$(BIN)/ruff check stabmon tests bench dashboards
	$(BIN)/ruff format --check stabmon tests bench dashboards

typecheck: $(STAMP)
	$(BIN)/mypy

test: tools lint typecheck
	$(BIN)/python dashboards/generate.py --check
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
