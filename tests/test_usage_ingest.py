"""Usage batches added into UsageMinute on the real PostgreSQL, and through a real Celery worker."""

from __future__ import annotations

import os
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from celery import Celery
from django.db import connections
from django.utils import timezone

from rollout.evidence import usage_side
from tenants.models import Tenant
from tests.conftest import celery_worker
from usage.ingest import ingest
from usage.models import UsageBatch, UsageMinute
from usage.recorder import UsageRecorder
from usage.sketch import quantile
from usage.tasks import prune_usage

MINUTE = 29_000_000  # 2025-02-20 03:20 UTC, in minutes since the epoch
BROKER = os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def drained(tenant: Tenant, *answers: tuple[int, int, float, float], minute: int = MINUTE, model: str = "digits"):
    """A recorder's drained rows for `answers` (status, items, compute, latency) of tenant's `model` v1."""
    rec = UsageRecorder(lambda: minute * 60.0 + 5)
    for status, items, compute, latency in answers:
        rec.record(tenant.pk, model, 1, status, items, compute, latency)
    return rec.drain().rows()


@pytest.fixture
def acme(db) -> Tenant:  # noqa: ANN001
    return Tenant.objects.create(name="Acme", slug="acme")


def test_batches_from_two_gateways_add_up_in_one_cell(acme) -> None:  # noqa: ANN001
    # given two gateways' batches for the same tenant, model, version and minute
    first = drained(acme, (200, 4, 0.004, 0.010), (503, 0, 0.0, 0.001))
    second = drained(acme, (200, 2, 0.002, 0.500), (404, 0, 0.0, 0.002))
    # when both are ingested
    assert ingest("gw-a-1", first) == 1
    assert ingest("gw-b-1", second) == 1
    # then one cell holds the sums and the merged latency sketch
    cell = UsageMinute.objects.get()
    assert cell.minute == datetime.fromtimestamp(MINUTE * 60, tz=UTC)
    assert (cell.requests, cell.errors_4xx, cell.errors_5xx, cell.items) == (4, 1, 1, 6)
    assert cell.compute_seconds == pytest.approx(0.006)
    assert sum(cell.latency.values()) == 4
    assert quantile(cell.latency, 1.0) == pytest.approx(0.5, rel=0.05)


def test_refusals_a_fallback_answered_add_up_and_older_rows_lack_them(acme) -> None:  # noqa: ANN001
    # given a gateway's batch with two refusals of digits v1 that its fallback answered, and a batch from a
    # process of an earlier release, whose rows have no such count
    rec = UsageRecorder(lambda: MINUTE * 60.0 + 5)
    rec.record(acme.pk, "digits", 1, 200, 1, 0.001, 0.010)
    rec.fell_back(acme.pk, "digits", 1)
    rec.fell_back(acme.pk, "digits", 1)
    older = [{k: v for k, v in row.items() if k != "fell_back"} for row in drained(acme, (200, 1, 0.001, 0.010))]
    # when both are ingested / then the cell holds the answers and, apart, the refusals
    assert ingest("gw-a-1", rec.drain().rows()) == 1
    assert ingest("gw-old-1", older) == 1
    cell = UsageMinute.objects.get()
    assert (cell.requests, cell.errors_5xx, cell.fell_back) == (2, 0, 2)


def test_a_retried_batch_is_counted_once(acme) -> None:  # noqa: ANN001
    # given a batch already ingested
    rows = drained(acme, (200, 3, 0.003, 0.010))
    assert ingest("batch-1", rows) == 1
    # when the same batch id comes again (a retried task) / then nothing is added
    assert ingest("batch-1", rows) == 0
    assert UsageMinute.objects.get().requests == 1
    assert UsageBatch.objects.filter(batch_id="batch-1").count() == 1
    # and a new batch for the same cell still adds
    assert ingest("batch-2", rows) == 1
    assert UsageMinute.objects.get().requests == 2


def test_cells_of_a_deleted_tenant_are_dropped_not_failed(acme) -> None:  # noqa: ANN001
    # given a batch with a live tenant's cell and a deleted tenant's
    gone = Tenant.objects.create(name="Gone", slug="gone")
    rows = drained(acme, (200, 1, 0.0, 0.01)) + drained(gone, (200, 1, 0.0, 0.01))
    gone.delete()
    # when ingested / then the live tenant's usage lands and the batch counts as done
    assert ingest("mixed", rows) == 1
    assert list(UsageMinute.objects.values_list("tenant__slug", flat=True)) == ["acme"]
    assert UsageBatch.objects.filter(batch_id="mixed").exists()


def test_a_malformed_batch_adds_nothing(acme) -> None:  # noqa: ANN001
    rows = drained(acme, (200, 1, 0.0, 0.01))
    rows.append({**rows[0], "requests": "many"})
    with pytest.raises(ValueError):
        ingest("bad", rows)
    assert not UsageMinute.objects.exists() and not UsageBatch.objects.exists()


def test_concurrent_batches_over_the_same_new_cells_both_land(transactional_db) -> None:  # noqa: ANN001
    # given two tenants and two batches that both create the same two cells, in opposite orders
    a = Tenant.objects.create(name="A", slug="a")
    b = Tenant.objects.create(name="B", slug="b")
    one = drained(a, (200, 1, 0.0, 0.01)) + drained(b, (200, 1, 0.0, 0.01))
    two = list(reversed(one))
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(batch_id: str, rows: list[dict]) -> None:
        try:
            start.wait()
            ingest(batch_id, rows)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            connections.close_all()

    # when both are ingested at once on two connections
    threads = [threading.Thread(target=run, args=(f"c{i}", rows)) for i, rows in enumerate((one, two))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    # then neither fails and each cell holds both
    assert not errors, errors
    assert sorted(UsageMinute.objects.values_list("tenant__slug", "requests")) == [("a", 2), ("b", 2)]


def test_prune_deletes_old_usage_and_old_batch_ids(acme, settings) -> None:  # noqa: ANN001
    settings.FERRY_USAGE_RETENTION_DAYS = 30
    settings.FERRY_USAGE_BATCH_DAYS = 7
    old_minute = int((timezone.now() - timedelta(days=31)).timestamp() // 60)
    new_minute = int((timezone.now() - timedelta(days=1)).timestamp() // 60)
    ingest("old", drained(acme, (200, 1, 0.0, 0.01), minute=old_minute))
    ingest("new", drained(acme, (200, 1, 0.0, 0.01), minute=new_minute))
    UsageBatch.objects.filter(batch_id="old").update(recorded_at=timezone.now() - timedelta(days=8))
    assert prune_usage() == (1, 1)
    assert UsageMinute.objects.count() == 1 and list(UsageBatch.objects.values_list("batch_id", flat=True)) == ["new"]


@pytest.fixture
def worker(transactional_db, tmp_path):  # noqa: ANN001, ANN201
    """A real Celery worker process on the test database, its broker the test Redis database."""
    with celery_worker(tmp_path, BROKER) as proc:
        yield proc


def test_worker_adds_a_batch_once_however_often_it_is_delivered(worker) -> None:  # noqa: ANN001
    # given a tenant's drained usage
    acme = Tenant.objects.create(name="Acme", slug="acme")
    rows = drained(acme, (200, 4, 0.004, 0.010), (200, 2, 0.002, 0.020))
    # when the same batch is delivered to the worker twice, then another batch for the same cell
    client = Celery(broker=BROKER, set_as_current=False)  # later tests keep the project app (eager tasks)
    for batch_id in ("w-1", "w-1", "w-2"):
        client.send_task("usage.tasks.record_usage", args=[batch_id, rows])
    # then the worker adds the first once and the second once: 4 requests, 12 items
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and worker.poll() is None:
        if UsageBatch.objects.filter(batch_id="w-2").exists():
            break
        time.sleep(0.2)
    assert worker.poll() is None, "worker exited"
    cell = UsageMinute.objects.get(tenant=acme)
    assert (cell.requests, cell.items) == (4, 12)


def test_a_rollouts_evidence_counts_a_refusal_its_fallback_answered_as_a_failure(acme) -> None:  # noqa: ANN001
    # given a candidate that answered 8 requests itself and refused 2 that the model's fallback answered
    rec = UsageRecorder(lambda: MINUTE * 60.0 + 5)
    for _ in range(8):
        rec.record(acme.pk, "digits", 2, 200, 1, 0.001, 0.010)
    rec.fell_back(acme.pk, "digits", 2)
    rec.fell_back(acme.pk, "digits", 2)
    ingest("gw-a-1", rec.drain().rows())
    # when a gate reads its side / then it was asked 10 times and failed 2: the fallback's answers are not its own
    side = usage_side("digits", 2, datetime.fromtimestamp(MINUTE * 60, tz=UTC))
    assert (side.requests, side.errors) == (10, 2)
