"""The demo's background traffic: scikit-learn's digits sent to one model over HTTP with the demo tenant's key,
at a fixed mean rate, in small bursts so the batcher forms batches of several sizes.

Each request carries an end user's id as its routing key (X-Ferry-Routing-Key, one of USERS at random): a
canary's share is sticky per routing key, and without one all of the demo key's traffic would go one way.

Bounded by construction: one burst at a time, each of at most 2 x rate x TICK requests, at most `in_flight`
of them on the wire at once (a thread each, a keep-alive connection per thread); a slow server slows the
loop down instead of queueing more. `send_burst()` is one step; `run()` repeats it until told to stop.
Plain Python, no Django: `manage.py demo_traffic` hands it the address, the key and the rate.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import orjson

TICK = 0.25  # seconds between the starts of two bursts
TIMEOUT = 10.0  # seconds a request may take before it counts as failed (status 0)
USERS = 1000  # end users the traffic comes from


class DemoTraffic:
    def __init__(
        self,
        *,
        host: str,
        port: int,
        key: str,
        rows: np.ndarray,
        model: str = "digits",
        rate: int = 20,
        in_flight: int = 8,
        seed: int = 0,
    ) -> None:
        if rate < 1 or in_flight < 1:
            raise ValueError("rate and in_flight must be at least 1")
        if rows.ndim != 2 or not len(rows):
            raise ValueError("rows must be a non-empty 2-D array")
        self.host, self.port, self.model = host, port, model
        self.rate, self.in_flight = rate, in_flight
        self._headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        self._bodies = [
            orjson.dumps(
                {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, rows.shape[1]], "data": row.tolist()}]}
            )
            for row in rows.astype(np.float32)
        ]
        self._rng = np.random.default_rng(seed)
        self._pool = ThreadPoolExecutor(in_flight, thread_name_prefix="demo-traffic")
        self._local = threading.local()
        self.statuses: Counter[int] = Counter()  # status -> answers since the last `take_statuses()`
        self._lock = threading.Lock()

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT)
        return conn

    def _post(self, request: tuple[bytes, int]) -> int:
        body, user = request
        conn = self._connection()
        try:
            headers = {**self._headers, "X-Ferry-Routing-Key": f"demo-user-{user}"}
            conn.request("POST", f"/v2/models/{self.model}/infer", body=body, headers=headers)
            response = conn.getresponse()
            response.read()
            status = response.status
            if response.will_close:
                conn.close()
        except (OSError, http.client.HTTPException):
            conn.close()  # reconnects on the next request
            status = 0
        with self._lock:
            self.statuses[status] += 1
        return status

    def ready(self) -> bool:
        """Whether the server answers its readiness check (no key needed)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT)
        try:
            conn.request("GET", "/v2/health/ready")
            response = conn.getresponse()
            response.read()
            return response.status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def send_burst(self) -> list[int]:
        """One burst of rate x TICK requests on average, each a random digit, sent at once: between 1 and
        2 x rate x TICK - 1 of them (below one a burst, one with that probability); the statuses, when all
        have answered."""
        mean = self.rate * TICK
        if mean < 1:
            size = int(self._rng.random() < mean)
        else:
            size = int(self._rng.integers(1, max(2, round(2 * mean))))
        picks = self._rng.integers(0, len(self._bodies), size)
        users = self._rng.integers(0, USERS, size)
        return list(self._pool.map(self._post, [(self._bodies[i], int(u)) for i, u in zip(picks, users, strict=True)]))

    def take_statuses(self) -> Counter[int]:
        with self._lock:
            taken, self.statuses = self.statuses, Counter()
        return taken

    def run(self, stop: Callable[[], bool], sleep: Callable[[float], object] = time.sleep) -> None:
        """Bursts every TICK seconds (or as fast as the server answers, if slower) until `stop()`."""
        while not stop():
            started = time.monotonic()
            self.send_burst()
            sleep(max(0.0, TICK - (time.monotonic() - started)))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
