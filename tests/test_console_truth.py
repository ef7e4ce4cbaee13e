"""The console's figures say what happened, failures included, and "—" where nothing was measured: every answer
is a kind (served, fallback, shed, error) and has its time in the latency figures, the live rate of a young
process divides by its age, a version's figures are dropped an hour after its last answer, batches run on the
nodes are said to be there, and a lost node's figures are not shown as current.

The data plane's side with a stand-in transport and a fake clock; the pages through Django's test client."""

from __future__ import annotations

import asyncio
import gc
import itertools
import time
from types import SimpleNamespace

import numpy as np
import orjson
import pytest
from django.contrib.auth.models import User

from rollout.routing import RouteTable
from serving import views
from serving.dataplane import plane as planes
from serving.dataplane.errors import DeadlineExceeded, ServingError
from serving.dataplane.gateway.gateway import Gateway
from serving.dataplane.gateway.snapshot import ModelEntry, RoutingSnapshot, SnapshotHub
from serving.dataplane.http.consumers import InferenceRequest, OverQuota
from serving.dataplane.metrics import metrics
from serving.dataplane.metrics.metrics import TOTAL, LiveWindow, merged_live
from serving.fleet_chart import utilisation_svg
from serving.fleet_state import node_doc
from serving.fleet_views import parts
from serving.policies.quota import RATE, Decision
from serving.version_charts import version_hour
from tests.conftest import register
from tests.test_admission import entry
from tests.test_work_utilisation import heartbeat  # a node's heartbeat at t=1000

TENANT = 7
TIMEOUT_S = 0.28  # a timed-out request's wait: between the 0.25 and 0.3 buckets around the 300 ms budget
SERVED_S = 0.012
_names = itertools.count()
# A data plane whose node is not in this process: the node host's view (`serve --workers N`), or the fleet's.
ELSEWHERE = SimpleNamespace(node=SimpleNamespace(is_ready=lambda key: False))


def unique(prefix: str) -> str:
    """A model name no other test used: the data plane's metrics live as long as the process."""
    return f"{prefix}-{next(_names)}-{time.monotonic_ns()}"


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


class TimesOut:
    """Times out (504) the first `failures` requests after TIMEOUT_S of the clock; answers the rest in SERVED_S."""

    def __init__(self, clock: Clock, failures: int) -> None:
        self.clock, self.failures = clock, failures

    async def infer(self, entry, inputs, rows, deadline, priority, **_):  # noqa: ANN001, ANN003, ANN201
        if self.failures:
            self.failures -= 1
            self.clock.now += TIMEOUT_S
            raise DeadlineExceeded("the deadline passed before the answer")
        self.clock.now += SERVED_S
        return {"scores": np.zeros((rows, 2), np.float32)}


def body() -> bytes:
    return orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [0.0] * 4}]})


def gateway_for(name: str, failures: int) -> Gateway:
    hub = SnapshotHub()
    model = ModelEntry(name, "", "", None, {1: entry(name)}, routes=RouteTable(stable=1))
    hub.set(RoutingSnapshot(serial=1, built_at=0.0, models={name: model}))
    clock = Clock()
    return Gateway(hub, TimesOut(clock, failures), clock)


async def answer_99_timeouts_and_1_success(name: str) -> Gateway:
    gateway = gateway_for(name, failures=99)
    for _ in range(99):
        with pytest.raises(ServingError) as timed_out:
            await gateway.infer(name, None, body(), None, TENANT)
        assert timed_out.value.status == 504
    assert (await gateway.infer(name, None, body(), None, TENANT)).status == 200
    return gateway


def count(name: str, status_class: str) -> tuple[int, dict[float, int]]:
    """ferry_request_seconds' count for `name` v1 in `status_class`, and its answers by bucket bound."""
    counts, _ = TOTAL.labels(name, "1", status_class).snapshot()
    return sum(counts), dict(zip([*TOTAL.bounds, float("inf")], counts, strict=True))


# -- failures are in every figure (audit item 1) -----------------------------------------------------------


async def test_99_timeouts_and_1_success_read_as_99_percent_errors_not_as_all_served() -> None:
    name = unique("timeouts")
    # given a version that timed out 99 requests (280 ms each) and answered 1 in 12 ms
    await answer_99_timeouts_and_1_success(name)
    # then the model page's hour counts 100 answers, 99% of them errors, and its p99 is the timeouts' wait
    hour = version_hour(name, 1)
    assert hour is not None
    assert (hour.answers, hour.errors) == (100, 99)
    assert hour.shares == {"served": 1.0, "fallback": 0.0, "shed": 0.0, "error": 99.0}
    assert hour.p99_ms is not None and abs(hour.p99_ms - TIMEOUT_S * 1000) < TIMEOUT_S * 1000 * 0.05
    # and the models page's last 30 s: level "errors", 99 of them, p50 and p99 the timeouts' wait
    live = views._live(name, 1)
    assert live["saturation"] == {"level": "errors", "fallback_pct": 0.0, "shed_pct": 0.0, "error_pct": 99.0}
    assert live["errors"] == 99
    assert live["p50_ms"] == pytest.approx(TIMEOUT_S * 1000, abs=0.1)
    assert live["p99_ms"] == pytest.approx(TIMEOUT_S * 1000, abs=0.1)


async def test_the_latency_histogram_has_every_answer_by_status_class_with_buckets_around_the_budget() -> None:
    name = unique("histogram")
    await answer_99_timeouts_and_1_success(name)
    # then the 504s are in ferry_request_seconds too, apart from the success, between 0.25 and 0.3 s
    assert {0.15, 0.25, 0.3} <= set(TOTAL.bounds)
    failed, failed_by_bound = count(name, "5xx")
    served, served_by_bound = count(name, "2xx")
    assert (failed, served) == (99, 1)
    assert failed_by_bound[0.3] == 99 and served_by_bound[0.025] == 1
    # and the 2xx child is the one Triton's statistics read as "success"
    assert metrics.for_version(name, 1).total is TOTAL.labels(name, "1", "2xx")


async def test_a_bad_request_is_an_error_with_its_time() -> None:
    name = unique("bad-request")
    gateway = gateway_for(name, failures=0)
    # when a request's body does not decode (400)
    with pytest.raises(ServingError) as refused:
        await gateway.infer(name, None, b'{"inputs": []}', None, TENANT)
    assert refused.value.status == 400
    # then it is an error in the console's kinds and a 4xx in the histogram
    assert metrics.for_version(name, 1).saturation.totals()["error"] == 1
    assert count(name, "4xx")[0] == 1


async def test_a_quota_refusal_counts_for_its_version_in_the_console() -> None:
    name = unique("quota")
    gateway = gateway_for(name, failures=0)
    request = InferenceRequest("POST", f"/v2/models/{name}/infer", {}, 0.002, None)
    plane = SimpleNamespace(gateway=gateway)
    refusal = Decision(admitted=False, reason=RATE, limit=1, remaining=0, reset=1.0, retry_after=1.0)
    # when the tenant's quota refuses a request for the version (429)
    with pytest.raises(OverQuota):
        request._over_quota(plane, SimpleNamespace(slug="t"), name, None, TENANT, refusal)  # type: ignore[arg-type]
    # then the version's figures show it as an error, with its time
    assert metrics.for_version(name, 1).saturation.totals()["error"] == 1
    assert metrics.live_stats(name, 1).errors == 1  # type: ignore[union-attr]
    assert count(name, "4xx")[0] == 1


# -- "—" where nothing was measured; a young process's rate (item 12) ----------------------------------------


def test_a_version_nothing_answered_shows_dashes_not_zero_and_ok() -> None:
    live = views._live(unique("never-asked"), 1)
    assert live["rate"] is None and live["errors"] is None and live["p99_ms"] is None
    assert live["saturation"] == {"level": None, "fallback_pct": None, "shed_pct": None, "error_pct": None}


def test_the_rate_of_a_process_younger_than_the_window_divides_by_its_age() -> None:
    now = 1000.0
    # given a process 2 s old (its window 30 s) that answered 10 requests
    young = LiveWindow(window=30, started=now - 2)
    for _ in range(10):
        young.request(0.01, True, now=now)
    # then its rate is 5 a second, not 10 / 30
    assert young.stats(now=now).rate == pytest.approx(5.0)
    # and merged with a process older than the window that answered 30, each rate over its own seconds
    old = LiveWindow(window=30, started=now - 300)
    for _ in range(30):
        old.request(0.01, True, now=now)
    merged = merged_live([{"live": young.doc(now=now)}, {"live": old.doc(now=now)}])
    assert merged is not None and merged.rate == pytest.approx(5.0 + 1.0)


# -- batches run elsewhere (item 13) -------------------------------------------------------------------------


async def test_a_process_whose_batches_run_on_the_nodes_says_so_rather_than_0_batches(monkeypatch) -> None:  # noqa: ANN001
    name = unique("no-batches-here")
    await answer_99_timeouts_and_1_success(name)
    # given a data plane whose node is not in this process
    monkeypatch.setattr(planes, "current", lambda: ELSEWHERE)
    hour = version_hour(name, 1)
    # then the hour has no batch count and no batch chart to show
    assert hour is not None and hour.batches is None and hour.batch_chart == ""


# -- the pages ------------------------------------------------------------------------------------------------


def test_the_pages_show_the_errors_and_where_batches_run(db, model_files, client, monkeypatch) -> None:  # noqa: ANN001
    name = unique("page")
    register(model_files.digits, name)
    client.force_login(User.objects.create_user(unique("staff"), is_staff=True, is_superuser=True))
    # given a version that timed out 99 requests and served 1, in a process whose batches run on the nodes
    asyncio.run(answer_99_timeouts_and_1_success(name))
    monkeypatch.setattr(planes, "current", lambda: ELSEWHERE)
    # then the model page gives the shares with the errors, and says where the batches are
    model_page = client.get(f"/console/models/{name}/").content.decode()
    assert '<span class="share-served">1.0% served</span>' in model_page
    assert ">99.0% errors</span>" in model_page
    assert '<span class="errors">99 answered with a failure status</span>' in model_page
    assert "batches are measured on the nodes" in model_page and "0 batches" not in model_page
    # and the models page's row reads "errors", with their count
    models_page = client.get("/console/models/").content.decode()
    row = models_page.split(f'<tr data-key="{name}:1">')[1].split("</tr>")[0]
    assert '<span class="sat sat-errors"' in row and "99.0% err" in row
    assert '<td class="errors">99</td>' in row


# -- a version's figures are dropped an hour after its last answer (item 9) -----------------------------------


def test_a_version_idle_for_an_hour_is_dropped_unless_something_still_holds_it() -> None:
    gone, held = unique("deleted"), unique("hosted")
    metrics.for_version(gone, 1).answered(200, 0.01)
    holder = metrics.for_version(held, 1)  # as a node holds the metrics of a version it hosts
    assert metrics.console_doc().keys() >= {f"{gone}:1", f"{held}:1"}
    # when an hour passes with nothing counted for either
    for vm in (metrics.for_version(gone, 1), holder):
        vm.hour._clock = lambda: time.time() + 3601 + 60
    metrics.prune(force=True)
    gc.collect()
    # then the one nothing holds is gone from the process's figures; the hosted one stays, the same object
    assert metrics.live_stats(gone, 1) is None and f"{gone}:1" not in metrics.console_doc()
    assert metrics.live_stats(held, 1) is not None
    assert metrics.for_version(held, 1) is holder
    # and a version counted for in the last hour is kept
    recent = unique("recent")
    metrics.for_version(recent, 1).answered(200, 0.01)
    metrics.prune(force=True)
    assert metrics.live_stats(recent, 1) is not None


def test_the_process_keeps_no_more_versions_than_it_counted_for_in_the_hour() -> None:
    # when 500 versions come and go, each answered once an hour ago
    before = len(metrics._versions)
    for _ in range(500):
        vm = metrics.for_version(unique("churn"), 1)
        vm.answered(200, 0.01)
        vm.hour._clock = lambda: time.time() + 3601 + 60
    del vm
    metrics.prune(force=True)
    gc.collect()
    # then none of them is kept
    assert len(metrics._versions) <= before and not [k for k in metrics._resting if k[0].startswith("churn-")]


# -- the fleet page: lost nodes and missing figures (item 11) ------------------------------------------------


def test_a_lost_node_shows_no_current_busy_or_work_and_its_chart_ends_where_its_heartbeats_did() -> None:
    # given a node lost 5 minutes ago that last said 90% busy, 40% work, with samples of its last 20 s
    info = heartbeat(busy=0.9, work=0.4, utilisation=[[20.0, 0.9, 0.4], [10.0, 0.9, 0.4], [0.0, 0.9, 0.4]])
    doc = node_doc(info, "lost", now=1300.0)
    # then its shares are unknown, shown as "—"
    assert (doc["busy"], doc["work"]) == (None, None)
    html = parts({"nodes": [doc | {"embedded": False}], "events": [], "versions": []})["nodes"]
    assert '<td class="busy" data-busy="">—</td>' in html and '<td class="work" data-work="">—</td>' in html
    # and its lines end 5 minutes before now, mid-chart (160 px for 10 minutes), not at the right edge
    svg = utilisation_svg(doc)
    assert svg.split('class="busy" points="')[1].split('"')[0].split()[-1].startswith("80.0,")
    # and once its samples are over ten minutes old, the chart says it has no data
    later = utilisation_svg(node_doc(info, "lost", now=1700.0))
    assert 'data-samples="0"' in later and ">no data</text>" in later and "<polyline" not in later
