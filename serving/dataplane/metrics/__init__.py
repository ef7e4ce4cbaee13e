"""The data plane's metrics: Prometheus collectors, the fast counters of the hot path, the node's metrics port,
the busy meter and who may read /metrics.
"""
