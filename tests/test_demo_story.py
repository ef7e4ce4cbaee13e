"""The demo's story (serving/demo_story.py): a second digits version rolled out through the real transitions to
a wait for an approver, a second tenant's pending quota request, and the bounded traffic that feeds them."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from django.core.management import call_command
from sklearn.datasets import load_digits

from rollout import transitions
from rollout.models import Rollout, RolloutState
from serving import demo_story
from serving.demo_traffic import DemoTraffic
from serving.models import Model, State
from tenants.governance import decide
from tenants.models import Membership, QuotaRequest, Role
from tests.conftest import LiveServer, register
from tests.load import stretched

pytestmark = pytest.mark.django_db


@pytest.fixture
def digits(model_files):  # noqa: ANN001, ANN201
    """`digits` v1 ready and stable, owned by the test tenant (whose policy requires an approval)."""
    register(model_files.digits, "digits")
    return Model.objects.get(name="digits")


def test_the_story_trains_a_candidate_and_starts_a_rollout_once(digits) -> None:  # noqa: ANN001
    lines: list[str] = []
    # when the story is set up: a candidate is trained (briefly here) and registered, and a rollout starts
    version = demo_story.candidate(lines.append, epoch_scale=0.05)
    assert version == 2
    candidate = digits.versions.get(version=2)
    assert candidate.state == State.READY and candidate.metrics["seed"] == demo_story.CANDIDATE_SEED
    rollout = demo_story.rollout(version, lines.append)
    # then it shadows the candidate with the demo's phases and gates, started by the system
    assert rollout.state == RolloutState.SHADOWING and rollout.started_by is None
    assert (rollout.baseline, rollout.candidate, rollout.steps) == (1, 2, demo_story.STEPS)
    assert rollout.max_p99_ratio == demo_story.THRESHOLDS.max_p99_ratio and rollout.min_agreement == 0.95
    assert (rollout.shadow_seconds, rollout.bake_seconds) == (demo_story.SHADOW_SECONDS, demo_story.BAKE_SECONDS)
    digits.refresh_from_db()
    assert digits.shadow_version == 2 and digits.stable_version == 1
    # and a second run keeps that rollout and that candidate
    assert demo_story.candidate(lines.append, epoch_scale=0.05) == 2
    assert demo_story.rollout(2, lines.append).pk == rollout.pk
    assert Rollout.objects.count() == 1


def test_after_a_promotion_the_next_run_rolls_out_the_former_stable_version(
    digits, model_files, django_user_model
) -> None:  # noqa: ANN001
    # given v2 rolled out and promoted by an approver (no step skipped: advanced through each one)
    register(model_files.digits, "digits")
    rollout = demo_story.rollout(2, lambda line: None)
    approver = django_user_model.objects.create_user("approver", password="an-approver-password")
    Membership.objects.create(user=approver, tenant=digits.tenant, role=Role.APPROVER)
    for _ in range(len(demo_story.STEPS) + 1):
        rollout = transitions.advance(rollout=rollout, actor=None)
    assert rollout.state == RolloutState.AWAITING_APPROVAL
    assert transitions.approve(rollout=rollout, actor=approver).state == RolloutState.PROMOTED
    # when the story runs again / then the candidate is v1, the former stable version, without training
    assert demo_story.candidate(lambda line: None) == 1
    again = demo_story.rollout(1, lambda line: None, phase_seconds=5)
    assert again.pk != rollout.pk and (again.baseline, again.candidate) == (2, 1)
    # (phases as short as tests/test_demo_browser.py asks for: the same steps and gates, 5 s bakes)
    assert (again.shadow_seconds, again.bake_seconds, again.steps) == (5, 5, demo_story.STEPS)


def test_no_stable_digits_no_candidate() -> None:
    lines: list[str] = []
    assert demo_story.candidate(lines.append) is None
    assert "no stable version" in lines[0]


def test_the_second_tenant_asks_for_a_quota_once(admin_user) -> None:  # noqa: ANN001
    # when the story sets up tenant acme / then it has an admin and one pending quota request
    request = demo_story.second_tenant(lambda line: None)
    assert request is not None and request.state == QuotaRequest.State.PENDING
    assert request.changes == demo_story.QUOTA_ASK
    assert Membership.objects.get(tenant=request.tenant).role == Role.ADMIN
    assert not request.requested_by.has_usable_password()
    # and a second run finds it pending instead of filing another
    assert demo_story.second_tenant(lambda line: None).pk == request.pk
    # when staff approve it / then later runs file nothing: the quota has what it asked
    decide(request=request, approve=True, note="", actor=admin_user)
    assert demo_story.second_tenant(lambda line: None) is None
    assert QuotaRequest.objects.count() == 1


def test_demo_traffic_off_starts_no_rollout_and_sends_nothing(digits, settings) -> None:  # noqa: ANN001
    settings.FERRY_DEMO_TRAFFIC = False
    call_command("demo_traffic", port=1)  # returns at once: nothing to wait for, no server asked
    call_command("demo_story")
    assert not Rollout.objects.exists() and digits.versions.count() == 1
    assert QuotaRequest.objects.filter(state=QuotaRequest.State.PENDING).count() == 1


def test_traffic_bursts_answer_and_stay_within_their_bound(transactional_db, model_files) -> None:  # noqa: ANN001
    # given a live server with digits
    register(model_files.digits, "digits")
    server = LiveServer().start()
    traffic = DemoTraffic(host="127.0.0.1", port=server.port, key=server.key, rows=load_digits().data, rate=40)
    try:
        assert traffic.ready()
        # when it sends bursts / then each has fewer than 2 x rate x TICK requests, and every request is answered:
        # served, or shed (503) while the version loads or the shared machine lags; never refused or unanswered.
        # At least 20 bursts, and until one request was served: on a machine with a load average of 20 on its 2
        # cores the event loop runs late past FERRY_MAX_LOOP_LAG_MS for seconds, and the front door then rightly
        # sheds every request of 20 bursts; how many bursts that takes depends on the machine, not on the traffic.
        sizes: list[int] = []
        statuses: Counter[int] = Counter()
        deadline = time.monotonic() + stretched(30.0)
        while len(sizes) < 20 or not statuses[200]:
            assert time.monotonic() < deadline, f"none of {len(sizes)} bursts served: {statuses}"
            sizes.append(len(traffic.send_burst()))
            statuses.update(traffic.take_statuses())
            assert set(statuses) <= {200, 503}, statuses  # refused or unanswered fails at once, not at the deadline
        assert all(1 <= n < 2 * 40 * 0.25 for n in sizes) and sum(sizes) > 20
        assert statuses[200] > 0 and set(statuses) <= {200, 503} and statuses.total() == sum(sizes), statuses
        # and a stop asked for ends the loop before its next burst
        traffic.run(stop=lambda: True)
        assert traffic.take_statuses() == {}
    finally:
        traffic.close()
        server.stop()
    # and a rate below one request a second is refused at construction
    with pytest.raises(ValueError):
        DemoTraffic(host="127.0.0.1", port=1, key="k", rows=load_digits().data, rate=0)
