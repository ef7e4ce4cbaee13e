"""Resources of its own for each pytest-xdist worker, and the tests that must not overlap kept on one.

`make test` runs the suite on three workers (`-n 3 --dist loadgroup`). pytest-django already gives each
worker a test database of its own (`test_<name>_gw0`, ...); the rest is shared unless split here:
the test Redis database, the Celery broker database and the data directory, all read from the
environment when the test modules and Django's settings are imported. This module is a plugin
(`-p tests.xdist_workers` in pyproject.toml's addopts), imported before pytest-django configures
Django, so it rewrites those variables in time: worker N uses the Redis databases 2N below the
configured ones and a subdirectory `gwN` of FERRY_DATA_DIR.

Tests that start deployments of real processes (web, nodes, Celery worker and beat) are put in one
xdist group, so at most one such deployment runs at a time while the other workers run in-process
tests: two of them on this 2-core machine at once would starve each other's processes.

It also gives the whole suite, this process and every process it starts, a latency budget far above the
300 ms default (`SUITE_LATENCY_BUDGET_MS`): on a loaded 2-core machine 300 ms is tight, and tests that are
not about the budget must not fail for it. Each version's `default_timeout_ms` still applies;
tests/test_latency_budget.py sets the budget it tests explicitly.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/15"
PROCESS_MODULES = {
    "test_artifact_processes",
    "test_autoscale_processes",
    "test_demo_browser",  # `make run`: an embedded deployment, its training, its background traffic
    "test_fleet_browser",
    "test_fleet_processes",
    "test_gateway_admission_processes",  # an overload of its own
    "test_gateway_restart_processes",
    "test_lifecycle_processes",
    "test_metrics_access",
    "test_node_host_processes",
    "test_node_providers",
    "test_postgres_outage",
    "test_revocation_gateways",
    "test_sandbox_processes",
    "test_shadow_processes",
    "test_streams_processes",
    "test_tracing_processes",
}


def _shift(url: str, by: int) -> str:
    base, _, db = url.rpartition("/")
    number = int(db) - by
    if number < 0:
        raise pytest.UsageError(f"too many xdist workers for the Redis databases below {url}")
    return f"{base}/{number}"


def _split_for_worker() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return
    index = int(worker[2:])
    redis_url = os.environ.get("FERRY_TEST_REDIS_URL", DEFAULT_REDIS_URL)
    broker = os.environ.get("FERRY_TEST_CELERY_BROKER_URL") or redis_url.rsplit("/", 1)[0] + "/14"
    os.environ["FERRY_TEST_REDIS_URL"] = _shift(redis_url, 2 * index)
    os.environ["FERRY_TEST_CELERY_BROKER_URL"] = _shift(broker, 2 * index)
    if data_dir := os.environ.get("FERRY_DATA_DIR"):
        own = Path(data_dir) / worker
        own.mkdir(parents=True, exist_ok=True)
        os.environ["FERRY_DATA_DIR"] = str(own)


_split_for_worker()

# Here, not in conftest.py: Django's settings are read before conftest.py is imported, and the processes
# the tests start inherit this environment. 60 s is the longest client deadline the gateway ever took.
SUITE_LATENCY_BUDGET_MS = "60000"
os.environ.setdefault("FERRY_LATENCY_BUDGET_MS", SUITE_LATENCY_BUDGET_MS)
# gRPC off in every server the suite starts: on its fixed default port (8001, SO_REUSEPORT) two servers would
# share connections. tests/test_grpc*.py give theirs a free port.
os.environ.setdefault("FERRY_GRPC_PORT", "0")


# tryfirst: pytest-xdist's worker turns `xdist_group` markers into the node id's `@group` suffix in its own
# `pytest_collection_modifyitems`, registered after this plugin and so, at the same priority, called before it:
# markers added later are never read and the group never forms.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in PROCESS_MODULES:
            item.add_marker(pytest.mark.xdist_group("processes"))
