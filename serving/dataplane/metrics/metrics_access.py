"""Who may read /metrics, and what a caller let in without the token sees.

Both places that serve the exposition (the web process's `/metrics`, `consumers.InferenceRequest`, and a
node's `runnode --metrics-port`, `node_metrics`) ask `configured().admit(...)`:

- the bearer token FERRY_METRICS_TOKEN (`Authorization: Bearer <token>`, as Prometheus' `authorization`
  block sends it), compared in constant time: everything, every label as written;
- no token presented, from an address in FERRY_METRICS_ALLOW (CIDRs, matched against the TCP peer, or the
  client a proxy of FERRY_TRUSTED_PROXIES forwarded; never a header a client could write): the same families,
  but the label values that would name a private model, its versions or a tenant are replaced by a stable
  opaque name (`redact`);
- anything else, a wrong token included (a misconfigured scraper should hear so, not get less): 401 with a
  Bearer challenge.

Visibility comes from the routing snapshot the process already holds (no database per scrape): a model is
named only when every tenant may see it (a platform model or a public one). A name the snapshot does not
know (a model deleted since, or no snapshot yet) is redacted too: this fails closed.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from django.conf import settings
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric

from serving.dataplane.errors import ServingError
from serving.dataplane.gateway.snapshot import RoutingSnapshot
from serving.dataplane.metrics import process_set

FULL = "full"
REDACTED = "redacted"
# Labels whose values are model names, and the one naming a tenant. A version, and a pipeline's step (named
# by its owner, after its model unless told otherwise), are redacted with the model (or pipeline) they are of.
MODEL_LABELS = ("model", "fallback")
TENANT_LABEL = "tenant"
VERSION_LABEL = "version"
STEP_LABEL = "step"
PRIVATE = "private-"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class MetricsRefused(ServingError):
    """401 with a Bearer challenge. Its own class, so a refused scrape is not counted as a refused inference
    request (`consumers` counts `auth.Unauthenticated` in ferry_requests_total)."""

    status = 401
    headers = ((b"www-authenticate", b'Bearer realm="ferry-metrics"'),)


@dataclass(frozen=True, slots=True)
class Access:
    token: bytes  # b"": none configured, so no caller sees everything
    allow: tuple[Network, ...]
    label_key: bytes  # keys the opaque names, so a guessed name cannot be checked against one

    def admit(self, authorization: bytes | None, client: str | None) -> str:
        """FULL or REDACTED for this caller, or MetricsRefused. `authorization` is the header's raw value;
        `client` the peer's address (None where unknown: only the token lets it in)."""
        if authorization and self.token:
            scheme, _, presented = authorization.partition(b" ")
            if scheme.lower() == b"bearer" and hmac.compare_digest(presented.strip(), self.token):
                return FULL
            raise MetricsRefused("wrong metrics token")
        if client is not None and allowed(client, self.allow):
            return REDACTED
        if self.token:
            raise MetricsRefused("/metrics needs the metrics token (Authorization: Bearer <FERRY_METRICS_TOKEN>)")
        raise MetricsRefused(
            "/metrics answers only addresses in FERRY_METRICS_ALLOW while no FERRY_METRICS_TOKEN is set"
        )


def allowed(client: str, networks: Iterable[Network]) -> bool:
    try:
        address = ipaddress.ip_address(client.split("%", 1)[0])  # an IPv6 zone id is not part of the address
    except ValueError:
        return False  # a Unix socket's peer, or no address at all
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack socket's view of an IPv4 peer
    return any(address in network for network in networks)


def parse_networks(values: Iterable[str]) -> tuple[Network, ...]:
    """CIDRs (or single addresses); ValueError names the bad one."""
    networks = []
    for value in values:
        try:
            networks.append(ipaddress.ip_network(value, strict=False))
        except ValueError as exc:
            raise ValueError(f"FERRY_METRICS_ALLOW: {value!r} is not an address or CIDR ({exc})") from None
    return tuple(networks)


def configured() -> Access:
    """The access the settings describe (read per scrape, so a test's settings override applies)."""
    return _access(settings.FERRY_METRICS_TOKEN, tuple(settings.FERRY_METRICS_ALLOW), settings.SECRET_KEY)


@functools.lru_cache(maxsize=8)
def _access(token: str, allow: tuple[str, ...], secret_key: str) -> Access:
    key = hashlib.sha256(b"ferry-metrics-labels:" + secret_key.encode()).digest()
    return Access(token.encode(), parse_networks(allow), key)


def exposition(level: str, snapshot: RoutingSnapshot | None, label_key: bytes) -> bytes:
    """The text exposition of the process's registry for a caller admitted at `level`: with the other web
    processes' beside it when this is one of several on one port (`process_set`)."""
    registry = process_set.registry()
    if level == FULL:
        return generate_latest(registry)
    return generate_latest(RedactedRegistry(registry, Redactor(snapshot, label_key)))


class Redactor:
    def __init__(self, snapshot: RoutingSnapshot | None, key: bytes) -> None:
        models = snapshot.models if snapshot is not None else {}
        # Named only where every tenant may see the model: a platform model or a public one (ModelEntry.visible_to).
        self.public = frozenset(name for name, m in models.items() if m.tenant_id is None or m.visibility == "public")
        self.key = key
        self._memo: dict[tuple[str, str], str] = {}

    def labels(self, labels: dict[str, str]) -> dict[str, str]:
        if not labels:
            return labels
        out = dict(labels)
        hidden_model = None
        for name in MODEL_LABELS:
            value = labels.get(name)
            if value and value not in self.public:
                out[name] = self.opaque("model", value)  # one opaque name per model, as model or fallback
                if name == "model":
                    hidden_model = value
        if hidden_model is not None:
            for label in (VERSION_LABEL, STEP_LABEL):
                if labels.get(label):
                    out[label] = self.opaque(label, f"{hidden_model}:{labels[label]}")
        if labels.get(TENANT_LABEL):
            out[TENANT_LABEL] = self.opaque(TENANT_LABEL, labels[TENANT_LABEL])
        return out

    def opaque(self, kind: str, value: str) -> str:
        """The same name for the same value in every scrape of processes sharing SECRET_KEY, so a redacted
        series stays one series; HMAC-keyed, so a guessed name cannot be confirmed by hashing it."""
        found = self._memo.get((kind, value))
        if found is None:
            digest = hmac.new(self.key, f"{kind}\0{value}".encode(), hashlib.sha256).hexdigest()[:12]
            found = self._memo[(kind, value)] = PRIVATE + digest
        return found


class RedactedRegistry:
    """What `generate_latest` reads (anything with `collect()`): the registry's families, labels redacted."""

    def __init__(self, registry: object, redactor: Redactor) -> None:
        self.registry = registry
        self.redactor = redactor

    def collect(self) -> Iterator[Metric]:
        redact = self.redactor.labels
        for family in self.registry.collect():  # type: ignore[attr-defined]
            copy = Metric(family.name, family.documentation, family.type, family.unit)
            copy.samples = [sample._replace(labels=redact(sample.labels)) for sample in family.samples]
            yield copy
