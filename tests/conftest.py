"""Shared fixtures: small real models built once per session, a registry on PostgreSQL, a live server.

The database is the real PostgreSQL (DATABASE_URL, set by `make test`); artifacts live in a
temporary directory per session.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from django.conf import settings as django_settings
from django.contrib.auth import hashers
from django.core.cache import cache
from torch import nn

try:
    from playwright.sync_api import expect
except ImportError:  # bench/gpu_check.sh's environment on a device machine carries no browser tooling
    expect = None

from serving.demo import Digits, TokenSentiment, build_digits, save_artifact

DIGITS_IO = {
    "inputs": [{"name": "input", "datatype": "FP32", "shape": [64]}],
    "outputs": [{"name": "scores", "datatype": "FP32", "shape": [10]}],
}
TOKENS_IO = {
    "inputs": [{"name": "tokens", "datatype": "INT64", "shape": [-1]}],
    "outputs": [{"name": "scores", "datatype": "FP32", "shape": [2]}],
}


class WrongDtype(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x[:, :10] * 100).to(torch.int64)


class FailsOnNegative(nn.Module):
    """Raises when any pixel of a row is negative: a model that fails on some inputs only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x < 0).any()):
            raise ValueError("negative pixel")
        return x[:, :10] * 2.0


# Playwright's expect() waits 5 s by default, apart from a context's default timeout: under a loaded CI
# machine Redoc takes longer than that to lay out the schema. Every browser assertion gets the same
# deadline as the pages' own waits (a failure past it, never a timing assertion).
if expect is not None:
    expect.set_options(timeout=30_000)


@pytest.fixture(autouse=True, scope="session")
def _quick_password_hashing() -> Iterator[None]:
    """Production's password hasher at fewer iterations (tests.hashers), for every test of the session."""
    quick = "tests.hashers.QuickPBKDF2PasswordHasher"
    before = django_settings.PASSWORD_HASHERS
    django_settings.PASSWORD_HASHERS = [
        quick if h == "django.contrib.auth.hashers.PBKDF2PasswordHasher" else h for h in before
    ]
    hashers.get_hashers.cache_clear()
    hashers.get_hashers_by_algorithm.cache_clear()
    yield
    django_settings.PASSWORD_HASHERS = before
    hashers.get_hashers.cache_clear()
    hashers.get_hashers_by_algorithm.cache_clear()


@dataclass
class Artifacts:
    digits: Path  # trained 64-hidden digits classifier, TorchScript
    digits_accuracy: float
    digits_export: Path  # the same network as a torch.export program
    tokens: Path  # variable-length input, TorchScript
    wrong_dtype: Path  # declares FP32 scores, returns INT64
    fails_on_negative: Path
    not_a_zip: Path
    corrupt_zip: Path


@pytest.fixture(scope="session")
def artifacts_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("artifacts-src")


@pytest.fixture(scope="session")
def model_files(artifacts_dir: Path) -> Artifacts:
    torch.manual_seed(0)
    digits, accuracy = build_digits(64, 1, 25)(lambda line: None)
    paths = Artifacts(
        digits=artifacts_dir / "digits.pt",
        digits_accuracy=accuracy,
        digits_export=artifacts_dir / "digits.pt2",
        tokens=artifacts_dir / "tokens.pt",
        wrong_dtype=artifacts_dir / "wrong_dtype.pt",
        fails_on_negative=artifacts_dir / "fails.pt",
        not_a_zip=artifacts_dir / "not_a_zip.pt",
        corrupt_zip=artifacts_dir / "corrupt.pt",
    )
    save_artifact(digits, "torchscript", torch.zeros(2, 64), paths.digits)
    save_artifact(digits, "torch_export", torch.zeros(2, 64), paths.digits_export)
    save_artifact(TokenSentiment(), "torchscript", torch.ones(2, 8, dtype=torch.int64), paths.tokens)
    save_artifact(WrongDtype(), "torchscript", torch.zeros(2, 64), paths.wrong_dtype)
    save_artifact(FailsOnNegative(), "torchscript", torch.zeros(2, 64), paths.fails_on_negative)
    paths.not_a_zip.write_bytes(b"this is not a model" * 10)
    with zipfile.ZipFile(paths.corrupt_zip, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x04garbage")
    return paths


@pytest.fixture(scope="session")
def digits_samples() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.data.astype(np.float32), data.target


@pytest.fixture(autouse=True)
def _empty_cache() -> None:
    """Every test starts with an empty cache: the API's throttles (tenants.throttles) count there per client
    address, and every test's client is 127.0.0.1."""
    cache.clear()


@pytest.fixture(autouse=True)
def _artifact_root(settings, tmp_path_factory: pytest.TempPathFactory) -> None:  # noqa: ANN001
    settings.FERRY_ARTIFACT_ROOT = tmp_path_factory.getbasetemp() / "store"


TEST_TENANT = "test"
_OWNER = object()  # register()'s default owner: the test tenant


def tenant(slug: str = TEST_TENANT):  # noqa: ANN201
    """The tenant `slug`, created if missing."""
    from tenants.models import Tenant

    return Tenant.objects.get_or_create(slug=slug, defaults={"name": slug.title()})[0]


def engineers_may_promote(slug: str = TEST_TENANT):  # noqa: ANN201
    """Tenant `slug` (created if missing) with the "engineers may promote" policy, for tests about routing
    rather than approvals: by default a tenant requires an approval for every change of a stable version
    (tests/test_promotion_policy.py tests that)."""
    from tenants.models import PromotionPolicy  # at use, as tenant() does: conftest loads before Django's apps

    t = tenant(slug)
    t.promotion_policy = PromotionPolicy.ENGINEERS
    t.save(update_fields=["promotion_policy"])
    return t


def mint_key(slug: str = TEST_TENANT, scopes: tuple[str, ...] = ("infer", "manage"), **extra: object) -> str:
    """A fresh API key token for tenant `slug`."""
    from tenants.actions import create_key

    return create_key(tenant=tenant(slug), name=f"test-{slug}", scopes=list(scopes), **extra)[1]


def register(
    path: Path,
    name: str,
    fmt: str = "torchscript",
    io: dict | None = None,
    *,
    owner: object = _OWNER,
    visibility: str = "public",
    **batching: object,
):
    """Register and validate synchronously; returns the ModelVersion. The model belongs to the test tenant
    (or `owner`, a Tenant or None for a platform model) with `visibility`, public by default."""
    from serving.actions import register_version

    io = io or DIGITS_IO
    with path.open("rb") as f:
        version = register_version(
            model_name=name,
            artifact_file=f,
            fmt=fmt,
            inputs=io["inputs"],
            outputs=io["outputs"],
            validate="sync",
            **batching,
        )
    model = version.model
    owner = tenant() if owner is _OWNER else owner
    if model.tenant_id != (owner.pk if owner is not None else None) or model.visibility != visibility:
        model.tenant = owner
        model.visibility = visibility
        model.save(update_fields=["tenant", "visibility", "updated_at"])
    return version


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving `config.asgi` in a thread of this process, with the embedded node, configured by
    the same `uvicorn_config` as `manage.py serve` (so the front door is the real one); `overrides`
    are uvicorn.Config keywords."""

    def __init__(self, **overrides: object) -> None:
        import uvicorn

        from config.asgi import application
        from serving.dataplane.http.frontdoor import uvicorn_config

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(
            application, "127.0.0.1", self.port, **{"log_level": "warning", "loop": "asyncio", **overrides}
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.key: str | None = None  # infer + manage for the test tenant, minted at start

    def start(self) -> LiveServer:
        self.key = mint_key()
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("live server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def plane(self):  # noqa: ANN201
        from serving.dataplane import plane as dataplane

        return dataplane.current()

    def refresh(self) -> None:
        """Make the server pick up registry changes now instead of at its next periodic refresh."""
        plane = self.plane()
        future = asyncio.run_coroutine_threadsafe(_refresh_and_settle(plane), plane.loop)
        future.result(timeout=120)


async def _refresh_and_settle(plane) -> None:  # noqa: ANN001
    await plane.refresh_once()
    await plane.wait_reconciled(plane.gateway.hub.current.serial)


@pytest.fixture
def live_server(transactional_db) -> Iterator[LiveServer]:  # noqa: ANN001
    """A running server over whatever the test registered before asking for it (call .refresh() after
    registering more)."""
    server = LiveServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def digits_server(transactional_db, model_files: Artifacts) -> Iterator[LiveServer]:  # noqa: ANN001
    """A live server with `digits` (TorchScript), `digits-export` (torch.export) and `tokens` (variable length)."""
    register(model_files.digits, "digits", max_batch_size=16, max_queue_delay_ms=2)
    register(model_files.digits_export, "digits-export", fmt="torch_export")
    register(model_files.tokens, "tokens", io=TOKENS_IO, max_batch_size=8)
    server = LiveServer().start()
    try:
        yield server
    finally:
        server.stop()


__all__ = ["Digits", "register", "tenant", "mint_key", "DIGITS_IO", "TOKENS_IO", "LiveServer"]


@contextlib.contextmanager
def celery_worker(log_dir: Path, broker: str, **extra_env: str) -> Iterator[subprocess.Popen]:
    """A real Celery worker process (`-P solo`) on the test database, with `broker` as its broker; stopped
    on exit. Its log is `log_dir/worker.log`."""
    from django.db import connection

    db = connection.settings_dict
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "REDIS_URL": broker,
        "FERRY_DATA_DIR": str(log_dir),
        "CELERY_TASK_ALWAYS_EAGER": "false",
        **extra_env,
    }
    with (log_dir / "worker.log").open("w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "config",
                "worker",
                "-P",
                "solo",
                "-Q",
                "celery",
                "--without-heartbeat",
                "--without-gossip",
                "--without-mingle",
                "-l",
                "info",
            ],
            cwd=Path(__file__).resolve().parent.parent,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
