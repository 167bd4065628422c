# Everything sets itself up from nothing: `make run` and `make test` are the two commands.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?=

.PHONY: all run test lint typecheck unit proto check-proto venv clean

all: test

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

## serve on 127.0.0.1:50051 with the default config (CONFIG=path for another)
run: $(STAMP)
	$(BIN)/rcoder serve $(if $(CONFIG),--config $(CONFIG),)

## lint, type check and the whole suite
test: $(STAMP) check-proto lint typecheck unit

lint: $(STAMP)
	$(BIN)/ruff check rcoder tests scripts
	$(BIN)/ruff format --check rcoder tests scripts

typecheck: $(STAMP)
	$(BIN)/mypy rcoder scripts

unit: $(STAMP)
	$(BIN)/pytest -p no:cacheprovider --cov --cov-report=term:skip-covered

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

check-proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py --check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
