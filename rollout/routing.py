"""Which version of a model serves a request. Plain Python over the routing snapshot: no Django, no
clock, no I/O, so the gateway, the simulator and the tests run the same policy.

Order (the first rule that names a version that is ready wins, a rule naming a version that is not
ready is skipped):
  1. a version pinned in the path (`/versions/{v}/`): 404 if unknown, 503 if not ready, never skipped;
  2. the caller's tenant's version (`RouteTable.tenants`);
  3. an experiment arm (`RouteTable.experiment`), sticky per routing key;
  4. the rollout weights (`RouteTable.weights`, stable and canary), sticky per routing key;
  5. the stable version.
Nothing ready among them: 503. A version registered after the stable one takes unpinned traffic only
once a rule names it, so a registration never puts an unloaded or untested version in front of callers.

Per request the cost is one blake2b of the routing key and a bisect over cumulative weights
precomputed when the snapshot was built.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

WEIGHT_TOLERANCE = 1e-6  # how far from 1 a weight sum may be (decimal shares such as 0.1 do not add up exactly)
_SCALE = float(2**64)


class RoutedVersion(Protocol):
    """A version as routing reads it (the snapshot's `VersionEntry` is one). Declared here so that this policy
    imports nothing of the snapshot's, which imports this module's `RouteTable`."""

    @property
    def key(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def loaded(self) -> bool: ...
    @property
    def failure_reason(self) -> str: ...
    @property
    def servable(self) -> bool: ...


V = TypeVar("V", bound=RoutedVersion)
V_co = TypeVar("V_co", bound=RoutedVersion, covariant=True)


class RoutedModel(Protocol, Generic[V_co]):
    """A model as routing reads it (the snapshot's `ModelEntry` is one): its versions and its route table."""

    @property
    def name(self) -> str: ...
    @property
    def versions(self) -> Mapping[int, V_co]: ...
    @property
    def routes(self) -> RouteTable: ...


class RouteError(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def _cumulative(shares: Mapping[int, float], what: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Versions in order and their cumulative weights, the last exactly 1.0; ValueError when the shares
    are not weights (a non-positive version, a negative or non-finite weight, a sum other than 1)."""
    if not shares:
        return (), ()
    versions = tuple(sorted(shares))
    total = 0.0
    bounds = []
    for v in versions:
        w = shares[v]
        if type(v) is not int or v < 1:
            raise ValueError(f"{what}: {v!r} is not a version number")
        if type(w) not in (int, float) or not math.isfinite(w) or w < 0:
            raise ValueError(f"{what}: the weight of version {v} must be a number from 0 to 1, not {w!r}")
        total += w
        bounds.append(total)
    if abs(total - 1.0) > WEIGHT_TOLERANCE:
        raise ValueError(f"{what}: weights must sum to 1, not {total:g}")
    bounds[-1] = 1.0
    return versions, tuple(bounds)


@dataclass(frozen=True, slots=True)
class RouteTable:
    """One model's routing rules, as the registry stores them (`serving.models.Model`): checked and
    precomputed at construction, so a table that exists is one the hot path can use as it is."""

    stable: int | None = None
    weights: Mapping[int, float] = field(default_factory=dict)  # rollout: version -> share
    experiment: Mapping[int, float] = field(default_factory=dict)  # A/B arms: version -> share
    tenants: Mapping[int, int] = field(default_factory=dict)  # tenant id -> version
    # A shadow: this share of the requests served by another version is mirrored to `shadow` (the
    # gateway's serving.dataplane.gateway.shadow), its answers compared, never returned.
    shadow: int | None = None
    shadow_fraction: float = 0.0
    _rollout: tuple[tuple[int, ...], tuple[float, ...]] = field(init=False, repr=False, compare=False)
    _arms: tuple[tuple[int, ...], tuple[float, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.stable is not None and (type(self.stable) is not int or self.stable < 1):
            raise ValueError(f"stable: {self.stable!r} is not a version number")
        for tenant, version in self.tenants.items():
            if type(tenant) is not int or type(version) is not int or version < 1:
                raise ValueError(f"tenants: {tenant!r} -> {version!r} is not a tenant id and a version number")
        if self.shadow is not None and (type(self.shadow) is not int or self.shadow < 1):
            raise ValueError(f"shadow: {self.shadow!r} is not a version number")
        fraction = self.shadow_fraction
        if type(fraction) not in (int, float) or not math.isfinite(fraction) or not 0 <= fraction <= 1:
            raise ValueError(f"shadow_fraction: must be a number from 0 to 1, not {fraction!r}")
        if fraction and self.shadow is None:
            raise ValueError("shadow_fraction: a share to mirror needs a shadow version")
        object.__setattr__(self, "_rollout", _cumulative(self.weights, "weights"))
        object.__setattr__(self, "_arms", _cumulative(self.experiment, "experiment"))

    def versions(self) -> set[int]:
        """Every version a rule names."""
        named = {*self.weights, *self.experiment, *self.tenants.values()}
        for version in (self.stable, self.shadow):
            if version is not None:
                named.add(version)
        return named

    def mirrors(self, served: int) -> bool:
        """Whether requests served by version `served` are mirrored to the shadow (a share of them)."""
        return self.shadow is not None and self.shadow_fraction > 0 and served != self.shadow

    def to_dict(self) -> dict[str, Any]:
        return {
            "stable": self.stable,
            "weights": dict(self.weights),
            "experiment": dict(self.experiment),
            "tenants": dict(self.tenants),
            "shadow": self.shadow,
            "shadow_fraction": self.shadow_fraction,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> RouteTable:
        """From `to_dict` after a trip through JSON (keys come back as strings); ValueError when malformed."""
        try:
            return cls(
                stable=doc.get("stable"),
                weights={int(k): v for k, v in (doc.get("weights") or {}).items()},
                experiment={int(k): v for k, v in (doc.get("experiment") or {}).items()},
                tenants={int(k): v for k, v in (doc.get("tenants") or {}).items()},
                shadow=doc.get("shadow"),
                shadow_fraction=doc.get("shadow_fraction") or 0.0,
            )
        except (TypeError, AttributeError) as exc:
            raise ValueError(f"malformed routing rules: {exc}") from None


NO_ROUTES = RouteTable()


def key_points(model: str, routing_key: str) -> tuple[float, float]:
    """Two independent points in [0, 1) for a routing key: one for the experiment, one for the rollout,
    so an experiment's arms and a canary's share do not pick the same callers. The model's name is in
    the hash, so one caller is not in every model's canary at once."""
    digest = hashlib.blake2b(f"{model}\0{routing_key}".encode(), digest_size=16).digest()
    return int.from_bytes(digest[:8], "big") / _SCALE, int.from_bytes(digest[8:], "big") / _SCALE


def _pick(table: tuple[tuple[int, ...], tuple[float, ...]], point: float) -> int:
    versions, bounds = table
    return versions[min(bisect.bisect_right(bounds, point), len(versions) - 1)]


def choose_version(
    model: RoutedModel[V],
    pinned: int | None = None,
    *,
    tenant_id: int | None = None,
    routing_key: str = "",
    ready: Callable[[str], bool] | None = None,
) -> V:
    """The version that serves this request (the module's docstring has the order). `ready(key)` says
    whether a version is loaded and ready on a node; None trusts the registry's own state."""
    if pinned is not None:
        entry = model.versions.get(pinned)
        if entry is None:
            raise RouteError(f"model '{model.name}' has no version {pinned}", 404)
        if not entry.servable:
            raise RouteError(f"model '{model.name}' version {pinned} is not ready ({_why(entry)})", 503)
        if ready is not None and not ready(entry.key):
            raise RouteError(f"model '{model.name}' version {pinned} is loading", 503)
        return entry
    routes = model.routes
    if tenant_id is not None and routes.tenants:
        chosen = _usable(model, routes.tenants.get(tenant_id), ready)
        if chosen is not None:
            return chosen
    if routes._arms[0] or routes._rollout[0]:
        arm_point, rollout_point = key_points(model.name, routing_key)
        if routes._arms[0]:
            chosen = _usable(model, _pick(routes._arms, arm_point), ready)
            if chosen is not None:
                return chosen
        if routes._rollout[0]:
            chosen = _usable(model, _pick(routes._rollout, rollout_point), ready)
            if chosen is not None:
                return chosen
    chosen = _usable(model, routes.stable, ready)
    if chosen is not None:
        return chosen
    raise RouteError(_no_route(model, routes.stable), 503)


def _usable(model: RoutedModel[V], number: int | None, ready: Callable[[str], bool] | None) -> V | None:
    """Version `number` of `model` if it can serve now (servable, and ready on a node), else None."""
    entry = model.versions.get(number) if number is not None else None
    if entry is None or not entry.servable or (ready is not None and not ready(entry.key)):
        return None
    return entry


def _no_route(model: RoutedModel[Any], stable: int | None) -> str:
    if stable is None:
        return f"model '{model.name}' has no ready version yet (none is stable)"
    entry = model.versions.get(stable)
    if entry is None:
        return f"model '{model.name}' has no ready version: its stable version {stable} is retired"
    why = "loading" if entry.servable else _why(entry)
    return f"model '{model.name}' has no ready version: its stable version {stable} is {why}"


def _why(entry: RoutedVersion) -> str:
    if entry.state == "ready" and not entry.loaded:
        return "unloaded"
    if entry.state == "failed":
        return f"failed: {entry.failure_reason}"
    return entry.state
