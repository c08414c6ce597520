# The Quickstart is two commands: `make demo` and `make test`.
# Everything else here is what those two are made of.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PG_HOST ?= 127.0.0.1
PG_PORT ?= 5432

# The locks this repository runs (tools/lockfile.py says how they are made):
# the server alone, and everything the tests and benchmarks need.
SERVE_LOCK ?= requirements/serve.txt
DEV_LOCK   ?= requirements/dev.txt

.PHONY: demo test install install-test os-packages pg-up lint unit bench bench-smoke proto clean \
        lock lock-upgrade test-latest

## Install everything, migrate the embedded SQLite database, load the demo
## tenants and lanes, and serve gRPC on 127.0.0.1:50051 (Ctrl-C stops).
demo: install
	$(BIN)/burstgate demo

## Install the test extras and run lint, type checks and the whole suite
## against SQLite and PostgreSQL (starting the local PostgreSQL if stopped).
## pytest-xdist runs it on one worker per core (at most 4): most tests wait on
## servers, processes and the database, so two workers on two cores halve the
## wall time. --dist loadfile keeps a module on one worker, so a module-scoped
## fixture that starts a process (an engine, a gateway) starts once.
## PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= auto
## The suite includes the benchmarks' tiny runs (the bench_smoke marker, what
## make bench-smoke runs alone): spread over the workers with the rest, they
## cost CI about a minute less than run after it.
test: install-test pg-up lint
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --maxprocesses 4 --dist loadfile

## Every benchmark in bench/ at a tiny size: a benchmark that no longer runs
## fails here (tests/integration/test_benchmarks_run.py). make test runs these
## too. About 2 CPU-minutes in all (ha_acceptance, the soak and litellm the
## most): 1 min 40 s alone on 2 quiet cores (2026-12-08); four workers were
## measured slower than two, so it runs on one per core.
bench-smoke: install-test pg-up
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --maxprocesses 4 --dist loadfile -m bench_smoke

# Installs take exact, hash-checked versions from the locks (pip refuses a
# file whose hash is not in the lock), then, without dependencies, the client
# wing (clients/python, burstgate-client: the API's stubs, the SDK, the
# sidecar) and burstgate itself, which depends on it. The editable install
# compiles the Cython extension in place with the locked Cython and
# setuptools (--no-build-isolation: an isolated build would take whatever
# Cython is newest); re-run when the .pyx/.pxd, a pyproject.toml or a lock
# change. The venv's own pip is replaced by the
# locked one in the first step.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml clients/python/pyproject.toml $(SERVE_LOCK) \
                   $(wildcard fastpath/*.pyx fastpath/*.pxd)
	$(BIN)/python -m pip install -q --require-hashes -r $(SERVE_LOCK)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e clients/python
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed $(DEV_LOCK)
	$(BIN)/python -m pip install -q --require-hashes -r $(DEV_LOCK)
	touch $@

# The API contract tests (tests/integration/test_proto_contract.py, the
# Node.js client test) need buf and the Node gRPC packages, pinned in
# clients/node/package-lock.json, and protoc with the Go toolchain and
# plugins from the OS packages. Nothing is fetched while the tests run.
# prometheus: for promtool, which checks and unit-tests the shipped alert rules
# (tests/integration/metrics; Debian's package also installs the Prometheus
# server's service: where services may start, `systemctl disable --now prometheus`).
NODE_DIR := clients/node
OS_PACKAGES := protobuf-compiler libprotobuf-dev golang-go protoc-gen-go protoc-gen-go-grpc \
               golang-google-protobuf-dev golang-google-grpc-dev prometheus

$(NODE_DIR)/node_modules/.installed: $(NODE_DIR)/package.json $(NODE_DIR)/package-lock.json | os-packages
	cd $(NODE_DIR) && npm ci --ignore-scripts --no-audit --no-fund
	touch $@

## Install the OS packages the tests need, only those missing (Debian/Ubuntu;
## as root, or through sudo). Node.js (with npm) too, when absent.
os-packages:
	@missing=""; \
	for p in $(OS_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || missing="$$missing $$p"; \
	done; \
	command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 || missing="$$missing nodejs npm"; \
	if [ -n "$$missing" ]; then \
	  if ! command -v apt-get >/dev/null 2>&1; then \
	    echo "missing OS packages:$$missing (install them; apt-get is not available here)"; exit 1; \
	  fi; \
	  sudo=""; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
	  echo "installing OS packages:$$missing"; \
	  $$sudo apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends $$missing; \
	fi

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test os-packages $(NODE_DIR)/node_modules/.installed

## Start the local PostgreSQL cluster when it is installed but not running.
## Skipped when BURSTGATE_TEST_PG_DSN points the tests elsewhere.
pg-up:
	@if [ -z "$$BURSTGATE_TEST_PG_DSN" ] && command -v pg_isready >/dev/null 2>&1 \
	    && ! pg_isready -q -h $(PG_HOST) -p $(PG_PORT); then \
	  echo "starting local PostgreSQL"; \
	  pg_ctlcluster --skip-systemctl-redirect $$(ls /etc/postgresql | sort -V | tail -n1) main start; \
	  for i in $$(seq 1 30); do pg_isready -q -h $(PG_HOST) -p $(PG_PORT) && break; sleep 1; done; \
	fi

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/mypy

unit: install-test
	$(BIN)/python -m pytest tests/unit

## Benchmarks (on demand): every script in bench/ at its standard size, one
## after another, regenerating BENCHMARKS.md (tools/benchreport.py; about
## 50 minutes). BENCH_ONLY=bench_grpc,bench_sdk runs those and keeps the rest.
BENCH_ONLY ?=
bench: install-test pg-up
	$(BIN)/python tools/benchreport.py $(if $(BENCH_ONLY),--only $(BENCH_ONLY))

## Regenerate controlplane/_proto after editing proto/ (with the generators
## pinned in pyproject.toml's test extra, installed from the lock).
proto: install-test
	$(BIN)/python -m controlplane.protogen

## Re-lock after changing pyproject.toml or requirements/*.in: every pin the
## new inputs still allow is kept. `make lock-upgrade` moves every package to
## the newest version allowed (then `make test`, and read the diff).
## uv is pinned in requirements/dev.in; it reaches PyPI.
UV_PIN = $(shell sed -n 's/^\(uv==[^ #]*\).*/\1/p' requirements/dev.in)
$(VENV)/.uv: $(BIN)/python requirements/dev.in
	$(BIN)/python -m pip install -q '$(UV_PIN)' packaging
	touch $@

lock: $(VENV)/.uv
	$(BIN)/python tools/lockfile.py compile
	$(BIN)/python tools/lockfile.py check

lock-upgrade: $(VENV)/.uv
	$(BIN)/python tools/lockfile.py compile --upgrade
	$(BIN)/python tools/lockfile.py check

## The suite on the newest versions pyproject.toml allows, in a throwaway copy
## of this tree with its own venv (the lock and .venv are left alone): run it
## before `make lock-upgrade`, and on purpose now and then, so that an upstream
## release that breaks burstgate is found by us. It prints what moved.
# The copy is a git repository of its own (tests list the tree with git),
# with ../shared beside it as beside this checkout (the shared traces).
LATEST_DIR ?= $(or $(TMPDIR),/tmp)/burstgate-test-latest
test-latest: $(VENV)/.uv
	rm -rf $(LATEST_DIR) && mkdir -p $(LATEST_DIR)/repo
	git ls-files -z --cached --others --exclude-standard \
	  | xargs -0 -I{} sh -c 'test -e "{}" && echo "{}"' \
	  | tar -cf - -T - | tar -xf - -C $(LATEST_DIR)/repo
	cd $(LATEST_DIR)/repo && git init -q && git add -A
	if [ -d ../shared ]; then ln -s "$$(cd ../shared && pwd)" $(LATEST_DIR)/shared; fi
	$(BIN)/python tools/lockfile.py latest $(LATEST_DIR)/latest.txt
	$(BIN)/python tools/lockfile.py diff $(DEV_LOCK) $(LATEST_DIR)/latest.txt
	$(MAKE) -C $(LATEST_DIR)/repo test PYTHON=$(PYTHON) \
	  SERVE_LOCK=$(LATEST_DIR)/latest.txt DEV_LOCK=$(LATEST_DIR)/latest.txt

clean:
	rm -rf build *.egg-info fastpath/*.c fastpath/*.so fastpath/*.html
