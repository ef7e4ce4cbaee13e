"""The records of what each node holds, per version and tier, written from the nodes' heartbeats at each
placement reconciler step: hot (on the device), warm (in host memory), cold (its artifact in the node's local
disk cache, or on its local storage).
The measured load time per version and accelerator type is the version's `placement_measurements`, which
the nodes report after each load (`serving.tasks.record_placement`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from django.db import transaction

from serving.dataplane.transport import fleet
from serving.models import ModelVersion, Replica, Tier


def tiers(node: fleet.NodeInfo) -> dict[str, str]:
    """Version key -> tier on `node`, hottest first where a key is in several. Cold: its artifact is on the
    node's local disk (`cached`); a version the node serves with its artifact elsewhere has no record there."""
    found = {key: Tier.COLD for key in node.cached}
    found.update({key: Tier.WARM for key in node.warm})
    found.update({key: Tier.HOT for key in node.hot})
    return found


@transaction.atomic
def record(nodes: Sequence[fleet.NodeInfo], versions: Mapping[str, ModelVersion], held: Mapping[str, set[str]]) -> int:
    """Replace the records with what `nodes` hold now; returns the rows written."""
    rows = []
    for node in nodes:
        assigned = held.get(node.name, set())
        for key, tier in tiers(node).items():
            version = versions.get(key)
            if version is not None:
                rows.append(
                    Replica(
                        node=node.name,
                        version=version,
                        tier=tier,
                        assigned=key in assigned,
                        accelerator=node.accelerator,
                    )
                )
    Replica.objects.all().delete()
    Replica.objects.bulk_create(rows)
    return len(rows)
