"""Python bytecodes per inference request on the server's event-loop thread, HTTP layer included.

    cd <a checkout> && /path/to/.venv/bin/python -m bench.opcodes --data-dir DIR [--requests 400]

The event loop's Python work is this server's ceiling, and a count of bytecodes is exact and
repeatable where timings on a shared 2-core machine swing by 15%: so this is how a change to the
request path is judged before a throughput run. It starts a real server (the checkout's own
uvicorn configuration, the front door included) in this process, drives `digits` with 8 keep-alive
client threads, then counts every bytecode the loop's thread runs (`sys.settrace` with opcode
events) over `--requests` more, and prints them per request by file and by function. Client
threads and the device thread are not traced. Run it from two checkouts (`git worktree add`), each
with a data dir its own migrations built (`manage.py migrate`, `build_demo_models`,
`ensure_demo_user`), to compare revisions. Tracing slows the server tenfold: only the counts mean
anything, not the time.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import http.client
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.opcodes", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--port", type=int, default=18123)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    sys.path.insert(0, os.getcwd())  # this checkout's code
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ["FERRY_DATA_DIR"] = str(a.data_dir)
    for name in ("FERRY_LOOP_LAG_TARGET_MS", "FERRY_MAX_LOOP_LAG_MS", "FERRY_MAX_FRONTEND_WAIT_MS"):
        os.environ[name] = "100000"  # tracing makes the loop late: keep the shed gate out of the count
    import django

    django.setup()
    counts = Counter(a)
    n = counts.run()
    root = os.getcwd() + "/"
    by_file: collections.Counter[str] = collections.Counter()
    for (filename, _), c in counts.ops.items():
        by_file[_short(filename, root)] += c
    print(f"\n{sum(counts.ops.values()) / n:,.0f} bytecodes per request over {n} requests (event-loop thread)")
    print("by file:")
    for name, c in by_file.most_common(a.top):
        print(f"  {c / n:8.1f}  {name}")
    print("by function:")
    for (filename, function), c in counts.ops.most_common(a.top):
        print(f"  {c / n:8.1f}  {_short(filename, root)}:{function}")
    return 0


def _server_config(port: int) -> Any:
    """This checkout's server configuration, as its `manage.py serve` has it."""
    import uvicorn

    try:
        from serving.dataplane.http.frontdoor import uvicorn_config
    except ImportError:
        try:
            from serving.frontdoor import uvicorn_config  # before the dataplane package
        except ImportError:  # before the front door: what serve passed to uvicorn.run then
            from django.conf import settings

            return uvicorn.Config(
                "config.asgi:application",
                host="127.0.0.1",
                port=port,
                loop="uvloop",
                http="httptools",
                lifespan="on",
                access_log=False,
                proxy_headers=False,
                limit_concurrency=settings.FERRY_MAX_CONCURRENCY,
                log_level="warning",
            )
    return uvicorn_config("config.asgi:application", "127.0.0.1", port, log_level="warning")


def _short(filename: str, root: str) -> str:
    if "site-packages/" in filename:
        return filename.split("site-packages/", 1)[1]
    return filename.removeprefix(root)


class Counter:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.ops: collections.Counter[tuple[str, str]] = collections.Counter()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return self._opcode

    def _opcode(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            name = code.co_name
            if code.co_filename == "<string>" and "self" in frame.f_locals:  # a generated (dataclass) method
                name = f"{type(frame.f_locals['self']).__name__}.{name}"
            self.ops[(code.co_filename, name)] += 1
        return self._opcode

    def run(self) -> int:
        import uvicorn
        import uvloop
        from sklearn.datasets import load_digits

        self.server = uvicorn.Server(_server_config(self.a.port))
        row = load_digits().data[0].astype("float32").tolist()
        self.body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": row}]})
        self.headers = {"Content-Type": "application/json"}
        key = self.a.data_dir / "demo-api-key"
        if key.exists():
            self.headers["Authorization"] = "Bearer " + key.read_text().strip()
        threading.Thread(target=self._client, daemon=True).start()

        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve()

        uvloop.run(serve())
        if self.error is not None:
            raise SystemExit(f"the client failed: {self.error!r}")
        return self.a.requests // 8 * 8

    def _burst(self, total: int) -> None:
        errors: list[BaseException] = []

        def worker(count: int) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", self.a.port, timeout=60)
            try:
                for _ in range(count):
                    conn.request("POST", "/v2/models/digits/infer", self.body, self.headers)
                    resp = conn.getresponse()
                    resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"answered {resp.status}")
            except BaseException as exc:  # noqa: BLE001  (reported by the main thread)
                errors.append(exc)
            finally:
                conn.close()

        threads = [threading.Thread(target=worker, args=(total // 8,)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _on_loop(self, fn: Any) -> None:
        done = threading.Event()

        def call() -> None:
            fn()
            done.set()

        assert self.loop is not None
        self.loop.call_soon_threadsafe(call)
        done.wait(30)

    def _client(self) -> None:
        try:
            while not self.server.started:
                time.sleep(0.1)
            print("server up; warming up with 800 requests", flush=True)
            self._burst(800)
            print(f"counting bytecodes over {self.a.requests} requests", flush=True)
            self._on_loop(lambda: sys.settrace(self._trace))
            self._burst(self.a.requests)
            self._on_loop(lambda: sys.settrace(None))
        except BaseException as exc:  # noqa: BLE001
            self.error = exc
        finally:
            self.server.should_exit = True


if __name__ == "__main__":
    sys.exit(main())
