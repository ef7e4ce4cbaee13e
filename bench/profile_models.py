"""Latency profiles measured on this machine's accelerator, in the file format the simulator reads (`sim.profiles`).

    python -m bench.profile_models OUT.json [--quick] [--max-batch 32]

Three models, built here with random weights (no download; the compute does not depend on the weights):
- `wide-mlp`: the benchmarks' compute-bound demo model, 64 -> 4096 x 4 -> 10 (`bench.models.build_wide_mlp`);
- `resnet50`: a standard vision model, ResNet-50 (v1.5: the stride on the 3x3 convolution) on 224 x 224 images;
- `bert-base`: a standard text model, a BERT-base-shaped encoder (12 layers, width 768, 12 heads, 3,072 wide
  feed-forward) over 128 tokens, from `torch.nn.TransformerEncoder` (the embedding lookup is left out).
On CUDA in FP16, on the CPU in FP32. Each batch size (powers of two up to --max-batch) is timed with
`bench.raw.time_batch` (warm-up, then calls synchronised with the device), and the profile is the mean call.
`bench/gpu_check.sh` runs it; a scenario reads the file with `measured: {file: ..., model: ...}`.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from datetime import UTC, datetime

import torch
from torch import nn

from bench.models import build_wide_mlp
from bench.raw import configure_threads, device, time_batch
from sim import profiles


class Bottleneck(nn.Module):
    def __init__(self, inp: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(inp, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, out, 1, bias=False),
            nn.BatchNorm2d(out),
        )
        self.skip = (
            nn.Identity()
            if stride == 1 and inp == out
            else nn.Sequential(nn.Conv2d(inp, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def build_resnet50(classes: int = 1000) -> nn.Module:
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    ]
    inp = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(inp, width, stride if i == 0 else 1))
            inp = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inp, classes)]
    return nn.Sequential(*layers)


def build_bert_base(layers: int = 12, width: int = 768) -> nn.Module:
    block = nn.TransformerEncoderLayer(width, 12, 4 * width, batch_first=True, activation="gelu")
    return nn.TransformerEncoder(block, layers, enable_nested_tensor=False)


MODELS = {
    "wide-mlp": (lambda: build_wide_mlp(), (64,), "the 64 -> 4096 x 4 -> 10 wide MLP (bench.models)"),
    "resnet50": (build_resnet50, (3, 224, 224), "ResNet-50 v1.5, 224 x 224, random weights"),
    "bert-base": (build_bert_base, (128, 768), "BERT-base-shaped encoder, 128 tokens, random weights"),
}
# --quick (a CPU dry run of the script, not numbers): the same code on small shapes.
QUICK = {
    "wide-mlp": (lambda: build_wide_mlp(width=256), (64,), "wide MLP at width 256 (quick)"),
    "resnet50": (build_resnet50, (3, 32, 32), "ResNet-50 v1.5 on 32 x 32 (quick)"),
    "bert-base": (lambda: build_bert_base(layers=1, width=96), (16, 96), "1-layer encoder, width 96 (quick)"),
}


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_models", description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="batches up to 4, short timings: a smoke test, not numbers")
    p.add_argument("--only", nargs="*", choices=sorted(MODELS))
    args = p.parse_args(argv)

    dev = device()
    configure_threads()
    half = dev.type == "cuda"
    top = 4 if args.quick else args.max_batch
    sizes = [1 << k for k in range(top.bit_length()) if 1 << k <= top]
    if sizes[-1] != top:
        sizes.append(top)
    seconds, warmup = (0.05, 0.02) if args.quick else (1.5, 0.5)
    name = torch.cuda.get_device_name(dev) if half else "cpu"
    doc = {
        "command": "python -m bench.profile_models " + " ".join(argv if argv is not None else sys.argv[1:]),
        "when": f"{datetime.now(UTC):%Y-%m-%d %H:%M UTC}",
        "commit": _commit(),
        "device": name + (" (FP16)" if half else " (FP32)") + (", quick: not numbers to publish" if args.quick else ""),
        "accelerator": re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"),
        "models": {},
    }
    gen = torch.Generator().manual_seed(0)
    for key in args.only or MODELS:
        build, shape, what = (QUICK if args.quick else MODELS)[key]
        torch.manual_seed(0)
        model = build().eval().to(dev)
        if half:
            model = model.half()
        points = {}
        for b in sizes:
            x = torch.rand((b, *shape), generator=gen).to(dev)
            x = x.half() if half else x
            row = time_batch(model, x, seconds, warmup)
            points[str(b)] = round(row.mean_ms_per_call, 4)
            print(f"[profile] {key} batch {b}: {row.mean_ms_per_call:.3f} ms ({row.calls} calls)", file=sys.stderr)
        memory = sum(t.numel() * t.element_size() for t in model.parameters())
        doc["models"][key] = {"max_batch_size": top, "profile_ms": points, "memory_bytes": memory, "what": what}
        del model
        if half:
            torch.cuda.empty_cache()
    profiles.write(args.out, doc)
    print(f"[profile] wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
