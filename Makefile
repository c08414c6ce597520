# The Quickstart is two commands: `make demo` and `make test`.
# Everything else here is what those two are made of.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PG_HOST ?= 127.0.0.1
PG_PORT ?= 5432

.PHONY: demo test install install-test pg-up lint unit bench proto clean

## Install everything, migrate the embedded SQLite database, load the demo
## tenants and lanes, and serve gRPC on 127.0.0.1:50051 (Ctrl-C stops).
demo: install
	$(BIN)/burstgate demo

## Install the test extras and run lint, type checks and the whole suite
## against SQLite and PostgreSQL (starting the local PostgreSQL if stopped).
test: install-test pg-up lint
	$(BIN)/python -m pytest

# The editable install compiles the Cython extension in place; re-run when
# the .pyx/.pxd or the dependencies change.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml $(wildcard fastpath/*.pyx fastpath/*.pxd)
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test,bench,parquet,otel]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

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

## Benchmarks (on demand; figures go to BENCHMARKS.md).
bench: install-test
	$(BIN)/python bench/bench_fastpath.py
	$(BIN)/python bench/bench_grpc.py

## Regenerate controlplane/_proto after editing proto/.
proto: install-test
	$(BIN)/python -m controlplane.protogen

clean:
	rm -rf build *.egg-info fastpath/*.c fastpath/*.so fastpath/*.html
