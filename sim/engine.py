"""The event loop: arrivals, routing, admission, batching and devices on one virtual clock.

Granularity. Events are device turns, not requests: a device takes a turn when a batch of its
versions is due (as its batching policy said, or as planned when its last batch started: see
`_run`), polls their `BatchQueue`s in turn, and only then are the arrivals since that version's
model was last looked at generated, as one cohort: the exact time
of the first arrival (kept ahead as `next_arrival`, an exponential draw), then a Poisson count
spread uniformly up to now. Poisson arrivals given their count are uniform, so this is exact in
distribution, and a cohort spans at most one device turn. Cohorts are routed (the model's split
over its versions comes from `rollout.routing.choose_version` over 1,000 sticky routing keys,
recomputed when a version's readiness changes), admitted by `serving.policies.admission` (the
largest prefix that fits the estimate), and put into the version's queue in pieces cut at batch
boundaries, so a backlogged queue still leaves in full batches. What admission refuses goes to the
model's fallback (its own admission), else is shed.

Replicas of a version share its queue; one of their devices, the version's waker, takes the turns
for it (`_covered`, `_hand_off`), so n idle replicas do not each wake for the same batch.

Simplified: one queue per version shared by all its replicas (the design's stream per version),
admission estimated against the version's first replica's device with the queue (and the work
arriving for the versions beside it, their admitted `DeviceShare`s) split evenly over replicas,
every request one row and one priority tier, no network, parsing or gateway cost, compute time =
profile x lognormal jitter (the profile is the truth's mean and is not re-learnt).
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rollout.routing import RouteError, choose_version
from serving.policies.admission import (
    ACTIVE_SHARE,
    HEADROOM,
    Arrivals,
    VersionLoad,
    completion_seconds,
    decide,
    hands_first,
)
from serving.policies.batching import Pending
from sim import catalogue, scaling
from sim.budget import Budget, Stopped
from sim.catalogue import SimModel, SimVersion
from sim.fleet import Device, Fleet, Replica, replicas_for, staying
from sim.metrics import Metrics
from sim.scenario import Scenario
from sim.summary import summarise

WAKE, TICK, READY = 1, 2, 3
INF = math.inf
BLOCK = 1 << 16  # variates numpy draws at a time: one Python-level draw per batch cost more than its bookkeeping


def poisson(rng: random.Random, mean: float) -> int:
    if mean <= 0:
        return 0
    if mean < 30:  # inversion by sequential search
        x, p = 0, math.exp(-mean)
        s, u = p, rng.random()
        while u > s:
            x += 1
            p *= mean / x
            s += p
        return x
    return max(0, int(rng.gauss(mean, math.sqrt(mean)) + 0.5))


def binomial(rng: random.Random, n: int, p: float) -> int:
    if p <= 0 or n <= 0:
        return 0
    if p >= 1:
        return n
    if n < 25:
        draw, hits = rng.random, 0
        for _ in range(n):
            if draw() < p:
                hits += 1
        return hits
    sd = math.sqrt(n * p * (1 - p))
    return min(n, max(0, int(rng.gauss(n * p, sd) + 0.5)))


class Simulation:
    def __init__(
        self,
        scenario: Scenario,
        policy: str,
        *,
        duration: float | None = None,
        progress: Callable[[str], None] | None = None,
        budget: Budget | None = None,
        arrivals: Sequence[Sequence[float]] | None = None,
    ) -> None:
        """`budget`: when to give up (its deadline or cancel flag), raising `Stopped`; None runs to the end.
        `arrivals`: a trace to replay instead of drawing Poisson arrivals, each model's arrival times (sorted, in
        seconds) in the catalogue's order (model i, the i-th most popular); a cohort is then the trace's arrivals
        since the model was last looked at (spread over its span as drawn ones are). For comparing with a real
        run that sent those requests (sim.validation_fleet): the same arrivals on both sides, so a scaling
        decision near a threshold is not down to two different samples of the same rate."""
        self.sc = scenario
        self.budget = budget
        self.duration = duration if duration is not None else scenario.duration
        self.rng = random.Random(scenario.seed)
        self.models: list[SimModel] = catalogue.build(scenario)
        self.versions: list[SimVersion] = [v for m in self.models for v in m.versions.values()]
        self.by_key = {v.key: v for v in self.versions}
        self.fleet = Fleet(scenario)
        self.policy = scaling.make(policy, scenario, self.versions)
        self.metrics = Metrics(scenario.window, self.duration)
        self.timeout = scenario.scaling.timeout
        self.max_queue = scenario.scaling.max_queue_size
        self.end = self.duration + self.timeout + 1.0
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.events = 0
        self.progress = progress
        sigma = scenario.jitter
        self.jitter = (-sigma * sigma / 2, sigma)  # lognormal with mean 1
        self.draws = np.random.default_rng(scenario.seed)
        self._jitters: list[float] = []  # drawn ahead, used from the end
        self._rate_at = scenario.traffic.at
        self._exponentials: list[float] = []  # unit-mean
        self.ready = lambda key: self.by_key[key].ready_count > 0
        if arrivals is not None and len(arrivals) != len(self.models):
            raise ValueError(f"a trace of {len(arrivals)} models for a catalogue of {len(self.models)}")
        for m, times in zip(self.models, arrivals or (), strict=False):
            m.trace = [float(t) for t in times]
        self.snap: dict[str, float] = {}
        self._last_tick = 0.0
        self._evictions_seen = 0  # of fleet.evicted, those whose versions' waiting work was answered

    # --- the loop -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        cpu = time.process_time()
        self._start()
        heap, pop, serve, last = self.heap, heapq.heappop, self._serve, self.end
        next_report = self.duration / 10
        events = 0
        budget = self.budget
        every = budget.every if budget is not None else 0
        while heap:
            t, _, kind, a = pop(heap)
            if t > last:
                break
            events += 1
            if every and not events % every and (why := budget.exhausted()) is not None:  # type: ignore[union-attr]
                self.events = events
                raise Stopped(why, min(t, self.duration), self.duration, events)
            if kind == WAKE:
                if a.wake_at == t:  # else a later plan replaced it
                    a.wake_at = INF
                    if a.on and a.busy_until <= t:
                        if a.hosted:
                            serve(a, t)
                        else:
                            self.fleet.release_if_empty(a, t)
            elif kind == TICK:
                self._tick(t)
                if self.progress and t >= next_report and t <= self.duration:
                    next_report += self.duration / 10
                    self.progress(
                        f"{self.sc.name}/{self.policy.name}: {t:.0f}/{self.duration:.0f} s simulated,"
                        f" {time.perf_counter() - started:.1f} s wall"
                    )
            else:
                self._ready(a, t)
        self.events = events
        self._finish()
        return self._result(time.perf_counter() - started, time.process_time() - cpu)

    def _push(self, t: float, kind: int, a: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a))

    def _recheck(self, dev: Device, now: float) -> None:
        """Something its planned turn did not foresee reached `dev` (rows, a replica, new arrival times): it
        takes a turn when its batch ends, or now when idle."""
        at = dev.busy_until if dev.busy_until > now else now
        if dev.wake_at > at:
            dev.wake_at = at
            self._push(at, WAKE, dev)

    def _start(self) -> None:
        """Every version starts with the replicas its policy wants for the opening load, already warm."""
        rate0 = self.sc.traffic.at(0.0)
        static = isinstance(self.policy, scaling.Static)
        # Versions no policy scales come last: in production they are loaded where the policy's replicas left room.
        for v in sorted(self.versions, key=lambda v: (not v.family.autoscaled, -v.memory_bytes)):
            v.observed = rate0 * v.model.popularity * v.weight
            if not static:
                v.demand = v.observed
            warm = self.sc.scaling.warm_pool
            if not v.family.autoscaled:
                want = 1
            elif static:
                want = self.policy.desired(0.0)[v]
            elif self.sc.scaling.opening_replicas:
                want = self.sc.scaling.opening_replicas
            else:
                want = replicas_for(v, v.demand, v.scaling.target_utilisation) + warm
            for _ in range(want):
                # Placing a replica looks at every device: a large fleet takes long before the first event.
                if self.budget is not None and (why := self.budget.exhausted()) is not None:
                    raise Stopped(why, 0.0, self.duration, 0)
                self.fleet.add(v, 0.0, warm=True)
        self.fleet.cold_starts = 0
        for m in self.models:
            self._resample(m, 0.0)
        self._push(0.0, TICK)

    # --- arrivals, routing, admission -----------------------------------------------------------
    def _resample(self, m: SimModel, now: float) -> None:
        rate = m.rate = self._rate_at(now) * m.popularity if now < self.duration else 0.0
        trace = m.trace
        if trace is not None:  # the next arrival the trace has not given yet (the rate stays for planning)
            i = m.traced
            m.next_arrival = trace[i] if i < len(trace) and trace[i] < self.duration else INF
        elif rate > 0:
            draws = self._exponentials
            if not draws:
                draws.extend(self.draws.exponential(1.0, BLOCK).tolist())
            m.next_arrival = now + draws.pop() / rate
        else:
            m.next_arrival = INF

    def _advance(self, m: SimModel, now: float) -> None:
        """Generate `m`'s arrivals up to `now` as one cohort and dispatch it."""
        if now > self.duration:
            now = self.duration
        first = m.next_arrival
        if first > now:
            if first > self.duration:
                # Drawn past the end: it never arrives. Left in place until the next tick, a batch window of 0
                # would have the model's device wake at that instant again and again without time passing.
                m.next_arrival, m.rate = INF, 0.0
            if now > m.t:
                m.t = now
            return
        trace = m.trace
        if trace is not None:
            i = m.traced
            k = bisect.bisect_right(trace, now, lo=i) - i  # at least one: trace[i] is `first`
            m.traced = i + k
        else:
            k = 1 + poisson(self.rng, self._rate_at((first + now) / 2) * m.popularity * (now - first))
        m.t = now
        self._resample(m, now)
        self.metrics.at(now).counts["arrived"] += k
        routes = self._routes(m) if m.routes_dirty else m.routes
        if len(routes) == 1:
            self._offer(m, routes[0][0], k, first, now, now, False, "no_replica", True)
        else:
            self._dispatch(m, k, first, now, now, fallback=False, reason="no_replica", first=True)

    def _routes(self, m: SimModel) -> list[tuple[SimVersion | None, float]]:
        counts: dict[int | None, int] = {}
        assert m.entry is not None
        for key in catalogue.ROUTING_KEYS:
            try:
                number: int | None = choose_version(m.entry, routing_key=key, ready=self.ready).version
            except RouteError:
                number = None
            counts[number] = counts.get(number, 0) + 1
        n = len(catalogue.ROUTING_KEYS)
        m.routes = [(m.versions[k] if k is not None else None, c / n) for k, c in sorted(counts.items(), key=str)]
        m.routes_dirty = False
        return m.routes

    def _dispatch(
        self, m: SimModel, k: int, lo: float, hi: float, now: float, *, fallback: bool, reason: str, first: bool = False
    ) -> None:
        """`first`: the cohort's earliest row arrived at `lo` exactly (a cohort from `_advance`); the others
        are uniform over [lo, hi]."""
        routes = self._routes(m) if m.routes_dirty else m.routes
        if len(routes) == 1:
            self._offer(m, routes[0][0], k, lo, hi, now, fallback, reason, first)
            return
        left, share_left = k, 1.0
        # The earliest row is any one of the k, so it goes to a version in proportion to its rows.
        holder = int(self.rng.random() * k) if first else -1
        for i, (v, share) in enumerate(routes):
            n = left if i == len(routes) - 1 else binomial(self.rng, left, share / share_left)
            share_left -= share
            left -= n
            if n:
                self._offer(m, v, n, lo, hi, now, fallback, reason, 0 <= holder < n)
                holder -= n

    def _offer(
        self,
        m: SimModel,
        v: SimVersion | None,
        k: int,
        lo: float,
        hi: float,
        now: float,
        fallback: bool,
        reason: str,
        first: bool = False,
    ) -> None:
        if v is None or not v.ready_count:
            self._refused(m, k, lo, hi, now, fallback, reason, first)
            return
        v.arrivals_total += k
        queue = v.queue
        timeout = self.timeout
        rows = queue.rows + k
        if rows <= v.max_batch and rows <= self.max_queue:
            # The usual case, `_admissible`'s first answer inline (it runs per cohort): all rows join a batch
            # that is not full yet, in one piece, when the device's in-flight remainder plus one full batch
            # of each of its versions fits the deadline.
            home = self._home(v)
            in_flight = home.busy_until - now
            if (in_flight if in_flight > 0 else 0.0) + home.ready_turn <= (lo + timeout - now) * HEADROOM:
                queue.put(Pending((lo, hi, fallback, first), k, lo, lo + timeout, 1, k))
                v.share.add(1, v.full_batch * k / v.max_batch, now)
                if fallback:
                    self._kick(v, now)
                return
        admit = self._admissible(v, k, now, lo + timeout)
        why = "deadline"
        room = self.max_queue - queue.rows
        if admit > room:
            admit, why = room, "queue_full"
        split = lo + (hi - lo) * admit / k
        if admit > 0:
            self._put(v, admit, lo, split, fallback, first)
            v.share.add(1, v.full_batch * admit / v.max_batch, now)
            if fallback:
                self._kick(v, now)
        if admit < k:
            v.refused_total += k - admit
            self._refused(m, k - admit, split, hi, now, fallback, why, first and admit == 0)

    def _refused(
        self, m: SimModel, k: int, lo: float, hi: float, now: float, fallback: bool, reason: str, first: bool = False
    ) -> None:
        fb = m.fallback
        if fallback or fb is None:
            self.metrics.shed(now, k, reason)
            return
        self._advance(fb, now)  # its own earlier arrivals queue first
        self._dispatch(fb, k, lo, hi, now, fallback=True, reason=reason, first=first)

    @staticmethod
    def _home(v: SimVersion) -> Device:
        """The device admission estimates `v`'s completion against: its first ready replica's."""
        for r in v.replicas:
            if r.ready:
                return r.device
        raise LookupError(f"{v.key} has no ready replica")

    def _admissible(self, v: SimVersion, k: int, now: float, deadline: float) -> int:
        """How many of `k` rows admission lets in: all, or the largest prefix whose estimate fits."""
        replicas = v.ready_count
        home = self._home(v)
        in_flight = home.busy_until - now if home.busy_until > now else 0.0
        queued = v.queue.rows
        if queued + k <= v.max_batch and in_flight + home.ready_turn <= (deadline - now) * HEADROOM:
            # Within one batch, `completion_seconds` is at most the in-flight remainder plus one full batch
            # of every version on the device, and that already fits: its verdict would be to admit.
            return k
        own = VersionLoad(queued // replicas, v.max_batch, v.estimate)
        # The others' queues are shared by their replicas, and so is the work arriving for them (a node sums
        # its versions' shares in one `DeviceShare`; here each replica's part of its version's).
        others = []
        coming = batches = handed = 0.0
        # The version whose batch is on the device takes its next turn after this request's first batch when
        # that batch outlasts the request's window (`completion_seconds`'s `first`), as on a node.
        running = home.batch_version if in_flight > 0 else None
        first = hands_first(
            on_device=running is not None, own_on_device=running is v, running_left=in_flight, window=v.window
        )
        for r in home.hosted:
            if r.ready and (o := r.version) is not v:
                part = o.share.total(now) / o.ready_count
                coming += part
                if part >= ACTIVE_SHARE:  # a version nothing arrives for takes no turn
                    batches += o.full_batch
                    if first and o is running:
                        handed += o.full_batch
                if o.queue.rows:
                    others.append(VersionLoad(o.queue.rows // o.ready_count, o.max_batch, o.estimate, o is running))
        arrivals = Arrivals(coming, batches, handed) if coming > 1e-9 else None
        horizon = deadline - now

        def fits(rows: int) -> bool:
            c = completion_seconds(
                own=own,
                rows=-(-rows // replicas),
                others=others,
                in_flight=in_flight,
                arrivals=arrivals,
                horizon=horizon,
                first=first,
            )
            return decide(now=now, deadline=deadline, priority=1, completion=c).admit

        if fits(k):
            return k
        good, bad = 0, k
        while bad - good > 1:
            mid = (good + bad) // 2
            if fits(mid):
                good = mid
            else:
                bad = mid
        return good

    def _put(self, v: SimVersion, k: int, lo: float, hi: float, fallback: bool, first: bool = False) -> None:
        """Queue `k` rows in pieces cut where the backlog's full batches end; the first piece holds the
        cohort's earliest row when `first`."""
        queue, mb, timeout = v.queue, v.max_batch, self.timeout
        span = hi - lo
        done = 0
        room = mb - queue.rows % mb
        while done < k:
            n = k - done if k - done < room else room
            a = lo + span * done / k
            queue.put(Pending((a, lo + span * (done + n) / k, fallback, first), n, a, a + timeout, 1, n))
            first = False
            done += n
            room = mb

    def _kick(self, v: SimVersion, now: float) -> None:
        """Wake an idle device of `v` for work that arrived without its model's own arrivals (a fallback);
        when all are busy, each takes a turn when its batch ends."""
        for r in v.replicas:
            d = r.device
            if r.ready and d.busy_until <= now:
                if d.wake_at > now:
                    d.wake_at = now
                    self._push(now, WAKE, d)
                return
        for r in v.replicas:
            if r.ready:
                self._recheck(r.device, now)

    # --- devices --------------------------------------------------------------------------------
    def _serve(self, dev: Device, now: float) -> None:
        """One device turn: the next hosted version (round robin) with a batch to leave runs it."""
        hosted = dev.hosted
        n = len(hosted)
        wake = INF
        start = dev.rr
        for i in range(n):
            j = (start + i) % n
            r = hosted[j]
            if not r.ready:
                continue
            v = r.version
            m = v.model
            if m.next_arrival <= now:
                self._advance(m, now)
            queue = v.queue
            rate = m.rate * v.weight
            if not queue.rows:
                # Nothing waits: the next batch starts gathering at the model's next arrival and leaves
                # when full (expected) or when its window closes, whichever comes first. Waking then
                # instead of at each arrival saves a turn per row; a batch that fills sooner than expected
                # leaves then, at most the expected fill time late.
                if rate > 0:
                    at = m.next_arrival + min(v.window, v.max_batch / rate)
                    if at < wake and not (v.ready_count > 1 and self._covered(v, dev, at)):
                        wake = at
                continue
            d = queue.poll(now)
            for p in d.expired:
                self.metrics.expired(p.deadline, p.payload[0], p.payload[1], p.rows)
            if d.batch:
                dev.rr = (j + 1) % n
                self._run(dev, v, d.batch, now)
                return
            asked = d.wake_at
            if asked is not None:
                if rate > 0:  # it may fill before its window closes
                    fill = max(now + (v.max_batch - queue.rows) / rate, m.next_arrival)
                    if fill < asked:
                        asked = fill
                if asked < wake and not (v.ready_count > 1 and self._covered(v, dev, asked)):
                    wake = asked
            elif queue.rows and m.next_arrival < wake:
                wake = m.next_arrival
        if wake < dev.wake_at or dev.wake_at <= now:
            dev.wake_at = wake
            if wake < INF:
                self._push(wake, WAKE, dev)

    def _run(self, dev: Device, v: SimVersion, batch: list[Pending], now: float) -> None:
        rows = 0
        for p in batch:
            rows += p.rows
        jitters = self._jitters
        if not jitters:
            jitters.extend(self.draws.lognormal(*self.jitter, BLOCK).tolist())
        dur = v.times[rows] * jitters.pop() * v.slowdown
        end = now + dur
        dev.busy_until = end
        dev.batch_version = v
        dev.batch_rows = rows
        v.last_used = now
        dev.busy_seconds += dur
        w = self.metrics.at(end)
        record, counts = w.pieces.extend, w.counts
        served = 0
        for p in batch:
            lo, hi, fb, first = p.payload
            if end <= p.deadline:
                counts["fallback" if fb else "served"] += p.rows
                served += p.rows
                # Its latencies, as `Metrics.flush` reads them: a piece holding its cohort's earliest row has
                # that row at lo exactly (it opened the batch window), the others spread over [lo, hi].
                record((end - lo, hi - lo, first, p.rows))
            else:  # the deadline timer answers 504 first
                self.metrics.expired(p.deadline, lo, hi, p.rows)
        dev.work_seconds += served * v.best_row
        # The device's next turn: when the first batch of its versions would leave (`_due`), or at `end` if
        # that comes first. A turn at `end` would mostly find nothing due and ask again later; skipped, the
        # device goes on then. What the plan could not see (a tick's new arrival times, a fallback's rows, a
        # replica coming or going) calls `_recheck`, which puts the turn back at `end`. A version with other replicas
        # counts only if this device is its waker (after the hand-off: the replica that frees first).
        wake = INF
        for r in dev.hosted:
            if not r.ready:
                continue
            o = r.version
            if o.ready_count > 1:
                self._hand_off(o, dev, now, end)
                if o.waker is not dev:
                    continue
            at = self._due(o, now)
            if at < wake:
                wake = at
        if wake < end:
            wake = end
        dev.wake_at = wake
        if wake < INF:
            self._push(wake, WAKE, dev)

    def _due(self, v: SimVersion, now: float) -> float:
        """When `v`'s next batch would leave as far as what waits now and its model's next arrival tell: the
        window from the oldest row waiting, else from the next arrival, earlier when the expected arrivals
        fill the batch first (or the oldest row's deadline less the batch's compute comes first); now when a
        full batch waits. The idle-device wake-up of `_serve`, where no poll has answered yet."""
        m = v.model
        rate = m.rate * v.weight
        queue = v.queue
        waiting = queue.rows
        if not waiting:
            return m.next_arrival + min(v.window, v.max_batch / rate) if rate > 0 else INF
        if waiting >= v.max_batch:
            return now
        oldest = queue.oldest_arrival(1)
        assert oldest is not None
        at = oldest + v.window
        late = oldest + self.timeout - v.times[waiting]
        if late < at:
            at = late
        if rate > 0:
            fill = now + (v.max_batch - waiting) / rate
            if fill < at:
                at = fill
        return at

    def _covered(self, v: SimVersion, dev: Device, at: float) -> bool:
        """Whether another device of `v`'s, its waker, already takes a turn by `at`; else `dev` becomes the
        waker. Replicas share the version's queue, so n idle ones would each wake for the same batch and all
        but one find it gone."""
        w = v.waker
        if w is not None and w is not dev and w.wake_at <= at:
            return True
        v.waker = dev
        return False

    def _hand_off(self, v: SimVersion, dev: Device, now: float, end: float) -> None:
        """`dev` starts a batch (until `end`) and `v`, one of its versions, has other replicas: their waker
        takes a turn when it is free and `v`'s next batch is due (`_due`, which the batch just taken moved).
        When `dev` was the waker, or none was, the replica's device that frees first (idle ones now, `dev` at
        `end`) becomes it."""
        w = v.waker
        if w is None or w is dev:
            w, free = dev, end
            for r in v.replicas:
                d = r.device
                if r.ready and d is not dev:
                    f = d.busy_until if d.busy_until > now else now
                    if f < free:
                        w, free = d, f
            v.waker = w
        else:
            free = w.busy_until if w.busy_until > now else now
        if w is not dev:
            at = self._due(v, now)
            if at < free:
                at = free
            if at < w.wake_at:
                w.wake_at = at
                self._push(at, WAKE, w)

    def _ready(self, r: Replica, now: float) -> None:
        if r.removed:
            return
        r.ready = True
        v = r.version
        v.ready_count += 1
        v.waker = None
        if v.ready_count == 1:
            v.model.routes_dirty = True
        d = r.device
        d.refresh()
        self._recheck(d, now)

    # --- control: scaling ticks -----------------------------------------------------------------
    def _tick(self, now: float) -> None:
        for m in self.models:
            self._advance(m, now)
            self._resample(m, now)
        phase = self.sc.scaling.tick_phase
        if now < phase:
            # The opening turn, before the first scaling tick (a twin ticks where its real fleet's ticks ran): the
            # devices plan their turns for the arrivals to come, and nothing is decided yet.
            self._plan_turns(now)
            self._push(phase, TICK)
            return
        last = self._last_tick
        if now > last:
            keep = math.exp(-(now - last) / 10.0)
            for v in self.versions:
                v.observed = keep * v.observed + (1 - keep) * (v.arrivals_total - v.counted) / (now - last)
                v.counted = v.arrivals_total
        self._last_tick = now
        for v in self.versions:
            v.in_service = 0
        for d in self.fleet.powered():
            if d.busy_until > now and d.batch_version is not None:
                d.batch_version.in_service += d.batch_rows
        # What no policy scales is left as it is (placement alone may evict it).
        desired = {v: n for v, n in self.policy.desired(now).items() if v.family.autoscaled}
        self._reconcile(desired, now)
        self._plan_turns(now)
        self._gauges(now, desired)
        self.metrics.flush(now - self.sc.window)
        if now + self.sc.scaling.tick <= self.end:
            self._push(now + self.sc.scaling.tick, TICK)
        if self.duration <= now < self.duration + self.sc.scaling.tick:
            self._snapshot(now)

    def _plan_turns(self, now: float) -> None:
        for v in self.versions:  # replicas may have come or gone: the devices' turns below claim anew
            v.waker = None
        for d in self.fleet.powered():
            if d.busy_until > now:
                self._recheck(d, now)  # new arrival times, replicas come or gone
            elif d.hosted:
                self._serve(d, now)

    def _reconcile(self, desired: dict[SimVersion, int], now: float) -> None:
        grow = []
        for v, want in desired.items():
            have = staying(v)
            if want < have:
                for _ in range(have - want):
                    was_ready = v.ready_count
                    if self.fleet.remove(v, now) is None:
                        break
                    if was_ready and not v.ready_count:
                        self._unload(v, now)
            elif want > have:
                grow.append((v, want - have))
        for v, extra in sorted(grow, key=lambda g: -g[0].memory_bytes):
            for _ in range(extra):
                if self.fleet.add(v, now) is None:
                    break
        for _, evicted in self.fleet.evicted[self._evictions_seen :]:
            if evicted.ready and not evicted.version.ready_count:
                self._unload(evicted.version, now)
        self._evictions_seen = len(self.fleet.evicted)
        self.fleet.consolidation_step(now)  # the reconciler's consolidation step, after its placement
        for at, replica in self.fleet.events:
            self._push(at, READY, replica)
        self.fleet.events.clear()

    def _unload(self, v: SimVersion, now: float) -> None:
        """The last ready replica left: what waits for it is answered 503 at once."""
        v.model.routes_dirty = True
        for p in v.queue.drain():
            self.metrics.shed(now, p.rows, "unloaded")

    def _gauges(self, now: float, desired: dict[SimVersion, int]) -> None:
        g = self.metrics.gauge
        powered = self.fleet.powered()
        busy = sum(d.busy_seconds for ds in self.fleet.devices.values() for d in ds)
        on = sum(d.on_seconds + (now - d.on_since if d.on else 0.0) for ds in self.fleet.devices.values() for d in ds)
        work = sum(d.work_seconds for ds in self.fleet.devices.values() for d in ds)
        last = getattr(self, "_last_gauge", None)
        if last is not None and on > last[1]:
            g(now, "utilisation", (busy - last[0]) / (on - last[1]))
            g(now, "work_utilisation", (work - last[2]) / (on - last[1]))
        self._last_gauge = (busy, on, work)
        g(now, "devices", len(powered))
        g(now, "replicas_ready", sum(v.ready_count for v in self.versions if v.family.autoscaled))
        g(now, "replicas", sum(staying(v) for v in self.versions))
        g(now, "moving", len(self.fleet.moves))  # consolidation moves in flight: each a second copy loading
        g(now, "queued", sum(v.queue.rows for v in self.versions))
        for kind, ds in self.fleet.devices.items():
            g(now, f"devices_{kind}", sum(1 for d in ds if d.on))

    def _snapshot(self, now: float) -> None:
        """Totals over the scenario's duration (the drain after it is not billed)."""
        per_kind: dict[str, dict[str, float]] = {}
        for kind, ds in self.fleet.devices.items():
            on = sum(d.on_seconds + (now - d.on_since if d.on else 0.0) for d in ds)
            busy = sum(d.busy_seconds for d in ds)
            work = sum(d.work_seconds for d in ds)
            per_kind[kind] = {"on_seconds": on, "busy_seconds": busy, "work_seconds": work}
        self.snap = {"at": now, "kinds": per_kind}  # type: ignore[dict-item]

    def _finish(self) -> None:
        """After the last deadline, nothing may still wait: what does was never run, and timed out."""
        for v in self.versions:
            for p in v.queue.drain():
                self.metrics.expired(p.deadline, p.payload[0], p.payload[1], p.rows)
        self.metrics.flush(math.inf)

    def _result(self, wall: float, cpu: float) -> dict[str, Any]:
        return summarise(self, wall, cpu)


def simulate(scenario: Scenario, policy: str, **kwargs: Any) -> dict[str, Any]:
    return Simulation(scenario, policy, **kwargs).run()
