"""The node's artifact cache (serving.dataplane.node.artifact_cache) and the control plane's artifact endpoint
(/internal/artifacts/<sha256>), in process; tests/test_artifact_processes.py runs them between processes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.test import AsyncClient

from serving import artifacts
from serving.dataplane.node import artifact_cache
from serving.dataplane.node.artifact_cache import ArtifactCache, ArtifactUnavailable


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Source:
    """Chunks from a dict by sha256, counting fetches; `lie` serves other bytes under a name."""

    def __init__(self, *blobs: bytes) -> None:
        self.blobs = {sha(b): b for b in blobs}
        self.fetches: list[str] = []

    def __call__(self, sha256: str, timeout_s: float) -> Iterator[bytes]:
        self.fetches.append(sha256)
        if sha256 not in self.blobs:
            raise ArtifactUnavailable(f"no artifact {sha256}", missing=True)
        data = self.blobs[sha256]
        return iter([data[i : i + 1000] for i in range(0, len(data), 1000)])


def sample(name: str, n: int = 3000) -> bytes:
    return (name.encode() * n)[:n]


def refused(where: str) -> float:
    return artifact_cache.REFUSED.labels(where)._value.get()


def test_a_fetch_is_cached_and_a_hit_is_checked_not_refetched(tmp_path: Path) -> None:
    a = sample("a")
    source = Source(a)
    cache = ArtifactCache(tmp_path, 10_000, source, max_artifact_bytes=10_000, timeout_s=5)
    # when a load asks twice
    first = cache.path(sha(a))
    second = cache.path(sha(a))
    # then it was fetched once, into a read-only file named by its hash
    assert first == second == tmp_path / sha(a)[:2] / sha(a)
    assert first.read_bytes() == a
    assert source.fetches == [sha(a)]
    assert first.stat().st_mode & 0o222 == 0


def test_a_tampered_cache_file_is_refused_counted_and_fetched_again(tmp_path: Path) -> None:
    a = sample("a")
    source = Source(a)
    cache = ArtifactCache(tmp_path, 10_000, source, max_artifact_bytes=10_000, timeout_s=5)
    path = cache.path(sha(a))
    before = refused("cache")
    # given the cached file changed on disk
    path.chmod(0o644)
    path.write_bytes(b"evil" + a[4:])
    # when it is asked for again
    again = cache.path(sha(a))
    # then the tampered bytes were refused and counted, and the file fetched again
    assert refused("cache") == before + 1
    assert again.read_bytes() == a
    assert source.fetches == [sha(a), sha(a)]


def test_fetched_bytes_that_do_not_match_their_name_are_refused_and_not_kept(tmp_path: Path) -> None:
    a, b = sample("a"), sample("b")
    source = Source(a)
    source.blobs[sha(b)] = a  # a source that answers other bytes under b's name
    cache = ArtifactCache(tmp_path, 10_000, source, max_artifact_bytes=10_000, timeout_s=5)
    before = refused("fetch")
    with pytest.raises(ArtifactUnavailable, match="do not match"):
        cache.path(sha(b))
    assert refused("fetch") == before + 1
    assert not cache.file_for(sha(b)).exists()
    assert list(tmp_path.glob(".fetch-*")) == []


def test_the_cache_is_bounded_in_bytes_least_recently_used_first(tmp_path: Path) -> None:
    a, b, c = sample("a"), sample("b"), sample("c")
    source = Source(a, b, c)
    cache = ArtifactCache(tmp_path, 7000, source, max_artifact_bytes=7000, timeout_s=5)
    cache.path(sha(a))
    cache.path(sha(b))
    import os

    os.utime(cache.file_for(sha(a)), (1, 1))  # a used before b
    os.utime(cache.file_for(sha(b)), (2, 2))
    cache.path(sha(a))  # a used again: now b is the least recently used
    # when a third does not fit beside both
    cache.path(sha(c))
    # then b went, a and c stay, and the cache holds no more than its bound
    assert not cache.file_for(sha(b)).exists()
    assert cache.file_for(sha(a)).exists() and cache.file_for(sha(c)).exists()
    assert cache.used_bytes() <= 7000


def test_an_artifact_over_the_limit_is_refused_while_it_streams(tmp_path: Path) -> None:
    big = sample("big", 5000)
    cache = ArtifactCache(tmp_path, 10_000, Source(big), max_artifact_bytes=4000, timeout_s=5)
    with pytest.raises(ArtifactUnavailable, match="larger than 4000"):
        cache.path(sha(big))
    assert cache.used_bytes() == 0


def test_an_unknown_artifact_is_unavailable(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path, 10_000, Source(), max_artifact_bytes=10_000, timeout_s=5)
    with pytest.raises(ArtifactUnavailable) as caught:
        cache.path("ab" * 32)
    assert caught.value.missing and caught.value.status == 503
    with pytest.raises(ArtifactUnavailable):
        cache.path("../../etc/passwd")


# -- the control plane's endpoint -------------------------------------------------------------------


async def body(response) -> bytes:  # noqa: ANN001
    return b"".join([chunk async for chunk in response.streaming_content])


@pytest.mark.django_db(transaction=True)  # store() runs on another thread, outside a test transaction
async def test_the_endpoint_streams_an_artifact_to_a_node_token_only(settings, model_files) -> None:  # noqa: ANN001
    from asgiref.sync import sync_to_async

    settings.FERRY_NODE_TOKEN = "node-secret"
    with model_files.digits.open("rb") as f:
        stored = await sync_to_async(artifacts.store)(f)
    url = f"/internal/artifacts/{stored.sha256}"
    client = AsyncClient()
    # a node with the token gets the bytes, streamed, with their length
    ok = await client.get(url, headers={"Authorization": "Bearer node-secret"})
    assert ok.status_code == 200
    assert int(ok["Content-Length"]) == stored.size_bytes
    assert await body(ok) == model_files.digits.read_bytes()
    # no token, or another one: 401 JSON
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic node-secret"}):
        denied = await client.get(url, headers=headers)
        assert denied.status_code == 401 and "node token" in denied.json()["error"]
    # an unknown sha256, or not a sha256: 404 JSON
    for name in ("ab" * 32, "nothex"):
        missing = await client.get(f"/internal/artifacts/{name}", headers={"Authorization": "Bearer node-secret"})
        assert missing.status_code == 404 and missing.json()["error"].startswith("no artifact")
    # with no token configured the endpoint is off
    settings.FERRY_NODE_TOKEN = ""
    off = await client.get(url, headers={"Authorization": "Bearer "})
    assert off.status_code == 403


# -- the node: a fetch that failed is tried again ---------------------------------------------------


async def test_a_failed_fetch_is_tried_again_at_the_next_snapshot_a_refused_load_is_not(model_files) -> None:  # noqa: ANN001
    from serving.dataplane.gateway.snapshot import ModelEntry, RoutingSnapshot, VersionEntry
    from serving.dataplane.http.protocol import TensorSpec
    from serving.dataplane.node.node import Node
    from serving.policies.batching import BatchingConfig

    def version(name: str) -> VersionEntry:
        return VersionEntry(
            model=name,
            version=1,
            state="ready",
            loaded=True,
            artifact_sha256=sha(name.encode()),
            format="torchscript",
            inputs=(TensorSpec("input", "FP32", (64,)),),
            outputs=(TensorSpec("scores", "FP32", (10,)),),
            batching=BatchingConfig(8, 0.0, 100),
            default_timeout_ms=1000,
            latency_profile={},
        )

    def snapshot(serial: int) -> RoutingSnapshot:
        return RoutingSnapshot(
            serial=serial,
            built_at=0.0,
            models={name: ModelEntry(name, "", "", None, {1: version(name)}) for name in ("fetched", "broken")},
        )

    asked: list[str] = []

    def artifact_path(sha256: str) -> Path:
        asked.append(sha256)
        if sha256 == sha(b"broken"):
            return Path(__file__)  # not an archive: the load is refused, for good
        if asked.count(sha256) == 1:
            raise ArtifactUnavailable("the control plane answered 503")
        return model_files.digits

    node = Node(artifact_path=artifact_path, device="cpu")
    try:
        # given a first snapshot whose fetch fails for one version and whose other version cannot load
        await node.reconcile(snapshot(1))
        assert node.failures["fetched:1"].transient and not node.failures["broken:1"].transient
        # when the next snapshot comes, the same versions in it
        await node.reconcile(snapshot(2))
        # then the fetch was tried again and the version loaded; the refused one was not tried again
        assert "fetched:1" in node.hosted and "fetched:1" not in node.failures
        assert asked.count(sha(b"fetched")) == 2 and asked.count(sha(b"broken")) == 1
    finally:
        await node.close()
