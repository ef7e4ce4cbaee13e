"""Model runtime: load an artifact onto a device and run batches under `torch.inference_mode()`.

The contract is fixed (LitServe's shape): load → assemble (pad and stack the requests) → predict
→ split per request. `assemble` and `split` are free functions, testable without a model.
Artifacts are TorchScript archives or `torch.export` programs; neither path unpickles
arbitrary Python objects.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from serving.protocol import DATATYPES, TensorSpec


class RuntimeFailure(Exception):
    """The model could not be loaded or did not answer as its signature says."""


def configure_torch_threads(requested: int) -> int:
    """Intra-op threads for CPU inference; 0 means cores - 1, leaving a core to the event loop."""
    threads = requested or max(1, (os.cpu_count() or 1) - 1)
    torch.set_num_threads(threads)
    return threads


def pick_device(preferred: str = "") -> torch.device:
    if preferred:
        return torch.device(preferred)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_module(path: Path, fmt: str, device: torch.device) -> torch.nn.Module:
    try:
        if fmt == "torchscript":
            module = torch.jit.load(str(path), map_location=device)
        elif fmt == "torch_export":
            with path.open("rb") as f:  # a buffer: torch.export only takes paths ending in .pt2
                program = torch.export.load(f)
            module = program.module().to(device)
        else:
            raise RuntimeFailure(f"unknown artifact format {fmt!r}")
    except RuntimeFailure:
        raise
    except Exception as exc:  # torch raises many types for a corrupt or mislabelled file
        raise RuntimeFailure(f"cannot load {fmt} artifact: {type(exc).__name__}: {exc}".strip()) from exc
    if hasattr(module, "eval") and fmt == "torchscript":
        module.eval()
    return module


def assemble(requests: Sequence[dict[str, np.ndarray]], specs: Sequence[TensorSpec]) -> list[np.ndarray]:
    """Stack each input across requests along the batch dimension, zero-padding variable dims."""
    batch: list[np.ndarray] = []
    for spec in specs:
        parts = [r[spec.name] for r in requests]
        if -1 in spec.shape:
            target = tuple(max(p.shape[d] for p in parts) for d in range(1, parts[0].ndim))
            parts = [_pad(p, target) for p in parts]
        batch.append(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0))
    return batch


def _pad(array: np.ndarray, target: tuple[int, ...]) -> np.ndarray:
    if array.shape[1:] == target:
        return array
    widths = [(0, 0)] + [(0, t - s) for s, t in zip(array.shape[1:], target, strict=True)]
    return np.pad(array, widths)


def _owned(array: np.ndarray) -> np.ndarray:
    """A contiguous, writable array: a lone request's binary input is a read-only view of the HTTP body,
    and a model that writes to its input in place must not write there."""
    if array.flags.c_contiguous and array.flags.writeable:
        return array
    return np.array(array, order="C")


def split(outputs: Sequence[np.ndarray], rows: Sequence[int], names: Sequence[str]) -> list[dict[str, np.ndarray]]:
    total = sum(rows)
    for name, out in zip(names, outputs, strict=True):
        if out.shape[0] != total:
            raise RuntimeFailure(f"output {name!r} has {out.shape[0]} rows for a batch of {total}")
    results: list[dict[str, np.ndarray]] = []
    start = 0
    for n in rows:
        results.append({name: out[start : start + n] for name, out in zip(names, outputs, strict=True)})
        start += n
    return results


class ModelRuntime:
    """One model version loaded on one device."""

    def __init__(
        self, path: Path, fmt: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], device: torch.device
    ) -> None:
        self.path = path
        self.fmt = fmt
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.output_names = [o.name for o in self.outputs]
        self.device = device
        self.module: torch.nn.Module | None = None
        self.memory_bytes = 0
        self.load_seconds = 0.0

    def load(self) -> None:
        started = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.module = load_module(self.path, self.fmt, self.device)
        if self.device.type == "cuda":
            self.memory_bytes = torch.cuda.memory_allocated(self.device) - before
        else:
            tensors = list(self.module.parameters()) + list(self.module.buffers())
            self.memory_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.load_seconds = time.perf_counter() - started

    def predict(self, batch: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Run one assembled batch; outputs come back as host arrays, checked against the signature."""
        if self.module is None:
            raise RuntimeFailure("model is not loaded")
        with torch.inference_mode():
            tensors = [torch.from_numpy(_owned(a)).to(self.device, non_blocking=True) for a in batch]
            try:
                raw = self.module(*tensors)
            except Exception as exc:
                raise RuntimeFailure(f"model raised {type(exc).__name__}: {exc}") from exc
            produced = self._as_list(raw)
            return [self._check(spec, t) for spec, t in zip(self.outputs, produced, strict=True)]

    def run(self, requests: Sequence[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        rows = [next(iter(r.values())).shape[0] for r in requests]
        outputs = self.predict(assemble(requests, self.inputs))
        return split(outputs, rows, self.output_names)

    def example_batch(self, rows: int, seed: int = 0) -> list[np.ndarray]:
        """Synthetic inputs of the declared signature (variable dims at length 8)."""
        rng = np.random.default_rng(seed)
        batch = []
        for spec in self.inputs:
            shape = (rows, *(8 if d == -1 else d for d in spec.shape))
            dtype = DATATYPES[spec.datatype]
            if np.issubdtype(dtype, np.floating):
                batch.append(rng.random(shape, dtype=np.float32).astype(dtype))
            elif dtype == np.bool_:
                batch.append(rng.integers(0, 2, shape).astype(np.bool_))
            else:
                batch.append(rng.integers(0, 2, shape).astype(dtype))
        return batch

    def profile(self, sizes: Sequence[int], repeats: int = 5) -> dict[int, float]:
        """Median seconds per call at each batch size, after a warm-up call."""
        profile: dict[int, float] = {}
        for size in sizes:
            batch = self.example_batch(size)
            self.predict(batch)
            samples = []
            for _ in range(repeats):
                started = time.perf_counter()
                self.predict(batch)
                samples.append(time.perf_counter() - started)
            profile[size] = float(np.median(samples))
        return profile

    def _as_list(self, raw: object) -> list[torch.Tensor]:
        if isinstance(raw, torch.Tensor):
            produced = [raw]
        elif isinstance(raw, list | tuple):
            produced = list(raw)
        elif isinstance(raw, dict):
            missing = [n for n in self.output_names if n not in raw]
            if missing:
                raise RuntimeFailure(f"model output lacks {missing}")
            produced = [raw[n] for n in self.output_names]
        else:
            raise RuntimeFailure(f"model returned {type(raw).__name__}, not tensors")
        if len(produced) != len(self.outputs):
            raise RuntimeFailure(f"model returned {len(produced)} outputs, signature declares {len(self.outputs)}")
        return produced

    def _check(self, spec: TensorSpec, tensor: object) -> np.ndarray:
        if not isinstance(tensor, torch.Tensor):
            raise RuntimeFailure(f"output {spec.name!r} is {type(tensor).__name__}, not a tensor")
        array = tensor.detach().cpu().numpy()
        expected = DATATYPES[spec.datatype]
        if array.dtype != expected:
            raise RuntimeFailure(f"output {spec.name!r} is {array.dtype}, signature says {spec.datatype}")
        if array.ndim != len(spec.shape) + 1 or any(
            d != -1 and d != s for d, s in zip(spec.shape, array.shape[1:], strict=False)
        ):
            raise RuntimeFailure(
                f"output {spec.name!r} has shape {list(array.shape)}, signature says {[-1, *spec.shape]}"
            )
        return array
