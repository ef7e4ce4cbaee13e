# Ferry entry points. `make run` serves in embedded mode; `make test` runs the suite on PostgreSQL and Redis,
# starting them (and installing them, on a fresh machine) when they are not running: scripts/services.sh.
SHELL := /bin/bash
PY := .venv/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
# The web process's gRPC listener (FERRY_GRPC_PORT; 0: off), on FERRY_GRPC_HOST (127.0.0.1 unless set).
GRPC_PORT ?= $(or $(FERRY_GRPC_PORT),8001)
GRPC_HOST := $(or $(FERRY_GRPC_HOST),127.0.0.1)
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/test
TEST_REDIS_URL ?= redis://127.0.0.1:6379/15
# Three workers on two cores (tests/xdist_workers.py): much of the suite waits (on processes starting, heartbeats,
# deadlines), so a third keeps the cores busier; in-process tests run beside the deployments of real processes,
# one at a time; the tests marked `solo` run after them, alone (scripts/test.sh). TESTS: a selection for both runs
# (paths, -k), e.g. make test TESTS="tests/test_batching.py".
PYTEST_ARGS ?= -n 3 --dist loadgroup --durations=25
# `make run`'s `manage.py demo_story` options, e.g. --phase-seconds 5 (tests/test_demo_browser.py: the rollout's
# phases bake 5 s instead of 30 s; each still waits for its gates' evidence).
DEMO_STORY_ARGS ?=

.PHONY: run setup test bench lint sim
setup:
	@scripts/setup.sh

run:
	@# Both ports free before minutes of set-up and training, or a message naming PORT / GRPC_PORT.
	@$(if $(wildcard $(PY)),$(PY),python3) scripts/free_ports.py $(HOST) $(PORT) $(GRPC_HOST) $(GRPC_PORT)
	@scripts/setup.sh demo
	$(PY) manage.py migrate --noinput -v0
	$(PY) manage.py build_demo_models
	$(PY) manage.py ensure_demo_user
	$(PY) manage.py demo_story $(DEMO_STORY_ARGS)
	@# The demo's traffic runs beside the server and stops with it (--with-parent: `exec` makes the server its parent).
	$(PY) manage.py demo_traffic --host $(HOST) --port $(PORT) --with-parent & FERRY_GRPC_PORT=$(GRPC_PORT) exec $(PY) manage.py serve --host $(HOST) --port $(PORT)

test:
	@scripts/setup.sh test
	@TEST_DATABASE_URL=$(TEST_DATABASE_URL) TEST_REDIS_URL=$(TEST_REDIS_URL) scripts/services.sh
	TEST_DATABASE_URL=$(TEST_DATABASE_URL) TEST_REDIS_URL=$(TEST_REDIS_URL) PYTEST_ARGS="$(PYTEST_ARGS)" scripts/test.sh $(TESTS)

bench:
	@scripts/setup.sh bench
	$(PY) -m bench.run

# The fleet simulator's scenarios under each scaling policy: writes docs/simulation.md and its plots.
sim:
	PYTHONPATH=. $(PY) -m sim.report

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/lint-imports
	.venv/bin/mypy
