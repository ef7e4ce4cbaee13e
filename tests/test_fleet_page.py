"""The fleet page's parts without a browser: the busy meter, the event stream, lost nodes, what a viewer may
see, the packing bar, the console page and /api/fleet/ by role, and the WebSocket (Channels' communicator
against the Redis channel layer). Redis is the test Redis (FERRY_TEST_REDIS_URL); the page reads heartbeats
written there as a node writes them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Iterator

import pytest
import redis
from asgiref.sync import async_to_sync
from asgiref.testing import ApplicationCommunicator
from django.test import Client

from serving.dataplane.metrics.busy import BusyMeter
from serving.dataplane.node.packing import Event
from serving.dataplane.transport import fleet, fleet_events, redis_pipe
from serving.dataplane.transport.fleet import NodeInfo
from serving.dataplane.transport.fleet_events import EventPublisher, FleetEvent
from serving.fleet_chart import packing_svg
from serving.fleet_state import scoped
from tests.conftest import tenant

REDIS_URL = os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
MiB = 1 << 20


def clear(client: redis.Redis) -> None:
    keys = list(client.scan_iter("ferry:*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture
def redis_db() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    clear(client)
    yield client
    clear(client)
    client.close()


def info(name: str, *, heartbeat_at: float, resident: dict[str, dict], busy: float = 0.25) -> NodeInfo:
    return NodeInfo(
        name=name,
        instance=f"{name}-1",
        host="box",
        pid=42,
        device="cpu",
        accelerator="a10g",
        accelerator_count=1,
        memory_total=64 * MiB,
        memory_budget=64 * MiB,
        memory_used=sum(r["bytes"] for r in resident.values() if r["tier"] == "hot"),
        labels={"zone": name},
        started_at=heartbeat_at - 100,
        heartbeat_at=heartbeat_at,
        serial=1,
        ready=frozenset(resident),
        hot=frozenset(k for k, r in resident.items() if r["tier"] == "hot"),
        busy=busy,
        resident=resident,
    )


def announce(client: redis.Redis, node: NodeInfo) -> None:
    """What NodeProcess.heartbeat_once writes."""
    client.hset(fleet.node_key(node.name), mapping=node.to_hash())
    client.expire(fleet.node_key(node.name), fleet.TTL_SECONDS)
    client.sadd(fleet.NODES_KEY, node.name)
    client.hset(fleet.SEEN_KEY, node.name, fleet.seen_entry(node))


def test_a_heartbeat_with_fields_this_release_does_not_know_is_still_read() -> None:
    node = info("newer", heartbeat_at=1.0, resident={})
    raw = {k.encode(): v for k, v in node.to_hash().items()} | {b"tiers_to_come": b"{}"}
    assert NodeInfo.from_hash(raw) == node


# -- the busy meter ------------------------------------------------------------------------------------------


def test_busy_meter_is_the_share_of_the_window_spent_computing() -> None:
    now = [100.0]
    meter = BusyMeter(window=10, clock=lambda: now[0])
    # given 2 s of batches over the next 10 s, one of them across a second boundary
    meter.add(100.2, 0.5)
    meter.add(104.7, 1.0)
    meter.add(109.0, 0.5)
    now[0] = 110.0
    assert meter.fraction() == pytest.approx(0.2)
    # when the window moves past the first batch, it no longer counts
    now[0] = 111.0
    assert meter.fraction() == pytest.approx(0.15)
    # and an idle device reads 0 once its window has passed
    now[0] = 200.0
    assert meter.fraction() == 0.0


def test_a_young_busy_meter_divides_by_its_age_not_the_window() -> None:
    meter = BusyMeter(window=10, clock=lambda: 0.0)
    meter.add(0.0, 1.5)
    assert meter.fraction(now=2.0) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        BusyMeter(window=0)


# -- the event stream ----------------------------------------------------------------------------------------


async def test_published_events_are_read_back_newest_first_within_the_hour(redis_db: redis.Redis) -> None:
    now = time.time()
    # given an event older than an hour in the stream
    redis_db.xadd(
        fleet_events.STREAM,
        {fleet_events.FIELD: fleet_events.encode(FleetEvent("node-a", now - 4000, "load", "old:1"))},
        id=f"{int((now - 4000) * 1000)}-0",
    )
    # when a node's packing records a load, an eviction and a failure, and its publisher flushes
    publisher = EventPublisher(REDIS_URL, "node-a")
    publisher.add(Event(now - 2, "load", "digits:1", "0.10 s, 1000 bytes"))
    publisher.add(Event(now - 1, "evict", "digits:1", "LRU: room for digits:2"))
    publisher.add(Event(now, "load_failed", "broken:1", "RuntimeError: no"))
    assert await publisher.flush_once() == 3
    await publisher.close()
    # then the stream reads back the last hour's, newest first, grouped for the page
    client = redis_pipe.client(REDIS_URL)
    try:
        events = await fleet_events.read_recent(client, now=time.time())
    finally:
        await client.aclose()
    assert [(e.node, e.kind, e.key, e.group) for e in events] == [
        ("node-a", "load_failed", "broken:1", "failure"),
        ("node-a", "evict", "digits:1", "eviction"),
        ("node-a", "load", "digits:1", "load"),
    ]


async def test_a_publisher_keeps_its_newest_events_while_redis_is_unreachable() -> None:
    # given a publisher whose Redis does not answer, with room for three events
    publisher = EventPublisher("redis://127.0.0.1:1/0", "node-a", buffered=3)
    for i in range(5):
        publisher.add(Event(float(i), "load", f"m:{i}"))
    # when it tries to send, it fails and keeps them; the two oldest were pushed out, counted
    with pytest.raises((redis.RedisError, OSError)):
        await publisher.flush_once()
    assert [e.key for e in publisher._buffer] == ["m:2", "m:3", "m:4"] and publisher.dropped == 2
    await publisher.close()


async def test_lost_nodes_are_those_seen_within_the_hour_whose_heartbeat_expired(redis_db: redis.Redis) -> None:
    now = time.time()
    announce(redis_db, info("live", heartbeat_at=now, resident={}))
    redis_db.hset(fleet.SEEN_KEY, "gone", fleet.seen_entry(info("gone", heartbeat_at=now - 60, resident={})))
    redis_db.hset(fleet.SEEN_KEY, "ancient", fleet.seen_entry(info("ancient", heartbeat_at=now - 7200, resident={})))
    client = redis_pipe.client(REDIS_URL)
    try:
        live = await fleet.read_fleet(client)
        lost = await fleet.read_lost(client, live, now)
    finally:
        await client.aclose()
    assert [n.name for n in live] == ["live"] and [n.name for n in lost] == ["gone"]
    assert not redis_db.hexists(fleet.SEEN_KEY, "ancient")  # older than the hour: dropped
    [event] = fleet_events.lost_events(lost, now)
    assert (event.node, event.kind, event.group) == ("gone", "lost", "failure")


# -- what the page draws -------------------------------------------------------------------------------------

STATE = {
    "at": 0.0,
    "nodes": [
        {
            "name": "n<1>",
            "memory_budget": 100 * MiB,
            "memory_used": 60 * MiB,
            "failures": {"secret:1": "x"},
            "resident": [
                {"key": "mine:1", "tier": "hot", "bytes": 20 * MiB},
                {"key": "secret:1", "tier": "hot", "bytes": 40 * MiB},
                {"key": "mine:2", "tier": "warm", "bytes": 10 * MiB},
            ],
        }
    ],
    "events": [{"key": "secret:1", "kind": "evict"}, {"key": "mine:1", "kind": "load"}, {"key": "", "kind": "lost"}],
}


def test_a_viewer_sees_only_the_versions_of_models_it_may_see_in_the_versions_table() -> None:
    state = {
        "at": 1.0,
        "nodes": [],
        "events": [],
        "versions": [
            {"key": "mine:1", "state": "READY", "reason": "", "hot": ["a"], "warm": []},
            {"key": "theirs:1", "state": "UNAVAILABLE", "reason": "cold", "hot": [], "warm": []},
        ],
    }
    assert [v["key"] for v in scoped(state, {"mine"})["versions"]] == ["mine:1"]
    assert len(scoped(state, None)["versions"]) == 2


def test_a_viewer_sees_other_tenants_versions_as_unnamed_segments_and_none_of_their_events() -> None:
    seen = scoped(STATE, {"mine"})
    node = seen["nodes"][0]
    assert [(r["key"], r.get("hidden", False), r["bytes"]) for r in node["resident"]] == [
        ("mine:1", False, 20 * MiB),
        ("", True, 40 * MiB),
        ("mine:2", False, 10 * MiB),
    ]
    assert node["failures"] == {}
    assert [e["key"] for e in seen["events"]] == ["mine:1", ""]
    assert scoped(STATE, None) is STATE  # platform staff see everything


def test_a_message_that_names_another_tenants_version_is_redacted_for_a_viewer() -> None:
    """Nodes no longer name other versions in what a tenant reads (tests/test_audit_fixes_node.py); an older
    node's event, or any message still naming a version the viewer may not see, has that name replaced."""
    state = {
        **STATE,
        "nodes": [{**STATE["nodes"][0], "failures": {"mine:2": "mine:2 needs 1 MiB (held by secret:1, mine:1)"}}],
        "events": [
            {"key": "mine:1", "kind": "evict", "detail": "LRU: room for secret:1"},
            {"key": "mine:1", "kind": "no_room", "detail": "held by secret:1, data-secret:1, secret:12, mine:1"},
            {"key": "", "kind": "lost", "detail": "no heartbeat since 12:30:45 UTC"},
        ],
        "versions": [
            {"key": "mine:1", "state": "UNAVAILABLE", "reason": "cold: no room now (held by secret:1)", "hot": []},
            {"key": "secret:1", "state": "READY", "reason": "", "hot": ["n<1>"]},
        ],
    }
    seen = scoped(state, {"mine", "data-secret"})
    assert [e["detail"] for e in seen["events"]] == [
        "LRU: room for another tenant's version",
        # any version of a hidden model; not a visible one whose name ends the same, nor a time
        "held by another tenant's version, data-secret:1, another tenant's version, mine:1",
        "no heartbeat since 12:30:45 UTC",
    ]
    assert seen["nodes"][0]["failures"] == {"mine:2": "mine:2 needs 1 MiB (held by another tenant's version, mine:1)"}
    assert [v["reason"] for v in seen["versions"]] == ["cold: no room now (held by another tenant's version)"]
    # platform staff read the messages as written
    assert scoped(state, None) is state


def test_a_push_is_narrowed_and_rendered_once_per_set_of_models() -> None:
    from serving.fleet_consumer import _rendered

    state = {
        **STATE,
        "nodes": [
            {
                **n,
                "state": "live",
                "embedded": False,
                "busy": 0.5,
                "heartbeat_age": 1.0,
                "heartbeat_at": 0.0,
                "labels": {},
                "host": "h",
                "pid": 1,
                "accelerator": "a10g",
                "accelerator_count": 1,
                "device": "cpu",
            }
            for n in STATE["nodes"]
        ],
        "events": [{**e, "at": 0.0, "node": "n", "group": "load", "detail": ""} for e in STATE["events"]],
    }
    mine = _rendered(state, {"mine"})
    assert _rendered(state, {"mine"}) is mine  # a second socket of the same tenant: no second rendering
    everything = _rendered(state, None)
    assert everything is not mine and "secret:1" in everything["html"]["events"]
    assert "secret" not in str(mine)


def test_the_packing_bar_draws_each_version_as_wide_as_its_footprint_against_the_budget() -> None:
    svg = packing_svg(scoped(STATE, {"mine"})["nodes"][0])
    widths = {
        m[0] + m[1]: float(m[2])
        for m in re.findall(
            r'class="segment (hot|warm)" data-key="([^"]*)" data-tier="\w+" x="[\d.]+" y="\d+" width="([\d.]+)"', svg
        )
    }
    assert widths == {"hotmine:1": pytest.approx(112.0), "hot": pytest.approx(224.0), "warmmine:2": pytest.approx(56.0)}
    assert "secret" not in svg and "another tenant&#x27;s version" in svg
    assert 'data-node="n&lt;1&gt;"' in svg  # names are escaped


# -- the console page and the API, by role -------------------------------------------------------------------


@pytest.fixture
def people(django_user_model) -> dict[str, Client]:  # noqa: ANN001
    from serving.models import Model, Visibility
    from tenants.models import Membership, Role

    acme, other = tenant("acme"), tenant("other")
    Model.objects.create(name="mine", tenant=acme, visibility=Visibility.PRIVATE)
    Model.objects.create(name="secret", tenant=other, visibility=Visibility.PRIVATE)
    clients = {"anonymous": Client()}
    for name, role in (("viewer", Role.VIEWER), ("nobody", None), ("staff", None)):
        user = django_user_model.objects.create_user(name, password="pw-long-enough", is_staff=name == "staff")
        if role:
            Membership.objects.create(user=user, tenant=acme, role=role)
        clients[name] = Client()
        clients[name].force_login(user)
    return clients


@pytest.fixture
def fleet_in_redis(settings, redis_db: redis.Redis) -> redis.Redis:  # noqa: ANN001
    settings.REDIS_URL = REDIS_URL
    now = time.time()
    announce(
        redis_db,
        info(
            "node-a",
            heartbeat_at=now,
            resident={"mine:1": {"tier": "hot", "bytes": 8 * MiB}, "secret:1": {"tier": "hot", "bytes": 16 * MiB}},
        ),
    )
    redis_db.hset(fleet.SEEN_KEY, "node-b", fleet.seen_entry(info("node-b", heartbeat_at=now - 30, resident={})))
    redis_db.xadd(
        fleet_events.STREAM,
        {fleet_events.FIELD: fleet_events.encode(FleetEvent("node-a", now - 5, "evict", "secret:1", "LRU"))},
    )
    redis_db.xadd(
        fleet_events.STREAM,
        {fleet_events.FIELD: fleet_events.encode(FleetEvent("node-a", now - 4, "load", "mine:1", "0.1 s"))},
    )
    return redis_db


def test_the_fleet_page_and_api_need_a_viewer(people, fleet_in_redis) -> None:  # noqa: ANN001
    # anonymous: the page sends to the login, the API refuses
    page = people["anonymous"].get("/console/fleet/")
    assert page.status_code == 302 and page["Location"].startswith("/login/")
    assert people["anonymous"].get("/api/fleet/").status_code == 403
    # logged in without a role anywhere: refused
    assert people["nobody"].get("/console/fleet/").status_code == 403
    assert people["nobody"].get("/api/fleet/").status_code == 403


def test_a_viewer_sees_the_nodes_bars_and_events_of_what_it_may_see(people, fleet_in_redis) -> None:  # noqa: ANN001
    page = people["viewer"].get("/console/fleet/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'href="/console/fleet/"' in html  # in the navigation
    assert 'data-node="node-a" data-state="live"' in html and 'data-node="node-b" data-state="lost"' in html
    assert 'class="segment hot" data-key="mine:1"' in html and "secret" not in html
    assert 'data-kind="load" data-key="mine:1"' in html and 'data-kind="lost"' in html
    doc = people["viewer"].get("/api/fleet/").json()
    a = next(n for n in doc["nodes"] if n["name"] == "node-a")
    assert (a["state"], a["accelerator"], a["busy"], a["memory_used"]) == ("live", "a10g", 0.25, 24 * MiB)
    assert [r["key"] for r in a["resident"]] == ["mine:1", ""]
    assert [(e["kind"], e["key"]) for e in doc["events"]][:2] == [("load", "mine:1"), ("lost", "")]
    # platform staff see every version by name
    staff = people["staff"].get("/api/fleet/").json()
    assert {r["key"] for n in staff["nodes"] for r in n["resident"]} == {"mine:1", "secret:1"}


def test_a_viewer_whose_version_was_evicted_for_another_tenants_reads_no_name_of_it(people, fleet_in_redis) -> None:  # noqa: ANN001
    # given the viewer's own version evicted for another tenant's private one, and then refused room that the
    # other one holds, as a node of an earlier release recorded them (naming the other version)
    now = time.time()
    for at, kind, detail in (
        (now - 3, "evict", "LRU: room for secret:1"),
        (now - 2, "no_room", "mine:1 needs 8.0 MiB; node node-a is 8.0 MiB short (held by secret:1)"),
    ):
        event = FleetEvent("node-a", at, kind, "mine:1", detail)
        fleet_in_redis.xadd(fleet_events.STREAM, {fleet_events.FIELD: fleet_events.encode(event)})
    # when the viewer reads the fleet / then it sees its own events, without the other tenant's version's name
    doc = people["viewer"].get("/api/fleet/").json()
    mine = [(e["kind"], e["detail"]) for e in doc["events"] if e["key"] == "mine:1"]
    assert ("evict", "LRU: room for another tenant's version") in mine
    assert "secret" not in json.dumps(doc)
    page = people["viewer"].get("/console/fleet/").content.decode()
    assert 'data-kind="evict" data-key="mine:1"' in page and "secret" not in page
    # and platform staff, who see every version, read the names
    staff = people["staff"].get("/api/fleet/").json()
    assert any(e["detail"] == "LRU: room for secret:1" for e in staff["events"])


def test_the_fleet_api_is_in_the_schema() -> None:
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    get = schema["paths"]["/api/fleet/"]["get"]
    assert set(get["responses"]) == {"200", "403"}


# -- the WebSocket -------------------------------------------------------------------------------------------


class WebsocketCommunicator(ApplicationCommunicator):
    """Channels' testing communicator, which `channels.testing` cannot be imported for here (its package imports
    daphne, not in the venv): the ASGI handshake and JSON frames against the real application."""

    def __init__(self, application, path: str, headers: list[tuple[bytes, bytes]]) -> None:  # noqa: ANN001
        super().__init__(
            application,
            {
                "type": "websocket",
                "path": path,
                "headers": headers,
                "subprotocols": [],
                "query_string": b"",
                "client": ("127.0.0.1", 1),
                "server": ("127.0.0.1", 80),
            },
        )

    async def connect(self, timeout: float = 10) -> bool:
        await self.send_input({"type": "websocket.connect"})
        answer = await self.receive_output(timeout)
        return answer["type"] == "websocket.accept"

    async def receive_json_from(self, timeout: float = 10) -> dict:
        answer = await self.receive_output(timeout)
        assert answer["type"] == "websocket.send", answer
        return json.loads(answer["text"])

    async def disconnect(self, code: int = 1000, timeout: float = 10) -> None:
        await self.send_input({"type": "websocket.disconnect", "code": code})
        await self.wait(timeout)


def session_headers(client: Client) -> list[tuple[bytes, bytes]]:
    cookie = "; ".join(f"{k}={v.value}" for k, v in client.cookies.items())
    return [(b"cookie", cookie.encode()), (b"origin", b"http://127.0.0.1")]


@pytest.fixture
def redis_layer(settings):  # noqa: ANN001, ANN201
    """The Redis channel layer as settings configure it with REDIS_URL, on the test Redis."""
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {
                "hosts": [{"address": REDIS_URL, "socket_timeout": settings.CHANNEL_LAYER_SOCKET_TIMEOUT_S}],
                "prefix": "ferry:test-asgi",
            },
        }
    }


def test_an_idle_socket_channel_outlasts_the_layers_blocking_read(redis_layer) -> None:  # noqa: ANN001
    """A regression: with redis-py's default 5 s read timeout, a channel with nothing for 5 s raised."""
    from channels.layers import get_channel_layer

    async def idle() -> None:
        layer = get_channel_layer()
        channel = await layer.new_channel()
        with pytest.raises(TimeoutError):  # asyncio's, from wait_for: nothing came, and nothing failed
            await asyncio.wait_for(layer.receive(channel), timeout=6.5)
        await layer.flush()

    async_to_sync(idle)()


@pytest.mark.django_db(transaction=True)
def test_the_socket_refuses_anonymous_users_and_users_without_a_role(people, fleet_in_redis, redis_layer) -> None:  # noqa: ANN001
    from config.asgi import application

    async def attempt(headers: list[tuple[bytes, bytes]]) -> bool:
        communicator = WebsocketCommunicator(application, "/ws/fleet/", headers=headers)
        connected = await communicator.connect()
        await communicator.disconnect()
        return connected

    assert not async_to_sync(attempt)([(b"origin", b"http://127.0.0.1")])
    assert not async_to_sync(attempt)(session_headers(people["nobody"]))
    # a page of another site cannot open one with the user's cookie
    assert not async_to_sync(attempt)([session_headers(people["viewer"])[0], (b"origin", b"http://evil.example")])


@pytest.mark.django_db(transaction=True)
def test_the_socket_pushes_the_fleet_and_new_events_to_a_viewer(people, fleet_in_redis, redis_layer) -> None:  # noqa: ANN001
    from config.asgi import application

    async def watch() -> tuple[dict, dict]:
        communicator = WebsocketCommunicator(application, "/ws/fleet/", headers=session_headers(people["viewer"]))
        assert await communicator.connect()
        try:
            first = await communicator.receive_json_from(timeout=10)
            # when a node publishes an eviction
            publisher = EventPublisher(REDIS_URL, "node-a")
            publisher.add(Event(time.time(), "evict", "mine:1", "LRU: room for mine:2"))
            await publisher.flush_once()
            await publisher.close()
            later = first
            deadline = time.monotonic() + 10
            while not any(e["kind"] == "evict" and e["key"] == "mine:1" for e in later["events"]):
                assert time.monotonic() < deadline, later["events"]
                later = await communicator.receive_json_from(timeout=10)
            return first, later
        finally:
            await communicator.disconnect()

    first, later = async_to_sync(watch)()
    # then the first push is the fleet as the viewer may see it, rendered for the page too
    assert first["type"] == "fleet"
    assert {n["name"]: n["state"] for n in first["nodes"]} == {"node-a": "live", "node-b": "lost"}
    assert 'class="segment hot" data-key="mine:1"' in first["html"]["nodes"] and "secret" not in str(first)
    # and the eviction arrives pushed, without asking
    assert 'data-kind="evict" data-key="mine:1"' in later["html"]["events"]


# -- what a node measures and announces ----------------------------------------------------------------------


async def test_a_node_meters_its_device_time_and_announces_what_it_holds(model_files) -> None:  # noqa: ANN001
    from serving.dataplane.node.node import Node
    from serving.fleet_state import embedded_info
    from tests.test_packing_node import digits, x

    node = Node(artifact_path=lambda sha: model_files.digits, device="cpu")
    seen: list[Event] = []
    node.packing.listeners.append(seen.append)
    try:
        hosted = await node.load(digits("one"))
        assert hosted is not None and node.busy.fraction() == 0.0  # loading is not serving
        # when it serves a few batches
        loop = asyncio.get_running_loop()
        for _ in range(5):
            await node.infer("one:1", x(8), 8, loop.time() + 5, 1)
        # then its busy share is what the device thread measured, and the load reached the listener
        assert 0.0 < node.busy.fraction() <= 1.0
        assert [(e.kind, e.key) for e in seen] == [("load", "one:1")]
        announced = embedded_info(node, time.time())
        assert announced.resident == {"one:1": {"tier": "hot", "bytes": hosted.runtime.memory_bytes}}
        assert announced.memory_used == hosted.runtime.memory_bytes > 0
    finally:
        await node.close()


def test_an_embedded_page_shows_this_processs_node_and_its_own_record(digits_server, django_user_model) -> None:  # noqa: ANN001
    from tenants.models import Membership, Role

    # given the embedded server (no Redis), which loaded digits, digits-export and tokens, and a viewer
    user = django_user_model.objects.create_user("embedded-viewer", password="pw-long-enough")
    Membership.objects.create(user=user, tenant=tenant(), role=Role.VIEWER)
    client = Client()
    client.force_login(user)
    doc = client.get("/api/fleet/").json()
    [node] = doc["nodes"]
    assert node["embedded"] and node["state"] == "live"
    assert {r["key"] for r in node["resident"]} == {"digits:1", "digits-export:1", "tokens:1"}
    assert node["memory_used"] == sum(r["bytes"] for r in node["resident"]) > 0
    assert {(e["kind"], e["key"]) for e in doc["events"]} >= {("load", "digits:1"), ("load", "tokens:1")}
    html = client.get("/console/fleet/").content.decode()
    assert "(this web process)" in html and 'data-key="digits:1"' in html
    # and each version's state is the one /v2/repository/index gives, with the node holding it
    from tests.test_inference_http import call

    index = call(digits_server, "POST", "/v2/repository/index", {}).json()
    assert {v["key"]: v["state"] for v in doc["versions"]} == {f"{r['name']}:{r['version']}": r["state"] for r in index}
    held = {v["key"]: v["hot"] for v in doc["versions"]}
    assert held["digits:1"] == [node["name"]]
    assert '<tr class="version" data-key="digits:1" data-state="READY">' in html
