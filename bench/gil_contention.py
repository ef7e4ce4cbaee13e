"""How much a busy Python thread slows a model's forward pass in the same process (the GIL).

    python -m bench.gil_contention [--seconds 2] [--layers 600]

A node runs its event loop (stream reads, decoding, replies, heartbeats) and its device thread in one
process. A TorchScript forward of many small ops takes the GIL between ops, so a loop thread that keeps
the GIL busy stretches every forward even with a free core. This measures the forward alone and beside a
thread that runs Python flat out (the worst case; a real loop is busy part of the time), same process,
one torch thread, the model of tests/test_autoscale_processes.py.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch


class Chain(torch.nn.Module):
    """`layers` matrix-vector products with tanh: many small ops, as a small model at batch one does."""

    def __init__(self, width: int = 512, layers: int = 600) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.inp = torch.nn.Parameter(torch.randn(64, width, generator=g) / 8, requires_grad=False)
        self.hidden = torch.nn.Parameter(torch.randn(width, width, generator=g) / width**0.5, requires_grad=False)
        self.out = torch.nn.Parameter(torch.randn(width, 10, generator=g) / width**0.5, requires_grad=False)
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.inp
        for _ in range(self.layers):
            h = torch.tanh(h @ self.hidden)
        return h @ self.out


def per_forward(model: torch.jit.ScriptModule, x: torch.Tensor, seconds: float) -> float:
    started, n = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        model(x)
        n += 1
    return (time.perf_counter() - started) / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gil_contention", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--layers", type=int, default=600)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model = torch.jit.script(Chain(layers=args.layers).eval())
    x = torch.zeros(1, 64)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(1000))

    with torch.inference_mode():
        for _ in range(5):
            model(x)
        print(f"[gil] forward alone for {args.seconds:g} s ...", flush=True)
        alone = per_forward(model, x, args.seconds)
        print(f"[gil] forward beside a busy Python thread for {args.seconds:g} s ...", flush=True)
        thread = threading.Thread(target=busy, daemon=True)
        thread.start()
        try:
            shared = per_forward(model, x, args.seconds)
        finally:
            stop.set()
            thread.join()
    print(
        f"forward alone {alone * 1000:.1f} ms, beside a busy Python thread {shared * 1000:.1f} ms:"
        f" {shared / alone:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
