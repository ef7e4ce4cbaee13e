"""What one autoscaler tick knows of the live system, read from Redis and the registry (control plane).

- Arrivals per version: what was asked of it, admitted or not. Every request a gateway sends is one
  XADD to `ferry:{model:version}:req`, and Redis keeps the stream's `entries-added` (XINFO STREAM,
  Redis 7): a cumulative counter at no cost per request. What the gateways refused before the stream
  (their admission, their own bounds, the stream's bound) is counted beside it (`stream_bound.refused_key`,
  added every second): under overload the admitted alone is about what the replicas already serve, and
  sizing for it would scale out a target utilisation's step per lead time, not to the demand. Both restart
  at 0 when Redis lost its data, which the policy reads as a counter reset. Requests refused while Redis
  is unreachable are in neither.
- Backlog: requests no node has taken. Nodes acknowledge and delete what they answered, so a stream
  holds what waits plus what nodes hold: backlog = XLEN - the group's pending entries. A node reads
  only while it holds fewer than two batches, so a backlog means every replica is full.
- Replicas: live nodes (heartbeats, `serving.dataplane.transport.fleet`) that hold the version hot.
- Settings: the version's latency profile, batch size and latency budget (FERRY_LATENCY_BUDGET_MS, or its
  `default_timeout_ms` where lower: the deadline the gateways give its requests), its measured
  footprint and cold start on the pool's accelerator type (`placement_measurements`, else what
  validation measured), and its `ScalingPolicy`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import redis
from django.conf import settings

from serving.dataplane.node.packing import DEFAULT_COLD_START
from serving.dataplane.transport import fleet, stream_bound
from serving.dataplane.transport.stream_codec import GROUP, request_stream
from serving.policies.autoscale import Observation, ScalingConfig
from serving.policies.batching import LatencyProfile


@dataclass(frozen=True, slots=True)
class StreamStats:
    added: int  # entries ever added (0: no stream)
    backlog: int  # entries no node has taken
    refused: int = 0  # requests gateways refused before the stream

    @property
    def asked(self) -> int:
        """Every request for the version, admitted or not: the autoscaler's arrival counter."""
        return self.added + self.refused


# XINFO STREAM answers with the stream's first and last entries, request bodies of any size: the script
# keeps them in Redis and returns four numbers per stream. KEYS: each stream, then its refusal counter. (One
# script over many streams: on Redis Cluster, whose slots differ per version, run it per stream.)
_STREAM_STATS = """
local out = {}
for i = 1, #KEYS, 2 do
  local key = KEYS[i]
  local refused = tonumber(redis.call('GET', KEYS[i + 1]) or '0')
  local ok, info = pcall(redis.call, 'XINFO', 'STREAM', key)
  if not ok then
    out[#out + 1] = {0, 0, 0, refused}
  else
    local f = {}
    for j = 1, #info, 2 do f[info[j]] = info[j + 1] end
    local pending = 0
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', key)) do
      local h = {}
      for j = 1, #g, 2 do h[g[j]] = g[j + 1] end
      if h['name'] == ARGV[1] then pending = h['pending'] end
    end
    out[#out + 1] = {f['entries-added'], f['length'], pending, refused}
  end
end
return out
"""


def read_streams(client: redis.Redis, keys: Iterable[str]) -> dict[str, StreamStats]:
    keys = list(keys)
    if not keys:
        return {}
    names = [name for k in keys for name in (request_stream(k), stream_bound.refused_key(k))]
    rows = client.register_script(_STREAM_STATS)(keys=names, args=[GROUP])
    return {
        key: StreamStats(int(added), max(0, int(length) - int(pending)), int(refused))
        for key, (added, length, pending, refused) in zip(keys, rows, strict=True)
    }


@dataclass(frozen=True, slots=True)
class Target:
    """A version the autoscaler sizes, as the registry describes it."""

    key: str
    pk: int
    accelerator: str
    config: ScalingConfig
    estimate: LatencyProfile


def target_for(version, policy, accelerator: str, scheduling_delay: float) -> Target:  # noqa: ANN001
    """`version` a ModelVersion (model selected), `policy` its ScalingPolicy."""
    measured = (version.placement_measurements or {}).get(accelerator) or {}
    memory = measured.get("memory_bytes") or version.memory_bytes or version.min_memory_bytes or 0
    cold_start = measured.get("cold_start_seconds")
    if cold_start is None:
        cold_start = version.load_seconds if version.load_seconds is not None else DEFAULT_COLD_START
    # Stored in seconds per batch size, as validation measured them (the snapshot carries the same).
    profile = LatencyProfile({int(b): float(s) for b, s in (version.latency_profile or {}).items()})
    config = ScalingConfig(
        accelerator=accelerator,
        memory_bytes=int(memory),
        cold_start=float(cold_start),
        latency_budget=min(settings.FERRY_LATENCY_BUDGET_MS, version.default_timeout_ms) / 1000,
        max_batch_size=version.max_batch_size,
        target_utilisation=policy.target_utilisation,
        warm_pool=policy.warm_pool,
        min_replicas=version.min_replicas,
        max_replicas=max(policy.max_replicas, version.min_replicas, 1),
        cool_down=policy.cool_down_seconds,
        idle_to_zero=policy.idle_to_zero_seconds if version.min_replicas == 0 else None,
        scheduling_delay=scheduling_delay,
    )
    return Target(f"{version.model.name}:{version.version}", version.pk, accelerator, config, profile)


def pick_accelerator(policy, version, known: Iterable[str]) -> str | None:  # noqa: ANN001
    """The pool a version scales on: its policy's, else its first allowed type, else the first pool known."""
    if policy.accelerator:
        return policy.accelerator
    if version.accelerators:
        return str(version.accelerators[0])
    return next(iter(known), None)


def observe(
    targets: Iterable[Target], streams: Mapping[str, StreamStats], nodes: Iterable[fleet.NodeInfo]
) -> list[Observation]:
    nodes = list(nodes)
    observations = []
    for t in targets:
        stats = streams.get(t.key, StreamStats(0, 0))
        replicas = sum(1 for n in nodes if t.key in n.hot)
        observations.append(
            Observation(t.key, t.config, stats.asked, replicas, t.estimate.estimate, stats.backlog, stats.refused)
        )
    return observations
