"""A web process restarted behind another, with real processes: two `manage.py serve` (FERRY_EMBEDDED_NODE=false)
and one `manage.py runnode` on the test PostgreSQL database and Redis (FERRY_TEST_REDIS_URL).

Readiness and the repository come from the nodes' heartbeats in Redis (`transport.fleet.FleetView`), not from
a web process's own history: one that has just started has served nothing, and must still say what the other
says. Under load meanwhile, every request is answered exactly once. The client is a load balancer's: it
takes the process out of rotation a moment before SIGTERM, as the web Deployment does, and sends a connection
refused by a stopped process to the other (it never left, so it is not lost)."""

from __future__ import annotations

import http.client
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import orjson

from tests.conftest import free_port, mint_key, register
from tests.test_inference_http import call, digits_request
from tests.test_streams_processes import (
    REDIS_URL,
    Proc,
    ready_on,
    redis_db,  # noqa: F401  (the fixture)
    start,
    start_node,
    stop_all,
    wait_for,
    web_ready,
)

BODY = orjson.dumps(digits_request(np.zeros((1, 64), np.float32)))
NO_ANSWER_S = 30  # far past any deadline here: an answer this late is none


def start_web(name: str, tmp_path: Path, port: int) -> Proc:
    return start(name, ["serve", "--host", "127.0.0.1", "--port", str(port)], tmp_path, REDIS_URL, port)


def send(webs: list[Proc], out: set[str], turn: int, key: str) -> tuple[str, int, bool]:
    """(web process, status, Retry-After present) from the web processes in turn, less those in `out`; status
    -1: sent, and no answer came."""
    for web in [w for w in webs[turn % 2 :] + webs[: turn % 2] if w.name not in out]:
        conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=NO_ANSWER_S)
        try:
            try:
                conn.connect()
            except ConnectionRefusedError:
                continue  # stopped: nothing was sent, the balancer sends it to the other
            try:
                conn.request(
                    "POST",
                    "/v2/models/digits/infer",
                    body=BODY,
                    headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
                )
                resp = conn.getresponse()
                resp.read()
                return web.name, resp.status, resp.getheader("Retry-After") is not None
            except OSError:
                return web.name, -1, False
        finally:
            conn.close()
    return "", -2, False


def test_a_restarted_web_process_routes_as_the_other_does(transactional_db, redis_db, model_files, tmp_path) -> None:  # noqa: ANN001, F811
    register(model_files.digits, "digits", max_batch_size=8, max_queue_delay_ms=2)
    key = mint_key()
    webs = [start_web("web-1", tmp_path, free_port()), start_web("web-2", tmp_path, free_port())]
    procs = [*webs, start_node("node-a", tmp_path, REDIS_URL)]
    try:
        wait_for("the node ready with digits:1", lambda: ready_on(redis_db, "node-a", "digits:1"), procs)
        wait_for("both web processes ready", lambda: all(web_ready(w) for w in webs), procs)
        wait_for(
            "digits served by both",
            lambda: all(call(w, "POST", "/v2/models/digits/infer", BODY, auth=key).status == 200 for w in webs),
            procs,
        )

        # given steady load on both web processes
        results: list[tuple[str, int, bool]] = []
        out: set[str] = set()
        stop = threading.Event()

        def client(offset: int) -> None:
            turn = offset
            while not stop.is_set():
                results.append(send(webs, out, turn, key))
                turn += 1
                time.sleep(0.02)

        clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
        for thread in clients:
            thread.start()
        time.sleep(2)

        # when web-2 is taken out of rotation, stopped (SIGTERM) a moment later, and started again on its port:
        # what the web Deployment's endpoints and preStop sleep do (platform/k8s/base/web.yaml)
        out.add("web-2")
        time.sleep(1)
        old = webs[1]
        old.proc.send_signal(signal.SIGTERM)
        old.proc.wait(timeout=60)
        webs[1] = start_web("web-2", tmp_path, old.port)
        procs[1] = webs[1]
        wait_for("web-2 ready again", lambda: web_ready(webs[1]), procs)
        out.discard("web-2")  # ready: back in rotation, as its readiness probe puts it
        back = len(results)
        time.sleep(3)
        stop.set()
        for thread in clients:
            thread.join(timeout=NO_ANSWER_S + 10)
            assert not thread.is_alive(), "a client still waits for an answer"

        # then every request was answered once: served, or refused with Retry-After (none lost, none a 500)
        statuses = Counter((status, retry) for _, status, retry in results)
        print(f"{len(results)} requests: {statuses}")
        assert all(status in (200, 504) or (status == 503 and retry) for status, retry in statuses), statuses
        # and the restarted one serves, and says of readiness and the repository what the other says
        assert any(name == "web-2" and status == 200 for name, status, _ in results[back:]), results[back:]
        ready = [call(w, "GET", "/v2/models/digits/ready", auth=key).status for w in webs]
        assert ready == [200, 200], ready
        index = [call(w, "POST", "/v2/repository/index", {}, auth=key) for w in webs]
        assert [i.status for i in index] == [200, 200] and index[0].json() == index[1].json(), [i.body for i in index]
        assert {"name": "digits", "version": "1", "state": "READY", "reason": ""} in index[1].json()
    finally:
        stop_all(procs)
