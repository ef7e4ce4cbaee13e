"""Latency profiles measured on this machine's accelerator, in the file format the simulator reads (`sim.profiles`).

    python -m bench.profile_models OUT.json [--quick] [--max-batch 32]

Three models, built here with random weights (no download; the compute does not depend on the weights):
- `wide-mlp`: the benchmarks' compute-bound demo model, 64 -> 4096 x 4 -> 10 (`bench.models.build_wide_mlp`);
- `resnet50`: a standard vision model, ResNet-50 (v1.5: the stride on the 3x3 convolution) on 224 x 224 images;
- `bert-base`: a standard text model, a BERT-base-shaped encoder (12 layers, width 768, 12 heads, 3,072 wide
  feed-forward) over 128 tokens, from `torch.nn.TransformerEncoder` (the embedding lookup is left out).
On CUDA in FP16, on the CPU in FP32. Each batch size (powers of two up to --max-batch) is timed with
`bench.raw.time_batch` (warm-up, then calls synchronised with the device) in three passes over all the sizes,
after a warm-up of the largest; a size's point is the median of its passes' mean calls.
`bench/gpu_check.sh` runs it; a scenario reads the file with `measured: {file: ..., model: ...}`.

It also times a cold start the way a node loads a version (`cold_start`): each model, and two larger MLPs of
filler weights (about 1 and 4 GB on the device), saved as a TorchScript artifact, written to disk and dropped
from the page cache, then `serving.dataplane.node.runtime.ModelRuntime.load` (the archive check, the operator
check, the load onto the device) and the first batch, synchronised. A line through those points gives the
seconds a load costs and the seconds per GB. Not in it: fetching the artifact from the store and starting the
sandboxed runtime process.

Then the same artifacts as a node loads a replica (`cold_start.isolated`): `IsolatedRuntime.load`, a runtime
process forked from the node's warm zygote, confined by the sandbox, CUDA started in it, the artifact's
bytes sent, checked and loaded onto the device. The zygote's own start (torch's import, once a node) is
timed apart, on a first load before the points. Where it ran, a scenario's fleet reads this line
(`sim.profiles.cold_start`); the first batch is not in it (the points above time it in-process).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from time import perf_counter

import django
import torch
from torch import nn

from bench.models import build_wide_mlp
from bench.raw import configure_threads, device, time_batch
from serving.dataplane.node.runtime import ModelRuntime
from serving.dataplane.node.runtime_process import IsolatedRuntime
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


ROUNDS = 3  # passes over the batch sizes; each size's profile point is the median of its passes


def build_filler_mlp(width: int, layers: int) -> nn.Module:
    """`layers` Linear(width, width) of filler weights, made without a random initialisation (seconds for
    billions of weights): what its load costs does not depend on the values."""
    blocks: list[nn.Module] = []
    for _ in range(layers):
        linear = nn.utils.skip_init(nn.Linear, width, width)
        with torch.no_grad():
            linear.weight.fill_(1.0 / width)
            linear.bias.zero_()
        blocks += [linear, nn.ReLU()]
    return nn.Sequential(*blocks)


# The larger cold-start points: about 1 GB and 4 GB of FP16 weights (2 and 8 layers of 16,384 x 16,384).
FILLERS = {"mlp-1gb": (16384, 2), "mlp-4gb": (16384, 8)}
QUICK_FILLERS = {"mlp-filler": (512, 2)}


def time_cold_start(key: str, model: nn.Module, example: torch.Tensor, dev: torch.device, scratch: Path) -> dict:
    """Save `model` as a TorchScript artifact (left in `scratch`), drop it from the page cache, and time Ferry's
    load of it onto `dev` in this process plus the first batch (synchronised)."""
    path = save_artifact(key, model, example, scratch)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    runtime = ModelRuntime(path, "torchscript", [], [], dev)
    started = perf_counter()
    runtime.load()
    loaded = perf_counter()
    assert runtime.module is not None
    with torch.inference_mode():
        runtime.module(example)
    sync()
    done = perf_counter()
    size = path.stat().st_size
    del runtime
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    print(
        f"[profile] cold start {key}: {size / 1e9:.3f} GB, load {loaded - started:.3f} s, "
        f"first batch {done - loaded:.3f} s",
        file=sys.stderr,
    )
    return {
        "model": key,
        "bytes": size,
        "load_s": round(loaded - started, 4),
        "first_batch_s": round(done - loaded, 4),
        "seconds": round(done - started, 4),
    }


def save_artifact(key: str, model: nn.Module, example: torch.Tensor, scratch: Path) -> Path:
    """`model` as a TorchScript artifact on disk, dropped from the page cache: its next read is the disk's."""
    path = scratch / f"{key}.pt"
    with torch.inference_mode(False), torch.no_grad():
        torch.jit.save(torch.jit.trace(model, example, check_trace=False), str(path))
    drop_cached(path)
    return path


def drop_cached(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def time_isolated_load(key: str, path: Path, dev: torch.device) -> dict:
    """Time a node's load of the artifact at `path` (dropped from the page cache first): `IsolatedRuntime.load`,
    a fresh sandboxed runtime process with CUDA started in it. The runtime process is stopped after."""
    drop_cached(path)
    runtime = IsolatedRuntime(path, "torchscript", [], [], dev)
    started = perf_counter()
    runtime.load()
    seconds = perf_counter() - started
    runtime.close()
    size = path.stat().st_size
    print(f"[profile] isolated load {key}: {size / 1e9:.3f} GB, {seconds:.3f} s", file=sys.stderr)
    return {"model": key, "bytes": size, "seconds": round(seconds, 4)}


def fit_cold_start(points: list[dict]) -> dict[str, float]:
    """Least squares of seconds against GB: the fixed cost of a load and its cost per GB (never below 0)."""
    xs = [p["bytes"] / 1e9 for p in points]
    ys = [p["seconds"] for p in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    per_gb = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread) if spread else 0.0
    return {"seconds": round(max(0.0, mean_y - per_gb * mean_x), 4), "per_gb": round(per_gb, 4)}


def isolated_loads(artifacts: list[Path], dev: torch.device) -> dict:
    """`time_isolated_load` of each artifact, after a first load that starts the zygote (timed apart)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    django.setup()  # the runtime process's settings: its timeouts, and what its sandbox hides
    first = time_isolated_load("zygote start + " + artifacts[0].stem, artifacts[0], dev)
    points = [time_isolated_load(path.stem, path, dev) for path in artifacts]
    return {
        "points": points,
        "fit": fit_cold_start(points),
        "first_load_s": first["seconds"],
        "what": "IsolatedRuntime.load, as a node loads a replica: a runtime process forked from the warm zygote, "
        "confined by the sandbox, CUDA started in it, the artifact (read from disk, not the page cache) sent, "
        "checked and loaded onto the device; not its first batch, the fetch from the store, or the zygote's own "
        "start (first_load_s: the first load, which started it)",
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
    p.add_argument("--no-cold-start", action="store_true", help="the latency profiles only")
    p.add_argument("--scratch", help="where the cold start's artifacts are written (default: the temp folder)")
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
    scratch = Path(tempfile.mkdtemp(prefix="ferry-cold-start-", dir=args.scratch))
    starts: list[dict] = []
    for key in args.only or MODELS:
        build, shape, what = (QUICK if args.quick else MODELS)[key]
        torch.manual_seed(0)
        model = build().eval().to(dev)
        if half:
            model = model.half()
        inputs = {}
        for b in sizes:
            x = torch.rand((b, *shape), generator=gen).to(dev)
            inputs[b] = x.half() if half else x
        # Clocks first: the largest batch for a while, so that no size is timed while the device's clocks rise.
        time_batch(model, inputs[sizes[-1]], warmup * 4, warmup)
        # Then ROUNDS passes over every size, each a short timing, and each size's median of its rounds: a
        # size timed in one go reads whatever the clocks did then (the first H200 run, which timed each size
        # once in order, had BERT-base's batch 8 faster than its batch 1).
        rounds: dict[int, list[float]] = {b: [] for b in sizes}
        for _ in range(ROUNDS):
            for b in sizes:
                rounds[b].append(time_batch(model, inputs[b], seconds / ROUNDS, warmup / ROUNDS).mean_ms_per_call)
        points = {}
        for b in sizes:
            points[str(b)] = round(statistics.median(rounds[b]), 4)
            spread = ", ".join(f"{ms:.3f}" for ms in rounds[b])
            print(f"[profile] {key} batch {b}: {points[str(b)]:.3f} ms (rounds: {spread})", file=sys.stderr)
        x = inputs[sizes[-1]]
        memory = sum(t.numel() * t.element_size() for t in model.parameters())
        doc["models"][key] = {"max_batch_size": top, "profile_ms": points, "memory_bytes": memory, "what": what}
        if not args.no_cold_start:
            starts.append(time_cold_start(key, model, x[:1], dev, scratch))
        del model
        if half:
            torch.cuda.empty_cache()
    if not args.no_cold_start:
        for key, (width, layers) in (QUICK_FILLERS if args.quick else FILLERS).items():
            model = build_filler_mlp(width, layers).eval()
            model = (model.half() if half else model).to(dev)
            example = torch.rand((1, width), generator=gen).to(dev)
            starts.append(time_cold_start(key, model, example.half() if half else example, dev, scratch))
            del model
        doc["cold_start"] = {
            "points": starts,
            "fit": fit_cold_start(starts),
            "what": "ModelRuntime.load (archive check, operator check, TorchScript onto the device) of an artifact "
            "read from disk, not the page cache, and its first batch; not the fetch from the store or the "
            "runtime process's start",
        }
        artifacts = [scratch / f"{point['model']}.pt" for point in starts]
        try:
            doc["cold_start"]["isolated"] = isolated_loads(artifacts, dev)
        except Exception as exc:  # a measurement this run could not take: the file says why, the rest stands
            print(f"[profile] isolated loads failed: {exc!r}", file=sys.stderr)
            doc["cold_start"]["isolated_error"] = repr(exc)
        for path in artifacts:
            path.unlink()
    scratch.rmdir()
    profiles.write(args.out, doc)
    print(f"[profile] wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
