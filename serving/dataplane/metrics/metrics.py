"""Prometheus metrics of the data plane, and a short in-memory window for the console's live view."""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from serving.dataplane.metrics import process_set
from serving.dataplane.metrics.fastmetrics import CounterChild, CounterFamily, HistogramChild, HistogramFamily
from serving.dataplane.metrics.history import KINDS, HourHistory, Minute
from usage import sketch

# 0.15, 0.25 and 0.3 around the platform's 300 ms budget, so a quantile near it falls between close bounds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.5, 1.0, 2.5, 5.0)
# The status_class label of ferry_request_seconds: a status's hundreds (three values, so three children a version).
STATUS_CLASSES = {2: "2xx", 4: "4xx", 5: "5xx"}
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# Written per request or per batch: the cheap families (serving.dataplane.metrics.fastmetrics).
REQUESTS = CounterFamily("ferry_requests", "Inference requests answered", ["model", "version", "status"])
QUEUE_WAIT = HistogramFamily(
    "ferry_queue_wait_seconds", "Time from arrival to batch start", ["model", "version"], buckets=LATENCY_BUCKETS
)
COMPUTE = HistogramFamily(
    "ferry_compute_seconds", "Model compute time per batch", ["model", "version"], buckets=LATENCY_BUCKETS
)
TOTAL = HistogramFamily(
    "ferry_request_seconds",
    "Time from arrival to answer, every answer: status_class 2xx (served), 4xx, 5xx (refusals, timeouts, failures)",
    ["model", "version", "status_class"],
    buckets=LATENCY_BUCKETS,
)
BATCH_SIZE = HistogramFamily("ferry_batch_size", "Rows per batch run", ["model", "version"], buckets=BATCH_BUCKETS)
QUEUE_DEPTH = Gauge("ferry_queue_depth", "Requests waiting", ["model", "version"])
DEVICE_BUSY = Counter("ferry_device_busy_seconds", "Seconds the device spent computing", ["device"])
FALLBACKS = Counter(
    "ferry_fallbacks", "Requests a saturated version passed to its fallback model", ["model", "version", "fallback"]
)
INTERNAL_ERRORS = Counter("ferry_internal_errors", "Unexpected exceptions answered 500 (bugs to fix)", ["component"])
SHED = Counter(
    "ferry_shed",
    "Requests refused to protect the latency of admitted ones (503)",
    ["model", "version", "reason", "tier"],
)
# The model label of a refusal whose URL names no model or pipeline the snapshot knows: a fixed one, so that names
# made up by clients (before authentication, at the front door) add no children (`DataPlane.count_saturation_shed`).
UNROUTED = ""
UNROUTED_FRONTEND_SHED = SHED.labels(UNROUTED, "", "frontend", "0")
# Distributed mode (serving.dataplane.transport.streams): what the gateway refused itself before a stream, and
# where each 504 was found.
GATEWAY_REFUSALS = Counter(
    "ferry_gateway_refusals",
    "Requests a gateway refused before its version's stream (then answered by the fallback, or 503 and in"
    " ferry_shed), by reason:"
    " deadline/tier (admission on the nodes' published load), node_lost (no live node consumes the stream),"
    " queue_full (this gateway's or the stream's bound)",
    ["model", "version", "reason"],
)
DEADLINES = Counter(
    "ferry_deadline_exceeded",
    "504s in distributed mode, by origin: gateway (its timer ran out waiting for the node), node (the node"
    " answered 504: expired in the stream, queued or loading), unsent (passed before the request was sent),"
    " send (passed while Redis took the request: a slow Redis)",
    ["model", "version", "origin"],
)
POISON = Counter(
    "ferry_poison_requests", "Requests the model failed on, found by bisecting their batch (422)", ["model", "version"]
)
ABANDONED = Counter(
    "ferry_abandoned", "Queued requests dropped unrun because their caller went away", ["model", "version"]
)
LOOP_LAG = Gauge("ferry_event_loop_lag_seconds", "How late this process's event loop runs its timers (smoothed)")
QUOTA_REFUSALS = Counter("ferry_quota_refusals", "Requests refused by their tenant's quota (429)", ["tenant", "reason"])
QUOTA_FALLBACKS = Counter(
    "ferry_quota_fallback",
    "Quota decisions made in this process because Redis did not"
    " answer in time (the tenant's limits divided by FERRY_QUOTA_GATEWAYS)",
)
# Embedded mode with several web processes (serving.dataplane.transport.host_link, node.node_host): the node
# host's in-flight leases that did not come back the usual way.
QUOTA_LATE_LEASES = Counter(
    "ferry_quota_late_leases",
    "In-flight leases the node host granted after this web process stopped waiting for its decision"
    " (FERRY_QUOTA_REDIS_TIMEOUT_MS), given back at once",
)
QUOTA_LEASES_EXPIRED = Counter(
    "ferry_quota_leases_expired",
    "In-flight leases the node host freed because no web process released them within FERRY_QUOTA_LEASE_S",
)
LOADED = Gauge("ferry_model_loaded", "1 while the version is loaded on this node", ["model", "version"])
# Packing (serving.dataplane.node.packing): versions evicted to make room, loads a request asked for, cold starts.
EVICTIONS = Counter(
    "ferry_evictions", "Versions unloaded from this node to make room for another (LRU)", ["model", "version", "reason"]
)
COLD_LOADS = Counter(
    "ferry_cold_loads",
    "Requests that found their version cold, by what happened to them",
    ["model", "version", "outcome"],
)
COLD_START = Histogram(
    "ferry_cold_start_seconds",
    "Load time of a version on this node, evictions and warm-up included",
    ["model"],
    buckets=(0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60, 120),
)
COLD_WAIT = Histogram(
    "ferry_cold_wait_seconds",
    "How long a request for a cold version waited for its load (served ones)",
    ["model"],
    buckets=(0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60),
)
UNSCHEDULABLE = Counter(
    "ferry_unschedulable", "Versions found unable to fit this node, by constraint", ["model", "version", "constraint"]
)
# The sandboxed runtime processes (serving.dataplane.node.runtime_process): one that died or stopped answering fails its
# batch (or load) and is replaced by a fresh one on next use.
RUNTIME_PROCESS_FAILURES = Counter(
    "ferry_runtime_process_failures", "Sandboxed runtime processes that died or timed out, by reason", ["reason"]
)
RUNTIME_PROCESS_STARTS = Counter("ferry_runtime_process_starts", "Sandboxed runtime processes started")


# About when this process started (its metrics with it): a live window's rate divides by the seconds it has
# been able to count, the window or less in a process younger than it (`LiveWindow.seconds`).
STARTED = time.monotonic()


@dataclass(frozen=True)
class LiveStats:
    rate: float  # answered requests per second over the window (or the seconds since the process started)
    p50_ms: float | None  # of every answer, failures included: what the callers waited
    p99_ms: float | None
    mean_batch: float | None
    errors: int  # answers other than a 200


class LiveWindow:
    """Recent requests and batches of one version, for the console (Prometheus holds the history)."""

    def __init__(
        self,
        window: float = 30.0,
        capacity: int = 20000,
        hour: HourHistory | None = None,
        started: float | None = None,
    ) -> None:
        self.window = window
        self.hour = hour  # the last hour, minute by minute, fed from here too (the console's model page)
        self.started = started  # when counting began, on the monotonic clock (None: the process's STARTED)
        self._latencies: deque[tuple[float, float, bool]] = deque(maxlen=capacity)  # (t, seconds, ok)
        self._batches: deque[tuple[float, int]] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        # For `doc`: how many entries each deque has had appended, how many of those are summarised in
        # `_seconds` (second -> [answers, errors, latency sketch, batches, rows]), so each is summarised once.
        self._appended = [0, 0]
        self._summarised = [0, 0]
        self._seconds: dict[int, list] = {}
        self._doc_lock = threading.Lock()  # the writer's loop and a console view's thread may both ask

    def request(self, seconds: float, ok: bool, now: float | None = None) -> None:
        with self._lock:
            self._latencies.append((now if now is not None else time.monotonic(), seconds, ok))
            self._appended[0] += 1
        if self.hour is not None:
            self.hour.answered(seconds, ok)

    def batch(self, rows: int, now: float | None = None) -> None:
        with self._lock:
            self._batches.append((now if now is not None else time.monotonic(), rows))
            self._appended[1] += 1
        if self.hour is not None:
            self.hour.batch(rows)

    def seconds(self, now: float) -> float:
        """The seconds the window's counts cover: the window, or less while the process is younger than it (at
        least one, so a process's first answers do not read as thousands a second)."""
        started = STARTED if self.started is None else self.started
        return min(self.window, max(1.0, now - started))

    def doc(self, now: float | None = None) -> dict:
        """The window as another web process can merge it (`merged_live`): answers, errors, every answer's
        latency as a sketch (usage.sketch buckets), the batches with their rows, to the second, and the
        seconds these cover (`seconds`).
        Each call summarises only what came since the last (a process writes this every second), so a busy
        version costs its new answers, not its whole window (5 ms at the window's 20,000 otherwise)."""
        with self._doc_lock:
            return self._doc(now if now is not None else time.monotonic())

    def _doc(self, now: float) -> dict:
        with self._lock:
            fresh = [self._appended[i] - self._summarised[i] for i in (0, 1)]
            answers = list(itertools.islice(reversed(self._latencies), min(fresh[0], len(self._latencies))))
            batches = list(itertools.islice(reversed(self._batches), min(fresh[1], len(self._batches))))
            self._summarised = list(self._appended)
        seconds = self._seconds
        for t, took, ok in answers:
            into = seconds.setdefault(int(t), [0, 0, {}, 0, 0])
            into[0] += 1
            sketch.add(into[2], took)
            if not ok:
                into[1] += 1
        for t, rows in batches:
            into = seconds.setdefault(int(t), [0, 0, {}, 0, 0])
            into[3] += 1
            into[4] += rows
        since = now - self.window
        for second in [second for second in seconds if second + 1 <= since]:
            del seconds[second]
        window = list(seconds.values())
        return {
            "answers": sum(w[0] for w in window),
            "errors": sum(w[1] for w in window),
            "latency": sketch.merged(w[2] for w in window),
            "batches": sum(w[3] for w in window),
            "rows": sum(w[4] for w in window),
            "seconds": self.seconds(now),
        }

    def stats(self, now: float | None = None) -> LiveStats:
        now = now if now is not None else time.monotonic()
        since = now - self.window
        with self._lock:
            recent = [(s, ok) for t, s, ok in self._latencies if t >= since]
            batches = [rows for t, rows in self._batches if t >= since]
        latencies = np.array([s for s, _ in recent])
        errors = sum(1 for _, ok in recent if not ok)
        return LiveStats(
            rate=len(recent) / self.seconds(now),
            p50_ms=float(np.percentile(latencies, 50) * 1000) if latencies.size else None,
            p99_ms=float(np.percentile(latencies, 99) * 1000) if latencies.size else None,
            mean_batch=float(np.mean(batches)) if batches else None,
            errors=errors,
        )


class SaturationWindow:
    """Counts of answers by kind in one-second buckets over the last `window` seconds: every answer is one kind
    (history.KINDS: served, fallback, shed, error)."""

    KINDS = KINDS

    def __init__(self, window: int = 30, hour: HourHistory | None = None) -> None:
        self.window = window
        self._buckets: deque[tuple[int, dict[str, int]]] = deque(maxlen=window)
        self.hour = hour
        self._lock = threading.Lock()

    def mark(self, kind: str, now: float | None = None) -> None:
        # No lock on this hot path: only the event loop's thread marks; a reader copies the buckets,
        # and at worst sees a count one behind.
        second = int(now if now is not None else time.monotonic())
        buckets = self._buckets
        if not buckets or buckets[-1][0] != second:
            buckets.append((second, dict.fromkeys(self.KINDS, 0)))
        buckets[-1][1][kind] += 1
        if self.hour is not None:
            self.hour.mark(kind)

    def totals(self, now: float | None = None) -> dict[str, int]:
        """Each kind's answers in the window."""
        since = int(now if now is not None else time.monotonic()) - self.window
        totals = dict.fromkeys(self.KINDS, 0)
        for second, counts in list(self._buckets):
            if second > since:
                for kind, n in list(counts.items()):
                    totals[kind] += n
        return totals

    def shares(self, now: float | None = None) -> dict[str, float]:
        """Each kind's share of the answers in the window (empty when there were none)."""
        return shares_of(self.totals(now))


def shares_of(totals: dict[str, int]) -> dict[str, float]:
    total = sum(totals.values())
    return {k: v / total for k, v in totals.items()} if total else {}


class VersionMetrics:
    """Label children resolved once per version, so the hot path skips label lookups."""

    def __init__(self, model: str, version: int) -> None:
        labels = (model, str(version))
        self.model, self.version = labels
        self.queue_wait = QUEUE_WAIT.labels(*labels)
        self.compute = COMPUTE.labels(*labels)
        self.total = TOTAL.labels(*labels, "2xx")  # the successes' (Triton's statistics "success" reads it)
        self.batch_size = BATCH_SIZE.labels(*labels)
        # No ferry_model_loaded or ferry_queue_depth child here: the node sets and removes those as it loads and
        # unloads (a gateway, or a version's metrics made afresh, would otherwise bring back a stale 0).
        self.poison = POISON.labels(*labels)
        self.abandoned = ABANDONED.labels(*labels)
        # A status's counter and its class's latency child, resolved on its first answer: one lookup an answer.
        self._status: dict[int, tuple[CounterChild, HistogramChild]] = {}
        self._shed: dict[tuple[str, int], Counter] = {}
        # Answers by kind over the live window: admitted (200), fallback, shed, error; for the console's
        # saturation indicator.
        self.hour = HourHistory()
        self.saturation = SaturationWindow(hour=self.hour)
        self.live = LiveWindow(hour=self.hour)

    def answered(self, status: int, seconds: float) -> None:
        """Count an answer and its time, whatever its status: a 504 took its caller's whole wait, and leaving
        it out would make the latency of a version that times out look like that of its few successes."""
        children = self._status.get(status)
        if children is None:
            total = TOTAL.labels(self.model, self.version, STATUS_CLASSES.get(status // 100, "5xx"))
            children = self._status[status] = (REQUESTS.labels(self.model, self.version, str(status)), total)
        children[0].inc()
        children[1].observe(seconds)
        self.live.request(seconds, status == 200)

    def idle(self) -> bool:
        """Whether it has counted nothing for an hour (every count the console shows goes into its hour)."""
        return self.hour.idle()

    def shed(self, reason: str, tier: int) -> None:
        key = (reason, tier)
        counter = self._shed.get(key)
        if counter is None:
            counter = self._shed[key] = SHED.labels(self.model, self.version, reason, str(tier))
        counter.inc()
        self.saturation.mark("shed")


# The versions this process counts for. One that counted nothing for an hour (deleted, retired, or just quiet)
# leaves `_versions` at the next prune (`prune`, at most every PRUNE_EVERY_S, from `for_version` and
# `console_doc`) for `_resting`, which keeps it only while something else holds it (a node's hosted version
# keeps its metrics): so the dict is bounded by the versions of the last hour and the hosted ones, however many
# versions come and go. `for_version` takes a resting one back, so a version's figures never split in two.
# (An answer in flight across the prune of a version idle for the hour may be missing from its console
# figures; its Prometheus series, kept by the families, count it.)
_versions: dict[tuple[str, int], VersionMetrics] = {}
_resting: weakref.WeakValueDictionary[tuple[str, int], VersionMetrics] = weakref.WeakValueDictionary()
_versions_lock = threading.Lock()
PRUNE_EVERY_S = 60.0
_pruned_at = time.monotonic()


def for_version(model: str, version: int) -> VersionMetrics:
    key = (model, version)
    found = _versions.get(key)
    if found is None:
        with _versions_lock:
            found = _versions.get(key)
            if found is None:
                found = _resting.pop(key, None)
                if found is None:
                    found = VersionMetrics(model, version)
                _versions[key] = found
        prune()
    return found


def prune(now: float | None = None, *, force: bool = False) -> None:
    """Move the versions idle for the hour to `_resting`, and back those a holder counted on since; at most
    every PRUNE_EVERY_S unless `force`."""
    global _pruned_at
    now = time.monotonic() if now is None else now
    if not force and now - _pruned_at < PRUNE_EVERY_S:
        return
    with _versions_lock:
        _pruned_at = now
        for key, vm in list(_versions.items()):
            if vm.idle():
                del _versions[key]
                _resting[key] = vm
        for key, vm in list(_resting.items()):
            if not vm.idle():
                _versions[key] = _resting.pop(key)


def _known(model: str, version: int) -> VersionMetrics | None:
    key = (model, version)
    found = _versions.get(key)
    return found if found is not None else _resting.get(key)


def saturation_shares(model: str, version: int) -> dict[str, float]:
    if (shared := process_set.current()) is not None:
        return shares_of(merged_kinds(shared.console("versions", f"{model}:{version}", alive_only=True)))
    found = _known(model, version)
    return found.saturation.shares() if found else {}


def live_stats(model: str, version: int) -> LiveStats | None:
    if (shared := process_set.current()) is not None:
        return merged_live(shared.console("versions", f"{model}:{version}", alive_only=True))
    found = _known(model, version)
    return found.live.stats() if found else None


def hour_history(model: str, version: int) -> list[Minute]:
    if (shared := process_set.current()) is not None:
        return merged_hour(shared.console("versions", f"{model}:{version}", alive_only=False))
    found = _known(model, version)
    return found.hour.last_hour() if found else []


# -- the console's figures across the web processes of one port (`serve --workers N`, process_set) ----------


def console_doc(only: str | None = None) -> dict[str, dict]:
    """This process's console figures of every version it counted for in the last hour or hosts (or of the
    version `only`), as `process_set` writes them for the other web processes: the live window, the answers by
    kind over the saturation window, the last hour."""
    prune()
    out = {}
    for (model, version), vm in list(_versions.items()) + list(_resting.items()):
        if only is not None and only != f"{model}:{version}":
            continue
        out[f"{model}:{version}"] = {
            "live": vm.live.doc(),
            "kinds": vm.saturation.totals(),
            "minutes": [m.to_doc() for m in vm.hour.last_hour()],
        }
    return out


def merged_live(docs: list[dict], window: float = 30.0) -> LiveStats | None:
    """The live figures of one version over every process's doc: rates (each process's answers over the seconds
    it counted) and errors summed, p50 and p99 of the merged sketch (within its bucket width of the exact ones
    one process computes), batches over all."""
    lives = [d["live"] for d in docs if "live" in d]
    if not lives:
        return None
    latency = sketch.merged(d["latency"] for d in lives)
    batches, rows = sum(d["batches"] for d in lives), sum(d["rows"] for d in lives)
    p50, p99 = sketch.quantile(latency, 0.5), sketch.quantile(latency, 0.99)
    return LiveStats(
        rate=sum(d["answers"] / d.get("seconds", window) for d in lives),
        p50_ms=None if p50 is None else p50 * 1000,
        p99_ms=None if p99 is None else p99 * 1000,
        mean_batch=rows / batches if batches else None,
        errors=sum(d["errors"] for d in lives),
    )


def merged_kinds(docs: list[dict]) -> dict[str, int]:
    totals = dict.fromkeys(SaturationWindow.KINDS, 0)
    for doc in docs:
        for kind, n in doc.get("kinds", {}).items():
            totals[kind] = totals.get(kind, 0) + int(n)
    return totals


def merged_hour(docs: list[dict]) -> list[Minute]:
    """The last hour of one version over every process's doc, minute by minute, oldest first."""
    minutes: dict[int, Minute] = {}
    for doc in docs:
        for found in doc.get("minutes", ()):
            minute = Minute.from_doc(found)
            minutes.setdefault(minute.start, Minute(minute.start)).add(minute)
    return [minutes[start] for start in sorted(minutes)]
