"""Content-addressed artifact store: files live under their sha256, written once, checked on read."""

from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
from pathlib import Path
from typing import BinaryIO

from django.conf import settings

from serving.dataplane import archive_check
from serving.models import Artifact

CHUNK = 1024 * 1024


class ArtifactRejected(Exception):
    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def root() -> Path:
    return Path(settings.FERRY_ARTIFACT_ROOT)


def path_for(sha256: str) -> Path:
    return root() / sha256[:2] / sha256


def store(stream: BinaryIO, *, expected_sha256: str | None = None, max_bytes: int | None = None) -> Artifact:
    """Stream an upload to disk, hashing as it goes; refuse it past `max_bytes` without reading on."""
    limit = max_bytes or settings.FERRY_MAX_ARTIFACT_BYTES
    root().mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    size = 0
    fd, tmp_name = tempfile.mkstemp(dir=root(), prefix=".upload-")
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
        try:
            archive_check.check_archive(tmp)  # read as data: refuses archives that would run code on load
        except archive_check.ArchiveRefused as exc:
            raise ArtifactRejected(f"archive refused: {exc.reason}") from None
        final = path_for(sha)
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists() and _file_sha256(final) == sha:
            tmp.unlink()
        else:
            # New, or the stored copy was damaged: the verified upload takes its place.
            tmp.chmod(0o444)
            os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    artifact, _ = Artifact.objects.get_or_create(sha256=sha, defaults={"size_bytes": size})
    return artifact


def verified_path(sha256: str) -> Path:
    """The artifact's file, after checking its bytes still hash to its name."""
    path = path_for(sha256)
    if not path.exists():
        raise ArtifactRejected(f"artifact {sha256} is missing from the store", status=503)
    if _file_sha256(path) != sha256:
        raise ArtifactRejected(f"artifact {sha256} is corrupt on disk", status=503)
    return path


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
