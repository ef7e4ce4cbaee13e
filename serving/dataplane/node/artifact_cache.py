"""A node's disk cache of artifacts, keyed by sha256, filled from a source (the control plane over HTTP,
or the artifact storage) and checked before every load.

- A file is used only after its bytes hash to its name. A cached file that does not (tampered with, or
  damaged on disk) is refused, counted and logged, deleted, and fetched again; fetched bytes that do not
  hash to the name asked for are refused and never written under it.
- Fetches are bounded: in bytes (FERRY_MAX_ARTIFACT_BYTES, checked against the declared length first and
  against what arrives), and in time (one deadline for the whole fetch, and per read).
- The cache is bounded in bytes: least recently used files are deleted to make room (a file's mtime is
  its last use). A model once loaded does not need its file, so deleting it costs a fetch next time only.
- Nothing here unpickles: the runtime's archive check (serving.dataplane.node.archive_check) reads the file
  as data before torch loads it.

This is data plane: no ORM. Loads run on the node's one load thread, so fetches run one at a time; the
lock keeps that true for any other caller.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from serving.dataplane.errors import Unavailable

log = logging.getLogger(__name__)

CHUNK = 1024 * 1024
SHA256 = re.compile(r"[0-9a-f]{64}")

REFUSED = Counter(
    "ferry_artifact_refused", "Artifact bytes refused because they did not hash to their sha256", ["where"]
)
FETCHES = Counter("ferry_artifact_fetches", "Artifact fetches into the node's cache, by outcome", ["outcome"])
HITS = Counter("ferry_artifact_cache_hits", "Loads served from the node's artifact cache")
CACHE_BYTES = Gauge("ferry_artifact_cache_bytes", "Bytes in the node's artifact cache")
EVICTED = Counter("ferry_artifact_cache_evictions", "Artifacts deleted from the cache to make room (LRU)")
FETCH_SECONDS = Histogram(
    "ferry_artifact_fetch_seconds",
    "Time to fetch an artifact into the cache",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)

Source = Callable[[str, float], Iterator[bytes]]  # (sha256, timeout per read) -> chunks


class ArtifactUnavailable(Unavailable):
    """The artifact cannot be had now: missing at the source, refused, too large, or the fetch failed."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message, retry_after=5)
        self.missing = missing


class ArtifactCache:
    def __init__(
        self,
        directory: Path | str,
        max_bytes: int,
        source: Source,
        *,
        max_artifact_bytes: int,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes < 1 or max_artifact_bytes < 1 or timeout_s <= 0:
            raise ValueError("the cache and artifact bounds and the fetch timeout must be positive")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.max_artifact_bytes = max_artifact_bytes
        self.timeout_s = timeout_s
        self._source = source
        self._clock = clock
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".fetch-*"):  # a fetch cut short by a crash
            stale.unlink(missing_ok=True)
        CACHE_BYTES.set(self.used_bytes())

    def file_for(self, sha256: str) -> Path:
        return self.directory / sha256[:2] / sha256

    def path(self, sha256: str) -> Path:
        """A local file whose bytes hash to `sha256`: the cached one if it checks, else a fresh fetch."""
        if not SHA256.fullmatch(sha256):
            raise ArtifactUnavailable(f"{sha256!r} is not a sha256", missing=True)
        with self._lock:
            cached = self.file_for(sha256)
            if cached.exists():
                if _file_sha256(cached) == sha256:
                    os.utime(cached)  # its last use, for LRU
                    HITS.inc()
                    return cached
                REFUSED.labels("cache").inc()
                log.error(
                    "cached artifact %s does not hash to its name (tampered or damaged); deleted, fetching it again",
                    sha256,
                )
                cached.unlink(missing_ok=True)
            return self._fetch(sha256)

    def used_bytes(self) -> int:
        return sum(size for _, size, _ in self._files())

    def _files(self) -> list[tuple[float, int, Path]]:
        found = []
        for path in self.directory.glob("??/*"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            found.append((st.st_mtime, st.st_size, path))
        return found

    def _make_room(self, incoming: int, keep: Path | None = None) -> None:
        files = sorted(f for f in self._files() if f[2] != keep)
        used = sum(size for _, size, _ in files) + (keep.stat().st_size if keep else 0)
        for _, size, path in files:
            if used + incoming <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            used -= size
            EVICTED.inc()
            log.info("artifact cache: deleted %s (least recently used) to make room", path.name)
        CACHE_BYTES.set(used + incoming)

    def _fetch(self, sha256: str) -> Path:
        started = self._clock()
        deadline = started + self.timeout_s
        limit = min(self.max_artifact_bytes, self.max_bytes)
        final = self.file_for(sha256)
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=self.directory, prefix=".fetch-")
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            size = 0
            with os.fdopen(fd, "wb") as out:
                for chunk in self._source(sha256, self.timeout_s):
                    size += len(chunk)
                    if size > limit:
                        raise ArtifactUnavailable(
                            f"artifact {sha256} is larger than {limit} bytes (the artifact"
                            " limit or the node's cache); refused"
                        )
                    if self._clock() > deadline:
                        raise ArtifactUnavailable(f"fetching artifact {sha256} took over {self.timeout_s:g}s")
                    digest.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != sha256:
                REFUSED.labels("fetch").inc()
                log.error("fetched bytes for artifact %s hash to %s: refused", sha256, digest.hexdigest())
                raise ArtifactUnavailable(f"artifact {sha256}: the fetched bytes do not match its sha256; refused")
            self._make_room(size)
            tmp.chmod(0o444)
            os.replace(tmp, final)
        except ArtifactUnavailable:
            FETCHES.labels("failed").inc()
            raise
        except (OSError, urllib.error.URLError) as exc:
            FETCHES.labels("failed").inc()
            raise ArtifactUnavailable(f"fetching artifact {sha256} failed: {exc}") from None
        finally:
            tmp.unlink(missing_ok=True)
        FETCHES.labels("fetched").inc()
        FETCH_SECONDS.observe(self._clock() - started)
        log.info("artifact %s fetched into the cache (%d bytes, %.2fs)", sha256, size, self._clock() - started)
        return final


def http_source(base_url: str, token: str, max_bytes: int) -> Source:
    """Artifacts from the control plane: GET {base_url}/internal/artifacts/<sha256> with the node token."""
    base = base_url.rstrip("/")

    def fetch(sha256: str, timeout_s: float) -> Iterator[bytes]:
        request = urllib.request.Request(
            f"{base}/internal/artifacts/{sha256}", headers={"Authorization": f"Bearer {token}"}
        )
        try:
            response = urllib.request.urlopen(request, timeout=timeout_s)  # noqa: S310 (the configured URL)
        except urllib.error.HTTPError as exc:
            detail = exc.read(2048).decode(errors="replace")
            exc.close()
            raise ArtifactUnavailable(
                f"the control plane answered {exc.code} for artifact {sha256}: {detail}", missing=exc.code == 404
            ) from None
        return _stream(response, sha256, max_bytes)

    return fetch


def _stream(response, sha256: str, max_bytes: int) -> Iterator[bytes]:  # noqa: ANN001
    with response:
        declared = response.headers.get("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise ArtifactUnavailable(f"artifact {sha256} is {declared} bytes, over the {max_bytes} byte limit")
        while chunk := response.read(CHUNK):
            yield chunk


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
