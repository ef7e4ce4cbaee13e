"""Content-addressed artifact store: files live under their sha256, written once, checked on read.

Through Django's storage API (`STORAGES["artifacts"]`): the filesystem under FERRY_ARTIFACT_ROOT by
default, an S3-compatible bucket (django-storages) when FERRY_ARTIFACT_STORAGE=s3. Nodes reach the
bytes either from that storage directly (same disk, or the bucket) or from the control plane's
`/internal/artifacts/<sha256>` (serving.artifact_views), and keep their own cache keyed by sha256
(serving.dataplane.node.artifact_cache), checking the hash before every load.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.files import File
from django.core.files.storage import FileSystemStorage, Storage, storages
from django.utils.functional import cached_property

from serving.dataplane.node import archive_check, operator_check, runtime_process
from serving.dataplane.node.artifact_cache import ArtifactCache, ArtifactUnavailable, http_source
from serving.dataplane.node.runtime import RuntimeFailure
from serving.models import Artifact

log = logging.getLogger(__name__)

CHUNK = 1024 * 1024


class ArtifactRejected(Exception):
    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class ArtifactFileStorage(FileSystemStorage):
    """The filesystem under FERRY_ARTIFACT_ROOT, read when first used and again when the setting changes
    (tests point it at a temporary folder), as FileSystemStorage follows MEDIA_ROOT."""

    @cached_property
    def base_location(self) -> str:
        return self._value_or_setting(self._location, str(settings.FERRY_ARTIFACT_ROOT))

    def _clear_cached_properties(self, setting: str, **kwargs: object) -> None:
        super()._clear_cached_properties(setting, **kwargs)
        if setting == "FERRY_ARTIFACT_ROOT":
            self.__dict__.pop("base_location", None)
            self.__dict__.pop("location", None)


def storage() -> Storage:
    return storages["artifacts"]


def name_for(sha256: str) -> str:
    return f"{sha256[:2]}/{sha256}"


def root() -> Path:
    return Path(settings.FERRY_ARTIFACT_ROOT)


def path_for(sha256: str) -> Path:
    """The artifact's file on local storage (FileSystemStorage only)."""
    return Path(storage().path(name_for(sha256)))


def store(stream: BinaryIO, *, expected_sha256: str | None = None, max_bytes: int | None = None) -> Artifact:
    """Stream an upload to a local temporary file, hashing as it goes (refused past `max_bytes` without
    reading on), check it as an archive, then save it to the storage under its sha256."""
    limit = max_bytes or settings.FERRY_MAX_ARTIFACT_BYTES
    digest = hashlib.sha256()
    size = 0
    fd, tmp_name = tempfile.mkstemp(prefix="ferry-upload-")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            while chunk := stream.read(CHUNK):
                size += len(chunk)
                if size > limit:
                    raise ArtifactRejected(f"artifact exceeds the {limit} byte limit", status=413)
                digest.update(chunk)
                out.write(chunk)
        if size == 0:
            raise ArtifactRejected("artifact is empty", status=400)
        sha = digest.hexdigest()
        if expected_sha256 and expected_sha256.lower() != sha:
            raise ArtifactRejected(f"sha256 mismatch: upload is {sha}, expected {expected_sha256}", status=400)
        if not zipfile.is_zipfile(tmp):
            raise ArtifactRejected("artifact is not a TorchScript or torch.export archive (not a zip file)")
        namespaces = settings.FERRY_ALLOWED_OPERATOR_NAMESPACES
        try:
            # read as data: refuses archives that would run code on load, and .pt2 programs calling refused operators
            kind = archive_check.check_archive(tmp, allowed_namespaces=namespaces)
            if kind == "zip":
                _check_torchscript_operators(tmp, namespaces, sha)
        except (archive_check.ArchiveRefused, operator_check.OperatorRefused) as exc:
            raise ArtifactRejected(f"archive refused: {exc.reason}") from None
        _save(sha, tmp)
    finally:
        tmp.unlink(missing_ok=True)
    artifact, _ = Artifact.objects.get_or_create(sha256=sha, defaults={"size_bytes": size})
    return artifact


# The operators found in archives this process inspected, by sha256 (newest last): the same bytes compile to the
# same graphs, so an upload of bytes seen before (another version of the same artifact, a re-upload) is checked
# against the policy without a second sandboxed compile. Bounded; only successful inspections are kept.
INSPECTED_MAX = 256
_inspected: OrderedDict[str, tuple[str, ...]] = OrderedDict()
_inspected_lock = threading.Lock()


def _check_torchscript_operators(tmp: Path, namespaces: list[str], sha: str) -> None:
    """Refuse a TorchScript archive whose compiled code calls an operator the policy does not allow
    (serving.dataplane.node.operator_check). Its code was read as data already (archive_check, which refuses
    a denied operator's name in it); all its operators are known only by compiling it, which runs its
    `__setstate__` code, so it is loaded in a fresh sandboxed process, never here (once per content: `sha`,
    the archive's verified sha256, keys what an earlier inspection found). One whose inspection does not
    complete (it does not load there: corrupt, a mislabelled format; or the child failed or timed out) is
    refused too, with the reason: an archive whose operators nobody has seen is not stored."""
    with _inspected_lock:
        known = _inspected.get(sha)
        if known is not None:
            _inspected.move_to_end(sha)
    if known is None:
        try:
            known = tuple(runtime_process.inspect_operators(tmp.read_bytes(), "torchscript"))
        except RuntimeFailure as exc:
            log.info("operator inspection of upload %s did not complete: %s", sha, exc)
            raise ArtifactRejected(f"archive refused: its operators could not be inspected: {exc}") from None
        with _inspected_lock:
            _inspected[sha] = known
            while len(_inspected) > INSPECTED_MAX:
                _inspected.popitem(last=False)
    operator_check.check(list(known), namespaces)


def _save(sha: str, tmp: Path) -> None:
    box, name = storage(), name_for(sha)
    if box.exists(name):
        if _sha256_of(_chunks(box, name)) == sha:
            return
        box.delete(name)  # the stored copy was damaged: the verified upload takes its place
    with tmp.open("rb") as f:
        saved = box.save(name, File(f, name=name))
    if saved != name:
        # Another upload of the same bytes saved it first and the storage picked a free name for this one.
        box.delete(saved)
        if _sha256_of(_chunks(box, name)) != sha:
            raise ArtifactRejected(f"the artifact storage holds a damaged {name}; upload again", status=503)
        return
    if isinstance(box, FileSystemStorage):
        os.chmod(box.path(name), 0o444)


def open_file(sha256: str) -> BinaryIO:
    """The stored artifact, open for reading (as stored: callers check the hash). ArtifactUnavailable if it
    is not stored."""
    try:
        return storage().open(name_for(sha256), "rb")
    except FileNotFoundError:
        raise ArtifactUnavailable(f"artifact {sha256} is missing from the store", missing=True) from None


def open_chunks(sha256: str, timeout_s: float | None = None) -> Iterator[bytes]:
    """The stored artifact's bytes, in chunks: a node cache's source when it reads the storage itself."""
    return _read(open_file(sha256))


def _read(f: BinaryIO) -> Iterator[bytes]:
    with f:
        while chunk := f.read(CHUNK):
            yield chunk


def _chunks(box: Storage, name: str) -> Iterator[bytes]:
    return _read(box.open(name, "rb"))


def verified_path(sha256: str) -> Path:
    """The artifact's file on local storage, after checking its bytes still hash to its name."""
    path = path_for(sha256)
    if not path.exists():
        raise ArtifactRejected(f"artifact {sha256} is missing from the store", status=503)
    if _file_sha256(path) != sha256:
        raise ArtifactRejected(f"artifact {sha256} is corrupt on disk", status=503)
    return path


def local_reader() -> Callable[[str], Path]:
    """How this process turns a sha256 into a verified local file when it reads the storage itself: the
    stored file where the storage is a local filesystem, else a disk cache filled from the storage."""
    if isinstance(storage(), FileSystemStorage):
        return verified_path
    return ArtifactCache(
        settings.FERRY_ARTIFACT_CACHE_DIR,
        settings.FERRY_ARTIFACT_CACHE_BYTES,
        open_chunks,
        max_artifact_bytes=settings.FERRY_MAX_ARTIFACT_BYTES,
        timeout_s=settings.FERRY_ARTIFACT_FETCH_TIMEOUT_S,
    ).path


def for_node() -> Callable[[str], Path]:
    """How a node process turns a sha256 into a verified local file: fetched from the control plane into its
    cache when FERRY_ARTIFACT_URL is set (a node on another machine), else read from the storage itself."""
    if not settings.FERRY_ARTIFACT_URL:
        return local_reader()
    if not settings.FERRY_NODE_TOKEN:
        raise ImproperlyConfigured("FERRY_ARTIFACT_URL needs FERRY_NODE_TOKEN (the web process's, to fetch with)")
    source = http_source(settings.FERRY_ARTIFACT_URL, settings.FERRY_NODE_TOKEN, settings.FERRY_MAX_ARTIFACT_BYTES)
    return ArtifactCache(
        settings.FERRY_ARTIFACT_CACHE_DIR,
        settings.FERRY_ARTIFACT_CACHE_BYTES,
        source,
        max_artifact_bytes=settings.FERRY_MAX_ARTIFACT_BYTES,
        timeout_s=settings.FERRY_ARTIFACT_FETCH_TIMEOUT_S,
    ).path


def on_node_disk() -> Callable[[str], bool]:
    """Whether an artifact is on this node's local disk without fetching it (a stat, not a hash check): in its
    cache where `for_node` fills one, else in the storage's own directory (None for a remote storage: then the
    cache)."""
    if settings.FERRY_ARTIFACT_URL or not isinstance(storage(), FileSystemStorage):
        directory = Path(settings.FERRY_ARTIFACT_CACHE_DIR)
        return lambda sha256: (directory / sha256[:2] / sha256).is_file()
    return lambda sha256: path_for(sha256).is_file()


def _sha256_of(chunks: Iterator[bytes]) -> str:
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def _file_sha256(path: Path) -> str:
    return _sha256_of(_read(path.open("rb")))
