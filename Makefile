# Everything sets itself up from nothing: `make run` and `make test` are the two commands.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# the pinned ACP agents of the built-in profiles (agents/package-lock.json)
AGENTS_STAMP := agents/node_modules/.installed
# build-time tools from npm, pinned (tools/package-lock.json): buf, for the API contract's checks
TOOLS_STAMP := tools/node_modules/.installed
# twine in a venv of its own (tools/twine-requirements.txt says why)
TWINE_VENV := .venv-twine
TWINE_STAMP := $(TWINE_VENV)/.installed
CONFIG ?=

.PHONY: all run test check fast docs docs-serve docs-reference lint typecheck unit soak bench bytecode proto check-proto check-api api-baseline dist venv twine agents tools postgres podman helper image clean podman

all: test

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[daemon,dev]'
	@touch $(STAMP)

venv: $(STAMP)

$(TWINE_STAMP): tools/twine-requirements.txt
	@test -x $(TWINE_VENV)/bin/python || $(PYTHON) -m venv $(TWINE_VENV)
	$(TWINE_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r tools/twine-requirements.txt
	@touch $(TWINE_STAMP)

twine: $(TWINE_STAMP)

## install the pinned agents (claude, claude-legacy, codex, gemini, opencode) into agents/node_modules
# `npm install` with the committed lock, not `npm ci`: the lock holds only the platform packages the
# registry serves here (linux-x64), and `npm ci` refuses a lock without every optional one. No install
# scripts: the profiles run the platform binaries themselves and nothing needs a native build.
$(AGENTS_STAMP): agents/package.json agents/package-lock.json
	npm install --prefix agents --no-save --ignore-scripts --no-audit --no-fund
	@touch $(AGENTS_STAMP)

agents: $(AGENTS_STAMP)

## install the pinned build-time tools (buf) into tools/node_modules; never shipped, so kept apart
# from agents/ (whose node_modules the image carries). `npm ci`: this lock holds every platform's
# binary package, so npm ci takes it as is. No install scripts: buf's only checks that its platform's
# binary package is there (the lock installs it) and would fetch one outside npm's lock otherwise.
$(TOOLS_STAMP): tools/package.json tools/package-lock.json
	npm ci --prefix tools --ignore-scripts --no-audit --no-fund
	@touch $(TOOLS_STAMP)

tools: $(TOOLS_STAMP)

## the exec wrapper in C (rcoder/agent/confinement/confine.c), static: what agents that confine themselves in their
## own process (generic profiles, OpenCode) start through, a bare exec instead of a Python start-up.
## Without a C compiler it is left out, and they start through `python -I -S landlock.py` instead
CONFINE_HELPER := rcoder/agent/confinement/rcoder-confine
$(CONFINE_HELPER): rcoder/agent/confinement/confine.c
	@if command -v $(CC) >/dev/null; then \
		$(CC) -O2 -s -static -Wall -Wextra -Werror -o $@.tmp $< && mv $@.tmp $@; \
	else \
		echo "make: no C compiler ($(CC)): agents that confine themselves start through python -I -S landlock.py (~15 ms more a start)" >&2; \
	fi

helper: $(CONFINE_HELPER)

## rcoder's and the tests' modules compiled ahead (quick when up to date). Where PYTHONDONTWRITEBYTECODE
## is set (as on this machine's base image) nothing else writes them, so every daemon and every fake
## agent the tests start would compile its modules again: a third of a daemon's start
bytecode: $(STAMP)
	@PYTHONDONTWRITEBYTECODE= $(BIN)/python -m compileall -q -j 0 rcoder tests scripts

## serve on 127.0.0.1:50051 with the default config (CONFIG=path for another)
run: $(STAMP) agents helper bytecode
	@echo "make: in a second terminal, in this folder: . $(BIN)/activate   (grpcurl and rcoder on PATH), then: rcoder chat --project demo --agent echo hello   (README.md: A first conversation)" >&2
	$(BIN)/rcoder serve $(if $(CONFIG),--config $(CONFIG),)

## the generated code and API checks, lint, type check and the whole suite. The container image is
## built meanwhile, in the background (its log: build/image.log; the build's whole process group is
## ended when this ends); the image's tests run last and wait for that build (scripts/image.py's lock)
test: $(STAMP) agents tools twine postgres podman helper
	@mkdir -p build
	@setsid $(PYTHON) scripts/image.py > build/image.log 2>&1 & image=$$!; \
		trap 'kill -TERM -- -$$image 2>/dev/null; wait $$image 2>/dev/null' EXIT; trap 'exit 143' INT TERM; \
		$(MAKE) --no-print-directory check-proto check-api lint docs typecheck unit

## the site's diagrams are drawn by mermaid's one-file build, served by the site itself (no CDN: the
## site reads without a network). Only that file of the pinned package, taken from the npm registry
## with `npm pack` and checked against its sha256: installing the package would bring 113 packages
## (154 MB) for a 3.5 MB file nothing else needs
MERMAID_VERSION := 11.17.2
MERMAID_SHA256 := 581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8
MERMAID_PINNED := build/vendor/mermaid-$(MERMAID_VERSION).min.js
# what scripts/docs_hooks.py copies into the site
MERMAID := build/vendor/mermaid.min.js
$(MERMAID_PINNED):
	@rm -rf build/vendor/pack && mkdir -p build/vendor/pack
	npm pack --silent --pack-destination build/vendor/pack mermaid@$(MERMAID_VERSION) >/dev/null
	tar -xzf build/vendor/pack/mermaid-$(MERMAID_VERSION).tgz -C build/vendor/pack package/dist/mermaid.min.js
	echo "$(MERMAID_SHA256)  build/vendor/pack/package/dist/mermaid.min.js" | sha256sum --check --quiet
	mv build/vendor/pack/package/dist/mermaid.min.js $@ && rm -rf build/vendor/pack
$(MERMAID): $(MERMAID_PINNED)
	cp $< $@

## the docs site (mkdocs.yml) into build/site, --strict: a broken link or anchor, a page missing from
## the nav, a proto element without a comment or a config key without a description fails it, and
## so does a page that lost a word or a table of its Markdown, or would fetch from another site
## (scripts/docs_site_check.py), or a generated reference not up to date (make docs-reference)
docs: $(STAMP) $(MERMAID)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

## docs/api-reference.md and docs/config-reference.md written from the proto and the settings model
## (kept in git: `make docs` fails while they differ from what these make)
docs-reference: $(STAMP)
	$(BIN)/python scripts/docs_hooks.py

## the docs site served on 127.0.0.1:8000, rebuilt on every change
docs-serve: $(STAMP) $(MERMAID)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict

## the inner loop, about 15 s warm (12 s measured on 2 cores): the generated code and API checks, lint, the type check
## and the fast set (tests marked `fast`: they start no process, no daemon, agent, PostgreSQL or
## tool; one that starts one fails: tests/process_guard.py). CONTRIBUTING.md says which loop is for what
check: $(STAMP) tools
	$(MAKE) --no-print-directory check-proto check-api lint typecheck fast

## only the files holding fast tests are collected: importing every test module costs ~12 s
FAST_FILES = $(shell grep -rlE --include='test_*.py' 'pytest\.mark\.fast' tests)
fast: $(STAMP)
	$(BIN)/pytest -p no:cacheprovider -q -m fast $(FAST_FILES)

lint: $(STAMP)
	$(BIN)/ruff check rcoder tests scripts
	$(BIN)/ruff format --check rcoder tests scripts

typecheck: $(STAMP)
	$(BIN)/mypy rcoder scripts tests

## four workers on two cores: most tests wait (on timeouts, leases, agents, a fake model) more than
## they compute, and the cores were 76% busy with three. Measured on this machine with a helper's
## benchmarks beside it: the suite 1091 s with three workers, 856 s with four (2026-12-06; before,
## two took about 1290 s where three took 1096). Nearly all the CPU is the tests' processes' (about
## 700 daemon starts, real agents, relays, git), not the workers'. --no-loadscope-reorder: the
## files go out in tests/conftest.py's order (FIRST_FILES, LAST_FILES), not by their test count
unit: $(STAMP) agents tools twine postgres podman helper bytecode
	$(BIN)/pytest -p no:cacheprovider -n 4 --dist loadfile --no-loadscope-reorder --durations=25 --cov --cov-report=term:skip-covered

## Debian's PostgreSQL 15 server binaries: tests/pg.py starts a throwaway cluster from them for the
## PostgreSQL store's tests. Installed when missing and we are root (no main cluster is created, no
## service started); otherwise says what to install. Nothing to do when they are there.
PG_BIN ?= /usr/lib/postgresql/15/bin
postgres:
	@test -x $(PG_BIN)/postgres || { \
		if [ "$$(id -u)" != 0 ]; then \
			echo "make: the PostgreSQL store's tests need $(PG_BIN)/postgres: install Debian's postgresql-15 (sudo apt-get install postgresql-15)" >&2; \
			exit 1; \
		fi; \
		echo "installing Debian's postgresql-15 (the PostgreSQL store's tests need its server binaries)"; \
		mkdir -p /etc/postgresql-common; \
		test -e /etc/postgresql-common/createcluster.conf || echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.conf; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			-o Dpkg::Options::=--force-confold postgresql-15 >/dev/null; \
		test -x $(PG_BIN)/postgres || { echo "make: postgresql-15 installed, but $(PG_BIN)/postgres is still missing" >&2; exit 1; }; \
	}

## Debian's podman and runc: the relays' containers (placement = "container": tests/relay/test_containers.py,
## test_placement_container.py, the benchmark's cold start) and the image's tests run on podman's service.
## Installed when missing and we are root (deploy/containers.conf gives them the rlimits they need);
## otherwise says what to install. Nothing to do on a machine that has them.
podman:
	@command -v podman >/dev/null && command -v runc >/dev/null || { \
		if [ "$$(id -u)" != 0 ]; then \
			echo "make: the container tests need podman and runc: install Debian's (sudo apt-get install --no-install-recommends podman runc)" >&2; \
			exit 1; \
		fi; \
		echo "installing Debian's podman and runc (the relays' containers and the image's tests run on them)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			podman runc >/dev/null; \
		command -v podman >/dev/null || { echo "make: podman installed, but still not on PATH" >&2; exit 1; }; \
	}

## the container image localhost/rcoder:<version>, tagged :latest (Containerfile; scripts/image.py): podman,
## runc (and mmdebstrap for the base it makes from Debian's packages) installed when missing and we are
## root; reused while its inputs are unchanged. BASE=debian:bookworm-slim builds on a registry's base.
BASE ?=
image: helper
	$(PYTHON) scripts/image.py $(if $(BASE),--base $(BASE),)

## the long fault runs: a thousand client cuts, a hundred daemon kills at each of three points, ten
## thousand turns; side by side (each its own daemons and folders), their counts printed at the end (-rP)
soak: $(STAMP) helper bytecode
	RCODER_SOAK=1 $(BIN)/pytest -p no:cacheprovider -n 3 --dist load -rP --timeout=0 tests/test_faults.py \
		tests/test_stress.py -k "killed or cuts or hundreds"

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py
	$(BIN)/python scripts/docs_hooks.py  # docs/api-reference.md follows the proto's comments (make docs-reference)

check-proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py --check

## the API contract: buf lint (exceptions in scripts/check_api.py, with their reasons) and buf breaking
## against api/baseline/, the proto of the last release: rename nothing, renumber nothing
check-api: $(STAMP) tools
	$(BIN)/python scripts/check_api.py

## on a release: the current proto becomes the baseline that buf breaking compares against (commit it)
api-baseline:
	rm -rf api/baseline && mkdir -p api/baseline
	cp -r proto/rcoder api/baseline/

## the wheel and the sdist, into dist/, checked by twine (the base install is the client;
## rcoder[daemon] adds the daemon: see docs/install.md)
dist: $(STAMP) twine
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(TWINE_VENV)/bin/twine check --strict dist/*

## benchmarks against a direct-client baseline taken in the same run (never part of `make test`);
## prints ratio, target and PASS/FAIL per line, writes bench-results.json
bench: $(STAMP) agents podman helper bytecode
	$(BIN)/python scripts/bench.py --json bench-results.json

clean:
	rm -rf $(VENV) $(TWINE_VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache $(CONFINE_HELPER)
