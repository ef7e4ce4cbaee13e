"""API keys on /v2: who may call, with which scope, and which models each tenant sees.

Three tenants: an owner of three models (private, shared with the member, public), a member it shares
with, and an outsider. Health, server metadata and /metrics stay anonymous.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import pytest
from django.utils import timezone

from tests.conftest import LiveServer, mint_key, register, tenant
from tests.test_inference_http import assert_error, call, digits_request, grew, infer, metrics

ZERO = digits_request(np.zeros((1, 64), np.float32))
SMALL = {"max_batch_size": 4, "max_queue_delay_ms": 1}
# Every protected endpoint, as (method, path template, body); {m} is a model name.
MODEL_ENDPOINTS = [
    ("GET", "/v2/models/{m}", None),
    ("GET", "/v2/models/{m}/versions/1", None),
    ("GET", "/v2/models/{m}/ready", None),
    ("GET", "/v2/models/{m}/versions/1/ready", None),
    ("GET", "/v2/models/{m}/config", None),
    ("GET", "/v2/models/{m}/stats", None),
    ("GET", "/v2/models/{m}/versions/1/stats", None),
    ("POST", "/v2/models/{m}/infer", ZERO),
    ("POST", "/v2/models/{m}/versions/1/infer", ZERO),
    ("POST", "/v2/repository/models/{m}/load", b""),
    ("POST", "/v2/repository/models/{m}/unload", b""),
]
INDEX = ("POST", "/v2/repository/index", b"")


@dataclass
class World:
    server: LiveServer
    owner: str  # tokens, infer + manage each
    member: str
    outsider: str
    tenant_ids: dict[str, int]


@pytest.fixture
def world(transactional_db, model_files, settings) -> Iterator[World]:  # noqa: ANN001
    # These tests are about who may call, not saturation: a busy test machine must not shed their requests.
    settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000
    owner, member = tenant("owner"), tenant("member")
    register(model_files.digits, "owned-private", owner=owner, visibility="private", **SMALL)
    shared = register(model_files.digits, "owned-shared", owner=owner, visibility="shared", **SMALL).model
    shared.shared_with.add(member)
    register(model_files.digits, "owned-public", owner=owner, visibility="public", **SMALL)
    register(model_files.digits, "platform", owner=None, visibility="private", **SMALL)
    keys = {slug: mint_key(slug) for slug in ("owner", "member", "outsider")}
    server = LiveServer().start()
    try:
        yield World(
            server,
            keys["owner"],
            keys["member"],
            keys["outsider"],
            {slug: tenant(slug).pk for slug in ("owner", "member", "outsider")},
        )
    finally:
        server.stop()


def ask(server: LiveServer, method: str, template: str, body: object, model: str, auth: object) -> object:
    return call(server, method, template.format(m=model), body, auth=auth)


def assert_401(resp, *fragments: str) -> None:  # noqa: ANN001
    assert_error(resp, 401, *fragments)
    assert resp.headers.get("www-authenticate", "").startswith("Bearer"), resp.headers


def index_names(server: LiveServer, token: str) -> set[str]:
    resp = call(server, *INDEX, auth=token)
    assert resp.status == 200, resp.body
    return {row["name"] for row in resp.json()}


def test_requests_without_a_usable_key_are_401(world: World) -> None:
    server = world.server
    before = metrics(server)
    endpoints = [*MODEL_ENDPOINTS, INDEX]
    # given no Authorization header / when any protected endpoint is asked / then 401 JSON with a Bearer challenge
    for method, template, body in endpoints:
        assert_401(ask(server, method, template, body, "owned-public", None), "API key")
    # given malformed headers and tokens / then 401 saying so
    for header in (
        "Basic b3duZXI6cHc=",
        "Bearer",
        "Bearer ",
        "Bearer not-a-key",
        "Bearer fy_short_x",
        "bearer fy_",
        "Token " + world.owner,
    ):
        resp = call(server, "GET", "/v2/models/owned-public", headers={"Authorization": header}, auth=None)
        assert_401(resp, "malformed")
    # given a well-formed key that was never issued, and a real prefix with a wrong secret / then 401
    assert_401(infer(server, "owned-public", ZERO, auth="fy_AAAAAAAAAA_" + "x" * 43), "unknown")
    prefix = world.owner[: 3 + 10]
    assert_401(infer(server, "owned-public", ZERO, auth=prefix + "_" + "y" * 43), "unknown")
    # and the refusals are counted, unrouted (model "")
    refused = len(endpoints) + 7 + 2
    assert grew(before, metrics(server), "ferry_requests_total", model="", version="", status="401") == refused
    # while probes, scrapers and server metadata need no key
    for path in ("/v2", "/v2/health/live", "/v2/health/ready", "/metrics"):
        assert call(server, "GET", path, auth=None).status == 200, path
    # and the same request with the key is served
    assert infer(server, "owned-public", ZERO, auth=world.owner).status == 200


def test_expired_key_is_401(world: World) -> None:
    from tenants.actions import create_key
    from tenants.models import ApiKey

    server = world.server
    key, token = create_key(
        tenant=tenant("owner"), name="short-lived", scopes=["infer"], expires_at=timezone.now() + timedelta(hours=1)
    )
    # given a key that is still valid / then it serves
    assert infer(server, "owned-public", ZERO, auth=token).status == 200
    # when its expiry passes (moved into the past here) / then 401 naming the expiry
    ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(seconds=1), updated_at=timezone.now())
    server.refresh()
    assert_401(infer(server, "owned-public", ZERO, auth=token), "expired")
    assert_401(call(server, "GET", "/v2/models/owned-public", auth=token), "expired")


def test_revocation_takes_effect_without_a_restart(world: World) -> None:
    from tenants.actions import create_key, revoke_key
    from tenants.models import ApiKey

    server = world.server
    owner = tenant("owner")
    assert infer(server, "owned-public", ZERO, auth=world.owner).status == 200
    elsewhere, elsewhere_token = create_key(tenant=owner, name="elsewhere", scopes=["infer"])
    here, here_token = create_key(tenant=owner, name="here", scopes=["infer"])
    assert infer(server, "owned-public", ZERO, auth=elsewhere_token).status == 200
    assert infer(server, "owned-public", ZERO, auth=here_token).status == 200
    # given a key revoked in this process (revoke_key republishes on commit) / then refused at once
    revoke_key(key=here)
    assert_401(infer(server, "owned-public", ZERO, auth=here_token), "revoked")
    # given a key revoked by another process (an UPDATE, no signal here) / then refused at the next refresh
    revoked_at = time.monotonic()
    ApiKey.objects.filter(pk=elsewhere.pk).update(revoked_at=timezone.now(), updated_at=timezone.now())
    while infer(server, "owned-public", ZERO, auth=elsewhere_token).status == 200:
        assert time.monotonic() - revoked_at < 10, "revocation never took effect"
        time.sleep(0.05)
    took = time.monotonic() - revoked_at
    # the refresh loop runs every 2 s; allow for the rebuild on a busy 2-core machine
    assert took < 3.0, f"revocation took {took:.1f} s"
    assert_401(infer(server, "owned-public", ZERO, auth=elsewhere_token), "revoked")
    # and the keys still in use had last_used_at recorded, off the request path
    deadline = time.monotonic() + 20
    while ApiKey.objects.get(prefix=world.owner[3:13]).last_used_at is None:
        assert time.monotonic() < deadline, "last_used_at never recorded"
        time.sleep(0.2)


def test_scopes_gate_load_unload_and_inference(world: World) -> None:
    server = world.server
    infer_only = mint_key("owner", scopes=("infer",))
    manage_only = mint_key("owner", scopes=("manage",))
    before = metrics(server)
    # given a key with infer but not manage / then load and unload are 403 (no challenge), inference is served
    for action in ("load", "unload"):
        resp = call(server, "POST", f"/v2/repository/models/owned-public/{action}", b"", auth=infer_only)
        assert_error(resp, 403, "manage")
        assert "www-authenticate" not in resp.headers
    assert infer(server, "owned-public", ZERO, auth=infer_only).status == 200
    assert "owned-public" in index_names(server, infer_only)
    # given a key with manage but not infer / then inference, metadata, ready, config, statistics and the index
    # are 403
    for method, template, body in [*MODEL_ENDPOINTS[:9], INDEX]:
        assert_error(ask(server, method, template, body, "owned-public", manage_only), 403, "infer")
    # and it may load and unload
    for action in ("unload", "load"):
        resp = call(server, "POST", f"/v2/repository/models/owned-public/{action}", b"", auth=manage_only)
        assert resp.status == 200, resp.body
    after = metrics(server)
    assert grew(before, after, "ferry_requests_total", model="", version="", status="403") == 2 + 10


def test_each_tenant_sees_only_what_it_may(world: World) -> None:
    server = world.server
    sees = {
        world.owner: {"owned-private", "owned-shared", "owned-public", "platform"},
        world.member: {"owned-shared", "owned-public", "platform"},
        world.outsider: {"owned-public", "platform"},
        server.key: {"owned-public", "platform"},  # the test tenant: another outsider
    }
    models = ("owned-private", "owned-shared", "owned-public", "platform")
    for token, visible in sees.items():
        # the index lists exactly the visible models
        assert index_names(server, token) == visible
        for model in models:
            for method, template, body in MODEL_ENDPOINTS:
                if model in visible and "/repository/" in template:
                    continue  # load/unload of a visible model: test_scopes_gate_load_unload_and_inference
                resp = ask(server, method, template, body, model, token)
                if model in visible:
                    assert resp.status == 200, (model, template, resp.status, resp.body)
                else:
                    # a model it may not see answers exactly as one that does not exist
                    unknown = ask(server, method, template, body, "no-such-model", token)
                    assert_error(unknown, 404)
                    assert_error(resp, 404)
                    assert resp.error == unknown.error.replace("no-such-model", model), (model, template)


def test_fallback_only_to_a_model_the_caller_may_see(world: World) -> None:
    from serving.models import Model

    # given a public model whose fallback is the owner's private model
    public = Model.objects.get(name="owned-public")
    public.fallback = Model.objects.get(name="owned-private")
    public.save()
    world.server.refresh()
    gateway = world.server.plane().gateway
    entry = gateway.route("owned-public", None, world.tenant_ids["outsider"])
    # when a saturated request looks for the fallback / then the outsider gets none, the owner gets it
    assert gateway._fallback(entry, "owned-public", 1, world.tenant_ids["outsider"]) is None
    assert gateway._fallback(entry, "owned-public", 1, world.tenant_ids["member"]) is None
    chosen = gateway._fallback(entry, "owned-public", 1, world.tenant_ids["owner"])
    assert chosen is not None and chosen.model == "owned-private"


def test_snapshot_carries_keys_but_not_revoked_ones(db) -> None:  # noqa: ANN001
    from django.conf import settings

    from serving.publish import build_snapshot
    from tenants.actions import create_key, revoke_key
    from tenants.keys import matches, pepper_from, split

    acme = tenant("acme")
    live, token = create_key(tenant=acme, name="live", scopes=["infer"])
    dead, _ = create_key(tenant=acme, name="dead", scopes=["infer", "manage"])
    revoke_key(key=dead)
    snapshot = build_snapshot()
    assert dead.prefix not in snapshot.keys
    entry = snapshot.keys[live.prefix]
    assert entry.tenant_id == acme.pk and entry.scopes == ("infer",) and entry.expires_at is None
    assert matches(pepper_from(settings.SECRET_KEY), split(token)[1], entry.digest)
    assert token not in repr(snapshot)


def test_verified_keys_are_remembered_per_snapshot_and_expiry_still_applies() -> None:
    from serving.dataplane.gateway import auth
    from serving.dataplane.gateway.snapshot import KeyEntry, RoutingSnapshot
    from tenants import keys

    pepper = b"p" * 32
    minted = keys.mint(pepper)
    header = b"Bearer " + minted.token.encode()
    entry = KeyEntry(digest=minted.digest, tenant_id=7, scopes=("infer",), expires_at=1000.0)
    first = RoutingSnapshot(serial=1, built_at=0.0, keys={minted.prefix: entry})
    # given a key verified once / then a repeat against the same snapshot is the same caller, from the memo
    caller = auth.authenticate(header, first, pepper, now=10.0)
    assert caller.tenant_id == 7 and auth.authenticate(header, first, pepper, now=11.0) is caller
    assert header in auth._memo
    # when its expiry passes with no new snapshot / then the memo does not keep it alive
    with pytest.raises(auth.Unauthenticated, match="expired"):
        auth.authenticate(header, first, pepper, now=1000.0)
    # when a new snapshot leaves the key out (revoked) / then the memo is forgotten and the key refused
    revoked = RoutingSnapshot(serial=2, built_at=0.0, keys={})
    with pytest.raises(auth.Unauthenticated, match="unknown or revoked"):
        auth.authenticate(header, revoked, pepper, now=11.0)
    assert header not in auth._memo
    # and a wrong secret under a known prefix is refused and never remembered
    forged = f"Bearer fy_{minted.prefix}_{'x' * 43}".encode()
    with pytest.raises(auth.Unauthenticated):
        auth.authenticate(forged, first, pepper, now=11.0)
    assert forged not in auth._memo


def test_the_memo_of_verified_keys_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from serving.dataplane.gateway import auth
    from serving.dataplane.gateway.snapshot import KeyEntry, RoutingSnapshot
    from tenants import keys

    pepper = b"p" * 32
    monkeypatch.setattr(auth, "MAX_REMEMBERED", 3)
    minted = [keys.mint(pepper) for _ in range(5)]
    snapshot = RoutingSnapshot(
        serial=3,
        built_at=0.0,
        keys={m.prefix: KeyEntry(digest=m.digest, tenant_id=1, scopes=("infer",), expires_at=None) for m in minted},
    )
    for m in minted:
        auth.authenticate(b"Bearer " + m.token.encode(), snapshot, pepper, now=0.0)
        assert len(auth._memo) <= 3
