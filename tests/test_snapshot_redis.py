"""Routing snapshots through the real Redis (FERRY_TEST_REDIS_URL, a database of its own)."""

import asyncio
import dataclasses
import os

import pytest
import redis

from serving.dataplane.gateway import snapshot_redis
from serving.dataplane.gateway.snapshot import RoutingSnapshot, SnapshotHub
from serving.dataplane.gateway.snapshot import hub as process_hub
from serving.dataplane.metrics.metrics import INTERNAL_ERRORS
from serving.publish import build_snapshot, publish_snapshot
from tests.conftest import register

REDIS_URL = os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture
def redis_url(settings):  # noqa: ANN001, ANN201
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(*snapshot_redis.KEYS)
    settings.REDIS_URL = REDIS_URL
    # Redis serials start at a clock reading, far above this process's embedded ones: put the process's
    # hub back, or later embedded-mode tests' snapshots would all look older than the last Redis one.
    held = process_hub.current
    yield REDIS_URL
    process_hub.current = held
    client.delete(*snapshot_redis.KEYS)
    client.close()


def test_encode_decode_round_trip(db, model_files) -> None:  # noqa: ANN001
    # given a registry with two models / when a snapshot crosses Redis' wire format / then it is equal
    register(model_files.digits, "digits", max_batch_size=16, preferred_batch_sizes=[4, 8])
    register(model_files.digits, "digits", max_queue_delay_ms=7)
    snapshot = build_snapshot()
    assert snapshot_redis.decode(snapshot_redis.encode(snapshot)) == snapshot


def test_publish_numbers_serials_cluster_wide(db, model_files, redis_url) -> None:  # noqa: ANN001
    register(model_files.digits, "digits")
    first = publish_snapshot()
    second = publish_snapshot()
    assert second.serial == first.serial + 1
    stored = snapshot_redis.RedisSnapshotStore(redis_url).load()
    assert stored is not None and stored.serial == second.serial
    assert stored.models["digits"].versions[1].servable


def test_a_slow_publisher_cannot_bring_back_a_revoked_key(db, redis_url) -> None:  # noqa: ANN001
    from tenants.actions import create_key, revoke_key
    from tests.conftest import tenant

    store = snapshot_redis.RedisSnapshotStore(redis_url)
    key, _ = create_key(tenant=tenant(), name="k", scopes=["infer"])
    # given a publisher that took its serial and read the registry while the key was live (the
    # periodic republish, say), and is slow to store it
    slow = build_snapshot(store.next_serial())
    assert key.prefix in slow.keys
    # when the key is revoked and that change published meanwhile
    revoke_key(key=key)
    revoked = publish_snapshot()  # what the on_commit hook does (this test's transaction never commits)
    assert key.prefix not in revoked.keys and revoked.serial > slow.serial
    # then the slow snapshot is refused: the stored one still leaves the key out
    assert store.publish(slow) is False
    stored = store.load()
    assert stored is not None and stored.serial == revoked.serial and key.prefix not in stored.keys
    # while a later publication is stored
    assert publish_snapshot().serial == store.load().serial > revoked.serial
    store.close()


async def test_serials_keep_rising_after_redis_loses_its_data(transactional_db, model_files, redis_url) -> None:  # noqa: ANN001
    from asgiref.sync import sync_to_async
    from django.db import connections

    await sync_to_async(register)(model_files.digits, "digits")
    hub = SnapshotHub()
    fed = asyncio.Event()
    task = asyncio.create_task(snapshot_redis.follow(redis_url, hub, ready=fed))
    try:
        await asyncio.wait_for(fed.wait(), 10)
        before = hub.current
        assert before is not None
        # given Redis restarted empty (no persistence), while the follower keeps the last snapshot
        client = redis.Redis.from_url(redis_url)
        client.delete(*snapshot_redis.KEYS)
        client.close()
        # when the control plane publishes again / then the new serial is above the old one and followed
        after = await sync_to_async(publish_snapshot)()
        assert after.serial > before.serial
        async with asyncio.timeout(10):
            while hub.current.serial != after.serial:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await sync_to_async(connections.close_all)()


async def test_follower_sees_each_publication(transactional_db, model_files, redis_url) -> None:  # noqa: ANN001
    # given a follower subscribed to the feed (registration runs on asgiref's thread, hence a real commit)
    from asgiref.sync import sync_to_async
    from django.db import connections

    await sync_to_async(register)(model_files.digits, "digits")  # publishes on commit
    client = redis.Redis.from_url(redis_url)
    client.delete(snapshot_redis.VALUE_KEY)
    client.close()
    hub = SnapshotHub()
    fed = asyncio.Event()
    task = asyncio.create_task(snapshot_redis.follow(redis_url, hub, ready=fed))
    try:
        await asyncio.wait_for(fed.wait(), 10)
        assert hub.current is None  # nothing published yet
        # when the control plane publishes / then the follower's hub holds it
        published = await sync_to_async(publish_snapshot)()
        async with asyncio.timeout(10):
            while hub.current is None or hub.current.serial < published.serial:
                await asyncio.sleep(0.01)
        assert hub.current == published
        # and an older serial never replaces a newer one, even with other content
        older = dataclasses.replace(
            snapshot_redis.decode(snapshot_redis.encode(published)), serial=published.serial - 1, models={}
        )
        hub.set(older)
        assert hub.current == published and hub.current.models
        # while a newer one does
        newer = dataclasses.replace(published, serial=published.serial + 1, models={})
        hub.set(newer)
        assert hub.current is newer
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await sync_to_async(connections.close_all)()


async def test_follower_catches_up_on_a_lost_announcement(transactional_db, model_files, redis_url) -> None:  # noqa: ANN001
    from asgiref.sync import sync_to_async
    from django.db import connections

    await sync_to_async(register)(model_files.digits, "digits")
    hub = SnapshotHub()
    fed = asyncio.Event()
    task = asyncio.create_task(snapshot_redis.follow(redis_url, hub, ready=fed))
    client = redis.Redis.from_url(redis_url)
    try:
        await asyncio.wait_for(fed.wait(), 10)
        assert hub.current is not None and hub.current.models
        # given a snapshot stored whose announcement never reached the follower (no PUBLISH at all)
        store = snapshot_redis.RedisSnapshotStore(redis_url)
        missed = dataclasses.replace(hub.current, serial=store.next_serial(), models={})
        store.close()
        client.set(snapshot_redis.VALUE_KEY, snapshot_redis.encode(missed))
        client.set(snapshot_redis.STORED_KEY, missed.serial)
        # then the follower's periodic serial check loads it (nothing else would: no beat runs here)
        async with asyncio.timeout(10):
            while hub.current.serial != missed.serial:
                await asyncio.sleep(0.05)
        assert hub.current == missed
    finally:
        client.close()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await sync_to_async(connections.close_all)()


async def test_follower_survives_unreachable_redis() -> None:
    # given a Redis address nothing listens on / when following / then it retries instead of raising
    hub = SnapshotHub()
    task = asyncio.create_task(snapshot_redis.follow("redis://127.0.0.1:1/0", hub))
    await asyncio.sleep(0.3)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_follower_outlives_a_snapshot_it_cannot_read_and_a_subscriber_that_raises(redis_url) -> None:  # noqa: ANN001
    errors = INTERNAL_ERRORS.labels("snapshot_feed")
    before = errors._value.get()
    store = snapshot_redis.RedisSnapshotStore(redis_url)
    client = redis.Redis.from_url(redis_url)
    hub = SnapshotHub()
    raised: list[int] = []

    def raises_once(snapshot: RoutingSnapshot) -> None:
        if not raised:
            raised.append(snapshot.serial)
            raise RuntimeError("a subscriber's bug")

    hub.subscribe(raises_once)
    task = asyncio.create_task(snapshot_redis.follow(redis_url, hub))
    try:
        # given a stored snapshot this process cannot decode (a publisher of another version, say)
        client.set(snapshot_redis.VALUE_KEY, b'{"models": "not a map"}')
        client.set(snapshot_redis.STORED_KEY, store.next_serial())
        # when the follower reads it / then the failure is logged and counted, and the follower goes on
        async with asyncio.timeout(10):
            while errors._value.get() == before:
                await asyncio.sleep(0.01)
        assert not task.done() and hub.current is None
        # and a readable snapshot published later (a revocation, say) still arrives, past a subscriber that raises
        first = RoutingSnapshot(serial=store.next_serial(), built_at=0.0)
        assert store.publish(first)
        async with asyncio.timeout(30):
            while hub.current is None:
                await asyncio.sleep(0.01)
        assert hub.current == first and raised == [first.serial]
        second = RoutingSnapshot(serial=store.next_serial(), built_at=0.0)
        assert store.publish(second)
        async with asyncio.timeout(30):
            while hub.current.serial != second.serial:
                await asyncio.sleep(0.01)
        assert not task.done()
    finally:
        client.close()
        store.close()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_a_subscriber_that_raises_leaves_the_others_told() -> None:
    # given a hub whose first subscriber has a bug, and a second one
    errors = INTERNAL_ERRORS.labels("snapshot_subscriber")
    before = errors._value.get()
    hub = SnapshotHub()
    told: list[int] = []

    def raises(snapshot: RoutingSnapshot) -> None:
        raise RuntimeError("a subscriber's bug")

    hub.subscribe(raises)
    hub.subscribe(lambda snapshot: told.append(snapshot.serial))
    # when a snapshot is set / then the second is told all the same, and the bug is counted
    hub.set(RoutingSnapshot(serial=1, built_at=0.0))
    assert told == [1] and hub.current is not None and hub.current.serial == 1
    assert errors._value.get() == before + 1
