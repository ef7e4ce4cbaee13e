"""Main-thread CPU per inference request through the ASGI app, in process, with no HTTP and no load generator.

    cd <a checkout> && /path/to/.venv/bin/python -m bench.asgi_cost --data-dir DIR [--requests 3000]

DIR holds a built registry (`manage.py migrate` and `build_demo_models` with FERRY_DATA_DIR=DIR). Run it
from two checkouts (`git worktree add`) over the same DIR to compare what each revision's ASGI path costs,
without the noise of a load generator sharing the cores: it starts the data plane, then drives
`config.asgi.application` with `digits` requests, 32 at a time, and prints `time.thread_time()` per request
for each round. The front door's uvicorn protocol is not in this path. The shed gate and the front-end
thresholds are set out of the way, and the request carries an API key when the data dir has one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.asgi_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--requests", type=int, default=3000, help="per round")
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args(argv)
    sys.path.insert(0, os.getcwd())  # this checkout's code, not the installed one's
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ["FERRY_DATA_DIR"] = str(a.data_dir)
    for name in ("FERRY_LOOP_LAG_TARGET_MS", "FERRY_MAX_LOOP_LAG_MS", "FERRY_MAX_FRONTEND_WAIT_MS"):
        os.environ[name] = "100000"
    import django

    django.setup()
    import uvloop
    from sklearn.datasets import load_digits

    row = load_digits().data[0].astype("float32").tolist()
    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": row}]}).encode()
    key_file = a.data_dir / "demo-api-key"
    auth = [(b"authorization", b"Bearer " + key_file.read_text().strip().encode())] if key_file.exists() else []
    uvloop.run(_rounds(body, auth, a.requests, a.rounds))
    return 0


async def _rounds(body: bytes, auth: list[tuple[bytes, bytes]], n: int, rounds: int) -> None:
    from config.asgi import application
    from serving import wiring

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *auth]

    async def one() -> None:
        scope = {"type": "http", "method": "POST", "path": "/v2/models/digits/infer", "raw_path": b"",
                 "query_string": b"", "headers": headers, "ferry.first_byte": time.monotonic(),
                 "ferry.gone": lambda: False}  # fmt: skip
        sent: list[dict] = []
        done = asyncio.Event()
        first = True

        async def receive() -> dict:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        await application(scope, receive, send)
        done.set()
        if sent[0]["status"] != 200:
            raise RuntimeError(f"answered {sent[0]['status']}: {sent[1].get('body', b'')[:200]!r}")

    await wiring.start()
    try:
        for r in range(rounds):
            gate = asyncio.Semaphore(32)

            async def guarded(gate: asyncio.Semaphore = gate) -> None:
                async with gate:
                    await one()

            cpu, wall = time.thread_time(), time.perf_counter()
            await asyncio.gather(*(guarded() for _ in range(n)))
            print(f"round {r}: {(time.thread_time() - cpu) / n * 1e6:.1f} µs main-thread CPU per request,"
                  f" {(time.perf_counter() - wall) / n * 1e6:.1f} µs wall", flush=True)  # fmt: skip
    finally:
        await wiring.stop()


if __name__ == "__main__":
    sys.exit(main())
