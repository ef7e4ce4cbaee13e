"""Model runtime: load an artifact onto a device and run batches under `torch.inference_mode()`.

The contract is fixed (LitServe's shape): load → assemble (pad and stack the requests) → predict
→ split per request. `assemble` and `split` are free functions, testable without a model.
Artifacts are TorchScript archives or `torch.export` programs; neither path unpickles
arbitrary Python objects.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from serving.dataplane.http.protocol import DATATYPES, TensorSpec, float_to_bf16
from serving.dataplane.node import operator_check


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


def load_module(
    source: Path | BinaryIO,
    fmt: str,
    device: torch.device,
    *,
    check_operators: bool = True,
    allowed_namespaces: Iterable[str] | None = None,
) -> torch.nn.Module:
    """Load an artifact after the same archive check as registration (serving.dataplane.node.archive_check),
    and refuse one that calls an operator the policy does not allow (serving.dataplane.node.operator_check).
    For TorchScript twice: its code is read as data first, and a denied operator's name anywhere in it
    refuses the archive before anything is compiled or run (archive_check.check_torchscript_code); then,
    once compiled, every operator its functions call is checked before any of its methods runs (by then its
    classes' `__setstate__` has run, code the first check read). `check_operators=False` leaves both out,
    for tests of the sandbox alone. `allowed_namespaces`: the platform admin's extra operator namespaces
    (FERRY_ALLOWED_OPERATOR_NAMESPACES; None reads this process's environment, as processes without Django
    settings do; the sandboxed runtime process is sent them instead).

    `source` is a path or an open binary file: the sandboxed runtime process is handed the artifact's
    verified bytes, never a path into the store."""
    from serving.dataplane.node.archive_check import ArchiveRefused

    try:
        if fmt == "torchscript":
            _check_archive(source, fmt, check_operators, allowed_namespaces)
            if not isinstance(source, Path):
                source.seek(0)
            module, operators = operator_check.load_torchscript(source, device)
            if check_operators:
                operator_check.check(operators, allowed_namespaces)
        elif fmt == "torch_export":
            with source.open("rb") if isinstance(source, Path) else contextlib.nullcontext(source) as f:
                _check_archive(f, fmt, check_operators, allowed_namespaces)  # one open file for the check and the load
                f.seek(0)
                program = _load_exported_program(f, check_operators, allowed_namespaces)
            # check_guards=False: the guard function is Python source built from the archive's
            # guards_code and exec'd; input shapes are still checked by the module's pre-hook.
            module = program.module(check_guards=False).to(device)
        else:
            raise RuntimeFailure(f"unknown artifact format {fmt!r}")
    except RuntimeFailure:
        raise
    except (ArchiveRefused, operator_check.OperatorRefused) as exc:
        raise RuntimeFailure(f"cannot load {fmt} artifact (refused): {exc.reason}") from None
    except Exception as exc:  # torch raises many types for a corrupt or mislabelled file
        raise RuntimeFailure(f"cannot load {fmt} artifact: {type(exc).__name__}: {exc}".strip()) from exc
    if hasattr(module, "eval") and fmt == "torchscript":
        module.eval()
    return module


def _check_archive(
    source: Path | BinaryIO, fmt: str, check_operators: bool = True, allowed_namespaces: Iterable[str] | None = None
) -> None:
    from serving.dataplane.node.archive_check import ArchiveRefused, check_archive

    kind = check_archive(source, check_operators=check_operators, allowed_namespaces=allowed_namespaces)
    if fmt == "torch_export" and kind != "torch_export":
        raise ArchiveRefused("not a torch.export (.pt2) archive")


def _load_exported_program(
    f: BinaryIO, check_operators: bool = True, allowed_namespaces: Iterable[str] | None = None
) -> torch.export.ExportedProgram:
    """`torch.export.load` without its pickle paths: this calls the pieces it uses for a .pt2 archive
    (torch/export/pt2_archive/_package.py, torch/_export/serde/serialize.py) and nothing else, so
    there is no retry as the legacy layout (torch.load, weights_only=False fallback), no AOTInductor
    library, and no sample inputs (read by torch with a weights_only=False fallback; the program does
    not need them). The archive is checked again through torch's own reader, so both see the same
    members; the check refuses pickled weights and constants, which the calls below would unpickle."""
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer, _bytes_to_dataclass
    from torch.export.pt2_archive._package import PT2ArchiveReader, _load_constants, _load_state_dict

    from serving.dataplane.node.archive_check import MODEL, PROGRAM, check_pt2_records

    reader = PT2ArchiveReader(f)
    check_pt2_records(
        reader.get_file_names(),
        reader.read_bytes,
        check_operators=check_operators,
        allowed_namespaces=allowed_namespaces,
    )
    serialized = _bytes_to_dataclass(schema.ExportedProgram, reader.read_bytes(PROGRAM))
    state_dict = _load_state_dict(reader, MODEL)
    constants = _load_constants(reader, MODEL)
    if not isinstance(state_dict, dict) or not isinstance(constants, dict):
        raise RuntimeFailure("torch.export archive holds legacy pickled weights or constants")
    return ExportedProgramDeserializer().deserialize(serialized, state_dict, constants, None)


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


def variable_lengths(request: dict[str, np.ndarray], specs: Sequence[TensorSpec]) -> tuple[int, ...]:
    """A request's sizes along the variable dims of the first input that has any (empty if none)."""
    for spec in specs:
        if spec.variable:
            array = request[spec.name]
            return tuple(array.shape[axis + 1] for axis, d in enumerate(spec.shape) if d == -1)
    return ()


def length_buckets(lengths: Sequence[tuple[int, ...]], rows: Sequence[int], min_fill: float = 0.5) -> list[list[int]]:
    """Group requests (by index) so that padding stays under half of each group's elements.

    One long request pads every row of its batch to its length; splitting the batch by length
    costs an extra device call per group, so a group is only split off when more than half of the
    padded batch would otherwise be zeros."""
    order = sorted(range(len(lengths)), key=lambda i: math.prod(lengths[i]))
    groups: list[list[int]] = []
    real = 0
    group_rows = 0
    for i in order:
        size = math.prod(lengths[i])
        if groups:
            padded = (group_rows + rows[i]) * size  # sorted ascending: this request is the group's longest
            if padded and (real + rows[i] * size) / padded >= min_fill:
                groups[-1].append(i)
                real += rows[i] * size
                group_rows += rows[i]
                continue
        groups.append([i])
        real, group_rows = rows[i] * size, rows[i]
    return groups


def trim_variable_outputs(
    results: list[dict[str, np.ndarray]], lengths: Sequence[tuple[int, ...]], specs: Sequence[TensorSpec]
) -> list[dict[str, np.ndarray]]:
    """Give each request its variable (-1) output dims at its own length, not its batch's padded one:
    the k-th variable dim of an output that came back at the batch's padded length of the k-th
    variable input dim is cut to the request's own length."""
    if not lengths or not lengths[0]:
        return results
    padded = tuple(max(dims) for dims in zip(*lengths, strict=True))
    for spec in specs:
        axes = [axis + 1 for axis, d in enumerate(spec.shape) if d == -1]
        if not axes:
            continue
        for result, own in zip(results, lengths, strict=True):
            array = result[spec.name]
            index: list[slice] = [slice(None)] * array.ndim
            for k, axis in enumerate(axes[: len(own)]):
                if array.shape[axis] == padded[k] and own[k] < padded[k]:
                    index[axis] = slice(0, own[k])
            result[spec.name] = array[tuple(index)]
    return results


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


def to_torch(array: np.ndarray, spec: TensorSpec) -> torch.Tensor:
    """`array` as the tensor `spec` declares, sharing its memory: a BF16 tensor arrives as its bits (numpy has
    no bfloat16: protocol.DATATYPES) and is viewed as torch.bfloat16."""
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if spec.datatype == "BF16" else tensor


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
        self._variable = any(spec.variable for spec in self.inputs)
        self.device = device
        self.module: torch.nn.Module | None = None
        self.memory_bytes = 0
        self.load_seconds = 0.0

    def load(self, source: BinaryIO | None = None, **options: Any) -> None:
        """Load from `path`, or from `source` (the sandboxed runtime process is sent the artifact's bytes);
        `options` go to load_module."""
        started = time.perf_counter()
        if self.device.type == "cuda":
            # The TorchScript loader allocates from C++, which leaves torch.cuda's Python-side state
            # uninitialised, and memory_allocated() then answers 0 for every load (seen on an H200: the
            # packing would take every GPU model for free). Initialised first, it counts what the load takes.
            torch.cuda.init()
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.module = load_module(self.path if source is None else source, self.fmt, self.device, **options)
        if self.device.type == "cuda":
            self.memory_bytes = torch.cuda.memory_allocated(self.device) - before
        else:
            tensors = list(self.module.parameters()) + list(self.module.buffers())
            self.memory_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.load_seconds = time.perf_counter() - started

    # The lifecycle the node drives (serving.dataplane.node.node); the sandboxed runtime (runtime_process) keeps a
    # process instead of a module.
    @property
    def loaded(self) -> bool:
        return self.module is not None

    def release(self) -> None:
        """Drop the loaded module."""
        self.module = None

    def to_host(self) -> None:
        """Move the weights to host memory (the warm tier on CUDA)."""
        if self.module is not None:
            self.module.to("cpu")

    def to_device(self) -> None:
        if self.module is not None:
            self.module.to(self.device)

    def predict(self, batch: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Run one assembled batch; outputs come back as host arrays, checked against the signature."""
        if self.module is None:
            raise RuntimeFailure("model is not loaded")
        with torch.inference_mode():
            tensors = [
                to_torch(_owned(a), spec).to(self.device, non_blocking=True)
                for a, spec in zip(batch, self.inputs, strict=True)
            ]
            try:
                raw = self.module(*tensors)
            except Exception as exc:
                raise RuntimeFailure(f"model raised {type(exc).__name__}: {exc}") from exc
            produced = self._as_list(raw)
            return [self._check(spec, t) for spec, t in zip(self.outputs, produced, strict=True)]

    def run(self, requests: Sequence[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        rows = [next(iter(r.values())).shape[0] for r in requests]
        if not self._variable:
            return split(self.predict(assemble(requests, self.inputs)), rows, self.output_names)
        lengths = [variable_lengths(r, self.inputs) for r in requests]
        results: list[dict[str, np.ndarray] | None] = [None] * len(requests)
        for group in length_buckets(lengths, rows):
            part = split(
                self.predict(assemble([requests[i] for i in group], self.inputs)),
                [rows[i] for i in group],
                self.output_names,
            )
            part = trim_variable_outputs(part, [lengths[i] for i in group], self.outputs)
            for i, result in zip(group, part, strict=True):
                results[i] = result
        return results  # type: ignore[return-value]

    def example_batch(self, rows: int, seed: int = 0) -> list[np.ndarray]:
        """Synthetic inputs of the declared signature (variable dims at length 8)."""
        rng = np.random.default_rng(seed)
        batch = []
        for spec in self.inputs:
            shape = (
                rows,
                *(min(8, m) if d == -1 else d for d, m in zip(spec.shape, spec.max_shape or spec.shape, strict=True)),
            )
            dtype = DATATYPES[spec.datatype]
            if spec.datatype == "BF16":
                batch.append(float_to_bf16(rng.random(shape, dtype=np.float32)))
            elif np.issubdtype(dtype, np.floating):
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
        if (tensor.dtype == torch.bfloat16) != (spec.datatype == "BF16"):
            produced = str(tensor.dtype).removeprefix("torch.")
            raise RuntimeFailure(f"output {spec.name!r} is {produced}, signature says {spec.datatype}")
        host = tensor.detach().cpu()
        # BF16 leaves as its bits, viewed on the host: numpy has no bfloat16 (protocol.DATATYPES)
        array = (host.view(torch.uint16) if spec.datatype == "BF16" else host).numpy()
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
