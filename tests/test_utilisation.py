"""Work utilisation: rows served over what the device could serve at its best batch size, beside busy time,
which a batching device reads near 100% at loads far below its capacity."""

from __future__ import annotations

import pytest

from serving.policies.batching import LatencyProfile
from serving.policies.utilisation import best_row_seconds, device_work_utilisation, work_utilisation
from sim import scenario as scenarios
from sim.engine import simulate

# A batch of b rows takes 5 ms + 0.5 ms x b: a batch of 32 serves 32 / 21 ms = 1,524 rows a second.
PROFILE = LatencyProfile({b: 0.005 + 0.0005 * b for b in (1, 2, 4, 8, 16, 32)})
CAPACITY = 32 / PROFILE.estimate(32)


def test_best_row_seconds_is_the_best_batchs_cost_per_row():
    assert best_row_seconds(PROFILE.estimate, 32) == pytest.approx(0.021 / 32)
    assert best_row_seconds(PROFILE.estimate, 1) == pytest.approx(0.0055)
    # a device that served its capacity for the whole powered time reads 1, half of it 0.5
    assert work_utilisation(PROFILE.estimate, 32, CAPACITY * 10, 10.0) == pytest.approx(1.0)
    assert work_utilisation(PROFILE.estimate, 32, CAPACITY * 5, 10.0) == pytest.approx(0.5)
    assert work_utilisation(PROFILE.estimate, 32, 100, 0.0) == 0.0
    both = device_work_utilisation([(PROFILE.estimate, 32, CAPACITY * 2), (PROFILE.estimate, 32, CAPACITY * 3)], 10.0)
    assert both == pytest.approx(0.5)
    with pytest.raises(ValueError):
        work_utilisation(PROFILE.estimate, 32, -1, 1.0)


def one_replica(load: float) -> dict:
    """One version on one device, statically one replica, at `load` x its capacity for 30 s."""
    doc = {
        "name": "one",
        "duration": 30,
        "seed": 3,
        "versions": 1,
        "canary_share": 0.0,
        "fallback_share": 0.0,
        "traffic": {"shape": "steady", "rate": load * CAPACITY},
        "families": {
            "m": {
                "share": 1.0,
                "accelerator": "gpu",
                "memory_gb": 1,
                "max_batch_size": 32,
                "max_queue_delay_ms": 5,
                "profile_ms": {b: 1000 * PROFILE.estimate(b) for b in (1, 2, 4, 8, 16, 32)},
            }
        },
        "fleet": {"gpu": {"nodes": 1, "memory_gb": 8, "speed": 1.0, "cost_per_hour": 1.0, "cold_start": 0}},
        "scaling": {"fixed_replicas": 1, "timeout": 0.3, "max_device_load": 10.0},
        "policies": ["static"],
    }
    return simulate(scenarios.from_dict(doc), "static")


@pytest.mark.parametrize("load", [0.3, 0.5, 0.7])
def test_one_replica_reads_its_load_in_work_and_far_more_in_busy_time(load):
    # Given one replica served at 30%, 50% and 70% of its capacity
    r = one_replica(load)
    # Then the work it did reads the load (within the jitter of the compute and the arrivals)
    assert r["work_utilisation"] == pytest.approx(load, abs=0.04)
    # while its busy time reads well above it: it runs small batches back to back
    assert r["utilisation"] > load + 0.2
