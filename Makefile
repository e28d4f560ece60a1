# Convoy developer entry points. Every target installs what it needs into .venv first,
# so a fresh clone needs only python3 and make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RECIPE ?= recipes/default.yaml
PYTEST_ARGS ?=
# Two pytest workers (pytest-xdist): a test that waits on a Ray, a restart or a timeout leaves
# its core to the other worker. Each worker has its own Ray; a module stays on one worker.
# PYTEST_WORKERS=0 runs in one process. The cluster tier runs beside them in its own pytest,
# ahead of them on the CPU (tests/run_tiers.py says how): its node kills and spot notices are
# timed against its runs.
PYTEST_WORKERS ?= 2

export RAY_USAGE_STATS_ENABLED := 0

.PHONY: install install-run dev run test lint format bench clean envtest-build

# Two installs, each with its own stamp, redone when pyproject.toml or constraints.txt change.
# `make run` installs the core and Ray only: all the default job needs. `make dev`, `make test`
# and `make lint` install every extra; that install also stands for `make run`'s, so `make run`
# after `make test` installs nothing. A command whose extra is missing names its install line.
RUN_EXTRAS := ray
DEV_EXTRAS := ray,s3,dev,text,sensors,k8s,plot,lightning,tracking,tune,hf,lora
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed
NEW_VENV := (test -x $(PY) || $(PYTHON) -m venv $(VENV)) && $(PY) -m pip install --quiet --upgrade pip
PIP_INSTALL := $(PY) -m pip install --quiet -c constraints.txt -e
# An editable install leaves the package's own bytecode to be written on first import, which
# PYTHONDONTWRITEBYTECODE (set on CI) forbids: then every process (each worker, each Ray actor)
# compiles Convoy's sources again. Written once here, as pip does for a wheel.
COMPILE_SOURCES := $(PY) -m compileall -q src
# The full install is current (a .venv made by `make test` before `make run` had a stamp).
FULL_CURRENT := [ $(STAMP) -nt pyproject.toml ] && [ $(STAMP) -nt constraints.txt ]

install-run: $(RUN_STAMP)

$(RUN_STAMP): pyproject.toml constraints.txt
	@$(FULL_CURRENT) || { set -x; $(NEW_VENV) && $(PIP_INSTALL) ".[$(RUN_EXTRAS)]" && $(COMPILE_SOURCES); }
	@touch $(RUN_STAMP)

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(NEW_VENV)
	$(PIP_INSTALL) ".[$(DEV_EXTRAS)]"
	$(COMPILE_SOURCES)
	touch $(STAMP) $(RUN_STAMP)

## dev: install every extra (tests, lint, plots, tracking, Lightning, Optuna, k8s, text, sensors, hf)
dev: install

## run: train the default recipe (ViT on digits, ddp, 2 workers on an embedded local Ray)
run: install-run
	$(VENV)/bin/convoy train $(RECIPE)

## lint: ruff (lint + format check), mypy and lint-imports
# One target a check, so that `make -k lint` (how make test runs it, beside the tests) runs
# every check and reports each failure; `make lint` stops at the first, as before.
LINT_CHECKS := lint-ruff lint-format lint-mypy lint-imports
.PHONY: $(LINT_CHECKS)
lint: $(LINT_CHECKS)

lint-ruff: install
	$(VENV)/bin/ruff check src tests benchmarks examples

lint-format: install
	$(VENV)/bin/ruff format --check src tests benchmarks examples

lint-mypy: install
	$(VENV)/bin/mypy

lint-imports: install
	$(VENV)/bin/lint-imports

format: install
	$(VENV)/bin/ruff check --fix src tests benchmarks examples
	$(VENV)/bin/ruff format src tests benchmarks examples

# The test kube-apiserver: built by tests/cluster/k8s/build_apiserver.sh (the sources and
# folder of ../shared/k8s-envtest/build.sh, for less CPU: it says how), started and stopped by
# ../shared/k8s-envtest's scripts. It takes minutes to build the first time on a machine;
# start it first, in the background, so it overlaps install and lint. The k8s tests wait for
# it on the same lock (and skip, saying why, where it cannot be built).
ENVTEST ?= ../shared/k8s-envtest
ENVTEST_BUILD := tests/cluster/k8s/build_apiserver.sh
ENVTEST_LOCK := /tmp/convoy-envtest-build.lock

# apt-get takes dpkg's lock and fails at once when another apt-get holds it: the build's one
# install (rsync) and the browser's take turns on this lock, so both run on a fresh machine.
APT_LOCK := /tmp/convoy-apt.lock
APT_WAIT := -o DPkg::Lock::Timeout=600
RSYNC_INSTALL := command -v rsync >/dev/null || apt-get $(APT_WAIT) install -y -qq rsync \
	|| { apt-get update -qq && apt-get $(APT_WAIT) install -y -qq rsync; }

# Its CPU (the shell's `times`: what its children used) goes to ENVTEST_CPU once it ends, for
# the bill tests/run_tiers.py prints: it runs outside the make that waits for the rest.
ENVTEST_CPU := /tmp/convoy-envtest-build.cpu

envtest-build:
	@rm -f $(ENVTEST_CPU); if [ -f $(ENVTEST)/start.sh ] && command -v flock >/dev/null; then \
		(flock $(ENVTEST_LOCK) sh -c 'flock $(APT_LOCK) sh -c "$(RSYNC_INSTALL)"; \
			bash $(ENVTEST_BUILD); times >$(ENVTEST_CPU)' >/tmp/convoy-envtest-build.log 2>&1 &); \
	fi

# Debian's Chromium, for the headless-browser check of `convoy report`'s HTML. Installed only
# where it is missing and we are root with apt-get; in the background (about 10 s with fresh
# package lists, longer on a cold mirror) so it overlaps install and lint. The test waits on
# the same lock and skips, saying why, where it is still missing. A failure is a message.
BROWSER_LOCK := /tmp/convoy-browser-install.lock
BROWSER_LOG := /tmp/convoy-browser-install.log
APT_CHROMIUM := DEBIAN_FRONTEND=noninteractive apt-get $(APT_WAIT) install -y --no-install-recommends chromium
BROWSER_INSTALL := $(APT_CHROMIUM) || { apt-get update && $(APT_CHROMIUM); } \
	|| echo "browser: chromium install failed; the browser test will skip"

.PHONY: browser
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "browser: chromium is missing (not root, or no apt-get); the report's browser test will skip"; \
	else \
		echo "browser: installing chromium (log: $(BROWSER_LOG))"; \
		if command -v flock >/dev/null; then \
			( flock $(BROWSER_LOCK) flock $(APT_LOCK) sh -c '$(BROWSER_INSTALL)' >$(BROWSER_LOG) 2>&1 & ); \
		else \
			sh -c '$(BROWSER_INSTALL)' >$(BROWSER_LOG) 2>&1; \
		fi; \
	fi

## test: every test tier (unit, distributed, e2e, cluster), lint beside them; then the CPU bill
# Lint runs beside the tests, at their low CPU weight, instead of ahead of them (mypy alone is
# about 30 CPU-s from a cold cache); its output comes after theirs, and its failure fails the run. The
# budget is tests/suite_budget.py; a full run (no PYTEST_ARGS) writes the figures
# tests/unit/test_suite_budget.py checks to tests/suite_cpu_measured.json: commit them.
# `make`, not `$(MAKE)`: a line naming $(MAKE) runs even under `make -n`, which would start
# the whole suite.
test: envtest-build browser install
	$(PY) tests/run_tiers.py --workers $(PYTEST_WORKERS) \
		--lint "make --no-print-directory -k lint" $(PYTEST_ARGS)

bench: install
	$(PY) benchmarks/launcher_overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
