"""One inference request as the gateway sees it, whichever protocol carried it (REST, gRPC, a pipeline's step).

A transport's front end authenticates, takes the quota, and builds an `Inference`; `Gateway.serve` routes it,
decodes it (through its `decode` hook, once the routed version's signature is known), sets its deadline and
priority, runs it (admission, fallback, shadow), counts it (metrics, usage) and returns a `Served`; the front
end encodes the outputs in its own protocol. No protocol's types appear here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from serving.dataplane.gateway.snapshot import VersionEntry


@dataclass(slots=True)
class Inference:
    """`name`, `version` (the path's text, None: routed), `viewer` (the caller's tenant; None is the data
    plane's own call). The tensors (`inputs`, `rows`), the output names asked for (`outputs`, None: all),
    Triton's request `parameters` ("priority", "timeout" in microseconds) and the client's `id` are set
    by the caller, or by `decode(request, entry)` once the gateway has routed the request to `entry`; it
    raises `ProtocolError` (or `ServingError`) for input the signature refuses.

    `timeout`: the transport's own limit in seconds from arrival (gRPC's deadline), cut like Triton's
    "timeout" parameter to the version's platform budget. `tier`: the tenant's priority tier (the highest
    level it may ask for). `routing_key`: keeps a caller on one side of an experiment or a canary.
    `gone`: whether the client has gone (checked when a queued request's turn comes). `nbytes`: the
    request's size on the wire, for the transport's byte bounds. `waited`: seconds the request had already
    waited when its handler began (the front door's measure, from when its first byte reached the machine);
    its deadline and its latency count from then."""

    name: str
    version: str | None
    viewer: int | None
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    rows: int = 0
    outputs: tuple[str, ...] | None = None
    parameters: dict = field(default_factory=dict)
    id: str | None = None
    timeout: float | None = None
    tier: int = 1
    routing_key: str = ""
    gone: Callable[[], bool] | None = None
    nbytes: int = 0
    decode: Callable[[Inference, VersionEntry], None] | None = None
    waited: float = 0.0


@dataclass(slots=True)
class Served:
    """The answer to an `Inference`: the version routed (`asked`), the one that answered (`entry`: its
    fallback when the asked one refused), and the outputs it produced (every one asked for is present)."""

    asked: VersionEntry
    entry: VersionEntry
    outputs: dict[str, np.ndarray]

    @property
    def fell_back(self) -> bool:
        return self.entry is not self.asked
