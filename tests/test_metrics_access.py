"""/metrics is no longer anonymous (issue 17, finding 3): the metrics token reads every label; an address in
FERRY_METRICS_ALLOW without it reads private models' names and versions and tenants' slugs redacted; anyone
else is 401. Checked on the web process's /metrics (in-process server) and on a node's --metrics-port (a
real `runnode`), after the labels that would leak exist: a private model's traffic and a tenant's quota
refusal. Peers are told apart by source address: Linux routes all of 127.0.0.0/8 to loopback, so a client
bound to 127.0.0.2 is a different peer from one on 127.0.0.1."""

from __future__ import annotations

import http.client
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest

from config.env import ImproperSetting, env_cidrs
from serving.dataplane.gateway.snapshot import ModelEntry, RoutingSnapshot
from serving.dataplane.metrics.metrics_access import Access, MetricsRefused, Redactor, allowed, parse_networks
from tests.conftest import LiveServer, free_port, mint_key, register, tenant
from tests.test_artifact_processes import web_live
from tests.test_inference_http import digits_request, infer
from tests.test_quota_http import set_quota
from tests.test_streams_processes import (
    REDIS_URL,
    ROOT,
    Proc,
    _env,
    ready_on,
    redis_db,  # noqa: F401 (a fixture)
    start_web,
    stop_all,
    wait_for,
)

TOKEN = "metrics-token-for-tests"
SECRET_MODEL = "acme-hidden-model"
SECRET_TENANT = "acme-secret-tenant"
ALLOWED_PEER = "127.0.0.2"  # the allow-list's address in these tests; 127.0.0.1 is outside it
ZERO = digits_request(np.zeros((1, 64), np.float32))
SMALL = {"max_batch_size": 4, "max_queue_delay_ms": 1}


def scrape(port: int, token: str | None = None, source: str = "127.0.0.1") -> tuple[int, dict[str, str], str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=(source, 0))
    try:
        conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read().decode()
    finally:
        conn.close()


def assert_refused(answer: tuple[int, dict[str, str], str]) -> None:
    status, headers, body = answer
    assert status == 401, (status, body[:300])
    assert headers["content-type"].startswith("application/json")
    assert headers["www-authenticate"].lower().startswith("bearer")
    assert "error" in orjson.loads(body)
    assert SECRET_MODEL not in body and SECRET_TENANT not in body


# -- the rules, on a snapshot made by hand ---------------------------------------------------------


def test_admission_token_allow_list_and_refusal() -> None:
    access = Access(TOKEN.encode(), parse_networks(["10.1.0.0/16", "::1"]), b"k")
    assert access.admit(f"Bearer {TOKEN}".encode(), "203.0.113.9") == "full"  # the token, from anywhere
    assert access.admit(None, "10.1.2.3") == "redacted"
    assert access.admit(None, "::ffff:10.1.2.3") == "redacted"  # a dual-stack socket's IPv4 peer
    assert access.admit(None, "::1") == "redacted"
    for authorization, client in [
        (None, "10.2.0.1"),
        (None, None),
        (None, "not-an-address"),
        (b"Bearer wrong", "10.1.2.3"),  # a wrong token is refused even from the list
        (f"Basic {TOKEN}".encode(), "203.0.113.9"),
        (TOKEN.encode(), "203.0.113.9"),
    ]:
        with pytest.raises(MetricsRefused):
            access.admit(authorization, client)
    # without a token configured, a presented one counts for nothing: only the list admits
    open_access = Access(b"", parse_networks(["127.0.0.0/8"]), b"k")
    assert open_access.admit(b"Bearer anything", "127.0.0.1") == "redacted"
    with pytest.raises(MetricsRefused):
        open_access.admit(b"Bearer anything", "192.0.2.1")
    assert not allowed("192.0.2.1", parse_networks(["127.0.0.0/8"]))


def test_redaction_hides_private_and_shared_models_and_every_tenant() -> None:
    models = {
        "open": ModelEntry("open", "", "", None, {}, tenant_id=1, visibility="public"),
        "platform": ModelEntry("platform", "", "", None, {}, tenant_id=None, visibility="private"),
        "mine": ModelEntry("mine", "", "", None, {}, tenant_id=1, visibility="private"),
        "ours": ModelEntry("ours", "", "", None, {}, tenant_id=1, visibility="shared", shared_with=frozenset({2})),
    }
    redactor = Redactor(RoutingSnapshot(1, 0.0, models=models), b"key")
    # names every tenant may see stay, with their versions
    assert redactor.labels({"model": "open", "version": "3"}) == {"model": "open", "version": "3"}
    assert redactor.labels({"model": "platform", "version": "1"}) == {"model": "platform", "version": "1"}
    # private and shared ones, their versions, unknown names and every tenant slug become opaque names
    for name in ("mine", "ours", "deleted-since"):
        out = redactor.labels({"model": name, "version": "2", "status": "200"})
        assert out["model"].startswith("private-") and out["version"].startswith("private-"), out
        assert name not in str(out) and out["status"] == "200"
    out = redactor.labels({"tenant": "acme", "reason": "rate"})
    assert out["tenant"].startswith("private-") and out["reason"] == "rate"
    # the same model has the same opaque name as a model and as a fallback, scrape after scrape
    fallback = redactor.labels({"model": "open", "version": "1", "fallback": "mine"})["fallback"]
    assert fallback == Redactor(RoutingSnapshot(2, 0.0, models=models), b"key").labels({"model": "mine"})["model"]
    # and another key gives other names (a guessed name cannot be checked by hashing it)
    assert Redactor(None, b"other").labels({"model": "mine"})["model"] != redactor.labels({"model": "mine"})["model"]
    assert Redactor(None, b"key").labels({"model": "open"})["model"].startswith("private-")  # no snapshot: closed
    assert redactor.labels({"model": "", "version": ""}) == {"model": "", "version": ""}  # unrouted stays
    # a pipeline's steps (named after their models unless told otherwise) go with the pipeline's name
    step = redactor.labels({"model": "a-pipeline", "step": "mine"})
    assert step["model"].startswith("private-") and step["step"].startswith("private-"), step
    assert redactor.labels({"model": "open", "step": "small"}) == {"model": "open", "step": "small"}


def test_allow_list_setting_is_checked(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("FERRY_METRICS_ALLOW", "10.0.0.0/8, ::1")
    assert env_cidrs("FERRY_METRICS_ALLOW", []) == ["10.0.0.0/8", "::1"]
    monkeypatch.setenv("FERRY_METRICS_ALLOW", "none")
    assert env_cidrs("FERRY_METRICS_ALLOW", ["127.0.0.0/8"]) == []
    monkeypatch.setenv("FERRY_METRICS_ALLOW", "10.0.0.0/33")
    with pytest.raises(ImproperSetting, match="10.0.0.0/33"):
        env_cidrs("FERRY_METRICS_ALLOW", [])


def test_embedded_default_admits_loopback_only_until_a_token_is_set(tmp_path: Path) -> None:
    # the settings module's defaults, read in a fresh interpreter per environment
    script = "from django.conf import settings; print(settings.FERRY_METRICS_ALLOW)"
    env = {k: v for k, v in _env(REDIS_URL, tmp_path).items() if not k.startswith("FERRY_METRICS_")}
    env["DJANGO_SETTINGS_MODULE"] = "config.settings"
    plain = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    with_token = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**env, "FERRY_METRICS_TOKEN": "t"},
        capture_output=True,
        text=True,
    )
    assert plain.stdout.strip() == "['127.0.0.0/8', '::1/128']", plain.stderr
    assert with_token.stdout.strip() == "[]", with_token.stderr


# -- the web process's /metrics ----------------------------------------------------------------------


@pytest.fixture
def leaky_server(transactional_db, model_files, settings) -> Iterator[LiveServer]:  # noqa: ANN001
    """A server where a private model has served and its tenant has been refused by its quota."""
    settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000  # no shedding on a busy machine
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000
    settings.FERRY_METRICS_TOKEN = TOKEN
    settings.FERRY_METRICS_ALLOW = [f"{ALLOWED_PEER}/32"]
    owner = tenant(SECRET_TENANT)
    register(model_files.digits, "digits", **SMALL)
    register(model_files.digits, SECRET_MODEL, owner=owner, visibility="private", **SMALL)
    key = mint_key(SECRET_TENANT)
    set_quota(SECRET_TENANT, monthly_requests=1)
    server = LiveServer().start()
    try:
        assert infer(server, SECRET_MODEL, ZERO, auth=key).status == 200
        assert infer(server, SECRET_MODEL, ZERO, auth=key).status == 429  # the month's budget is spent
        assert infer(server, "digits", ZERO).status == 200
        yield server
    finally:
        server.stop()


def test_web_metrics_need_the_token_or_an_allowed_address(leaky_server: LiveServer) -> None:
    port = leaky_server.port
    # given the labels exist: the token reads them all
    status, _, body = scrape(port, TOKEN)
    assert status == 200
    assert f'model="{SECRET_MODEL}"' in body and f'tenant="{SECRET_TENANT}"' in body
    # an anonymous caller from outside the allow-list, or one with a wrong token, is refused
    assert_refused(scrape(port))
    assert_refused(scrape(port, "not-the-token"))
    assert_refused(scrape(port, "not-the-token", source=ALLOWED_PEER))
    # an API key is not the metrics token
    assert_refused(scrape(port, leaky_server.key))
    # an allowed address without the token gets the families, with no private name and no tenant slug in them
    status, _, body = scrape(port, source=ALLOWED_PEER)
    assert status == 200
    assert SECRET_MODEL not in body and SECRET_TENANT not in body
    assert 'model="digits"' in body  # a public model keeps its name
    refusals = [line for line in body.splitlines() if line.startswith("ferry_quota_refusals_total{")]
    assert refusals and all('tenant="private-' in line for line in refusals), refusals
    assert any(
        line.startswith("ferry_requests_total{") and 'model="private-' in line and 'status="429"' in line
        for line in body.splitlines()
    )


# -- a node's --metrics-port -------------------------------------------------------------------------


def start_node(tmp_path: Path, web: Proc, metrics_port: int, **env: str) -> Proc:
    home = tmp_path / "node-m-home"
    (home / "artifacts").mkdir(parents=True, exist_ok=True)
    environment = {
        **_env(REDIS_URL, home),
        "FERRY_ARTIFACT_ROOT": str(home / "artifacts"),
        "FERRY_ARTIFACT_URL": f"http://127.0.0.1:{web.port}",
        "FERRY_NODE_TOKEN": "node-token",
        **env,
    }
    log_path = tmp_path / "node-m.log"
    with log_path.open("a") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "runnode",
                "--name",
                "node-m",
                "--memory",
                "8GiB",
                "--metrics-port",
                str(metrics_port),
            ],
            cwd=ROOT,
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return Proc("node-m", proc, log_path)


def test_node_metrics_port_needs_the_token_or_an_allowed_address(
    transactional_db,
    redis_db,  # noqa: F811 (a fixture)
    model_files,
    tmp_path,
    monkeypatch,
) -> None:
    owner = tenant(SECRET_TENANT)
    register(model_files.digits, SECRET_MODEL, owner=owner, visibility="private", **SMALL)
    monkeypatch.setenv("FERRY_NODE_TOKEN", "node-token")  # the web process's (start_web passes os.environ on)
    web = start_web(tmp_path, REDIS_URL)
    procs = [web]
    metrics_port = free_port()
    try:
        wait_for("the web process live", lambda: web_live(web), procs)
        node = start_node(
            tmp_path, web, metrics_port, FERRY_METRICS_TOKEN=TOKEN, FERRY_METRICS_ALLOW=f"{ALLOWED_PEER}/32"
        )
        procs.append(node)
        wait_for(
            f"the node ready with {SECRET_MODEL}:1", lambda: ready_on(redis_db, "node-m", f"{SECRET_MODEL}:1"), procs
        )
        # the token reads the private model's labels
        status, _, body = scrape(metrics_port, TOKEN)
        assert status == 200
        assert f'ferry_node_version_hot{{model="{SECRET_MODEL}",version="1"}} 1.0' in body
        # no token from outside the list, or a wrong one: 401
        assert_refused(scrape(metrics_port))
        assert_refused(scrape(metrics_port, "not-the-token", source=ALLOWED_PEER))
        # the allowed address: the node's families, the private model's name nowhere
        status, _, body = scrape(metrics_port, source=ALLOWED_PEER)
        assert status == 200
        assert SECRET_MODEL not in body
        assert any(line.startswith('ferry_node_version_hot{model="private-') for line in body.splitlines()), body
        assert "ferry_node_memory_budget_bytes 8.589934592e+09" in body
    finally:
        stop_all(procs)
