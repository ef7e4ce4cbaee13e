"""Demo models, trained at set-up from data that ships with scikit-learn or is generated here.

- `digits`: the demo classifier, an MLP wide enough to be compute-bound (3 x 1536: about 2 ms a
  batch-1 call on one core here), TorchScript.
  Input `input` FP32 [64]: the 8x8 image's pixel values, 0 to 16. Output `scores` FP32 [10].
- `digits-small`: the same signature at 64 hidden units, a `torch.export` program; the fallback of
  `digits` and of `digits-wide`.
- `digits-wide`: the same signature again, a wide convolutional net (384 channels, 3 x 3 convolutions
  over the 8x8 image): heavy enough per row that one web process serves a few hundred requests a
  second, so overload can be shown with the generator on the same machine. TorchScript.
- `token-sentiment`: variable-length INT64 token ids (0 pads) → FP32 [2] scores, TorchScript.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

SEED = 0


class Digits(nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        dims = [64] + [hidden] * layers
        blocks: list[nn.Module] = []
        for a, b in zip(dims, dims[1:], strict=False):
            blocks += [nn.Linear(a, b), nn.ReLU()]
        self.body = nn.Sequential(*blocks, nn.Linear(dims[-1], 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x / 16.0)  # clients send raw pixel values 0..16


class WideDigits(nn.Module):
    """Convolutions over the 8x8 image at `channels` wide, then one linear layer over every position.
    Compute per row grows with channels squared while the weights stay small (4M at 384 channels)."""

    def __init__(self, channels: int, layers: int) -> None:
        super().__init__()
        blocks: list[nn.Module] = [nn.Conv2d(1, channels, 3, padding=1), nn.ReLU()]
        for _ in range(layers - 1):
            blocks += [nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU()]
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(channels * 64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.body((x / 16.0).reshape(-1, 1, 8, 8))  # clients send raw pixel values 0..16
        return self.head(features.flatten(1))


class TokenSentiment(nn.Module):
    """Mean of token embeddings, padding (id 0) masked out, so a padded batch answers as unpadded rows."""

    def __init__(self, vocab: int = 64, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.head = nn.Linear(dim, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = (tokens != 0).unsqueeze(-1).to(torch.float32)
        summed = (self.embed(tokens) * mask).sum(dim=1)
        return self.head(summed / mask.sum(dim=1).clamp(min=1.0))


@dataclass
class DemoModel:
    name: str
    description: str
    fmt: str
    inputs: list[dict]
    outputs: list[dict]
    batching: dict
    build: Callable[[Callable[[str], None], float], tuple[nn.Module, float]]  # (say, epoch scale)
    example: torch.Tensor


def digits_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.data.astype(np.float32)
    y = digits.target.astype(np.int64)
    return train_test_split(x, y, test_size=0.2, random_state=SEED, stratify=y)


def _train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    lr: float,
    say: Callable[[str], None],
    seed: int = SEED,
) -> None:
    torch.manual_seed(seed)
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for epoch in range(epochs):
        order = torch.randperm(len(x))
        for start in range(0, len(x), 64):
            idx = order[start : start + 64]
            optimiser.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            optimiser.step()
        if (epoch + 1) % max(1, epochs // 5) == 0:
            say(f"  epoch {epoch + 1}/{epochs} loss {loss.item():.4f}")
    model.eval()


def _scaled(epochs: int, scale: float) -> int:
    return max(1, round(epochs * scale))


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.inference_mode():
        return float((model(x).argmax(dim=1) == y).float().mean())


def build_digits(
    hidden: int, layers: int, epochs: int, seed: int = SEED
) -> Callable[[Callable[[str], None], float], tuple[nn.Module, float]]:
    """The MLP trained from `seed` (its initial weights and the order of its batches; the held-out split
    stays SEED's, so accuracies compare)."""

    def build(say: Callable[[str], None], epoch_scale: float = 1.0) -> tuple[nn.Module, float]:
        torch.manual_seed(seed)
        x_train, x_test, y_train, y_test = digits_data()
        model = Digits(hidden, layers)
        x, y = torch.from_numpy(x_train), torch.from_numpy(y_train)
        _train(model, x, y, _scaled(epochs, epoch_scale), 1e-3, say, seed)
        return model, _accuracy(model, torch.from_numpy(x_test), torch.from_numpy(y_test))

    build.recipe = f"digits hidden={hidden} layers={layers} epochs={epochs} seed={seed}"  # type: ignore[attr-defined]
    return build


def build_wide_digits(
    channels: int, layers: int, epochs: float
) -> Callable[[Callable[[str], None], float], tuple[nn.Module, float]]:
    """Trained in steps of 32 under a one-cycle learning rate: the few epochs a slow model can afford
    at set-up still reach a useful accuracy. `epoch_scale` may cut it below one epoch (tests)."""

    def build(say: Callable[[str], None], epoch_scale: float = 1.0) -> tuple[nn.Module, float]:
        torch.manual_seed(SEED)
        x_train, x_test, y_train, y_test = digits_data()
        x, y = torch.from_numpy(x_train), torch.from_numpy(y_train)
        model = WideDigits(channels, layers)
        batch = 32
        per_epoch = -(-len(x) // batch)
        total = max(1, round(epochs * epoch_scale * per_epoch))
        optimiser = torch.optim.Adam(model.parameters(), lr=2e-3)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=2e-3, total_steps=total)
        loss_fn = nn.CrossEntropyLoss()
        model.train()
        step = 0
        while step < total:
            order = torch.randperm(len(x))
            for start in range(0, len(x), batch):
                idx = order[start : start + batch]
                optimiser.zero_grad()
                loss = loss_fn(model(x[idx]), y[idx])
                loss.backward()
                optimiser.step()
                schedule.step()
                step += 1
                if step % per_epoch == 0 or step == total:
                    say(f"  step {step}/{total} (epoch {step / per_epoch:.1f}) loss {loss.item():.4f}")
                if step == total:
                    break
        model.eval()
        return model, _accuracy(model, torch.from_numpy(x_test), torch.from_numpy(y_test))

    build.recipe = f"wide-digits channels={channels} layers={layers} epochs={epochs}"  # type: ignore[attr-defined]
    return build


def sentiment_data(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Token ids 1..63 in rows of 4..24 tokens (0 pads); ids 1-8 are positive, 9-16 negative, the rest
    neutral; the label is whether positives outnumber negatives (ties dropped)."""
    rows, labels = [], []
    while len(rows) < n:
        length = int(rng.integers(4, 25))
        tokens = rng.integers(1, 64, length)
        pos, neg = int(((tokens >= 1) & (tokens <= 8)).sum()), int(((tokens >= 9) & (tokens <= 16)).sum())
        if pos == neg:
            continue
        padded = np.zeros(24, dtype=np.int64)
        padded[:length] = tokens
        rows.append(padded)
        labels.append(int(pos > neg))
    return np.stack(rows), np.array(labels, dtype=np.int64)


def build_sentiment(say: Callable[[str], None], epoch_scale: float = 1.0) -> tuple[nn.Module, float]:
    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    x_train, y_train = sentiment_data(6000, rng)
    x_test, y_test = sentiment_data(1000, rng)
    model = TokenSentiment()
    _train(model, torch.from_numpy(x_train), torch.from_numpy(y_train), _scaled(15, epoch_scale), 1e-2, say)
    return model, _accuracy(model, torch.from_numpy(x_test), torch.from_numpy(y_test))


build_sentiment.recipe = "token-sentiment"  # type: ignore[attr-defined]

DIGITS_IO = {
    "inputs": [{"name": "input", "datatype": "FP32", "shape": [64]}],
    "outputs": [{"name": "scores", "datatype": "FP32", "shape": [10]}],
}

DEMO_MODELS = [
    DemoModel(
        "digits-small",
        "Handwritten digits (scikit-learn's 8x8 set), 64 hidden units; fallback of digits.",
        "torch_export",
        **DIGITS_IO,
        batching={"max_batch_size": 64, "max_queue_delay_ms": 2.0, "max_queue_size": 2048},
        build=build_digits(64, 1, 40),
        example=torch.zeros(2, 64),
    ),
    DemoModel(
        "digits",
        "Handwritten digits (scikit-learn's 8x8 set), 3 x 1536 MLP: the demo classifier.",
        "torchscript",
        **DIGITS_IO,
        batching={
            "max_batch_size": 32,
            "max_queue_delay_ms": 5.0,
            "max_queue_size": 2048,
            "preferred_batch_sizes": [8, 16, 32],
        },
        build=build_digits(1536, 3, 12),
        example=torch.zeros(2, 64),
    ),
    DemoModel(
        "digits-wide",
        "Handwritten digits (scikit-learn's 8x8 set), a 384-channel convnet: compute-bound,"
        " a few hundred requests/s per process; falls back to digits-small.",
        "torchscript",
        **DIGITS_IO,
        batching={
            "max_batch_size": 32,
            "max_queue_delay_ms": 5.0,
            "max_queue_size": 1024,
            "preferred_batch_sizes": [8, 16, 32],
        },
        build=build_wide_digits(384, 3, 3),
        example=torch.zeros(2, 64),
    ),
    DemoModel(
        "token-sentiment",
        "Variable-length token ids (0 pads): do ids 1-8 outnumber ids 9-16?",
        "torchscript",
        inputs=[{"name": "tokens", "datatype": "INT64", "shape": [-1]}],
        outputs=[{"name": "scores", "datatype": "FP32", "shape": [2]}],
        batching={"max_batch_size": 32, "max_queue_delay_ms": 5.0, "max_queue_size": 1024},
        build=build_sentiment,
        example=torch.ones(2, 8, dtype=torch.int64),
    ),
]


FALLBACKS = {"digits": "digits-small", "digits-wide": "digits-small"}


def save_artifact(model: nn.Module, fmt: str, example: torch.Tensor, path: Path) -> None:
    if fmt == "torchscript":
        torch.jit.save(torch.jit.script(model), str(path))
        return
    batch = torch.export.Dim("batch", min=1, max=4096)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))


# Trained demo models kept on disk, so a second `make run` (or the demo's browser test, which runs `make run` in a
# fresh data directory) registers the same artifact instead of training it again: minutes on a shared 2-core
# machine. An entry is keyed by everything the training reads (cache_key): this file's code, the recipe, the epoch
# scale, the format and the library versions; training is seeded, so a hit holds what training would produce. A
# fresh clone has no cache (var/ is not in git) and trains. FERRY_DEMO_MODEL_CACHE names another directory
# ("off": none).
CACHE_ENV = "FERRY_DEMO_MODEL_CACHE"
CACHE_ENTRIES = 16  # the newest entries kept; older ones (other code, other recipes) are removed


def demo_cache_dir() -> Path | None:
    given = os.environ.get(CACHE_ENV, "").strip()
    if given.lower() == "off":
        return None
    return Path(given) if given else Path(__file__).resolve().parent.parent / "var" / "demo-model-cache"


def cache_key(demo: DemoModel, build: Callable, epoch_scale: float) -> str | None:
    """What the artifact depends on, hashed; None for a build without a recipe (nothing to key it by)."""
    recipe = getattr(build, "recipe", None)
    if recipe is None:
        return None
    import sklearn

    parts = {
        "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "recipe": recipe,
        "epoch_scale": repr(float(epoch_scale)),
        "format": demo.fmt,
        "example": [list(demo.example.shape), str(demo.example.dtype)],
        "versions": [torch.__version__, np.__version__, sklearn.__version__],
        "threads": torch.get_num_threads(),  # the order of floating-point sums in the kernels
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _cached(cache: Path, key: str) -> tuple[Path, dict] | None:
    entry = cache / key
    try:
        meta = json.loads((entry / "entry.json").read_text())
        artifact = entry / meta["file"]
        if not artifact.is_file() or not isinstance(meta.get("sha256"), str):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    os.utime(entry)  # recently used: kept by the pruning below
    return artifact, meta


def _keep(cache: Path, key: str, artifact: Path, accuracy: float) -> None:
    """Add an entry atomically (a directory renamed into place), then keep only the newest CACHE_ENTRIES."""
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".new-", dir=cache))
    try:
        shutil.copyfile(artifact, staging / artifact.name)
        sha = hashlib.sha256((staging / artifact.name).read_bytes()).hexdigest()
        meta = {"file": artifact.name, "sha256": sha, "accuracy": accuracy}
        (staging / "entry.json").write_text(json.dumps(meta))
        try:
            staging.rename(cache / key)
        except OSError:  # another process kept the same entry first
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    entries = sorted((p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")), key=_mtime)
    for old in entries[:-CACHE_ENTRIES]:
        shutil.rmtree(old, ignore_errors=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def train_and_register(
    demo: DemoModel,
    build: Callable[[Callable[[str], None], float], tuple[nn.Module, float]],
    say: Callable[[str], None],
    epoch_scale: float = 1.0,
    metrics: dict | None = None,
    cache: Path | None = None,
) -> object:
    """Train with `build`, save the artifact in the demo's format and register it as the next version of
    `demo.name`, validated before this returns; the registered ModelVersion. With `cache`, an artifact trained
    earlier by the same code and recipe is registered instead of training again; its sha256 is checked as the
    registry checks every upload's, and an entry that fails the check is removed and the model trained."""
    from serving.actions import register_version
    from serving.errors import RegistrationError

    started = time.perf_counter()

    def register(path: Path, accuracy: float, sha256: str | None) -> object:
        with path.open("rb") as f:
            return register_version(
                model_name=demo.name,
                artifact_file=f,
                fmt=demo.fmt,
                inputs=demo.inputs,
                outputs=demo.outputs,
                sha256=sha256,
                description=demo.description,
                task="classification",
                metrics={"accuracy": round(accuracy, 4), **(metrics or {})},
                validate="sync",
                **demo.batching,
            )

    key = cache_key(demo, build, epoch_scale) if cache is not None else None
    version = None
    hit = _cached(cache, key) if cache is not None and key is not None else None
    if hit is not None:
        path, meta = hit
        say(f"{demo.name}: trained earlier by this code and recipe, from {path.parent}")
        say(f"{demo.name}: held-out accuracy {float(meta['accuracy']):.4f}")
        try:
            version = register(path, float(meta["accuracy"]), meta["sha256"])
        except RegistrationError as exc:
            if hashlib.sha256(path.read_bytes()).hexdigest() == meta["sha256"]:
                raise  # refused for what it is (a quota, a name), not for the cache's copy: training would be too
            say(f"{demo.name}: the cached artifact is refused ({exc}); removing it and training")
            shutil.rmtree(path.parent, ignore_errors=True)
    if version is None:
        say(f"{demo.name}: training")
        module, accuracy = build(say, epoch_scale)
        say(f"{demo.name}: held-out accuracy {accuracy:.4f}")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / ("model.pt2" if demo.fmt == "torch_export" else "model.pt")
            save_artifact(module, demo.fmt, demo.example, path)
            version = register(path, accuracy, None)
            if cache is not None and key is not None:
                try:
                    _keep(cache, key, path, accuracy)
                except OSError as exc:  # a cache that cannot be written costs the next run its training, no more
                    say(f"{demo.name}: not kept in {cache}: {exc}")
    say(
        f"{demo.name}: version {version.version} {version.state} {version.failure_reason} "  # type: ignore[attr-defined]
        f"({time.perf_counter() - started:.1f}s)"
    )
    return version


def build_all(
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    only_missing: bool = True,
    epoch_scale: float = 1.0,
    cache: Path | None = None,
) -> list[str]:
    """Train, save and register each demo model; skip those already ready unless told otherwise.
    `epoch_scale` < 1 trains briefly: the same models and code path, at lower accuracy (tests). `cache`:
    reuse artifacts trained earlier (train_and_register)."""
    from serving.models import Model, ModelVersion, State

    built = []
    for demo in DEMO_MODELS:
        if only_missing and ModelVersion.objects.filter(model__name=demo.name, state=State.READY).exists():
            say(f"{demo.name}: already built, skipping")
            continue
        train_and_register(demo, demo.build, say, epoch_scale, cache=cache)
        built.append(demo.name)
    for name, fallback in FALLBACKS.items():
        model = Model.objects.filter(name=name).first()
        small = Model.objects.filter(name=fallback).first()
        if model and small and model.fallback_id != small.pk:
            model.fallback = small
            model.save(update_fields=["fallback", "updated_at"])
    return built


def give_to_tenant(tenant: object) -> list[str]:
    """Make the demo models `tenant`'s public models (those still without a tenant); returns their names."""
    from serving.models import Model, Visibility

    given = []
    for model in Model.objects.filter(name__in=[d.name for d in DEMO_MODELS], tenant__isnull=True):
        model.tenant = tenant
        model.visibility = Visibility.PUBLIC
        model.save(update_fields=["tenant", "visibility", "updated_at"])
        given.append(model.name)
    return given
