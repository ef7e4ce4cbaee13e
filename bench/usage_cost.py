"""What usage metering costs on the inference path: `UsageRecorder.record` per answer, and a drain.

    .venv/bin/python -m bench.usage_cost [--number 1000000]

Prints microseconds per call (best of five timeit repeats): recording into an existing cell (the common
case: one tenant, model and version answering many requests in a minute), recording over 1,000 distinct
cells, and a drain of 1,000 cells (the flusher's step on the event loop, every FERRY_USAGE_FLUSH_SECONDS).
"""

from __future__ import annotations

import argparse
import timeit

from usage.recorder import UsageRecorder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.usage_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--number", type=int, default=1_000_000)
    a = p.parse_args(argv)
    rec = UsageRecorder(lambda: 1_800_000_000.0)
    hot = min(timeit.repeat(lambda: rec.record(1, "digits", 1, 200, 4, 0.0012, 0.0034), number=a.number, repeat=5))
    print(f"record, one cell:      {hot / a.number * 1e6:.3f} us")
    rec.drain()
    tenants = iter(range(10**9))
    spread = min(
        timeit.repeat(
            lambda: rec.record(next(tenants) % 1000, "digits", 1, 200, 4, 0.0012, 0.0034), number=a.number, repeat=5
        )
    )
    print(f"record, 1000 cells:    {spread / a.number * 1e6:.3f} us")
    rec.drain()

    def fill() -> None:
        for t in range(1000):
            rec.record(t, "digits", 1, 200, 4, 0.0012, 0.0034)

    drain = min(timeit.repeat(rec.drain, setup=fill, number=1, repeat=50))
    print(f"drain of 1000 cells:   {drain * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
