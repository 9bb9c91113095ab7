# The README's quick start: `make demo` and `make test`, each from a fresh clone.
# torch is pinned to the CPU build this project is developed and tested with;
# an unpinned torch would pull gigabytes of CUDA packages onto a CPU machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck tools dashboards deploy bench gpu-check clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(TORCH) -e '.[dev,dashboards,report,integrations]'
	touch $(STAMP)

# The real Prometheus and promtool, and Alertmanager's amtool (Debian's packages), for the
# rule, deployment-config and end-to-end tests; headless Chromium to open `stabmon report` pages.
# Without root they are not installed here: those tests skip locally and fail in CI.
tools:
	@{ command -v promtool && command -v amtool && command -v chromium; } >/dev/null || \
		{ [ "$$(id -u)" = 0 ] && apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends prometheus prometheus-alertmanager \
		chromium fonts-dejavu-core >/dev/null; } || \
		echo "make: promtool/amtool/chromium missing and not root: those tests will skip"

dashboards: $(STAMP)
	$(BIN)/python dashboards/generate.py

# The Kubernetes PrometheusRule and dashboard ConfigMaps, from the rules file and dashboards/json.
deploy: $(STAMP)
	$(BIN)/python deploy/kubernetes/generate.py

# The overhead benchmark with the peers users would use instead (Lightning's grad_norm, wandb.watch).
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(BIN)/python bench/overhead.py --update-readme

# On a machine with an NVIDIA GPU: a CUDA torch in its own venv (.venv-gpu), every gpu-marked
# test, the sync check under sync-debug "error", the GPU overhead workload and the daemon on real
# NVML, into gpu-check-report.md. Elsewhere it lists what it needs and exits 2, changing nothing.
# `make gpu-check GPU_CHECK_FLAGS=--dry-run` prints the plan; bench/gpu_check.py --help lists the rest.
gpu-check:
	$(PYTHON) bench/gpu_check.py $(GPU_CHECK_FLAGS)

demo: $(STAMP)
	$(BIN)/stabmon demo

lint: $(STAMP)
	$(BIN)/ruff check stabmon tests bench dashboards deploy
	$(BIN)/ruff format --check stabmon tests bench dashboards deploy

typecheck: $(STAMP)
	$(BIN)/mypy

test: tools lint typecheck
	$(BIN)/python dashboards/generate.py --check
	$(BIN)/python deploy/kubernetes/generate.py --check
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .venv-gpu .pytest_cache .mypy_cache .ruff_cache
