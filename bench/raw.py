"""Raw model throughput with no server: a tight loop under inference_mode at several batch sizes.

    python -m bench.raw [MODEL.pt] [--shape 64] [--batch-sizes 1,2,4,8,16,32] [--seconds 2]

Honours FERRY_TORCH_THREADS exactly as the server does, so raw and served numbers share a thread count,
and FERRY_DEVICE as the server does ("" picks cuda when present, else cpu); on CUDA each call is timed
to its completion (synchronised).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from time import perf_counter

import torch
from torch import nn

BATCH_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass
class RawRow:
    batch_size: int
    calls: int
    ms_per_call: float  # median
    rows_per_s: float  # batch_size / median call time
    mean_ms_per_call: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def configure_threads() -> int:
    """Apply FERRY_TORCH_THREADS with the server's own rule (unset or 0: cores - 1)."""
    from serving.dataplane.node.runtime import configure_torch_threads

    return configure_torch_threads(int(os.environ.get("FERRY_TORCH_THREADS", "").strip() or 0))


def device() -> torch.device:
    """The server's rule: FERRY_DEVICE, or cuda when present, else cpu."""
    from serving.dataplane.node.runtime import pick_device

    return pick_device(os.environ.get("FERRY_DEVICE", "").strip())


def load_model(model: nn.Module | str | Path, dev: torch.device | None = None) -> nn.Module:
    dev = dev or device()
    if isinstance(model, nn.Module):
        return model.to(dev).eval()
    from serving.dataplane.node.runtime import (
        load_module,  # the server's own loader, so raw and served run the same module
    )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return load_module(Path(model), "torchscript", dev)


def time_batch(model: nn.Module, x: torch.Tensor, seconds: float, warmup_s: float) -> RawRow:
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        t_end = perf_counter() + warmup_s
        warm: list[float] = []
        while len(warm) < 3 or perf_counter() < t_end:
            t = perf_counter()
            model(x)
            sync()
            warm.append(perf_counter() - t)
        n = max(5, min(int(seconds / statistics.median(warm)), 100_000))
        times = []
        for _ in range(n):
            t = perf_counter()
            model(x)
            sync()
            times.append(perf_counter() - t)
    med = statistics.median(times)
    return RawRow(x.shape[0], n, med * 1000.0, x.shape[0] / med, statistics.fmean(times) * 1000.0)


def measure(
    model: nn.Module | str | Path,
    input_shape: Sequence[int],
    batch_sizes: Sequence[int] = BATCH_SIZES,
    *,
    seconds: float = 2.0,
    warmup_s: float = 0.3,
    progress: bool = True,
) -> list[RawRow]:
    dev = device()
    module = load_model(model, dev)
    threads = configure_threads()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batch_sizes:
        x = (torch.rand((b, *input_shape), generator=gen) * 16.0).to(dev)
        row = time_batch(module, x, seconds, warmup_s)
        rows.append(row)
        if progress:
            print(
                f"[raw] batch {b:3d}: {row.ms_per_call:8.2f} ms/call  {row.rows_per_s:10.1f} rows/s  "
                f"({row.calls} calls, {dev}, {threads} threads)",
                file=sys.stderr,
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.raw", description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="TorchScript file; default: the 4096x4 wide MLP, built in memory")
    p.add_argument("--shape", default="64", help="input shape without the batch dimension, e.g. 64 or 3,32,32")
    p.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    p.add_argument("--seconds", type=float, default=2.0)
    a = p.parse_args(argv)
    if a.model:
        model: nn.Module | str = a.model
    else:
        from bench.models import build_wide_mlp

        model = build_wide_mlp()
    rows = measure(
        model,
        [int(s) for s in a.shape.split(",")],
        [int(s) for s in a.batch_sizes.split(",")],
        seconds=a.seconds,
    )
    print(json.dumps([r.to_dict() for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
