"""Admission: may a request join a queue, given everything already waiting for the same device?

Plain Python, time passed in: the node calls it per request and the fleet simulator can call the
same functions. All versions hosted on a node share one device thread, so a request's wait is not
its own queue's work alone. The device runs one batch at a time and each version has at most one
batch in flight, so the versions take turns: while the newcomer's version runs the `rounds`
batches up to and including the newcomer's, every other version with work runs at most `rounds`
batches of its own. Hence

    completion = in-flight remainder + own work (rows ahead + own rows)
                 + max(sum over other versions of min(their queued work, rounds x their full-batch time),
                       min(that + the work arriving for them within the request's time left,
                           rounds x one full batch of each of them))

(what arrives meanwhile takes its turns too: the others' recent admitted device share, `Arrivals`, counting
the full batches only of versions work arrives for; and a version whose batch is on the device when the
request's is handed to it takes one turn fewer, `first`).

Two corrections make that an estimate of the answer's time rather than the device's:
- work of higher priority that arrives later in the same version's queue runs first, so a lower
  tier's completion is divided by the share of the device its version's higher tiers leave it
  (`1 - rho_higher`, from the recent device work they were admitted with: the priority queue's
  usual slowdown factor);
- the estimate covers the device and its hand-back to the event loop, not parsing, encoding or
  the network, so a request must fit `HEADROOM` of its remaining budget.

A request is admitted when its corrected completion fits that; lower priority tiers must meet a
tighter share of their budget (`tier_share`), so they are shed first as the backlog grows.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from serving.policies.batching import tier_share

Estimate = Callable[[int], float]

HEADROOM = 0.8  # share of the remaining budget the device estimate may use; the rest is the front end's
MAX_HIGHER_SHARE = 0.9  # past this share of the device taken by higher tiers, a lower tier is not admitted


class DeviceShare:
    """Device seconds per second admitted, per priority tier, decaying over `tau` seconds."""

    def __init__(self, tau: float = 1.0) -> None:
        self.tau = tau
        self._levels: dict[int, tuple[float, float]] = {}  # priority -> (value, as of)
        self._top = math.inf  # the highest tier (lowest number) ever admitted

    def add(self, priority: int, seconds: float, now: float) -> None:
        self._levels[priority] = (self._decayed(priority, now) + seconds / self.tau, now)
        if priority < self._top:
            self._top = priority

    def higher_than(self, priority: int, now: float) -> float:
        """Share of the device taken by tiers above `priority` (lower numbers), recently."""
        if priority <= self._top:  # nothing above it was ever admitted: the usual case, one tier
            return 0.0
        total = 0.0
        for p in self._levels:
            if p < priority:
                total += self._decayed(p, now)
        return total

    def total(self, now: float) -> float:
        """Device seconds per second admitted recently, every tier: the work arriving for this version."""
        return sum(self._decayed(p, now) for p in self._levels)

    def _decayed(self, priority: int, now: float) -> float:
        value, at = self._levels.get(priority, (0.0, now))
        return value * math.exp(-(now - at) / self.tau) if now > at else value


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs a microsecond per request
class VersionLoad:
    """One version's queued work on the device: rows waiting, its largest batch, its compute estimate."""

    rows: int
    max_batch: int
    estimate: Estimate
    handed: bool = False  # a batch of it is on the device or handed to it: its next one waits for that

    def seconds(self) -> float:
        return work_seconds(self.rows, self.max_batch, self.estimate)


@dataclass(slots=True)
class Verdict:
    admit: bool
    completion: float  # estimated seconds from now until this request's answer
    reason: str = ""  # why it was refused: "deadline", "tier"


def work_seconds(rows: int, max_batch: int, estimate: Estimate) -> float:
    """Compute time for `rows` queued rows run in full batches, then the remainder."""
    if rows <= 0:
        return 0.0
    full, rest = divmod(rows, max_batch)
    return full * estimate(max_batch) + (estimate(rest) if rest else 0.0)


# A version whose admitted device share is under this takes no turn worth counting while a request waits: the
# cap on the others' arriving work (`Arrivals.full_batches`) counts one full batch of each version at or above
# it only. Counting every hosted version's, idle ones too, made the cap of a node hosting several models
# larger than any request's budget, so a busy neighbour's arrivals alone refused every request of a quiet
# version: a fallback beside its saturated primary was refused at every step of the overload benchmark
# (docs/benchmarks/overload.md, distributed mode, 2026-12-05).
ACTIVE_SHARE = 0.01


@dataclass(slots=True)
class Arrivals:
    """The work arriving for the other versions on the device: their admitted device seconds a second, summed
    (each version's `DeviceShare`, callers' tiers for a caller), and one full batch of each of them with a
    share of ACTIVE_SHARE or more, summed (the most of it that runs in one round: a version nothing arrives
    for takes no turn)."""

    seconds_per_second: float
    full_batches: float
    handed: float = 0.0  # of `full_batches`, those of versions with a batch on the device (`VersionLoad.handed`)


def hands_first(*, on_device: bool, own_on_device: bool, running_left: float, window: float) -> bool:
    """`completion_seconds`'s `first`: whether a request's first batch is handed to the device before the batch
    running there ends. Something is on the device (`on_device`), nothing of the request's own version (its next
    batch would wait for that one), and what is left of the running batch outlasts the version's batch window."""
    return on_device and not own_on_device and running_left >= window


def completion_seconds(
    *,
    own: VersionLoad,
    rows: int,
    others: Iterable[VersionLoad],
    in_flight: float,
    arrivals: Arrivals | None = None,
    horizon: float = 0.0,
    first: bool = False,
) -> float:
    """Estimated time until a request of `rows` rows, queued behind `own.rows`, is answered.

    `first`: the request's first batch is handed to the device before the batch on it now ends (the caller
    knows: what is left of that batch outlasts the version's batch window, and no batch of the request's own
    version is on the device). A version has one batch on the device at most and hands it its next only once
    that one ends, so then every version with a batch on the device (`handed`) takes its next turn after the
    request's: one turn fewer than the others in the request's rounds. Counting it a full turn, a fallback
    packed beside its saturated primary was charged a batch of the primary it never waits for, and refused at
    every step of the overload benchmark (docs/benchmarks/overload.md, distributed mode, 2026-12-05).

    The other versions' turns come from the work they have queued now and from the work that arrives for them
    while the request waits: `arrivals` over `horizon` (the caller passes the request's time left), at most
    one full batch of each a round. Counting the queued work alone, a version packed beside busy others was
    admitted on a wait they then lengthened by a batch each round, and answered late. The arrivals are one
    sum for all the others, not a term each: a node hosting a hundred versions reads it in one step per
    request (`Node._completion` keeps it as one `DeviceShare`; a term each cost 58 us a request there
    against 4 us without), so the others' queued work and arrivals share one cap, a full batch of each of
    them a round, where a term each would cap every version apart. Over the time left, not over the wait
    itself: the least wait that its own arrivals do not lengthen (a fixed point) was tried, and in the
    simulator let more admitted requests miss their deadline (spike-3x 0.05% against 0.02%, 16 packed
    versions rising together 1.1% against 0.4%) for no more served: admission bounds the slow tail, and an
    admitted request waits at most its time left."""
    total = own.rows + rows
    rounds = math.ceil(total / own.max_batch)
    turns = 0.0  # the others' work that runs before the request's last batch
    for other in others:
        if other.rows:
            its_rounds = rounds - 1 if first and other.handed else rounds
            turns += min(other.seconds(), its_rounds * other.estimate(other.max_batch))
    if arrivals is not None and horizon > 0.0 and arrivals.seconds_per_second > 0.0:
        # What is queued now arrived recently too (the share counts it): queued and arriving share one cap,
        # a full batch of each other version a round (one fewer of each with a batch on the device, `first`).
        most = rounds * arrivals.full_batches - (arrivals.handed if first else 0.0)
        turns = max(turns, min(turns + arrivals.seconds_per_second * horizon, most))
    return in_flight + work_seconds(total, own.max_batch, own.estimate) + turns


def drain_seconds(loads: Iterable[VersionLoad], in_flight: float) -> float:
    """How long the device needs to finish everything queued now: the basis of Retry-After."""
    return in_flight + sum(load.seconds() for load in loads)


def retry_after(drain: float) -> float:
    """Whole seconds, at least one: when the backlog that refused this request will have drained."""
    return float(max(1, math.ceil(drain)))


CALIBRATION_TAU_S = 2.0  # how long what answered requests took is remembered
CALIBRATION_MIN_ESTIMATE_S = 0.05  # shorter estimates are mostly fixed costs, not the device's queue
CALIBRATION_QUANTILE = 0.9
CALIBRATION_MIN_SAMPLES = 20  # fewer recent than this: no correction
CALIBRATION_SAMPLES = 512
CALIBRATION_REFRESH_S = 0.1  # the quantile is recomputed at most this often, not per request
MAX_CORRECTION = 4.0


class Calibration:
    """How far the device estimate falls short of the time admitted requests really take, on this node.

    The estimate counts the device's queue at the profile's speed. When the node's process is short of CPU
    (the event loop, parsing and the device thread contending for it), batches start later than the profile
    says, and requests admitted near the edge of their budget miss it: 504s where a quick 503 or the fallback
    was due. `factor` is the CALIBRATION_QUANTILE of took / estimated over the admitted requests answered in
    the last CALIBRATION_TAU_S (took: from admission to the answer, or to the deadline for one that missed
    it), never below 1; the node multiplies each estimate by it before `decide`. A quantile, not a mean: the
    bound is on the slow tail. Only requests estimated at CALIBRATION_MIN_ESTIMATE_S or more teach it (a short
    estimate's error is a request's fixed cost, which HEADROOM covers); with too few of them, it is 1."""

    def __init__(
        self,
        *,
        tau: float = CALIBRATION_TAU_S,
        min_estimate: float = CALIBRATION_MIN_ESTIMATE_S,
        quantile: float = CALIBRATION_QUANTILE,
    ) -> None:
        self.tau = tau
        self.min_estimate = min_estimate
        self.quantile = quantile
        self._samples: deque[tuple[float, float]] = deque(maxlen=CALIBRATION_SAMPLES)  # (when, took / estimated)
        self._factor = 1.0
        self._until = -math.inf

    def observe(self, estimated: float, took: float, now: float) -> None:
        if estimated >= self.min_estimate:
            self._samples.append((now, took / estimated))

    def factor(self, now: float) -> float:
        if now < self._until:
            return self._factor
        self._until = now + CALIBRATION_REFRESH_S
        since = now - self.tau
        while self._samples and self._samples[0][0] < since:
            self._samples.popleft()
        if len(self._samples) < CALIBRATION_MIN_SAMPLES:
            self._factor = 1.0
        else:
            ratios = sorted(r for _, r in self._samples)
            self._factor = min(MAX_CORRECTION, max(1.0, ratios[int(self.quantile * (len(ratios) - 1))]))
        return self._factor


def decide(*, now: float, deadline: float, priority: int, completion: float, higher_share: float = 0.0) -> Verdict:
    """Admit when the corrected completion fits the budget's headroom; a lower tier must fit a tighter share."""
    if higher_share >= MAX_HIGHER_SHARE:
        return Verdict(False, completion, "tier")
    completion = completion / (1.0 - higher_share)
    budget = (deadline - now) * HEADROOM
    if completion <= budget:
        if completion <= budget * tier_share(priority):
            return Verdict(True, completion)
        return Verdict(False, completion, "tier")
    return Verdict(False, completion, "deadline")
