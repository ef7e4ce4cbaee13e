"""The response cache: its key, its byte bound and LRU order, its scopes across tenants, its invalidation by
snapshot, and its Redis tier (the real Redis of the suite)."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import numpy as np
import pytest
import redis

from serving.dataplane.gateway import cache as rc
from serving.dataplane.gateway.cache import RedisTier, ResponseCache, request_key, scope
from serving.dataplane.gateway.snapshot import ModelEntry, RoutingSnapshot, TenantEntry
from tests.test_admission import entry

TENANTS = {
    1: TenantEntry("a", 10, 10, 10, 1000, 1, share_response_cache=True),
    2: TenantEntry("b", 10, 10, 10, 1000, 1, share_response_cache=True),
    3: TenantEntry("c", 10, 10, 10, 1000, 1),
}


def version(name: str = "m", **changes: object):  # noqa: ANN201
    return dataclasses.replace(entry(name), response_cache=True, **changes)


def model(v, **changes: object) -> ModelEntry:  # noqa: ANN001
    return ModelEntry(v.model, "classification", "", None, {v.version: v}, **changes)


def snapshot(*models: ModelEntry, serial: int = 1) -> RoutingSnapshot:
    return RoutingSnapshot(serial, 0.0, {m.name: m for m in models}, tenants=TENANTS)


def inputs(value: float = 1.0, shape: tuple[int, ...] = (1, 4), dtype: str = "<f4") -> dict[str, np.ndarray]:
    return {"input": np.full(shape, value, dtype=np.dtype(dtype))}


def answer(n: int = 1) -> dict[str, np.ndarray]:
    return {"scores": np.arange(n * 2, dtype=np.float32).reshape(n, 2)}


def test_the_key_changes_with_every_part_of_the_request_and_of_the_version() -> None:
    v = version()
    base = request_key(v, inputs(), None, b"t1")
    assert request_key(v, inputs(), None, b"t1") == base  # same request, same key
    others = [
        request_key(v, inputs(2.0), None, b"t1"),  # the bytes
        request_key(v, inputs(shape=(2, 2)), None, b"t1"),  # the shape, same bytes count
        request_key(v, {"input": inputs()["input"].view(np.int32)}, None, b"t1"),  # the dtype, same bytes
        request_key(v, {"other": inputs()["input"]}, None, b"t1"),  # the input's name
        request_key(v, inputs(), ("scores",), b"t1"),  # the outputs asked for
        request_key(v, inputs(), None, b"t2"),  # the scope
        request_key(dataclasses.replace(v, version=2), inputs(), None, b"t1"),  # the version
        request_key(dataclasses.replace(v, artifact_sha256="1" * 64), inputs(), None, b"t1"),  # the artifact
    ]
    assert base not in others and len(set(others)) == len(others)


def test_answers_are_shared_only_for_a_public_model_and_tenants_that_opted_in() -> None:
    v = version()
    platform = model(v)  # no owner: every tenant sees it
    public = model(v, tenant_id=1, visibility="public")
    shared = model(v, tenant_id=1, visibility="shared", shared_with=frozenset({2}))
    private = model(v, tenant_id=1, visibility="private")
    # opted in, public: one shared scope
    assert scope(platform, 1, TENANTS) == scope(platform, 2, TENANTS) == rc.SHARED
    assert scope(public, 2, TENANTS) == rc.SHARED
    # not opted in: its own scope, even for a public model
    assert scope(platform, 3, TENANTS) == b"t3"
    # a model not visible to every tenant: never shared, whoever opted in
    assert scope(shared, 2, TENANTS) == b"t2"
    assert scope(private, 1, TENANTS) == b"t1"


def test_a_hit_returns_the_answer_without_device_time_and_the_bound_in_bytes_evicts_least_recent() -> None:
    v = version()
    per_entry = rc.ENTRY_OVERHEAD + answer()["scores"].nbytes
    cache = ResponseCache(per_entry * 3, max_entry_fraction=1.0)
    cache.on_snapshot(snapshot(model(v)))
    keys = [request_key(v, inputs(float(i)), None, b"t1") for i in range(4)]
    for k in keys[:3]:
        cache.put(v, k, answer())
    # the first is used, so the second is now the least recently used
    hit = cache.get(keys[0])
    assert hit is not None and hit.compute_seconds == 0.0
    np.testing.assert_array_equal(hit["scores"], answer()["scores"])
    cache.put(v, keys[3], answer())
    assert len(cache) == 3 and cache.nbytes <= cache.max_bytes
    assert cache.get(keys[1]) is None
    assert all(cache.get(k) is not None for k in (keys[0], keys[2], keys[3]))
    # a kept answer is read-only: a caller cannot change what the next one gets
    with pytest.raises(ValueError):
        cache.get(keys[0])["scores"][0, 0] = 5.0


def test_an_answer_larger_than_its_share_of_the_bound_is_not_kept() -> None:
    v = version()
    cache = ResponseCache(4096)  # an entry may take an eighth: 512 bytes
    cache.on_snapshot(snapshot(model(v)))
    key = request_key(v, inputs(), None, b"t1")
    cache.put(v, key, {"scores": np.zeros((64, 2), np.float32)})  # 512 bytes of tensor, plus the overhead
    assert cache.get(key) is None and cache.nbytes == 0


def test_a_snapshot_drops_the_entries_of_a_version_retired_opted_out_replaced_or_made_private() -> None:
    v1, v2 = version("m"), version("n")
    m, n = model(v1), model(v2)
    cache = ResponseCache(1 << 20)
    cache.on_snapshot(snapshot(m, n))
    k1, k2 = request_key(v1, inputs(), None, rc.SHARED), request_key(v2, inputs(), None, rc.SHARED)
    cache.put(v1, k1, answer())
    cache.put(v2, k2, answer())
    # when a snapshot changes nothing that matters, both stay
    cache.on_snapshot(snapshot(m, n, serial=2))
    assert cache.get(k1) is not None and cache.get(k2) is not None
    # when m's version is retired, its entries go and n's stay
    retired = dataclasses.replace(v1, state="retired")
    cache.on_snapshot(snapshot(model(retired), n, serial=3))
    assert cache.get(k1) is None and cache.get(k2) is not None
    # a store for a version the snapshot no longer allows is refused (it ran while the snapshot changed)
    cache.put(v1, k1, answer())
    assert cache.get(k1) is None
    # when n opts out, or its model stops being public, its entries go
    cache.on_snapshot(snapshot(m, n, serial=4))
    cache.put(v1, k1, answer())
    cache.on_snapshot(snapshot(model(dataclasses.replace(v1, response_cache=False)), n, serial=5))
    assert cache.get(k1) is None and cache.get(k2) is not None
    cache.on_snapshot(snapshot(m, model(v2, tenant_id=1, visibility="private"), serial=6))
    assert cache.get(k2) is None
    # and a new artifact under the same version drops the old one's answers
    cache.put(v1, k1, answer())
    cache.on_snapshot(snapshot(model(dataclasses.replace(v1, artifact_sha256="2" * 64)), serial=7))
    assert cache.get(k1) is None and cache.nbytes == 0


def _redis_url() -> str:
    return os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


async def test_the_redis_tier_fills_a_second_gateway_and_a_bad_value_is_a_miss() -> None:
    url = _redis_url()
    plain = redis.Redis.from_url(url)
    plain.flushdb()
    v = version()
    first = ResponseCache(1 << 20, redis_tier=RedisTier(url))
    second = ResponseCache(1 << 20, redis_tier=RedisTier(url))
    for c in (first, second):
        c.on_snapshot(snapshot(model(v)))
    key = request_key(v, inputs(), None, rc.SHARED)
    try:
        # given an answer stored by one gateway
        assert await first.lookup(v, key) is None
        first.put(v, key, answer(3))
        await asyncio.wait(first.redis._writes, timeout=5)  # type: ignore[union-attr]
        assert plain.pttl(RedisTier.redis_key(v.key, key)) > 0  # it expires
        # when another gateway looks it up, it finds it in Redis, and keeps it locally after
        hits = rc.LOOKUPS.labels("m", "1", "hit_redis")._value.get()
        found = await second.lookup(v, key)
        assert found is not None and found.compute_seconds == 0.0
        np.testing.assert_array_equal(found["scores"], answer(3)["scores"])
        assert rc.LOOKUPS.labels("m", "1", "hit_redis")._value.get() == hits + 1
        assert second.get(key) is not None
        # and a value that is not a reply is a miss, counted, not an error
        other = request_key(v, inputs(7.0), None, rc.SHARED)
        plain.set(RedisTier.redis_key(v.key, other), b"\x93garbage")
        errors = rc.REDIS_ERRORS._value.get()
        assert await second.lookup(v, other) is None
        assert rc.REDIS_ERRORS._value.get() == errors + 1
    finally:
        await first.close()
        await second.close()
        plain.flushdb()
        plain.close()


async def test_an_unreachable_redis_is_a_miss() -> None:
    v = version()
    cache = ResponseCache(1 << 20, redis_tier=RedisTier("redis://127.0.0.1:1/0", timeout_s=0.5))
    cache.on_snapshot(snapshot(model(v)))
    try:
        assert await cache.lookup(v, request_key(v, inputs(), None, b"t1")) is None
    finally:
        await cache.close()
