"""Latency profiles Ferry measured, in the file format the simulator reads.

`bench/profile_models.py` (run by `bench/gpu_check.sh` on a machine with an accelerator) writes one JSON file:

    {"command": "...", "when": "2026-12-01 12:00 UTC", "commit": "abc1234", "device": "NVIDIA H200",
     "accelerator": "h200",
     "models": {"resnet50": {"max_batch_size": 32, "memory_bytes": 102760448,
                             "profile_ms": {"1": 1.9, "2": 2.1, ...}, "what": "torchvision resnet50, fp16"}}}

A scenario's family names it with `measured: {file: PATH, model: NAME}` instead of `profile_ms` (see
`sim.scenario`): the points are the file's, and the family's source says what measured them and when. A fleet's
node type names it with `measured_cold_start: PATH` instead of `cold_start` and `cold_start_per_gb`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("command", "when", "commit", "device", "accelerator", "models")


def validate(doc: dict[str, Any]) -> None:
    """Raise ValueError when `doc` is not a profile file the simulator can read."""
    missing = [k for k in KEYS if k not in doc]
    if missing:
        raise ValueError(f"profile file lacks {', '.join(missing)}")
    for name, model in doc["models"].items():
        points = model.get("profile_ms") or {}
        if not points:
            raise ValueError(f"model {name} has no profile_ms")
        if int(model.get("max_batch_size", 0)) not in {int(b) for b in points}:
            raise ValueError(f"model {name}'s profile lacks its max_batch_size")
        if any(float(ms) <= 0 for ms in points.values()):
            raise ValueError(f"model {name} has a batch that took no time")


def read(path: str | Path, model: str) -> tuple[dict[int, float], dict[str, str]]:
    """One model's measured (batch -> ms) points from a profile file, and its source as a scenario cites it."""
    path = Path(path)
    if not path.is_absolute():
        path = ROOT / path
    doc = json.loads(path.read_text())
    validate(doc)
    if model not in doc["models"]:
        raise ValueError(f"{path.name} has no model {model!r}; it has {', '.join(sorted(doc['models']))}")
    entry = doc["models"][model]
    points = {int(b): float(ms) for b, ms in entry["profile_ms"].items()}
    source = {
        "kind": "measured",
        "command": str(doc["command"]),
        "when": f"{doc['when']} (commit {doc['commit']})",
        "model": str(entry.get("what", model)),
        "device": str(doc["device"]),
        "table": ", ".join(f"{b}: {ms:.3g} ms" for b, ms in sorted(points.items())),
        "derived": "the mean compute per batch as measured, used as it is",
    }
    return points, source


def cold_start(path: str | Path) -> tuple[float, float, str]:
    """The cold start a profile file measured (`bench.profile_models`' `cold_start`): the seconds a load costs,
    the seconds per GB on top, and its source as a fleet cites it. A node's whole load of a replica (its
    `isolated` line: the sandboxed runtime process, CUDA's start in it) where the file has one, else the load
    in-process."""
    path = Path(path)
    if not path.is_absolute():
        path = ROOT / path
    doc = json.loads(path.read_text())
    validate(doc)
    measured = doc.get("cold_start")
    if not measured or not measured.get("points"):
        raise ValueError(f"{path.name} has no cold_start")
    if measured.get("isolated", {}).get("points"):
        measured = measured["isolated"]
    fit = measured["fit"]
    points = ", ".join(f"{p['model']} {p['bytes'] / 1e9:.2f} GB {p['seconds']:.2f} s" for p in measured["points"])
    source = (
        f"cold start measured: `{doc['command']}`, {doc['when']} (commit {doc['commit']}), {doc['device']}: "
        f"{measured['what']}; points {points}; least squares {fit['seconds']:.2f} s + {fit['per_gb']:.3f} s/GB"
    )
    return float(fit["seconds"]), float(fit["per_gb"]), source


def write(path: str | Path, doc: dict[str, Any]) -> None:
    validate(doc)
    Path(path).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
