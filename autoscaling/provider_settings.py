"""The node provider the settings name (FERRY_NODE_PROVIDER, FERRY_NODE_POOLS), built once per process."""

from __future__ import annotations

import functools
import os

from django.conf import settings

from autoscaling.providers import KubernetesProvider, LocalProvider, NodeProvider, pools_from


@functools.cache
def provider_from_settings() -> NodeProvider | None:
    kind = settings.FERRY_NODE_PROVIDER
    pools = pools_from(settings.FERRY_NODE_POOLS)
    if kind == "":
        return None
    if kind == "local":
        return LocalProvider(
            pools,
            settings.DATA_DIR / "nodes",
            max_total=settings.FERRY_LOCAL_NODES_MAX,
            env=dict(os.environ),
            cwd=settings.BASE_DIR,
        )
    if kind == "kubernetes":
        return KubernetesProvider(pools, namespace=settings.FERRY_K8S_NAMESPACE)
    raise ValueError(f"FERRY_NODE_PROVIDER={kind!r}: use local, kubernetes, or leave it empty")
