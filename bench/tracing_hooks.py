"""What the tracing hooks cost with traces off, per request: the calls the request path makes, timed alone.

    .venv/bin/python -m bench.tracing_hooks [--number 1000000] [--rate REQ_PER_S] [--record PAGE]

With no OTEL_* variable (tracing off, as shipped), one REST request passes these hooks: the front door's
`tracing.ENABLED` test (serving/dataplane/http/consumers.py), a flag test before and after the route, the
reply (serving/dataplane/gateway/gateway.py) and the admission, the node's tests for its queue span and its
batch (serving/dataplane/node/node.py), and in distributed mode the stream's (transport/streams.py).
Prints microseconds per request (best of five timeit repeats) and, given `--rate` (a measured req/s of the
same server, e.g. bench.tracing_cost's off median), the share of one event-loop thread's time they take at
that rate: the hooks' cost as a fraction of throughput.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import timeit
from pathlib import Path

from bench import report
from bench.report import splice_section
from serving.dataplane import tracing

START, END = "<!-- tracinghooks:start -->", "<!-- tracinghooks:end -->"


def one_request() -> None:
    # consumers: the front door's choice of the traced path
    if tracing.ENABLED:
        raise AssertionError("tracing is on")
    for _ in range(3):  # the gateway's route and reply, the node's admission: `since` / `mark` pairs
        begun = tracing.since() if tracing.ENABLED else 0
        if begun:
            tracing.mark("ferry.step", begun)
    queue = tracing.start_child("ferry.queue") if tracing.ENABLED else None  # node.infer
    left = tracing.ENABLED  # node._run_live: the batch's spans
    carried = tracing.carrier() if tracing.ENABLED else None  # streams.py (distributed mode only)
    assert queue is None and not left and carried is None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tracing_hooks", description=__doc__.split("\n\n")[0])
    p.add_argument("--number", type=int, default=1_000_000)
    p.add_argument("--rate", type=float, help="req/s of the off server, to express the cost as a share")
    p.add_argument("--record", type=Path)
    a = p.parse_args(argv)
    tracing.shutdown()
    best = min(timeit.repeat(one_request, number=a.number, repeat=5)) / a.number
    empty = min(timeit.repeat(lambda: None, number=a.number, repeat=5)) / a.number
    per_request_us = (best - empty) * 1e6
    print(f"hooks per request, traces off: {per_request_us:.3f} us")
    share = per_request_us * 1e-6 * a.rate if a.rate else None
    if share is not None:
        print(f"at {a.rate:,.1f} req/s: {share:.4%} of one thread's time")
    if a.record:
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        commit = report.commit()
        command = report.command_line("bench.tracing_hooks", argv)
        rate_line = (
            f" At {a.rate:,.1f} req/s (the off server's median above) they take **{share:.3%}** of one event-loop"
            " thread's time, against the issue's bar of 2%. That is their share at this rate: it grows with the"
            " rate (the cost a request times the requests a second)."
            if share is not None
            else ""
        )
        text = "\n".join(
            [
                START,
                "## The hooks with traces off",
                "",
                f"`{command}` on {when}, commit `{commit}`: the calls one request makes into"
                f" `serving.dataplane.tracing` with traces off (ten flag tests: the front door's, two for each of the"
                f" route, reply and admission steps, the queue's, the batch's and the stream's), best of five"
                f" timeit repeats less an empty call: **{per_request_us:.3f} us"
                f" per request**.{rate_line}",
                "",
                END,
            ]
        )
        splice_section(a.record, START, END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
