"""The usage recorder, its latency sketch and its flusher: plain Python on a fake clock."""

from __future__ import annotations

import random

import pytest

from usage import sketch
from usage.flusher import UNMETERED, UsageFlusher
from usage.recorder import Drained, UsageRecorder


class FakeClock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_sketch_percentiles_stay_within_the_bucket_width() -> None:
    # given 10,000 latencies spread over four decades
    rng = random.Random(7)
    values = sorted(10 ** rng.uniform(-3.5, 0.5) for _ in range(10_000))
    built: sketch.Sketch = {}
    for v in values:
        b = sketch.bucket_of(v)
        built[b] = built.get(b, 0) + 1
    # then each percentile is within the bucket's half width (about 4.5%) of the exact one
    for q in (0.5, 0.95, 0.99):
        exact = values[int(q * len(values)) - 1]
        assert sketch.quantile(built, q) == pytest.approx(exact, rel=0.05)


def test_sketches_merge_by_adding_buckets_and_survive_json_keys() -> None:
    # given two processes' sketches, one of them read back from JSON (string keys)
    a = {sketch.bucket_of(0.001): 3, sketch.bucket_of(0.1): 1}
    b = sketch.to_json({sketch.bucket_of(0.001): 1, sketch.bucket_of(1.0): 4})
    # when merged / then the counts add and the percentiles are those of the union
    total = sketch.merged([a, b])
    assert sum(total.values()) == 9
    assert total[sketch.bucket_of(0.001)] == 4
    assert sketch.quantile(total, 0.5) == pytest.approx(0.1, rel=0.05)
    assert sketch.quantile(total, 1.0) == pytest.approx(1.0, rel=0.05)
    assert sketch.quantile({}, 0.99) is None


def test_sketch_ends_clamp_out_of_range_latencies() -> None:
    assert sketch.bucket_of(0.0) == 0
    assert sketch.bucket_of(-1.0) == 0
    assert sketch.bucket_of(10_000.0) == sketch.TOP_INDEX
    with pytest.raises(ValueError):
        sketch.quantile({1: 1}, 0)


def test_recorder_counts_per_tenant_model_version_and_minute() -> None:
    # given a recorder on a fake clock at the start of a minute
    clock = FakeClock(60 * 30_000_000)
    rec = UsageRecorder(clock)
    # when tenant 1 gets two answers and an error in one minute, tenant 2 one answer, and the clock
    # moves into the next minute for one more answer of tenant 1
    rec.record(1, "digits", 1, 200, 4, 0.002, 0.010)
    rec.record(1, "digits", 1, 200, 1, 0.001, 0.020)
    rec.record(1, "digits", 1, 429, 0, 0.0, 0.0001)
    rec.record(1, "digits", 1, 504, 0, 0.0, 1.0)
    rec.record(2, "digits", 1, 200, 2, 0.003, 0.010)
    clock.now += 60
    rec.record(1, "digits", 1, 200, 8, 0.004, 0.030)
    drained = rec.drain()
    # then there is one row per key, with its counts and its latency sketch
    rows = {(r["tenant"], r["minute"]): r for r in drained.rows()}
    assert set(rows) == {(1, 30_000_000), (2, 30_000_000), (1, 30_000_001)}
    first = rows[(1, 30_000_000)]
    assert (first["requests"], first["errors_4xx"], first["errors_5xx"], first["items"]) == (4, 1, 1, 5)
    assert first["compute_seconds"] == pytest.approx(0.003)
    assert sum(first["latency"].values()) == 4
    assert all(isinstance(k, str) for k in first["latency"])  # JSON-ready
    assert drained.overflowed == 0
    # and draining starts afresh
    assert rec.drain().rows() == [] and len(rec) == 0


def test_recorder_is_bounded_and_counts_what_it_left_out() -> None:
    # given room for two cells
    rec = UsageRecorder(FakeClock(), max_keys=2)
    # when a third key arrives, twice / then it is not metered but counted; known keys still count
    rec.record(1, "a", 1, 200, 1, 0.0, 0.01)
    rec.record(1, "b", 1, 200, 1, 0.0, 0.01)
    rec.record(1, "c", 1, 200, 1, 0.0, 0.01)
    rec.record(1, "c", 1, 200, 1, 0.0, 0.01)
    rec.record(1, "a", 1, 200, 1, 0.0, 0.01)
    drained = rec.drain()
    assert len(drained.rows()) == 2 and drained.overflowed == 2
    assert sum(r["requests"] for r in drained.rows()) == 3
    with pytest.raises(ValueError):
        UsageRecorder(max_keys=0)


async def test_flusher_resends_a_failed_batch_under_the_same_id() -> None:
    # given a flusher whose first send fails
    rec = UsageRecorder(FakeClock())
    sent: list[tuple[str, list[dict]]] = []
    failures = [RuntimeError("broker down")]

    async def send(batch_id: str, drained: Drained) -> None:
        if failures:
            raise failures.pop()
        sent.append((batch_id, drained.rows()))

    flusher = UsageFlusher(rec, send)
    rec.record(1, "digits", 1, 200, 1, 0.0, 0.01)
    # when it flushes / then the failure surfaces and the batch waits
    with pytest.raises(RuntimeError):
        await flusher.flush()
    assert len(flusher.pending) == 1
    waiting_id = flusher.pending[0][0]
    # when more is counted and it flushes again / then the old batch goes first, same id, then the new one
    rec.record(1, "digits", 1, 200, 1, 0.0, 0.01)
    assert await flusher.flush() == 2
    assert [b for b, _ in sent][0] == waiting_id and sent[0][0] != sent[1][0]
    assert not flusher.pending
    # and with nothing counted a flush sends nothing
    assert await flusher.flush() == 0


async def test_flusher_outbox_is_bounded_and_counts_what_it_dropped() -> None:
    rec = UsageRecorder(FakeClock())

    async def send(batch_id: str, drained: Drained) -> None:
        raise RuntimeError("down")

    flusher = UsageFlusher(rec, send, max_pending=2)
    before = UNMETERED.labels("outbox_full")._value.get()
    for _ in range(3):
        rec.record(1, "digits", 1, 200, 1, 0.0, 0.01)
        rec.record(1, "digits", 1, 500, 0, 0.0, 0.01)
        flusher.drain()
    assert len(flusher.pending) == 2
    assert UNMETERED.labels("outbox_full")._value.get() - before == 2
