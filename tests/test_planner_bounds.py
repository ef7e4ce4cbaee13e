"""The capacity planner cannot be made to run long: every input is bounded, a check stops at its deadline and
says how far it got, a client that leaves stops its check, checks are few at a time, and a check needs a role."""

from __future__ import annotations

import asyncio
import itertools
import time
import urllib.parse

import pytest
from asgiref.testing import ApplicationCommunicator
from prometheus_client import REGISTRY

from serving import planner_runs
from sim.budget import CANCELLED, DEADLINE, Budget, Stopped
from sim.engine import Simulation
from sim.planner import BOUNDS, OutOfRange, WhatIf, scenario_doc
from sim.scenario import from_dict
from tenants.models import Membership
from tests.conftest import tenant

PAGE = "/console/planner/"
PASSWORD = "a-long-test-password"
WAIT_S = 60  # bound on waiting for a check's loop to end; a failure past it, never a timing assertion
# A check that takes seconds of one core (every request its own batch on 200 placed replicas), not one
# that finishes before the test can leave.
SLOW = {
    "rate": "2500",
    "latency_ms": "0.01",
    "batch_window_ms": "0",
    "replicas": "100",
    "models": "2",
    "device": "accelerator",
    "p99_ms": "300",
}
CSRF = "k" * 32  # an unmasked CSRF secret: the cookie and the form field may carry the same one


def user(django_user_model, name: str, role: str | None = None):  # noqa: ANN001, ANN201
    u = django_user_model.objects.create_user(name, password=PASSWORD)
    if role is not None:
        Membership.objects.create(user=u, tenant=tenant(), role=role)
    return u


def checks(outcome: str) -> float:
    return REGISTRY.get_sample_value("ferry_planner_simulations_total", {"outcome": outcome}) or 0.0


# --- bounds -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rate", "1e12"),
        ("rate", "0"),
        ("rate", "nan"),
        ("rate", "inf"),
        ("latency_ms", "1e-9"),
        ("latency_ms", "1e9"),
        ("batch_window_ms", "-1"),
        ("batch_window_ms", "1e9"),
        ("replicas", "1000000"),
        ("models", "0"),
        ("models", "100000"),
        ("p99_ms", "1e12"),
        ("p99_ms", "0"),
    ],
)
def test_an_input_outside_its_range_is_refused_naming_it_and_the_range(
    client,
    django_user_model,
    field,  # noqa: ANN001
    value,
) -> None:
    client.force_login(user(django_user_model, "op", "engineer"))
    low, high = BOUNDS[field]
    resp = client.get(PAGE, {field: value, "device": "accelerator", "format": "json"})
    assert resp.status_code == 400
    assert resp.json()["field"] == field
    assert f"from {low:,g} to {high:,g}" in resp.json()["error"]
    # and the simulation check refuses it the same way, before anything runs
    before = sum(checks(o) for o in ("complete", "deadline", "cancelled", "error"))
    page = client.post(PAGE, {field: value, "device": "accelerator"})
    assert page.status_code == 400
    assert f"from {low:,g} to {high:,g}".encode() in page.content
    assert sum(checks(o) for o in ("complete", "deadline", "cancelled", "error")) == before


def test_what_if_bounds_are_checked_in_plain_python() -> None:
    with pytest.raises(OutOfRange) as caught:
        WhatIf(p99_ms=1e12)
    assert caught.value.field == "p99_ms"
    WhatIf(**{name: high for name, (_, high) in BOUNDS.items()})  # the ends themselves are allowed
    WhatIf(**{name: low for name, (low, _) in BOUNDS.items()})


# --- the simulator's budget -----------------------------------------------------------------------------


def test_the_event_loop_stops_at_its_deadline_on_the_injected_clock() -> None:
    ticks = itertools.count()
    budget = Budget(50, clock=lambda: float(next(ticks)), every=16)  # one "second" per look
    sim = Simulation(from_dict(scenario_doc(WhatIf())), "static", budget=budget)
    with pytest.raises(Stopped) as caught:
        sim.run()
    assert caught.value.reason == DEADLINE
    assert 0 < caught.value.simulated_s < caught.value.duration_s
    assert caught.value.events <= 50 * 16


def test_the_event_loop_stops_when_cancelled() -> None:
    budget = Budget(3600)
    budget.cancelled.set()
    with pytest.raises(Stopped) as caught:
        Simulation(from_dict(scenario_doc(WhatIf())), "static", budget=budget).run()
    assert caught.value.reason == CANCELLED


def test_without_a_budget_the_check_runs_to_its_end() -> None:
    result = Simulation(from_dict(scenario_doc(WhatIf())), "static", budget=Budget(3600)).run()
    assert result["requests"] > 0 and result["unanswered"] == 0


# --- the page ---------------------------------------------------------------------------------------------


def test_a_user_without_a_role_gets_403_on_the_simulation_check(client, django_user_model) -> None:  # noqa: ANN001
    client.force_login(user(django_user_model, "nobody"))
    assert client.get(PAGE, {"format": "json"}).status_code == 200  # the analytic answer stays open
    resp = client.post(PAGE, {"format": "json"})
    assert resp.status_code == 403
    assert "engineer" in resp.json()["error"]
    assert client.post(PAGE, {}).status_code == 403
    # a viewer is no engineer either; platform staff may
    client.force_login(user(django_user_model, "viewer", "viewer"))
    assert client.post(PAGE, {"format": "json"}).status_code == 403
    staff = django_user_model.objects.create_user("staff", password=PASSWORD, is_staff=True)
    client.force_login(staff)
    assert client.post(PAGE, {"format": "json"}).status_code == 200


def test_a_check_past_its_deadline_stops_and_says_how_far_it_got(client, django_user_model, settings) -> None:  # noqa: ANN001
    settings.FERRY_PLANNER_DEADLINE_S = 0  # spent at the loop's first look
    client.force_login(user(django_user_model, "eng", "engineer"))
    before = checks(DEADLINE)
    resp = client.post(PAGE, {"format": "json"})
    assert resp.status_code == 504
    doc = resp.json()
    assert "gave up" in doc["error"] and "deadline" in doc["error"]
    assert 0 <= doc["simulated_s"] < doc["duration_s"]
    assert checks(DEADLINE) == before + 1
    page = client.post(PAGE, {})
    assert page.status_code == 504
    assert b"gave up" in page.content and b"Bottleneck:" in page.content  # the analytic answer stands
    assert planner_runs.SLOTS.running() == 0


def test_a_completed_check_answers_its_figures(client, django_user_model) -> None:  # noqa: ANN001
    client.force_login(user(django_user_model, "eng", "engineer"))
    resp = client.post(PAGE, {"format": "json", "rate": "200"})
    assert resp.status_code == 200
    assert resp.json()["simulation"]["requests"] > 0


def test_slots_one_per_user_and_a_few_per_process() -> None:
    slots = planner_runs.Slots()
    slots.take(1, 2, 5)
    with pytest.raises(planner_runs.Busy) as mine:
        slots.take(1, 2, 5)
    assert mine.value.status == 429 and mine.value.retry_after == 5
    slots.take(2, 2, 5)
    with pytest.raises(planner_runs.Busy) as full:
        slots.take(3, 2, 5)
    assert full.value.status == 503
    slots.give(1)
    slots.take(3, 2, 5)


def test_a_second_check_waits_its_turn_and_a_full_process_says_so(client, django_user_model, settings) -> None:  # noqa: ANN001
    eng = user(django_user_model, "eng", "engineer")
    client.force_login(eng)
    # given a check of this user's running (its slot held)
    planner_runs.SLOTS.take(eng.pk, settings.FERRY_PLANNER_MAX_SIMULATIONS, 5)
    try:
        resp = client.post(PAGE, {"format": "json"})
        assert resp.status_code == 429 and int(resp["Retry-After"]) >= 1
        assert "still running" in resp.json()["error"]
    finally:
        planner_runs.SLOTS.give(eng.pk)
    # given the process runs its maximum of others' checks
    settings.FERRY_PLANNER_MAX_SIMULATIONS = 1
    planner_runs.SLOTS.take(-1, 1, 5)
    try:
        resp = client.post(PAGE, {"format": "json"})
        assert resp.status_code == 503 and int(resp["Retry-After"]) >= 1
    finally:
        planner_runs.SLOTS.give(-1)
    assert client.post(PAGE, {"format": "json", "rate": "200"}).status_code == 200


def _wait(predicate, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {WAIT_S} s")
        time.sleep(0.01)


def test_a_client_that_leaves_stops_its_check(
    transactional_db,
    client,
    django_user_model,  # noqa: ANN001
    settings,
) -> None:
    # config.asgi builds the whole application when imported: only this test needs it
    from config.asgi import application

    settings.FERRY_PLANNER_DEADLINE_S = 600  # only the client's leaving may stop it
    eng = user(django_user_model, "eng", "engineer")
    client.force_login(eng)
    session = client.cookies[settings.SESSION_COOKIE_NAME].value
    body = urllib.parse.urlencode({**SLOW, "csrfmiddlewaretoken": CSRF}).encode()
    cookie = f"{settings.SESSION_COOKIE_NAME}={session}; {settings.CSRF_COOKIE_NAME}={CSRF}"
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": PAGE,
        "raw_path": PAGE.encode(),
        "query_string": b"",
        "root_path": "",
        "server": ("testserver", 80),
        "client": ("127.0.0.1", 50000),
        "headers": [
            (b"host", b"testserver"),
            (b"content-type", b"application/x-www-form-urlencoded"),
            (b"content-length", str(len(body)).encode()),
            (b"cookie", cookie.encode()),
        ],
    }
    before = {o: checks(o) for o in ("complete", "cancelled")}

    async def leave_mid_check() -> None:
        app = ApplicationCommunicator(application, scope)
        await app.send_input({"type": "http.request", "body": body, "more_body": False})
        # when its check runs, the client leaves
        while planner_runs.SLOTS.running() == 0:
            assert not app.future.done(), "the request ended before its check started"
            await asyncio.sleep(0.005)
        await app.send_input({"type": "http.disconnect"})
        await asyncio.wait_for(app.wait(), WAIT_S)

    asyncio.run(leave_mid_check())
    # then the check's loop ends (its thread gives its slot back), cancelled and not run to its end
    _wait(lambda: planner_runs.SLOTS.running() == 0, "the abandoned check stopped")
    _wait(lambda: checks("cancelled") == before["cancelled"] + 1, "the check counted as cancelled")
    assert checks("complete") == before["complete"]
