"""Admission at the gateway in distributed mode, with real processes: one web process (FERRY_EMBEDDED_NODE=false)
and one `manage.py runnode` process, on the test PostgreSQL database and Redis (FERRY_TEST_REDIS_URL).

Under a load past the node's capacity the gateway refuses at once, on the load the node publishes
(`serving.dataplane.transport.load_view`), what could not be answered in time, so the stream holds only what
can be: the answers are 200s and quick 503s with Retry-After, and few 504s. Without it the node reads two
requests at a time, the rest wait in the stream past their deadline, and most answers are 504s.
Statuses only, with margins: no timing is asserted.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from pathlib import Path

import orjson
import torch
from torch import nn

from autoscaling import observe
from serving.demo import save_artifact
from tests.conftest import mint_key, register
from tests.test_streams_processes import (  # noqa: F401  (redis_db: the fixture)
    REDIS_URL,
    digits,
    ready_on,
    redis_db,
    start_node,
    start_web,
    stop_all,
    wait_for,
    web_ready,
)

LOAD_SECONDS = 8
BUDGET_S = 1.0  # the web process's FERRY_LATENCY_BUDGET_MS
PROBES = 5
MIN_CLIENTS = 16
MAX_CLIENTS = 96


class Slow(nn.Module):
    """The digits network, then about 50 ms of matrix products (on an idle core) whose result is discarded, the
    same for any batch size: a device that is the bottleneck, with the web process's event loop left free."""

    def __init__(self, inner: torch.jit.ScriptModule) -> None:
        super().__init__()
        self.inner = inner
        self.weight = torch.randn(384, 384) / 384**0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ones(384, 384)
        for _ in range(20):
            y = torch.tanh(y @ self.weight)
        return self.inner(x) + 0.0 * y.sum()


def test_overload_gets_quick_503s_from_the_gateway_not_504s_from_the_stream(
    transactional_db,  # noqa: ANN001, ARG001
    redis_db,  # noqa: ANN001, F811
    model_files,  # noqa: ANN001
    tmp_path: Path,
) -> None:
    # given a version whose batch is one row taking 50 ms or more, with a 1 s budget
    slow = tmp_path / "slow.pt"
    save_artifact(Slow(torch.jit.load(str(model_files.digits))), "torchscript", torch.zeros(2, 64), slow)
    register(slow, "digits", max_batch_size=1, max_queue_delay_ms=1, default_timeout_ms=1000)
    key = mint_key()
    budget = str(int(BUDGET_S * 1000))
    procs = [start_web(tmp_path, REDIS_URL, FERRY_LATENCY_BUDGET_MS=budget), start_node("node-a", tmp_path, REDIS_URL)]
    web, node = procs
    try:
        wait_for("the node ready with digits:1", lambda: ready_on(redis_db, "node-a", "digits:1"), procs)
        wait_for("the web process ready", lambda: web_ready(web), procs)
        resp, _ = digits(web, key)
        assert resp.status == 200, resp.body
        # How long one request takes here and now, one at a time: the clients below are enough to need three
        # budgets' worth of the device whatever this machine's speed (a fixed count overloads only a busy one).
        started = time.monotonic()
        for _ in range(PROBES):
            resp, _ = digits(web, key)
            assert resp.status == 200, resp.body
        each = (time.monotonic() - started) / PROBES
        clients = max(MIN_CLIENTS, min(MAX_CLIENTS, math.ceil(3 * BUDGET_S / each)))

        # when three budgets' worth of clients call it without a deadline of their own, each pausing a moment
        # after a refusal (they do not spin)
        answers: list[tuple[int, dict, bytes]] = []
        lock = threading.Lock()
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                try:
                    resp, _ = digits(web, key)
                    answer = (resp.status, resp.headers, resp.body)
                except OSError:
                    answer = (-1, {}, b"")  # no answer at all
                with lock:
                    answers.append(answer)
                if answer[0] != 200:
                    time.sleep(0.1)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        for t in threads:
            t.start()
        time.sleep(LOAD_SECONDS)
        stop.set()
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive(), "a client still waits for an answer"

        statuses = Counter(status for status, _, _ in answers)
        shed = [orjson.loads(body).get("error", "") for status, _, body in answers if status == 503]
        at_gateway = sum("refused at the gateway" in message for message in shed)
        print(
            f"{clients} clients, {each * 1000:.0f} ms a request alone; statuses: {dict(statuses)};"
            f" 503s refused at the gateway: {at_gateway} of {len(shed)}"
        )
        # then every request got an answer, none a 500
        assert set(statuses) <= {200, 503, 504}, statuses
        # and the overload is answered by 503s with Retry-After, most of them by the gateway before the stream
        assert statuses[200] >= 10 and statuses[503] >= 10, statuses
        assert all(headers.get("retry-after") for status, headers, _ in answers if status == 503)
        assert at_gateway >= len(shed) // 2, (at_gateway, len(shed))
        # and few requests waited in the stream past their deadline
        assert statuses[504] <= max(5, 0.05 * sum(statuses.values())), statuses
        # and the autoscaler counts every request asked for, refused or not: each refusal reaches the version's
        # refusal counter within the web process's next flush (every second), beside the stream's entries; only
        # a request whose deadline passed before it was sent (a 504) may be in neither
        # (waited for whole: the front door's refusals and the gateway's reach Redis in different flushes, and on a
        # busy machine the front door's came a flush after the gateway's, 260 of 6,107 requests, CI 2026-12-05)
        sent = len(answers) + 1 + PROBES

        def counted() -> bool:
            streams = observe.read_streams(redis_db, ["digits:1"])["digits:1"]
            return streams.refused >= at_gateway and streams.asked >= sent - statuses[504]

        wait_for("every request asked for counted in Redis", counted, procs, timeout=30.0)
        asked = observe.read_streams(redis_db, ["digits:1"])["digits:1"].asked
        assert asked <= sent, (asked, sent, statuses)
        node.alive()
    finally:
        stop_all(procs)
