"""Gateway → node transport. Embedded mode calls the in-process node; the interface is what a
Redis Streams transport implements for distributed mode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from serving.dataplane.gateway.snapshot import VersionEntry


class Outputs(dict[str, np.ndarray]):
    """One request's output tensors, with its share of its batch's device seconds (by rows) for usage
    metering. Still a plain dict to everything else."""

    __slots__ = ("compute_seconds",)

    def __init__(self, tensors: dict[str, np.ndarray], compute_seconds: float = 0.0) -> None:
        super().__init__(tensors)
        self.compute_seconds = compute_seconds


class Transport(Protocol):
    async def infer(
        self,
        entry: VersionEntry,
        inputs: dict[str, np.ndarray],
        rows: int,
        deadline: float,
        priority: int,
        *,
        nbytes: int = 0,
        gone: Callable[[], bool] | None = None,
        tenant: int | None = None,
        outputs: tuple[str, ...] | None = None,
    ) -> dict[str, np.ndarray]:
        """Answer one request or raise a `ServingError`; `deadline` is on the monotonic clock; `nbytes`
        is what the request holds in memory while it waits (queues are bounded in bytes too); `gone`
        says whether its client has left (its request is then dropped unrun, answered 499); `tenant`
        and `outputs` (the output names asked for, None: all) travel with a request to a remote node."""
        ...

    def count_refused(self, key: str) -> None:
        """A request for version `key` was refused before this transport saw it (the front door's gate): it was
        asked for all the same, and the autoscaler sizes the version for what was asked."""
        ...


class LocalNode(Protocol):
    """What the in-process transport calls on the node beside it (`serving.dataplane.node.node.Node`), named
    here so that the transport does not import the node, which imports this module's `Outputs`."""

    async def infer(
        self,
        key: str,
        inputs: dict[str, np.ndarray],
        rows: int,
        deadline: float,
        priority: int,
        nbytes: int = 0,
        gone: Callable[[], bool] | None = None,
    ) -> dict[str, np.ndarray]: ...


class InProcessTransport:
    def __init__(self, node: LocalNode) -> None:
        self.node = node

    async def infer(
        self,
        entry: VersionEntry,
        inputs: dict[str, np.ndarray],
        rows: int,
        deadline: float,
        priority: int,
        *,
        nbytes: int = 0,
        gone: Callable[[], bool] | None = None,
        tenant: int | None = None,
        outputs: tuple[str, ...] | None = None,
    ) -> dict[str, np.ndarray]:
        return await self.node.infer(entry.key, inputs, rows, deadline, priority, nbytes, gone)

    def count_refused(self, key: str) -> None:
        """Nothing to count with: one node beside the gateway, no fleet autoscaler (it reads the streams)."""
