"""A node with no heartbeat of its own, as a heartbeat would announce it: the embedded node of a web process,
and the node host's (`serve --workers N` in embedded mode), which the fleet page shows beside the fleet's.

Neither takes a stream's requests, so neither announces itself in the fleet that gateways route by
(`serving.dataplane.transport.fleet`); the page asks for this instead.
"""

from __future__ import annotations

import os
import socket

from serving.dataplane.node.node import Node
from serving.dataplane.transport import fleet
from serving.dataplane.transport.fleet import NodeInfo


def describe(node: Node, name: str, now: float) -> NodeInfo:
    """`node`, of this process, named `name`, as of `now` (epoch seconds)."""
    hosted = dict(node.hosted)
    return NodeInfo(
        name=name,
        instance="embedded",
        host=socket.gethostname(),
        pid=os.getpid(),
        device=str(node.device),
        accelerator=node.accelerator,
        accelerator_count=0 if node.device.type == "cpu" else 1,
        memory_total=node.memory_budget,
        memory_budget=node.memory_budget,
        memory_used=sum(h.runtime.memory_bytes for h in hosted.values()),
        labels={},
        started_at=0.0,
        heartbeat_at=now,
        serial=node.reconciled_serial,
        hot=frozenset(hosted),
        failures={k: f.reason for k, f in dict(node.failures).items()},
        busy=round(node.busy.fraction(), 4),
        work=round(node.work.fraction(), 4),
        utilisation=[list(sample) for sample in node.work.history()],
        resident=fleet.resident_of(hosted),
    )


def process_name() -> str:
    """This process's node's name on the fleet page: host and pid."""
    return f"{socket.gethostname()}:{os.getpid()}"
