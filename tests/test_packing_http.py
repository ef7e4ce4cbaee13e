"""Multi-model packing in embedded mode: a real server (conftest's LiveServer) on the real PostgreSQL, a node
budget that holds two versions of the digits model, and requests over HTTP.

Every version of `pack` is the same digits artifact, so each has the same footprint F; the budget is 2.5 F.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from serving.dataplane.node.node import EVICTED_LRU
from serving.models import ModelVersion
from tenants.models import AuditEntry
from tests.conftest import LiveServer, register
from tests.test_inference_http import assert_error, call, digits_request, scores, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def infer_version(server: LiveServer, version: int, body: dict, model: str = "pack"):  # noqa: ANN201
    return call(server, "POST", f"/v2/models/{model}/versions/{version}/infer", body)


def index(server: LiveServer) -> dict[str, dict]:
    resp = call(server, "POST", "/v2/repository/index", b"")
    assert resp.status == 200
    return {f"{r['name']}:{r['version']}": r for r in resp.json()}


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def versions(model_files) -> list[ModelVersion]:  # noqa: ANN001
    """Three versions of `pack` (version 1 is stable)."""
    return [register(model_files.digits, "pack", max_batch_size=8, max_queue_delay_ms=1) for _ in range(3)]


@pytest.fixture
def serve(settings, versions) -> Iterator:  # noqa: ANN001
    """Start a live server with a budget of 2.5 footprints, after the test has set up the registry."""
    servers: list[LiveServer] = []
    footprint = versions[0].memory_bytes
    assert footprint and footprint > 0

    def start(budget: float = 2.5) -> LiveServer:
        settings.FERRY_NODE_MEMORY_BYTES = int(budget * footprint)
        # What is tested is packing, not the front door's shedding on a machine other tests load.
        settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000
        servers.append(LiveServer().start())
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def hosted(server: LiveServer) -> set[str]:
    return set(server.plane().node.hosted)


def test_a_load_that_does_not_fit_evicts_the_least_recently_used_idle_version(serve, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    # given a node that loaded versions 1 and 2 at start and left 3 cold (it did not fit)
    server = serve()
    assert hosted(server) == {"pack:1", "pack:2"}
    rows = index(server)
    assert rows["pack:3"]["state"] == "UNAVAILABLE" and rows["pack:3"]["reason"].startswith("cold")
    # and version 1 used after version 2, so 2 is the least recently used
    assert infer_version(server, 1, digits_request(x[:1])).status == 200
    evicted_before = counter("ferry_evictions_total", model="pack", version="2", reason="lru")
    waited_before = counter("ferry_cold_loads_total", model="pack", version="3", outcome="waited")
    wait_observed_before = counter("ferry_cold_wait_seconds_count", model="pack")
    # when a request asks for the cold version 3
    resp = infer_version(server, 3, digits_request(x[:2]))
    # then it waited for the load and was answered by version 3
    assert resp.status == 200 and resp.headers["x-ferry-model-version"] == "3"
    assert scores(resp).shape == (2, 10)
    assert counter("ferry_cold_loads_total", model="pack", version="3", outcome="waited") == waited_before + 1
    assert counter("ferry_cold_wait_seconds_count", model="pack") == wait_observed_before + 1
    # and version 2, the idle least recently used, was evicted, counted and recorded with the reason
    assert hosted(server) == {"pack:1", "pack:3"}
    assert counter("ferry_evictions_total", model="pack", version="2", reason="lru") == evicted_before + 1
    events = [e for e in server.plane().node.packing.events if e.kind == "evict"]
    assert [(e.key, e.detail) for e in events] == [("pack:2", EVICTED_LRU)]  # not naming the version it made room for
    # and the index shows the evicted version cold, loadable on demand
    assert index(server)["pack:2"]["reason"].startswith("cold")
    # and the node told the registry the footprint and cold start it measured on its accelerator type
    wait_until(
        lambda: "cpu" in ModelVersion.objects.get(model__name="pack", version=3).placement_measurements,
        "the measurements reported to the registry",
    )
    measured = ModelVersion.objects.get(model__name="pack", version=3).placement_measurements["cpu"]
    assert measured["memory_bytes"] > 0 and measured["cold_start_seconds"] > 0
    # when version 2 is asked for again / then it comes back, evicting the now least recently used (1)
    assert infer_version(server, 2, digits_request(x[:1])).status == 200
    assert hosted(server) == {"pack:2", "pack:3"}


def test_pinned_and_stable_with_minimum_replicas_are_never_evicted(serve, versions, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    # given version 1 (stable) kept by a minimum of one replica and version 2 pinned, both loaded at start
    ModelVersion.objects.filter(pk=versions[0].pk).update(min_replicas=1)
    ModelVersion.objects.filter(pk=versions[1].pk).update(pinned=True)
    server = serve()
    assert hosted(server) == {"pack:1", "pack:2"}
    # when the cold version 3 is asked for, with nothing else to evict
    resp = infer_version(server, 3, digits_request(x[:1]))
    # then it is refused with 503 and a reason counting what holds the memory (never naming it: it may be another
    # tenant's), and neither kept one left
    message = assert_error(resp, 503, "pack:3", "could not be loaded", "held by 2 other versions that must stay")
    assert "pack:1" not in message and "pack:2" not in message
    assert "retry-after" in resp.headers
    assert hosted(server) == {"pack:1", "pack:2"}
    assert not [e for e in server.plane().node.packing.events if e.kind == "evict"]
    # and the kept versions keep serving
    assert infer_version(server, 1, digits_request(x[:1])).status == 200
    assert infer_version(server, 2, digits_request(x[:1])).status == 200


def test_a_pinned_version_evicts_idle_ones_to_load_at_reconcile(serve, versions, digits_samples) -> None:  # noqa: ANN001
    # given versions 1 and 2 loaded, 3 cold
    server = serve()
    assert hosted(server) == {"pack:1", "pack:2"}
    # when version 3 is pinned in the registry
    ModelVersion.objects.filter(pk=versions[2].pk).update(pinned=True)
    versions[2].model.save()  # moves updated_at: the refresh sees a change
    server.refresh()
    # then the reconcile loads it at once, evicting an idle version rather than waiting for a request
    assert "pack:3" in hosted(server) and len(hosted(server)) == 2


def measured_cold_start(version: ModelVersion, seconds: float) -> None:
    """What a node of this type reported for `version`: the node's estimate of its cold start until it
    measures its own."""
    ModelVersion.objects.filter(pk=version.pk).update(
        placement_measurements={"cpu": {"memory_bytes": version.memory_bytes, "cold_start_seconds": seconds}}
    )


def test_a_cold_start_longer_than_the_deadline_is_503_with_retry_after(serve, versions, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    # given cold version 3, whose cold start on this accelerator type was reported as 30 s
    measured_cold_start(versions[2], 30.0)
    server = serve()
    refused_before = counter("ferry_cold_loads_total", model="pack", version="3", outcome="refused")
    # when a request for it allows 2 s (Triton's timeout parameter, in microseconds)
    resp = infer_version(server, 3, digits_request(x[:1], parameters={"timeout": 2_000_000}))
    # then it is not kept waiting: 503 with Retry-After the remaining load time, the cold start named
    assert_error(resp, 503, "cold and loading", "30.0 s left")
    assert resp.headers["retry-after"] == "30"
    assert counter("ferry_cold_loads_total", model="pack", version="3", outcome="refused") == refused_before + 1
    # and the load it triggered goes on, so a later request finds it loaded
    wait_until(lambda: "pack:3" in hosted(server), "the triggered load")
    assert infer_version(server, 3, digits_request(x[:1])).status == 200
    # and the node measured its own cold start, which it goes by from now on
    assert server.plane().node.packing.cold_start(server.plane().gateway.route("pack", "3", None)) < 30.0


def test_a_cold_start_longer_than_the_deadline_takes_the_fallback(model_files, versions, serve, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    # given `pack` with a fallback model `small` of the same signature, and pack:3 cold with a 30 s cold start
    small = register(model_files.digits, "small", max_batch_size=8)
    versions[0].model.fallback = small.model
    versions[0].model.save()
    measured_cold_start(versions[2], 30.0)
    server = serve(budget=3.5)  # pack:1, pack:2 and small:1 loaded
    assert "small:1" in hosted(server) and "pack:3" not in hosted(server)
    # when a request for version 3 cannot wait for its load
    resp = infer_version(server, 3, digits_request(x[:1], parameters={"timeout": 2_000_000}))
    # then the fallback answers it, and says so
    assert resp.status == 200, resp.body
    assert resp.headers["x-ferry-fallback-from"] == "pack:3"
    assert resp.json()["model_name"] == "small"


def test_a_version_that_can_never_fit_is_unschedulable_with_its_reason(serve, versions, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    # given version 2 allowed only on h100s and version 3 needing more device memory than the node has
    ModelVersion.objects.filter(pk=versions[1].pk).update(accelerators=["h100"])
    ModelVersion.objects.filter(pk=versions[2].pk).update(min_memory_bytes=1 << 40)
    # when the node starts
    server = serve(budget=5)
    # then neither is loaded, and the index says why
    assert hosted(server) == {"pack:1"}
    rows = index(server)
    assert rows["pack:2"]["state"] == "UNAVAILABLE"
    assert rows["pack:2"]["reason"].startswith("unschedulable (accelerator)") and "h100" in rows["pack:2"]["reason"]
    assert rows["pack:3"]["reason"].startswith("unschedulable (min_memory)")
    # and the registry holds the reason (the node reports it back)
    wait_until(
        lambda: ModelVersion.objects.get(pk=versions[2].pk).unschedulable_reason != "",
        "the unschedulable reason in the registry",
    )
    assert "min_memory" in ModelVersion.objects.get(pk=versions[2].pk).unschedulable_reason
    # and the verdict is in the audit log, as the system's
    wait_until(lambda: AuditEntry.objects.filter(action="version.unschedulable").count() == 2, "the audit entries")
    entry = AuditEntry.objects.get(action="version.unschedulable", target="model pack version 2")
    assert entry.actor_name == "system" and "h100" in entry.after["unschedulable_reason"]
    # and a request for it is refused with the reason, without a load being tried
    assert_error(infer_version(server, 2, digits_request(x[:1])), 503, "cannot be served", "unschedulable", "h100")
    # and later snapshots (the report itself moved updated_at) do not try it again
    server.refresh()
    events = [(e.kind, e.key) for e in server.plane().node.packing.events if e.key in ("pack:2", "pack:3")]
    assert events == [("unschedulable", "pack:2"), ("unschedulable", "pack:3")]
    # when version 2's constraint is lifted (what the placement PATCH does)
    ModelVersion.objects.filter(pk=versions[1].pk).update(accelerators=[], unschedulable_reason="")
    versions[1].model.save()
    server.refresh()
    # then it is judged again, loads, and serves
    assert "pack:2" in hosted(server) and index(server)["pack:2"]["state"] == "READY"
    assert infer_version(server, 2, digits_request(x[:1])).status == 200


def test_a_footprint_over_the_whole_budget_is_unschedulable(serve, versions) -> None:  # noqa: ANN001
    # given the registry's footprint of version 3 (validation's measurement) over the node's budget
    ModelVersion.objects.filter(pk=versions[2].pk).update(memory_bytes=10 * versions[2].memory_bytes)
    server = serve()
    reason = index(server)["pack:3"]["reason"]
    assert reason.startswith("unschedulable (memory)") and "whole budget" in reason
