"""Which version of a model serves a request. Plain Python over the routing snapshot."""

from __future__ import annotations

from serving.snapshot import ModelEntry, VersionEntry


class RouteError(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def choose_version(model: ModelEntry, pinned: int | None = None) -> VersionEntry:
    """A pinned version if it can serve; else the newest servable version."""
    if pinned is not None:
        entry = model.versions.get(pinned)
        if entry is None:
            raise RouteError(f"model '{model.name}' has no version {pinned}", 404)
        if not entry.servable:
            raise RouteError(f"model '{model.name}' version {pinned} is not ready ({_why(entry)})", 503)
        return entry
    servable = model.servable_versions()
    if not servable:
        raise RouteError(f"model '{model.name}' has no ready version", 503)
    return servable[-1]


def _why(entry: VersionEntry) -> str:
    if entry.state == "ready" and not entry.loaded:
        return "unloaded"
    if entry.state == "failed":
        return f"failed: {entry.failure_reason}"
    return entry.state
