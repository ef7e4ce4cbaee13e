"""Overload: what Ferry does when offered more than it can serve.

    .venv/bin/python -m bench.run --only overload [--quick]

For `digits-wide` (compute-bound, a few hundred requests/s per process here): measure its capacity,
then ramp offered load open-loop from 0.5x to 3x capacity and back down, with every request a
labelled sample from scikit-learn's digits carrying a deadline and a priority tier. Per second of the
schedule: offered, sent, admitted (200), served by the fallback, shed (503) by reason, 504, goodput
(200 within the deadline), admitted p50/p99. Then the same ramp with admission off
(FERRY_ADMISSION=false, server restarted), and the same ramp on `digits` (the fast model).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench import capacity
from bench.cpu_split import CpuSplit
from bench.ramp import CLIENT, CLIENT_KINDS, FALLBACK, PRIMARY, SHED, TIMEOUT_504, RampRecord, Requests, Step, run_ramp
from bench.server import HEADERS, ROOT, Server, counters, free_port, http_post, say, scrape

WIDE_MODEL = "digits-wide"
FAST_MODEL = "digits"
FALLBACK_MODEL = "digits-small"
MULTIPLIERS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 2.0, 1.0, 0.5)
P99_BUDGET_MS = 300.0
GOODPUT_SHARE = 0.90  # goodput at the peak step, as a share of the best step's goodput
RECOVERY_BUDGET_S = 5.0
RSS_GROWTH_LIMIT = 0.25  # this benchmark's bound on RSS growth across one ramp
# The last two only distributed mode has: where each 504 was found, and what a gateway refused before a stream.
SERVER_COUNTERS = (
    "ferry_shed_total",
    "ferry_requests_total",
    "ferry_fallbacks_total",
    "ferry_deadline_exceeded_total",
    "ferry_gateway_refusals_total",
)


@dataclass
class OverloadSettings:
    step_s: float = 8.0
    capacity_step_s: float = 6.0
    probe_s: float = 2.0
    deadline_ms: int = 250  # the client's deadline where it sends one, and then the goodput's bound
    # Issue 19's acceptance: clients that send no deadline, held to the platform's budget (budget_ms, the
    # servers' FERRY_LATENCY_BUDGET_MS, then also the goodput's bound). True: each request carries deadline_ms.
    client_deadline: bool = False
    budget_ms: int = 300
    tiers: tuple[tuple[int, float], ...] = ((1, 0.25), (2, 0.75))  # (priority, share of requests)
    multipliers: tuple[float, ...] = MULTIPLIERS
    max_connections: int = 1024
    settle_s: float = 3.0

    @property
    def goodput_ms(self) -> int:
        """A 200 counts as goodput within this: the client's deadline, or the platform's budget without one."""
        return self.deadline_ms if self.client_deadline else self.budget_ms

    @property
    def sent_deadline_ms(self) -> int | None:
        return self.deadline_ms if self.client_deadline else None

    @classmethod
    def for_mode(cls, quick: bool) -> OverloadSettings:
        if quick:
            return cls(step_s=2.0, capacity_step_s=2.0, probe_s=1.0, settle_s=1.0)
        return cls()


@dataclass
class RampResult:
    label: str
    model: str
    admission: bool
    capacity: float
    capacity_source: str
    deadline_ms: int  # the goodput's bound: the client's deadline, or the platform's budget without one
    steps: list[dict[str, Any]] = field(default_factory=list)
    client_deadline: bool = False  # whether the requests carried `deadline_ms` as their `timeout`
    series: dict[str, list[float]] = field(default_factory=dict)
    accuracy: dict[str, dict[str, float]] = field(default_factory=dict)
    memory_before: dict[str, int] = field(default_factory=dict)
    memory_after: dict[str, int] = field(default_factory=dict)
    pre_p99_ms: float = math.nan
    recovery_s: float | None = None  # None: not back to normal before the schedule ended
    recovery_from_s: float = math.nan
    goodput_recovery_s: float | None = None  # seconds until goodput is back to >= 90% of offered
    server_counters: dict[str, float] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    conns_max: int = 0
    id_mismatches: int = 0
    generator_cores: float = math.nan
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


# -------------------------------------------------------------------------------------------- requests


def digits_requests(url: str, deadline_ms: int | None, tiers: tuple[tuple[int, float], ...]) -> Requests:
    """Every sample of scikit-learn's digits, once per tier, each carrying the deadline (Triton's
    `timeout`, microseconds; none when `deadline_ms` is None: the platform's budget applies) and its tier
    as `priority`; each send draws a tier by its share."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    total = sum(share for _, share in tiers)
    bodies, labels, body_tiers, ids, weights = [], [], [], [], []
    for tier, share in tiers:
        for i, (x, y) in enumerate(zip(digits.data, digits.target, strict=True)):
            rid = f"digit-{i}-label-{y}-tier-{tier}"  # echoed in the answer: checked against the request
            parameters: dict[str, int] = {"priority": tier}
            if deadline_ms is not None:
                parameters["timeout"] = deadline_ms * 1000
            bodies.append(orjson.dumps({
                "id": rid,
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": x.tolist()}],
                "parameters": parameters,
            }))  # fmt: skip
            labels.append(int(y))
            body_tiers.append(tier)
            ids.append(rid)
            weights.append(share / total / len(digits.data))
    return Requests(url, bodies, np.array(labels), np.array(body_tiers), HEADERS, ids, np.array(weights))


def probe_body(deadline_ms: int | None) -> bytes:
    from sklearn.datasets import load_digits

    x = load_digits().data[0]
    doc: dict[str, Any] = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": x.tolist()}]}
    if deadline_ms is not None:
        doc["parameters"] = {"timeout": deadline_ms * 1000}
    return orjson.dumps(doc)


# -------------------------------------------------------------------------------------------- analysis


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) * 1000.0 if values.size else math.nan


def per_second(rec: RampRecord, requests: Requests, deadline_s: float) -> dict[str, list[float]]:
    """One entry per second of the schedule; requests count in the second they were *scheduled*."""
    n_sec = int(math.ceil(sum(st.seconds for st in rec.steps)))
    sec = np.minimum(rec.sched.astype(int), n_sec - 1)
    ok = (rec.outcome == PRIMARY) | (rec.outcome == FALLBACK)
    good = ok & (rec.latency <= deadline_s)
    sent_sec = rec.sent[~np.isnan(rec.sent)].astype(int)
    out: dict[str, list[float]] = {k: [] for k in (
        "t", "offered", "sent", "admitted", "fallback", "shed", "504", "client", "goodput", "p50_ms", "p99_ms",
        "multiplier")}  # fmt: skip
    for r in rec.reasons:
        out[f"shed_{r}"] = []
    counts = {
        "offered": np.bincount(sec, minlength=n_sec),
        "sent": np.bincount(np.minimum(sent_sec, n_sec - 1), minlength=n_sec)[:n_sec],
        "admitted": np.bincount(sec[ok], minlength=n_sec),
        "fallback": np.bincount(sec[rec.outcome == FALLBACK], minlength=n_sec),
        "shed": np.bincount(sec[rec.outcome == SHED], minlength=n_sec),
        "504": np.bincount(sec[rec.outcome == TIMEOUT_504], minlength=n_sec),
        "client": np.bincount(sec[rec.outcome == CLIENT], minlength=n_sec),
        "goodput": np.bincount(sec[good], minlength=n_sec),
    }
    for i, r in enumerate(rec.reasons):
        counts[f"shed_{r}"] = np.bincount(sec[(rec.outcome == SHED) & (rec.reason == i)], minlength=n_sec)
    order = np.argsort(sec, kind="stable")
    bounds = np.searchsorted(sec[order], np.arange(n_sec + 1))
    starts = np.cumsum([0.0] + [st.seconds for st in rec.steps])
    for s in range(n_sec):
        idx = order[bounds[s] : bounds[s + 1]]
        lat = rec.latency[idx][ok[idx]]
        out["t"].append(float(s))
        for k, v in counts.items():
            out[k].append(float(v[s]))
        out["p50_ms"].append(_pct(lat, 50))
        out["p99_ms"].append(_pct(lat, 99))
        step = min(int(np.searchsorted(starts, s, side="right")) - 1, len(rec.steps) - 1)
        out["multiplier"].append(rec.steps[step].multiplier)
    return out


def per_step(rec: RampRecord, requests: Requests, deadline_s: float) -> list[dict[str, Any]]:
    rows = []
    tiers = requests.tiers[rec.body]
    for i, st in enumerate(rec.steps):
        m = rec.step_of == i
        out, lat, status = rec.outcome[m], rec.latency[m], rec.status[m]
        ok = (out == PRIMARY) | (out == FALLBACK)
        sent = ~np.isnan(rec.sent[m])
        lag = (rec.sent[m] - rec.sched[m])[sent]
        start = sum(x.seconds for x in rec.steps[:i])
        loop = np.array([])
        if rec.loop_t is not None and rec.loop_lag is not None:
            loop = rec.loop_lag[(rec.loop_t >= start) & (rec.loop_t < start + st.seconds)]
        row: dict[str, Any] = {
            "multiplier": st.multiplier, "offered_rps": st.rate, "seconds": st.seconds, "requests": int(m.sum()),
            "sent_rps": float(sent.sum()) / st.seconds, "send_lag_p99_ms": _pct(lag, 99),
            "loop_lag_p99_ms": _pct(loop, 99),
            "admitted_rps": float(ok.sum()) / st.seconds,
            "primary_rps": float((out == PRIMARY).sum()) / st.seconds,
            "fallback_rps": float((out == FALLBACK).sum()) / st.seconds,
            "shed_rps": float((out == SHED).sum()) / st.seconds,
            "t504_rps": float((out == TIMEOUT_504).sum()) / st.seconds,
            "other_rps": float((out == 4).sum()) / st.seconds,
            "client_rps": float((out == CLIENT).sum()) / st.seconds,
            "goodput_rps": float((ok & (lat <= deadline_s)).sum()) / st.seconds,
            "p50_ms": _pct(lat[ok], 50), "p99_ms": _pct(lat[ok], 99),
            "primary_p99_ms": _pct(lat[out == PRIMARY], 99),
            "shed_with_retry_after": -1 if rec.retry_after is None else int((rec.retry_after[m] == 1).sum()),
            # For the acceptance rows: every HTTP answer, the 504s and 500s among them, and the 503s and 429s
            # that came without Retry-After.
            "answers": int((status > 0).sum()), "t504": int((status == 504).sum()),
            "t429": int((status == 429).sum()), "t503": int((status == 503).sum()),
            "t500": int(((status >= 500) & (status != 503) & (status != 504)).sum()),
            "refusals_without_retry_after": int((((status == 503) | (status == 429)) & (
                np.zeros(int(m.sum()), bool) if rec.retry_after is None else rec.retry_after[m] != 1)).sum()),
            "shed_by_reason": {r: int(((out == SHED) & (rec.reason[m] == j)).sum())
                               for j, r in enumerate(rec.reasons) if ((out == SHED) & (rec.reason[m] == j)).any()},
            "client_by_kind": {k: int(((out == CLIENT) & (rec.reason[m] == j)).sum())
                               for j, k in enumerate(CLIENT_KINDS) if ((out == CLIENT) & (rec.reason[m] == j)).any()},
            "admitted_share_by_tier": {
                int(t): float((ok & (tiers[m] == t)).sum()) / max(1, int((tiers[m] == t).sum()))
                for t in np.unique(requests.tiers)
            },
        }  # fmt: skip
        rows.append(row)
    return rows


def accuracy(rec: RampRecord) -> dict[str, dict[str, float]]:
    out = {}
    for name, code in (("primary", PRIMARY), ("fallback", FALLBACK)):
        graded = (rec.outcome == code) & (rec.correct >= 0)
        n = int(graded.sum())
        out[name] = {"answers": n, "correct": int((rec.correct[graded] == 1).sum()),
                     "accuracy": float((rec.correct[graded] == 1).mean()) if n else math.nan}  # fmt: skip
    return out


def recovery(res: RampResult, rec: RampRecord) -> None:
    """p99 recovery: from the start of the first step back at <= 1x capacity after the peak, the seconds
    until the first second whose admitted p99 is under 1.5 x the pre-overload p99 (that of the leading
    steps below 1x) or under 300 ms.
    Goodput recovery: likewise, until the first second whose goodput is >= 90% of its offered load."""
    mults = [st.multiplier for st in rec.steps]
    peak = int(np.argmax(mults))
    # The baseline: the leading steps below capacity (at 1x a server is at its limit by definition).
    pre = [i for i in range(peak) if all(m < 1.0 for m in mults[: i + 1])]
    pre = pre or [i for i in range(peak) if all(m <= 1.0 for m in mults[: i + 1])]
    ok = (rec.outcome == PRIMARY) | (rec.outcome == FALLBACK)
    if pre:
        res.pre_p99_ms = _pct(rec.latency[np.isin(rec.step_of, pre) & ok], 99)
    after = [i for i in range(peak + 1, len(mults)) if mults[i] <= 1.0]
    if not after:
        return
    start = sum(st.seconds for st in rec.steps[: after[0]])
    res.recovery_from_s = start
    limit = max(res.pre_p99_ms * 1.5 if not math.isnan(res.pre_p99_ms) else 0.0, P99_BUDGET_MS)
    sr, first = res.series, math.floor(start)
    for t, p99 in zip(sr["t"], sr["p99_ms"], strict=True):
        if t >= first and not math.isnan(p99) and p99 < limit:
            res.recovery_s = t - first
            break
    for t, good, offered in zip(sr["t"], sr["goodput"], sr["offered"], strict=True):
        if t >= first and offered and good >= 0.9 * offered:
            res.goodput_recovery_s = t - first
            break


def counter_delta(before: str | None, after: str | None, model_names: tuple[str, ...]) -> dict[str, float]:
    b, a = counters(before, SERVER_COUNTERS), counters(after, SERVER_COUNTERS)
    out: dict[str, float] = {}
    for key, value in a.items():
        name, labels = key
        lab = dict(labels)
        if lab.get("model") not in model_names:
            continue
        delta = value - b.get(key, 0.0)
        if delta:
            text = ",".join(f"{k}={v}" for k, v in labels if k != "version")
            out[f"{name}{{{text}}}"] = delta
    return out


# -------------------------------------------------------------------------------------------- running


async def measure_capacity(base: str, model: str, s: OverloadSettings, body: bytes | None = None) -> float:
    """Highest open-loop rate with p99 < 300 ms and < 0.1% errors (shed counts as an error, and so does an
    answer of the model's fallback: capacity is what the model itself serves; counting the fallback's answers,
    a search on 2026-12-05 put `digits-wide`'s at 1,186 req/s, of which the fallback answered 704 at 1x),
    seeded by a closed-loop probe: capacity.find_max_rate with short steps. `body`: the request searched with (default:
    the first digit, carrying the settings' deadline)."""
    url = f"{base}/v2/models/{model}/infer"
    body = body if body is not None else probe_body(s.sent_deadline_ms)
    status, payload = http_post(url, body)
    if status != 200:
        raise RuntimeError(f"{model}: sanity request answered {status}: {payload[:300]!r}")
    # The seed's probe carries no deadline parameter (the version's default): with 32 in flight and a
    # short deadline, admission would refuse much of a closed loop and the seed would be far too low.
    seed = await capacity.probe_capacity(url, probe_body(None), HEADERS, concurrency=32, duration=s.probe_s)
    say(f"{model}: closed-loop probe {seed:.1f} req/s; searching open-loop")
    await asyncio.sleep(2.0)
    best, _ = await capacity.find_max_rate(
        url, body, HEADERS, start=max(5.0, 0.6 * seed), stop=50_000.0, p99_budget_ms=P99_BUDGET_MS,
        max_error_ratio=0.001, duration=s.capacity_step_s, warmup=0.5, factor=1.25, refine_steps=1,
        min_rate=max(1.0, 0.6 * seed / 1.25**4), cooldown=1.0, cooldown_after_fail=2.0, fallback_is_error=True,
    )  # fmt: skip
    if best is None:
        raise RuntimeError(f"{model}: no rate passed the capacity search")
    say(f"{model}: capacity {best.achieved_rate:.1f} req/s (p99 {best.p99_ms:.1f} ms)")
    return best.achieved_rate


async def ramp(server: Server, model: str, cap: float, source: str, admission: bool, s: OverloadSettings,
               label: str, client_deadline: bool | None = None) -> RampResult:  # fmt: skip
    """One ramp of `s.multipliers` x `cap`. `client_deadline` (default: the settings'): False, the requests
    carry no deadline (the platform's budget applies); `s.deadline_ms` is then only the goodput's bound."""
    client_deadline = s.client_deadline if client_deadline is None else client_deadline
    goodput_ms = s.deadline_ms if client_deadline else s.budget_ms
    res = RampResult(label, model, admission, cap, source, goodput_ms, client_deadline=client_deadline)
    url = f"{server.base}/v2/models/{model}/infer"
    requests = digits_requests(url, s.deadline_ms if client_deadline else None, s.tiers)
    steps = [Step(m, m * cap, s.step_s) for m in s.multipliers]
    await asyncio.sleep(s.settle_s)
    res.memory_before = server.rss_kib()
    before = scrape(server.base)
    say(f"===== ramp: {label}: {' '.join(f'{m:g}x' for m in s.multipliers)} of {cap:.0f} req/s, "
        f"{s.step_s:g} s each, " + (f"deadline {s.deadline_ms} ms" if client_deadline else
                                    f"no client deadline (budget {s.budget_ms} ms)") + " =====")  # fmt: skip
    cpu = CpuSplit()
    with cpu.running():
        began = time.time()
        rec = await run_ramp(requests, model, steps, max_connections=s.max_connections, label=label)
    await asyncio.sleep(2.0)
    res.memory_after = server.rss_kib()
    res.server_counters = counter_delta(before, scrape(server.base), (model, FALLBACK_MODEL))
    deadline_s = goodput_ms / 1000.0
    res.series = per_second(rec, requests, deadline_s)
    res.steps = per_step(rec, requests, deadline_s)
    ends = np.cumsum([st.seconds for st in steps])
    windows = [(began + end - st.seconds, began + end) for st, end in zip(steps, ends, strict=True)]
    for row, cores in zip(res.steps, cpu.by_window(windows), strict=True):
        row["cores"] = cores  # by kind of process (bench.cpu_split)
    res.accuracy = accuracy(rec)
    res.reasons = list(rec.reasons)
    res.conns_max = rec.conns_max
    res.id_mismatches = rec.id_mismatches
    res.generator_cores = rec.generator_cores
    recovery(res, rec)
    for row in res.steps:
        say(f"{label}: {row['multiplier']:g}x offered {row['offered_rps']:.0f}/s sent {row['sent_rps']:.0f}/s"
            f" admitted {row['admitted_rps']:.0f}/s (fallback {row['fallback_rps']:.0f}) shed {row['shed_rps']:.0f}/s"
            f" 504 {row['t504_rps']:.0f}/s goodput {row['goodput_rps']:.0f}/s p99 {row['p99_ms']:.0f} ms"
            f" (generator: send lag p99 {row['send_lag_p99_ms']:.0f} ms,"
            f" loop lag p99 {row['loop_lag_p99_ms']:.0f} ms)")  # fmt: skip
    return res


def admission_setting_known() -> bool:
    try:
        return "FERRY_ADMISSION" in (ROOT / "config" / "settings.py").read_text()
    except OSError:
        return False


def run_overload(env: dict[str, str], data_dir: Path, s: OverloadSettings,
                 fast_capacity: float | None = None) -> dict[str, Any]:  # fmt: skip
    """The whole phase: its own servers (admission on, then off), three ramps. Returns the report's input."""
    from bench.loadgen import arun

    out: dict[str, Any] = {"settings": s.__dict__, "ramps": [], "admission_setting_known": admission_setting_known()}
    models = (WIDE_MODEL, FALLBACK_MODEL, FAST_MODEL)
    # The budget the acceptance holds is the platform's default: set, so an exported test value cannot leak in.
    env = {**env, "FERRY_LATENCY_BUDGET_MS": str(s.budget_ms)}
    on_env = {**env, "FERRY_ADMISSION": "true"}
    off_env = {**env, "FERRY_ADMISSION": "false"}
    wide_cap: float | None = None
    with Server(on_env, free_port(), data_dir / "server-overload-on.log") as server:
        server.wait_ready(models)
        try:
            wide_cap = arun(measure_capacity(server.base, WIDE_MODEL, s))
            out["ramps"].append(arun(ramp(server, WIDE_MODEL, wide_cap, "measured here", True, s,
                                          f"{WIDE_MODEL}, admission on")))  # fmt: skip
        except Exception as exc:  # keep going: the other ramps still say something
            say(f"{WIDE_MODEL} (admission on): {type(exc).__name__}: {exc}")
            out["ramps"].append(RampResult(f"{WIDE_MODEL}, admission on", WIDE_MODEL, True, wide_cap or 0, "",
                                           s.goodput_ms, error=f"{type(exc).__name__}: {exc}"))  # fmt: skip
        try:
            if fast_capacity:
                cap, source = fast_capacity, "the served sweep's figure (served.md; no deadline parameter)"
            else:
                cap, source = arun(measure_capacity(server.base, FAST_MODEL, s)), "measured here"
            out["ramps"].append(arun(ramp(server, FAST_MODEL, cap, source, True, s, f"{FAST_MODEL}, admission on")))
        except Exception as exc:
            say(f"{FAST_MODEL}: {type(exc).__name__}: {exc}")
            out["ramps"].append(RampResult(f"{FAST_MODEL}, admission on", FAST_MODEL, True, 0, "", s.goodput_ms,
                                           error=f"{type(exc).__name__}: {exc}"))  # fmt: skip
    if wide_cap:
        with Server(off_env, free_port(), data_dir / "server-overload-off.log") as server:
            server.wait_ready(models)
            try:
                out["ramps"].insert(1, arun(ramp(server, WIDE_MODEL, wide_cap, "the admission-on run's", False, s,
                                                 f"{WIDE_MODEL}, admission off")))  # fmt: skip
            except Exception as exc:
                say(f"{WIDE_MODEL} (admission off): {type(exc).__name__}: {exc}")
                out["ramps"].insert(1, RampResult(f"{WIDE_MODEL}, admission off", WIDE_MODEL, False, wide_cap, "",
                                                  s.goodput_ms, error=f"{type(exc).__name__}: {exc}"))  # fmt: skip
    return out
