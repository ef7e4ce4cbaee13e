"""Node providers: how many nodes a plan wants per pool, the Kubernetes provider's requests as a tiny local HTTPS
API server receives them, and the local provider starting and stopping real `runnode` processes (which announce
themselves in Redis with the pool's accelerator, budget and labels).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import redis

from autoscaling.providers import KubernetesProvider, LocalProvider, Pool, ProviderError, pools_from
from serving.dataplane.transport import fleet

REDIS_URL = os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


def test_pools_are_read_from_the_settings_json_and_mistakes_are_refused() -> None:
    pools = pools_from({"a10g": {"memory": "24GiB", "max_nodes": 3, "labels": {"zone": "b"}}})
    assert pools == {"a10g": Pool("a10g", 24 * GiB, 0, 3, {"zone": "b"}, "")}
    assert pools["a10g"].workload == "ferry-node-a10g"
    with pytest.raises(ValueError, match="memory"):
        pools_from({"a10g": {"max_nodes": 3}})
    with pytest.raises(ValueError, match="unknown"):
        pools_from({"a10g": {"memory": "1GiB", "max_node": 3}})
    with pytest.raises(ValueError, match="min_nodes"):
        pools_from({"a10g": {"memory": "1GiB", "min_nodes": 3, "max_nodes": 2}})


# --- Kubernetes ---------------------------------------------------------------------------------


class FakeApiServer:
    """An HTTPS server that keeps each StatefulSet's replicas and records every request it receives."""

    def __init__(self, tmp_path: Path, replicas: dict[str, int], refuse: int = 0) -> None:
        self.cert = tmp_path / "ca.crt"
        key = tmp_path / "tls.key"
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                str(key),
                "-out",
                str(self.cert),
                "-days",
                "1",
                "-subj",
                "/CN=127.0.0.1",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
            ],
            check=True,
            capture_output=True,
        )
        self.replicas = dict(replicas)
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.refuse = refuse
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.requests.append((self.command, self.path, dict(self.headers), body))
                name = self.path.split("/statefulsets/")[1].split("/")[0]
                if server.refuse:
                    self.send_response(server.refuse)
                    self.end_headers()
                    self.wfile.write(b'{"kind":"Status","reason":"Forbidden"}')
                    return
                if self.command == "PATCH":
                    server.replicas[name] = json.loads(body)["spec"]["replicas"]
                doc = {
                    "kind": "Scale",
                    "apiVersion": "autoscaling/v1",
                    "metadata": {"name": name},
                    "spec": {"replicas": server.replicas[name]},
                    "status": {"replicas": server.replicas[name]},
                }
                payload = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_PATCH = _answer  # noqa: N815

        import ssl

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, key)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("sa-token-1\n")
    return path


def test_kubernetes_provider_patches_the_scale_subresource_only_when_it_differs(tmp_path: Path, token: Path) -> None:
    api = FakeApiServer(tmp_path, {"ferry-node-a10g": 1, "gpu-h100": 2})
    try:
        pools = {
            "a10g": Pool("a10g", 24 * GiB, max_nodes=4),
            "h100": Pool("h100", 80 * GiB, max_nodes=4, statefulset="gpu-h100"),
        }
        provider = KubernetesProvider(pools, namespace="ferry", base_url=api.url, token_file=token, ca_file=api.cert)
        # when a10g is asked for 3 nodes and h100 for the 2 it runs
        assert provider.apply({"a10g": 3, "h100": 2}) == {"a10g": 3, "h100": 2}
        # then each scale subresource is read, and only a10g's is patched, as a merge patch with the bearer token
        methods = [(m, p) for m, p, _, _ in api.requests]
        base = "/apis/apps/v1/namespaces/ferry/statefulsets"
        assert methods == [
            ("GET", f"{base}/ferry-node-a10g/scale"),
            ("PATCH", f"{base}/ferry-node-a10g/scale"),
            ("GET", f"{base}/gpu-h100/scale"),
        ]
        _, _, headers, body = api.requests[1]
        assert headers["Authorization"] == "Bearer sa-token-1"
        assert headers["Content-Type"] == "application/merge-patch+json"
        assert json.loads(body) == {"spec": {"replicas": 3}}
        assert api.replicas == {"ferry-node-a10g": 3, "gpu-h100": 2}
        # and a rotated token is read at the next call; a wish past the pool's maximum is capped
        token.write_text("sa-token-2")
        provider.apply({"a10g": 9})
        assert api.requests[-1][2]["Authorization"] == "Bearer sa-token-2"
        assert api.replicas["ferry-node-a10g"] == 4
        assert api.replicas["gpu-h100"] == 0  # no wish for h100: its minimum, 0
    finally:
        api.close()


def test_kubernetes_provider_refuses_a_server_it_cannot_trust_and_reports_refusals(tmp_path: Path, token: Path) -> None:
    api = FakeApiServer(tmp_path, {"ferry-node-a10g": 1}, refuse=403)
    try:
        pools = {"a10g": Pool("a10g", 24 * GiB, max_nodes=4)}
        refused = KubernetesProvider(pools, namespace="ferry", base_url=api.url, token_file=token, ca_file=api.cert)
        with pytest.raises(ProviderError, match="403"):
            refused.apply({"a10g": 2})
        # without the cluster's CA the server's certificate is not trusted, and nothing is sent
        sent = len(api.requests)
        untrusted = KubernetesProvider(pools, namespace="ferry", base_url=api.url, token_file=token, ca_file=None)
        with pytest.raises(ProviderError, match="CERTIFICATE_VERIFY_FAILED"):
            untrusted.apply({"a10g": 2})
        assert len(api.requests) == sent
    finally:
        api.close()


# --- local processes -----------------------------------------------------------------------------


def _live_nodes(client: redis.Redis) -> dict[str, fleet.NodeInfo]:
    nodes = {}
    for name in client.smembers(fleet.NODES_KEY):
        raw = client.hgetall(fleet.node_key(name.decode()))
        if raw:
            nodes[name.decode()] = fleet.NodeInfo.from_hash(raw)
    return nodes


def _wait(what: str, check, run_dir: Path, timeout: float = 240.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in run_dir.glob("*.log"))
            pytest.fail(f"{what}\n{logs}")
        time.sleep(0.3)


def test_local_provider_starts_and_stops_named_runnode_processes_within_its_bound(
    tmp_path: Path,
    db,
    settings,  # noqa: ANN001
) -> None:
    from serving.dataplane.gateway.snapshot import hub
    from serving.publish import publish_snapshot

    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    settings.REDIS_URL = REDIS_URL
    # A Redis serial starts at a clock reading, far above this process's embedded ones: the process's hub is
    # put back afterwards, or later embedded-mode tests' snapshots would all look older than this one.
    held = hub.current
    publish_snapshot()  # an (empty) routing snapshot, so the nodes start serving at once
    hub.current = held
    env = {
        **os.environ,
        "REDIS_URL": REDIS_URL,
        "FERRY_EMBEDDED_NODE": "false",
        "FERRY_DATA_DIR": str(tmp_path),
        "FERRY_TORCH_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    pools = {"t4": Pool("t4", 512 * (1 << 20), max_nodes=3, labels={"zone": "z1"})}
    run_dir = tmp_path / "nodes"
    provider = LocalProvider(
        pools, run_dir, max_total=2, prefix="as", env=env, cwd=ROOT, command=[sys.executable, "manage.py", "runnode"]
    )
    try:
        # when three nodes are asked for, on a machine bounded to two
        assert provider.apply({"t4": 3}) == {"t4": 2}
        # then two runnode processes join the fleet, named, with the pool's accelerator, budget and labels
        _wait("two local nodes heartbeating", lambda: set(_live_nodes(client)) == {"as-t4-0", "as-t4-1"}, run_dir)
        node = _live_nodes(client)["as-t4-1"]
        assert (node.accelerator, node.memory_budget, node.labels) == ("t4", 512 * (1 << 20), {"zone": "z1"})
        # and another worker process's provider (a fresh instance, same run directory) sees them and starts none
        other = LocalProvider(pools, run_dir, max_total=2, prefix="as", env=env, cwd=ROOT)
        assert other.running() == {"t4": ["as-t4-0", "as-t4-1"]}
        assert other.apply({"t4": 2}) == {"t4": 2}
        stopped_pid = int((run_dir / "as-t4-1.pid").read_text().split()[0])
        # when one is asked for, the highest-numbered node is stopped (SIGTERM: it leaves the fleet)
        assert other.apply({"t4": 1}) == {"t4": 1}
        _wait("as-t4-1 leaving the fleet", lambda: set(_live_nodes(client)) == {"as-t4-0"}, run_dir, 60)
        # and its process ends (detached, so init reaps it: no zombie is left whichever process stopped it)
        _wait("as-t4-1's process ending", lambda: not Path(f"/proc/{stopped_pid}").exists(), run_dir, 60)
        assert provider.running() == {"t4": ["as-t4-0"]}
    finally:
        provider.apply({"t4": 0})
        _wait("every local node gone", lambda: not _live_nodes(client), run_dir, 60)
        client.flushdb()
        client.close()
