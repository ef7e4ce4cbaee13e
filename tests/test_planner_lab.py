"""The capacity lab without a browser: the five cards walk the seed's path (meters and diagram), the curve and
the budget bar say what the analytic model says, a simulation check sweeps a few rates within its bounds, and
"from my fleet" reads usage, measured profiles and nodes, scoped to the caller."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from datetime import timedelta

import pytest
from django.utils import timezone

from rollout.models import Rollout
from serving.models import Artifact, Model, ModelVersion, State, Visibility
from serving.planner_chart import budget_svg, diagram_svg, path_nodes, plot_svg
from serving.planner_fleet import RATE_MINUTES, fleet_inputs, one_request_ms
from serving.planner_views import CARDS
from sim.budget import DEADLINE, Budget
from sim.engine import simulate as run
from sim.planner import (
    HOT_VERSIONS,
    MAX_SIM_REPLICAS,
    SWEEP,
    WhatIf,
    answer,
    curve,
    meters,
    scenario_doc,
    sim_requests,
    simulate,
    sweep_rates,
)
from sim.scenario import from_dict
from tenants.models import Membership
from tests.conftest import tenant
from usage.models import UsageMinute

PAGE = "/console/planner/"
PASSWORD = "a-long-test-password"


def card(key: str) -> WhatIf:
    inputs = next(i for k, _, _, i in CARDS if k == key)
    return WhatIf(**inputs)


def state(w: WhatIf, name: str) -> str:
    a = answer(w)
    return {m.name: m.state for m in meters(w, a)}[name]


def value(w: WhatIf, name: str) -> float:
    a = answer(w)
    return {m.name: m.value for m in meters(w, a)}[name]


def nodes(w: WhatIf) -> set[str]:
    return {n.key for n in path_nodes(w, answer(w))}


# --- the walkthrough -----------------------------------------------------------------------------------------


def test_the_cards_walk_from_one_endpoint_to_packing_as_the_seed_describes() -> None:
    single, batching, gpu, canary, packing = (card(k) for k in ("single", "batching", "gpu", "canary", "packing"))
    # a single CPU endpoint: three boxes, near saturation, its tail over the target, no accelerator
    assert nodes(single) == {"clients", "gateway", "replicas"}
    assert state(single, "Serving capacity") in {"warn", "over"}
    assert state(single, "p99 latency budget") == "over"
    assert state(single, "Accelerator efficiency") == "off"
    # dynamic batching: a batcher, more capacity from the same server, a window spent of p99
    assert nodes(batching) == nodes(single) | {"batcher"}
    assert answer(batching).capacity > answer(single).capacity
    assert answer(batching).window_ms > 0 == answer(single).window_ms
    # GPU-backed autoscaling replicas: a GPU pool, more than one replica and their metrics; every meter ok
    assert nodes(gpu) == nodes(batching) | {"gpu", "metrics"}
    assert answer(gpu).replicas > 1
    assert {m.state for m in meters(gpu, answer(gpu))} == {"ok"}
    # a registry with a canary: registry, traffic split and shadow; a candidate beside each model
    assert nodes(canary) == nodes(gpu) | {"registry", "split", "shadow"}
    assert answer(canary).versions == 2 * answer(gpu).versions
    assert value(canary, "Multi-model packing") > value(gpu, "Multi-model packing")
    # multi-model packing at high throughput: more versions a device than it keeps hot
    assert packing.rate > gpu.rate and packing.models > HOT_VERSIONS
    assert answer(packing).bottleneck == "multi-model packing"
    assert state(packing, "Multi-model packing") == "over"
    # every card can be checked by simulation here
    for key, *_ in CARDS:
        assert answer(card(key)).replicas * card(key).versions <= MAX_SIM_REPLICAS, key


def test_autoscaling_sizes_the_replicas_for_the_target_utilisation() -> None:
    w = replace(card("gpu"), rate=20_000)
    a = answer(w)
    assert a.replicas == a.replicas_needed and a.utilisation <= 0.7
    fixed = answer(replace(w, autoscale=False, replicas=2))
    assert fixed.replicas == 2 and fixed.bottleneck == "serving capacity"


# --- the pictures --------------------------------------------------------------------------------------------


def test_the_curve_rises_with_the_rate_and_is_unbounded_past_capacity() -> None:
    w = WhatIf(rate=1000, replicas=2)
    a = answer(w)
    points = curve(w, a)
    assert points[-1]["rate"] >= 1.25 * a.capacity
    bounded = [p for p in points if p["p99_ms"] is not None]
    assert [p["p99_ms"] for p in bounded] == sorted(p["p99_ms"] for p in bounded)
    assert all(p["p99_ms"] is None for p in points if p["rate"] >= a.capacity)
    assert all(p["throughput"] == pytest.approx(min(p["rate"], a.capacity)) for p in points)
    svg = plot_svg(w, a, points)
    assert f'data-rate="{w.rate:g}"' in svg and 'class="capacity"' in svg and "sim-point" not in svg
    drawn = plot_svg(w, a, points, [{"rate": 500.0, "p99_ms": 20.0, "throughput": 500.0}])
    assert drawn.count('class="sim-point"') == 1


def test_the_budget_bar_is_p99_in_parts() -> None:
    w = WhatIf(rate=2000, models=3)
    a = answer(w)
    assert a.compute_ms + a.window_ms + a.turn_ms + a.queue_ms == pytest.approx(a.p99_ms)
    svg = budget_svg(w, a)
    assert all(f'data-part="{k}"' in svg for k in ("compute_ms", "turn_ms", "queue_ms"))
    saturated = WhatIf(rate=100_000, replicas=1)
    assert math.isinf(answer(saturated).p99_ms)
    assert "unbounded" in budget_svg(saturated, answer(saturated))


def test_the_diagram_escapes_and_names_its_path() -> None:
    w = card("canary")
    svg = diagram_svg(w, answer(w))
    assert svg.count('class="node"') == len(path_nodes(w, answer(w)))
    assert "off the hot path: Metrics + latency, Shadow traffic" in svg
    assert 'data-edge="split-shadow"' in svg and 'data-edge="registry-replicas"' in svg


# --- the simulation check ------------------------------------------------------------------------------------


def test_a_check_sweeps_a_few_rates_within_the_request_bound() -> None:
    w = card("gpu")
    check = simulate(w, Budget(600), plot=False)
    assert check.stopped is None and check.png is None
    assert [p["rate"] for p in check.points] == [w.rate, *sweep_rates(w)]
    assert 1 < len(check.points) <= 1 + len(SWEEP)
    # the requests of every rate together stay near the one bound (Poisson arrivals: their mean is the bound)
    assert sum(p["requests"] for p in check.points) <= 1.05 * sim_requests(w)
    assert all(p["p99_ms"] is not None and p["throughput"] > 0 for p in check.points)


def test_a_deadline_during_the_sweep_keeps_the_points_done() -> None:
    w = card("gpu")
    # how often the budget's start and the first run read the clock (the runs are seeded: the same each time)
    looks = itertools.count()
    first = from_dict(scenario_doc(w, requests=sim_requests(w) / 2))
    run(first, "static", budget=Budget(1, clock=lambda: next(looks) * 0.0))
    first_run = next(looks)
    # a clock that passes the deadline right after them: the sweep stops at its first look
    reads = itertools.count()
    check = simulate(w, Budget(1, clock=lambda: 0.0 if next(reads) < first_run else 10.0), plot=False)
    assert check.stopped == DEADLINE
    assert [p["rate"] for p in check.points] == [w.rate]
    assert check.points[0]["requests"] > 0


# --- the page ------------------------------------------------------------------------------------------------


def test_the_json_answer_carries_the_meters_the_path_and_the_rendered_results(client, django_user_model) -> None:  # noqa: ANN001
    client.force_login(django_user_model.objects.create_user("anyone", password=PASSWORD))
    inputs = {"format": "json", "form": "lab", "rate": "3000", "batching": "on", "canary": "on", "autoscale": "on"}
    doc = client.get(PAGE, inputs).json()  # no device: the GPU box is unticked
    assert [m["key"] for m in doc["meters"]] == [
        "serving-capacity",
        "p99-latency-budget",
        "accelerator-efficiency",
        "replica-fleet-pressure",
        "multi-model-packing",
    ]
    assert doc["meters"][2]["state"] == "off"
    assert "gpu" not in doc["nodes"] and {"split", "registry", "shadow"} <= set(doc["nodes"])
    assert 'class="lab-plot"' in doc["html"] and 'class="lab-diagram"' in doc["html"]
    page = client.get(PAGE)
    assert b"static/ferry/planner.js" in page.content and b"<script>" not in page.content


def test_the_check_answers_its_points_and_draws_them(client, django_user_model) -> None:  # noqa: ANN001
    eng = django_user_model.objects.create_user("eng", password=PASSWORD)
    Membership.objects.create(user=eng, tenant=tenant(), role="engineer")
    client.force_login(eng)
    resp = client.post(
        PAGE, {"format": "json", "form": "lab", "rate": "3000", "device": "accelerator", "batching": "on"}
    )
    assert resp.status_code == 200
    doc = resp.json()
    assert len(doc["points"]) >= 2 and doc["points"][0]["rate"] == 3000
    assert doc["html"].count('class="sim-point"') == len(doc["points"])
    assert doc["html"].count('class="sim-row"') == len(doc["points"])


# --- from my fleet --------------------------------------------------------------------------------------------


def _version(model: Model, number: int, profile: dict, **extra: object) -> ModelVersion:
    artifact, _ = Artifact.objects.get_or_create(sha256=f"{number:064d}", defaults={"size_bytes": 1})
    return ModelVersion.objects.create(
        model=model,
        version=number,
        artifact=artifact,
        format="torchscript",
        inputs=[],
        outputs=[],
        state=State.READY,
        latency_profile=profile,
        **extra,
    )


def _live(name: str, hot: int, accelerators: int = 0) -> dict:
    resident = [{"key": f"m:{i}", "tier": "hot", "bytes": 1} for i in range(hot)]
    return {"name": name, "state": "live", "accelerator_count": accelerators, "resident": resident}


def test_from_my_fleet_reads_usage_profiles_and_nodes_of_the_callers_tenants(django_user_model, settings) -> None:  # noqa: ANN001
    mine, other = tenant(), tenant("other")
    viewer = django_user_model.objects.create_user("viewer", password=PASSWORD)
    Membership.objects.create(user=viewer, tenant=mine, role="viewer")
    fast = Model.objects.create(name="fast", tenant=mine, visibility=Visibility.PRIVATE)
    slow = Model.objects.create(name="slow", tenant=mine, visibility=Visibility.PRIVATE)
    _version(fast, 1, {"1": 4.0, "8": 6.0}, max_queue_delay_ms=2.0, max_batch_size=8)
    _version(slow, 1, {"4": 40.0}, max_queue_delay_ms=10.0, max_batch_size=1)  # no batch of one: 10 ms a row
    now = timezone.now()
    minute = now.replace(second=0, microsecond=0) - timedelta(minutes=1)
    UsageMinute.objects.create(tenant=mine, model_name="fast", version=1, minute=minute, requests=2400)
    UsageMinute.objects.create(tenant=mine, model_name="slow", version=1, minute=minute, requests=600)
    UsageMinute.objects.create(tenant=other, model_name="fast", version=1, minute=minute, requests=10**6)
    UsageMinute.objects.create(
        tenant=mine, model_name="fast", version=1, minute=minute - timedelta(hours=1), requests=9
    )
    settings.FERRY_LATENCY_BUDGET_MS = 250
    fleet = {"nodes": [_live("a", 3, 1), _live("b", 1), {**_live("c", 7), "state": "lost"}]}

    doc = fleet_inputs(viewer, fleet, now)

    inputs = doc["inputs"]
    assert inputs["rate"] == pytest.approx(3000 / (RATE_MINUTES * 60), abs=0.01)  # the other tenant's not counted
    assert inputs["latency_ms"] == pytest.approx((2400 * 4.0 + 600 * 10.0) / 3000, abs=1e-3)
    assert inputs["batch_window_ms"] == pytest.approx((2400 * 2.0 + 600 * 10.0) / 3000, abs=0.01)
    assert inputs["batching"] is True
    assert (inputs["replicas"], inputs["device"], inputs["models"]) == (2, "accelerator", 2)
    assert inputs["p99_ms"] == 250 and inputs["canary"] is False and doc["missing"] == []
    # a running rollout of one of the caller's models is a canary (its candidate a second version per model)
    Rollout.objects.create(model=fast, candidate=2, baseline=1, phase_started_at=now)
    again = fleet_inputs(viewer, fleet, now)["inputs"]
    assert again["canary"] is True and again["models"] == 1


def test_from_my_fleet_tells_nothing_of_another_tenants_rollouts(django_user_model) -> None:  # noqa: ANN001
    # given another tenant's public model and its model shared with this tenant, each rolling out
    mine, other = tenant(), tenant("other")
    viewer = django_user_model.objects.create_user("viewer", password=PASSWORD)
    Membership.objects.create(user=viewer, tenant=mine, role="viewer")
    staff = django_user_model.objects.create_user("staff", password=PASSWORD, is_staff=True)
    public = Model.objects.create(name="their-public", tenant=other, visibility=Visibility.PUBLIC)
    shared = Model.objects.create(name="their-shared", tenant=other, visibility=Visibility.SHARED)
    shared.shared_with.add(mine)
    now = timezone.now()
    for model in (public, shared):
        _version(model, 1, {"1": 4.0})
        Rollout.objects.create(model=model, candidate=2, baseline=1, phase_started_at=now)
    # when this tenant's viewer reads its fleet / then no rollout is running that it may read
    doc = fleet_inputs(viewer, {"nodes": []}, now)
    assert doc["inputs"]["canary"] is False and doc["sources"]["canary"] == "no rollout is running"
    # while platform staff, who read every rollout, see one
    assert fleet_inputs(staff, {"nodes": []}, now)["inputs"]["canary"] is True


def test_from_my_fleet_says_what_an_empty_fleet_cannot(django_user_model) -> None:  # noqa: ANN001
    staff = django_user_model.objects.create_user("staff", password=PASSWORD, is_staff=True)
    doc = fleet_inputs(staff, {"nodes": []}, timezone.now())
    assert set(doc["missing"]) >= {"rate", "latency_ms", "replicas", "device", "models"}
    assert "rate" not in doc["inputs"]


def test_one_request_from_a_measured_profile() -> None:
    assert one_request_ms({"1": 3.0, "4": 5.0}) == 3.0
    assert one_request_ms({"4": 8.0, "16": 20.0}) == 2.0
    assert one_request_ms({"x": "y", "0": 1.0, "2": float("nan")}) is None
    assert one_request_ms({}) is None


def test_from_my_fleet_needs_a_role_as_the_fleet_page_does(client, django_user_model) -> None:  # noqa: ANN001
    client.force_login(django_user_model.objects.create_user("nobody", password=PASSWORD))
    resp = client.get(PAGE + "fleet/")
    assert resp.status_code == 403 and "viewers" in resp.json()["error"]
    viewer = django_user_model.objects.create_user("viewer", password=PASSWORD)
    Membership.objects.create(user=viewer, tenant=tenant(), role="viewer")
    client.force_login(viewer)
    resp = client.get(PAGE + "fleet/")
    assert resp.status_code == 200 and "inputs" in resp.json()
    assert client.post(PAGE + "fleet/").status_code == 405
