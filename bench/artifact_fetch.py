"""What fetching an artifact from the control plane costs a node: `manage.py serve` (embedded mode, its
own data dir) serving a random blob of --mib MiB from its artifact store at /internal/artifacts/<sha256>,
and a node's `ArtifactCache` fetching it over HTTP on this machine's loopback.

Reports, over --rounds fetches (each into an empty cache): seconds and MiB/s of a cold fetch (stream,
hash, write, rename), of a cache hit (the hash check before every load), and the web process's peak RSS
before and after (the endpoint streams in 1 MiB chunks; it must not hold the artifact in memory).

    python -m bench.artifact_fetch [--mib 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench.server import ROOT, Server, free_port, http_get, manage, say

TOKEN = "bench-node-token"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from serving.dataplane.node.artifact_cache import ArtifactCache, http_source

    work = Path(tempfile.mkdtemp(prefix="ferry-artifact-fetch-"))
    try:
        store = work / "data" / "artifacts"
        blob = os.urandom(args.mib * 1024 * 1024)
        sha = hashlib.sha256(blob).hexdigest()
        (store / sha[:2]).mkdir(parents=True)
        (store / sha[:2] / sha).write_bytes(blob)
        del blob
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        env.update(FERRY_DATA_DIR=str(work / "data"), FERRY_NODE_TOKEN=TOKEN, FERRY_TORCH_THREADS="1")
        manage(["migrate", "--noinput", "-v", "0"], env)
        port = free_port()
        with Server(env, port, work / "web.log", cwd=ROOT) as server:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if http_get(f"{server.base}/v2/health/live")[0] == 200:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(server.log_tail())
                time.sleep(0.5)
            before = server.rss_kib()
            source = http_source(server.base, TOKEN, max_bytes=2 * args.mib * 1024 * 1024)
            cold, hit = [], []
            for i in range(args.rounds):
                cache = ArtifactCache(
                    work / f"cache-{i}",
                    4 * args.mib * 1024 * 1024,
                    source,
                    max_artifact_bytes=2 * args.mib * 1024 * 1024,
                    timeout_s=600,
                )
                started = time.perf_counter()
                cache.path(sha)
                cold.append(time.perf_counter() - started)
                started = time.perf_counter()
                cache.path(sha)
                hit.append(time.perf_counter() - started)
                shutil.rmtree(work / f"cache-{i}")
            after = server.rss_kib()
        med = sorted(cold)[len(cold) // 2]
        med_hit = sorted(hit)[len(hit) // 2]
        say(f"{args.mib} MiB artifact, {args.rounds} rounds, load average {os.getloadavg()[0]:.1f}")
        print(f"cold fetch: median {med:.2f} s ({args.mib / med:.0f} MiB/s); all {[round(c, 2) for c in cold]}")
        print(f"cache hit (hash check): median {med_hit:.2f} s ({args.mib / med_hit:.0f} MiB/s)")
        print(
            f"web peak RSS: {before.get('VmHWM', 0) / 1024:.0f} MiB before, {after.get('VmHWM', 0) / 1024:.0f} MiB"
            f" after"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
