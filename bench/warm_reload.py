"""A reload from the warm tier (host memory) against a cold load (artifact on disk), on one node.

Two versions of the wide MLP (bench.models) take turns in a device budget that holds one; each load
evicts the other. With a warm budget that holds one, the evicted version waits in host memory and its next
load takes it from there; without, every load reads, parses and warms up the artifact again. Prints the
time of each `Node.load` (the eviction, the load, the warm-up) per mode.

    .venv/bin/python -m bench.warm_reload [--rounds 10] [--width 1024] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench.models import build_wide_mlp, save_torchscript
from serving.dataplane.gateway.snapshot import PlacementEntry, VersionEntry
from serving.dataplane.http.protocol import TensorSpec
from serving.dataplane.node.node import Node
from serving.policies.batching import BatchingConfig


def entry(name: str) -> VersionEntry:
    return VersionEntry(
        model=name,
        version=1,
        state="ready",
        loaded=True,
        artifact_sha256="0" * 64,
        format="torchscript",
        inputs=(TensorSpec("input", "FP32", (64,)),),
        outputs=(TensorSpec("scores", "FP32", (10,)),),
        batching=BatchingConfig(8, 0.002, 100),
        default_timeout_ms=1000,
        latency_profile={},
        placement=PlacementEntry(),
    )


async def run(path: Path, rounds: int, warm: bool, device: str) -> list[float]:
    node = Node(artifact_path=lambda sha: path, device=device)
    try:
        first = await node.load(entry("a"))
        assert first is not None
        size = first.runtime.memory_bytes
        node.memory_budget = int(size * 1.5)
        node.warm_budget = int(size * 1.5) if warm else 0
        times = []
        for i in range(rounds):
            name = "b" if i % 2 == 0 else "a"
            for hosted in node.hosted.values():
                hosted.last_used = 0.0
            started = time.perf_counter()
            loaded = await node.load(entry(name))
            times.append(time.perf_counter() - started)
            assert loaded is not None
        return times[1:]  # the first load of b is cold in both modes
    finally:
        await node.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--device", default="cpu")
    a = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_torchscript(build_wide_mlp(width=a.width), Path(tmp) / "mlp.pt")
        for warm in (False, True):
            times = asyncio.run(run(path, a.rounds, warm, a.device))
            label = "warm tier" if warm else "cold (no warm tier)"
            print(
                f"{label:22} loads {len(times)}: median {statistics.median(times) * 1000:.1f} ms,"
                f" max {max(times) * 1000:.1f} ms"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
