"""The compute-bound benchmark model: a wide MLP whose cost is dominated by its 4096x4096 matmuls."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from torch import nn


def build_wide_mlp(
    width: int = 4096, layers: int = 4, in_features: int = 64, out_features: int = 10, seed: int = 0
) -> nn.Module:
    """`layers` hidden Linear(width)+ReLU blocks between a 64-wide input and a 10-wide output; eval mode."""
    print(
        f"[models] building wide MLP {in_features}->{width}x{layers}->{out_features} (seed {seed})",
        file=sys.stderr,
        flush=True,
    )
    with torch.random.fork_rng(devices=[]):  # seeded without disturbing the caller's RNG
        torch.manual_seed(seed)
        blocks: list[nn.Module] = [nn.Linear(in_features, width), nn.ReLU()]
        for _ in range(layers - 1):
            blocks += [nn.Linear(width, width), nn.ReLU()]
        blocks.append(nn.Linear(width, out_features))
        module = nn.Sequential(*blocks)
    n_params = sum(p.numel() for p in module.parameters())
    print(
        f"[models] {n_params / 1e6:.1f}M parameters ({n_params * 4 / 2**20:.0f} MiB FP32)",
        file=sys.stderr,
        flush=True,
    )
    return module.eval()


def save_torchscript(module: nn.Module, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is the format the server loads
        scripted = torch.jit.script(module.eval())
        torch.jit.save(scripted, str(path))
    print(
        f"[models] saved TorchScript to {path} ({path.stat().st_size / 2**20:.0f} MiB)",
        file=sys.stderr,
        flush=True,
    )
    return path
