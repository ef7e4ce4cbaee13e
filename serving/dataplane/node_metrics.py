"""A node process's Prometheus endpoint (`runnode --metrics-port`): the data-plane families this process
writes (ferry_requests_total, ferry_cold_start_seconds, ferry_evictions_total, ferry_artifact_*, ...) plus
the node's own state, read from it at scrape time:

- ferry_node_stream_entries_total{outcome}: stream entries served, expired, claimed from lost nodes,
  malformed, errors (NodeProcess.counts);
- ferry_node_held_requests{model,version}: requests this node took off a stream and holds (queued or
  running), and ferry_queue_depth (the batchers' queues, already a data-plane gauge);
- ferry_node_versions{state}: versions hot (loaded) and cold (servable, loaded on demand);
  ferry_node_version_hot{model,version}: 1 per loaded version;
- ferry_node_memory_used_bytes, ferry_node_memory_budget_bytes;
- ferry_node_version_load_seconds{model,version}: the measured load time of each version loaded here.

Served by prometheus_client's own HTTP server on its own thread: a scrape never waits on the event loop,
and reads only copies of the node's dicts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from serving.dataplane.node_process import NodeProcess

log = logging.getLogger(__name__)


class NodeCollector(Collector):
    def __init__(self, process: NodeProcess) -> None:
        self.process = process

    def collect(self) -> Iterator[Metric]:
        process, node = self.process, self.process.node
        counts = dict(process.counts)
        entries = CounterMetricFamily("ferry_node_stream_entries", "Stream entries this node handled, by outcome",
                                      labels=["outcome"])
        for outcome, n in sorted(counts.items()):
            entries.add_metric([outcome], n)
        yield entries

        held = GaugeMetricFamily("ferry_node_held_requests", "Requests taken off a stream and held (queued or"
                                 " running)", labels=["model", "version"])
        for key, n in sorted(process.held().items()):
            held.add_metric(_labels(key), n)
        yield held

        hosted = dict(node.hosted)
        cold = dict(node.packing.cold)
        versions = GaugeMetricFamily("ferry_node_versions", "Versions this node serves, by state", labels=["state"])
        versions.add_metric(["hot"], len(hosted))
        versions.add_metric(["cold"], len([k for k in cold if k not in hosted]))
        yield versions
        hot = GaugeMetricFamily("ferry_node_version_hot", "1 per version loaded on this node",
                                labels=["model", "version"])
        for key in sorted(hosted):
            hot.add_metric(_labels(key), 1)
        yield hot

        yield GaugeMetricFamily("ferry_node_memory_used_bytes", "Measured footprint of the loaded versions",
                                value=sum(h.runtime.memory_bytes for h in hosted.values()))
        yield GaugeMetricFamily("ferry_node_memory_budget_bytes", "The node's memory budget",
                                value=process.facts.memory_budget)

        loads = GaugeMetricFamily("ferry_node_version_load_seconds", "Measured load time (cold start) of each"
                                  " version on this node", labels=["model", "version"])
        for key, (_footprint, seconds) in sorted(dict(node.packing.measured).items()):
            loads.add_metric(_labels(key), seconds)
        yield loads


def _labels(key: str) -> list[str]:
    model, _, version = key.rpartition(":")
    return [model, version]


def serve(process: NodeProcess, port: int, addr: str = "0.0.0.0") -> object:  # noqa: S104 (a scrape target)
    """Register the node's collector and serve the registry on `port`; returns the server (shutdown())."""
    REGISTRY.register(NodeCollector(process))
    server, _thread = start_http_server(port, addr=addr)
    log.info("node metrics on http://%s:%d/metrics", addr, server.server_port)
    return server
