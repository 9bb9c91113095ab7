# The README's quick start: `make demo` and `make test`, each from a fresh clone.
# torch is pinned to the CPU build this project is developed and tested with;
# an unpinned torch would pull gigabytes of CUDA packages onto a CPU machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# Extra pip options, e.g. PyTorch's CPU index where the default index serves CUDA builds.
PIP_ARGS ?=
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck tools dashboards deploy bench gpu-check clean

# Ultralytics and its torchvision go to a folder of their own, which only the Ultralytics tests
# put on their subprocess's path: on this CPU torch, torchvision fails to import, and
# torchmetrics (so Lightning) imports it whenever it is installed. Ultralytics' other
# dependencies go into the venv, with torch pinned in the same command.
ULTRALYTICS_SITE := $(VENV)/ultralytics-site
ULTRALYTICS := ultralytics==8.4.190 torchvision==0.28.0
ULTRALYTICS_DEPS := opencv-python polars ultralytics-thop ultralytics-platform requests pillow

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(PIP_ARGS) $(TORCH) -e '.[dev,dashboards,report,integrations]' $(ULTRALYTICS_DEPS)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(PIP_ARGS) --no-deps --upgrade --target $(ULTRALYTICS_SITE) $(ULTRALYTICS)
	touch $(STAMP)

# The real Prometheus and promtool, and Alertmanager's amtool (Debian's packages), for the
# rule, deployment-config and end-to-end tests; headless Chromium to open `stabmon report` pages.
# It says what it installs before it does. Without root they are not installed: it names what
# is missing, and those tests skip (CI runs as root, so there they run).
TOOL_PACKAGES := prometheus prometheus-alertmanager chromium fonts-dejavu-core
tools:
	@if command -v promtool >/dev/null && command -v amtool >/dev/null && command -v chromium >/dev/null; then \
		:; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "make tools: installing Debian packages $(TOOL_PACKAGES) with apt-get (for the promtool, amtool and report tests)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends $(TOOL_PACKAGES) >/dev/null; \
	else \
		echo "make tools: not root, so not installing $(TOOL_PACKAGES); the tests that need promtool, amtool or chromium will skip"; \
	fi

dashboards: $(STAMP)
	$(BIN)/python dashboards/generate.py

# The Kubernetes PrometheusRule and dashboard ConfigMaps, from the rules file and dashboards/json,
# and the monitoring mixin (deploy/mixin: alerts, rules, dashboards, config) from the same.
deploy: $(STAMP)
	$(BIN)/python deploy/kubernetes/generate.py
	$(BIN)/python deploy/mixin/generate.py

# The overhead benchmark with the peers users would use instead (Lightning's grad_norm, wandb.watch).
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(BIN)/python bench/overhead.py --update-readme

# On a machine with an NVIDIA GPU, in under five minutes: $(PYTHON)'s own CUDA torch (nothing
# installed, no network; GPU_CHECK_FLAGS=--install makes a .venv-gpu with one instead), the
# gpu-marked tests of an explicit list of files (the daemon on real NVML and the real-device sync
# check among them), the fake-CUDA sync audit and a GPT loop (MFU, overhead per step, sync-checked), each step bounded,
# into gpu-check-report.md. Elsewhere it lists what it needs and exits 2, changing nothing.
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
	$(BIN)/python deploy/mixin/generate.py --check
	$(BIN)/python -m pytest -n 3

clean:
	rm -rf $(VENV) .venv-gpu .pytest_cache .mypy_cache .ruff_cache
