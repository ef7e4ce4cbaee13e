"""What the sandboxed runtime process costs (serving.dataplane.node.runtime_process): the same open-loop load on
the same models with FERRY_RUNTIME_ISOLATION=process (the default) and =inline (unsafe: the contrast only).

    .venv/bin/python -m bench.runtime_cost [--duration 8] [--digits-rates 300,600,1200] [--wide-rates 40,80,160]

One data dir (embedded mode: SQLite, the demo models built once), then one server per isolation mode, each
offered the same rates on `digits` (fast: the channel's round trip is a visible share of a batch) and on
`digits-wide` (compute-bound: it is not). Prints one table, throughput (2xx/s) and p50/p99 per mode and rate,
and writes it as JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from bench import loadgen
from bench.run import digits_body, setup_data_dir
from bench.server import HEADERS, Server, free_port, say, use_key

MODES = ("inline", "process")
MODELS = ("digits", "digits-wide")


def parse_rates(value: str) -> list[float]:
    return [float(v) for v in value.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.runtime_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per rate (after 1 s warm-up)")
    parser.add_argument("--digits-rates", type=parse_rates, default=parse_rates("300,600,1200"))
    parser.add_argument("--wide-rates", type=parse_rates, default=parse_rates("40,80,160"))
    parser.add_argument("--threads", type=int, default=1, help="FERRY_TORCH_THREADS of the server")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--data-dir", type=Path, help="reuse a data dir an earlier run set up (skips the demo build)")
    args = parser.parse_args(argv)

    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="ferry-runtime-cost-"))
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(
        {
            "FERRY_DATA_DIR": str(data_dir),
            "PYTHONUNBUFFERED": "1",
            "FERRY_TORCH_THREADS": str(args.threads),
            # about the runtime's cost, not saturation: the front door must not shed what the node could serve
            "FERRY_LOOP_LAG_TARGET_MS": "60000",
            "FERRY_MAX_LOOP_LAG_MS": "60000",
            # inline is refused without it (config/settings.py); set for both modes, so they differ in isolation only
            "FERRY_DEBUG": "true",
        }
    )
    say(f"FERRY_DATA_DIR={data_dir}")
    if args.data_dir is None:
        setup_data_dir(env, None, demo=True)
    elif use_key(data_dir) is None:
        raise SystemExit(f"{data_dir} has no demo API key: set it up with a run without --data-dir")
    body = digits_body()
    rates = {"digits": args.digits_rates, "digits-wide": args.wide_rates}
    rows = []
    for mode in MODES:
        with Server({**env, "FERRY_RUNTIME_ISOLATION": mode}, free_port(), data_dir / f"server-{mode}.log") as server:
            server.wait_ready(MODELS)
            for model in MODELS:
                for rate in rates[model]:
                    result = loadgen.arun(
                        loadgen.run(
                            f"{server.base}/v2/models/{model}/infer",
                            body,
                            dict(HEADERS),
                            rate,
                            args.duration,
                            progress=False,
                        )
                    )
                    rows.append(
                        {
                            "mode": mode,
                            "model": model,
                            "offered": rate,
                            "achieved": result.achieved_rate,
                            "p50_ms": result.p50_ms,
                            "p99_ms": result.p99_ms,
                            "errors": result.errors,
                            "count": result.count,
                        }
                    )
                    say(
                        f"{mode:7} {model:11} offered {rate:7.0f}/s: {result.achieved_rate:7.1f}/s"
                        f" p50 {result.p50_ms:6.1f} ms p99 {result.p99_ms:7.1f} ms errors {result.errors}"
                    )
    print("\n| model | offered req/s | inline req/s | process req/s | inline p99 ms | process p99 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    by = {(r["mode"], r["model"], r["offered"]): r for r in rows}
    for model in MODELS:
        for rate in rates[model]:
            a, b = by[("inline", model, rate)], by[("process", model, rate)]
            print(
                f"| {model} | {rate:.0f} | {a['achieved']:.1f} | {b['achieved']:.1f} | {a['p99_ms']:.1f} |"
                f" {b['p99_ms']:.1f} |"
            )
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "duration": args.duration, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
