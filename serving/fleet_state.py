"""What the fleet page and `/api/fleet/` show: the nodes (live, lost, and this process's embedded node) and the
events of the last hour, as one JSON-able document, and that document narrowed to what a person may see.

Read from Redis (`serving.dataplane.transport.fleet` heartbeats and last heartbeats,
`serving.dataplane.transport.fleet_events`) when
REDIS_URL is set; an embedded node of this process is read from memory, and without Redis its own event record
is the only one. An embedded node appears on its own process's page only: it takes no stream's requests, so it
never announces itself in the fleet that gateways route by.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

import redis.asyncio as aioredis
from django.conf import settings

from serving.dataplane import plane as planes
from serving.dataplane.errors import ServingError
from serving.dataplane.http.consumers import load_failure, repository_state
from serving.dataplane.node import announce
from serving.dataplane.node.node import Node
from serving.dataplane.transport import fleet, fleet_events
from serving.dataplane.transport.fleet import NodeInfo
from serving.dataplane.transport.fleet_events import FleetEvent
from serving.dataplane.transport.host_link import HostView

log = logging.getLogger(__name__)

EVENTS_SHOWN = 200
HIDDEN = "another tenant's version"


def embedded_name() -> str:
    return announce.process_name()


def embedded_info(node: Node, now: float) -> NodeInfo:
    """This process's in-process node, as a heartbeat would announce it."""
    return announce.describe(node, embedded_name(), now)


def node_doc(info: NodeInfo, state: str, now: float) -> dict[str, Any]:
    """`info` as the page and `/api/fleet/` show it. A lost node's busy and work shares are None (unknown now,
    not what it last said), as is the work share of a node too old to measure it; its samples stay, on the
    clock of their own time, so its chart ends where its heartbeats did."""
    used = sum(int(r.get("bytes", 0)) for r in info.resident.values() if r.get("tier", "hot") == "hot")
    live = state == "live"
    return {
        "name": info.name,
        "state": state,
        "host": info.host,
        "pid": info.pid,
        "device": info.device,
        "accelerator": info.accelerator,
        "accelerator_count": info.accelerator_count,
        "labels": info.labels,
        "heartbeat_at": info.heartbeat_at,
        "heartbeat_age": round(max(0.0, now - info.heartbeat_at), 1),
        "memory_total": info.memory_total,
        "memory_budget": info.memory_budget,
        "memory_used": max(info.memory_used, used),
        "busy": info.busy if live else None,
        "work": info.work if live else None,
        # ages become epoch seconds at the heartbeat, so the page can draw them on one time axis
        "utilisation": [[round(info.heartbeat_at - s[0], 1), s[1], s[2]] for s in info.utilisation],
        "resident": [
            {"key": key, "tier": str(r.get("tier", "hot")), "bytes": int(r.get("bytes", 0))}
            for key, r in sorted(info.resident.items())
        ],
        "failures": dict(sorted(info.failures.items())),
    }


async def read_state(client: aioredis.Redis | None, *, now: float | None = None) -> dict[str, Any]:
    """The whole fleet, unscoped. `client` reads Redis (None: embedded without Redis)."""
    now = time.time() if now is None else now
    nodes: list[dict[str, Any]] = []
    events: list[FleetEvent] = []
    plane = planes.current()
    embedded = plane.node if plane is not None and isinstance(plane.node, Node) else None
    if embedded is not None:
        nodes.append(node_doc(embedded_info(embedded, now), "live", now) | {"embedded": True})
    host = await host_node(plane) if plane is not None and isinstance(plane.node, HostView) else None
    if host is not None:
        info, events = host
        nodes.append(node_doc(info, "live", now) | {"embedded": True, "node_host": True})
    if client is not None:
        live = await fleet.read_fleet(client)
        lost = await fleet.read_lost(client, live, now)
        nodes += [node_doc(n, "live", now) | {"embedded": False} for n in live]
        nodes += [node_doc(n, "lost", now) | {"embedded": False} for n in lost]
        events = await fleet_events.read_recent(client, now=now, count=EVENTS_SHOWN)
        events += fleet_events.lost_events(lost, now)
    elif host is not None:
        events = host[1]
    elif embedded is not None:
        name = embedded_name()
        record = list(embedded.packing.events)  # one C-level copy: a sync view may read it off the node's loop
        events = [FleetEvent.of(name, e) for e in record if e.at >= now - fleet_events.WINDOW_SECONDS]
    events.sort(key=lambda e: e.at, reverse=True)
    return {
        "at": now,
        "nodes": nodes,
        "versions": versions_doc(plane, nodes),
        "events": [e.to_doc() for e in events[:EVENTS_SHOWN]],
    }


def versions_doc(plane: planes.DataPlane | None, nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every version of the routing snapshot with the state `/v2/repository/index` gives it (the same functions),
    its reason, and the live nodes holding it hot or warm. Empty where this process has no data plane."""
    if plane is None:
        return []
    where: dict[str, dict[str, list[str]]] = {}
    for node in nodes:
        if node["state"] != "live":
            continue
        for r in node["resident"]:
            where.setdefault(r["key"], {"hot": [], "warm": []}).setdefault(r["tier"], []).append(node["name"])
    rows = []
    for model in plane.gateway.snapshot.models.values():
        for v in model.versions.values():
            held = where.get(v.key, {})
            rows.append(
                {
                    "key": v.key,
                    "state": repository_state(plane, v),
                    "reason": v.failure_reason or load_failure(plane, v),
                    "hot": sorted(held.get("hot", [])),
                    "warm": sorted(held.get("warm", [])),
                }
            )
    rows.sort(key=lambda r: (_model(r["key"]), int(r["key"].rpartition(":")[2])))
    return rows


async def host_node(plane: planes.DataPlane) -> tuple[NodeInfo, list[FleetEvent]] | None:
    """The node host's node and record (`serve --workers N` in embedded mode), asked over this process's link
    on the plane's own loop (a sync view reads the page from another); None while the host does not answer."""
    view = plane.node
    assert isinstance(view, HostView)
    try:
        if asyncio.get_running_loop() is plane.loop:
            return await view.fleet()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(view.fleet(), plane.loop))
    except (ServingError, TimeoutError, ValueError, KeyError) as exc:
        log.warning("the node host did not say what it holds: %s", exc)
        return None


async def read_now() -> dict[str, Any]:
    """`read_state` with a client of its own (a page load, an API call)."""
    if not settings.REDIS_URL:
        return await read_state(None)
    from serving.dataplane.transport import redis_pipe

    client = redis_pipe.client(settings.REDIS_URL, name="ferry-fleet-page")
    try:
        return await read_state(client)
    finally:
        await client.aclose()


def _model(key: str) -> str:
    return key.rpartition(":")[0]


# A version's key ("model:version") inside a message, not part of a longer name.
_KEY_IN_TEXT = re.compile(r"(?<![A-Za-z0-9_.-])[A-Za-z0-9][A-Za-z0-9_.-]{0,99}:[0-9]+(?![0-9])")


def scoped(state: dict[str, Any], models: set[str] | None) -> dict[str, Any]:
    """`state` as someone who sees only `models` (names; None: every model) may see it: other tenants' versions
    keep their place and size in the packing bars, without their names; their events and failures are left out.

    The messages shown (events' details, failures, versions' reasons) do not name other versions where they are
    written (`serving.dataplane.node.node`, `serving.policies.placement`); one that still names a version of a
    model of the fleet this viewer may not see (a node of an earlier release) gets HIDDEN in its place."""
    if models is None:
        return state

    def shown(key: str) -> bool:
        return not key or _model(key) in models

    # The models of the versions this state holds that the viewer may not see: a message's "name:version" of one of
    # them is hidden, whichever version it names. (Not every "name:digits" not shown: "12:30" is a time.)
    keys = [r["key"] for node in state["nodes"] for r in node["resident"]]
    keys += [k for node in state["nodes"] for k in node["failures"]]
    keys += [e["key"] for e in state["events"]]
    keys += [v["key"] for v in state.get("versions", [])]
    hidden = {_model(k) for k in keys if not shown(k)}

    def clean(text: str) -> str:
        if not hidden or ":" not in text:
            return text
        return _KEY_IN_TEXT.sub(lambda m: HIDDEN if _model(m[0]) in hidden else m[0], text)

    nodes = []
    for node in state["nodes"]:
        resident = [r if shown(r["key"]) else r | {"key": "", "hidden": True} for r in node["resident"]]
        failures = {k: clean(v) for k, v in node["failures"].items() if shown(k)}
        nodes.append(node | {"resident": resident, "failures": failures})
    events = [e | {"detail": clean(e["detail"])} if e.get("detail") else e for e in state["events"] if shown(e["key"])]
    versions = [
        v | {"reason": clean(v["reason"])} if v.get("reason") else v
        for v in state.get("versions", [])
        if shown(v["key"])
    ]
    return state | {"nodes": nodes, "events": events, "versions": versions}
