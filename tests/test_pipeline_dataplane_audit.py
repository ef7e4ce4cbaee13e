"""A pipeline's call on the runner alone (a stand-in gateway that routes and decodes as `Gateway.serve` does):
what a routed version of another signature, a broken version, a failing branch and a reused name do.

Each step's model has a stable version (what the snapshot's check typed the pipeline with) and may be routed
to another (a canary, an arm, a pin): one that takes or gives other tensors is refused before it runs, a 503
the pipeline's fallback answers; a version the check marked broken hands the call to the fallback too; a
merge of answers that do not fit is a 503, never a 500; the first branch to fail cancels its siblings; the
console's figures of a name are its current owner's."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import orjson
import pytest

from rollout.routing import RouteTable
from serving.dataplane.errors import ServingError, Unavailable
from serving.dataplane.gateway.pipeline import PipelineRunner, PipelineStats, stats, stats_key
from serving.dataplane.gateway.snapshot import (
    ModelEntry,
    PipelineEntry,
    PipelineVersionEntry,
    RoutingSnapshot,
    VersionEntry,
)
from serving.dataplane.http.protocol import DATATYPES, TensorSpec
from serving.pipelines import delete_pipeline, register_pipeline
from serving.policies.batching import BatchingConfig
from tenants.models import Tenant
from tests.test_api import client_for, people  # noqa: F401 - the fixture
from tests.test_pipeline_api import SWITCH as CASCADE
from tests.test_pipeline_api import models  # noqa: F401 - the fixture

IN = (TensorSpec("input", "FP32", (4,)),)
SCORES = (TensorSpec("scores", "FP32", (4,)),)
WIDER = (TensorSpec("scores", "FP32", (5,)),)
ENSEMBLE = {"ensemble": [{"model": "a"}, {"model": "b"}]}
SWITCH = {
    "sequence": [
        {"model": "a"},
        {"switch": {"tensor": "scores", "op": ">", "value": 0.5}, "then": {"model": "b"}, "else": {"model": "c"}},
    ]
}


def version(model: str, number: int, inputs=IN, outputs=SCORES, max_batch: int = 8) -> VersionEntry:  # noqa: ANN001
    return VersionEntry(
        model, number, "ready", True, "", "torchscript", inputs, outputs, BatchingConfig(max_batch, 0.001, 64), 1000, {}
    )


def model(name: str, *versions: VersionEntry) -> ModelEntry:
    return ModelEntry(name, "", "", None, {v.version: v for v in versions}, routes=RouteTable(stable=1))


class Fleet:
    """What the runner uses of a Gateway: the snapshot and `serve`, which routes a step to `routed[model]`
    (else the pinned or stable version), decodes it as the gateway does, and answers each output of the
    routed version's signature, or what `answers[key]` makes of it (a node answering apart from its
    signature). `hold` keeps a version's step waiting until cancelled."""

    def __init__(
        self, entries: list[ModelEntry], spec: dict, broken: str = "", fallback: str | None = None, owner: int = 7
    ) -> None:
        pipeline = PipelineEntry(
            "p",
            "",
            {1: PipelineVersionEntry(1, spec, IN, SCORES, broken=broken, max_rows=8)},
            1,
            tenant_id=owner,
            visibility="public",
            fallback=fallback,
        )
        self.snapshot = RoutingSnapshot(1, 0.0, {m.name: m for m in entries}, pipelines={"p": pipeline})
        self.hub = SimpleNamespace(current=self.snapshot)
        self.routed: dict[str, int] = {}
        self.answers: dict[str, object] = {}
        self.fail: dict[str, ServingError] = {}
        self.hold: set[str] = set()
        self.ran: list[str] = []
        self.cancelled: list[str] = []

    async def serve(self, request):  # noqa: ANN001, ANN201
        entry_model = self.snapshot.models[request.name]
        number = int(request.version) if request.version else self.routed.get(request.name, 1)
        entry = entry_model.versions[number]
        request.decode(request, entry)
        self.ran.append(entry.key)
        if entry.key in self.hold:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(entry.key)
                raise
        await asyncio.sleep(0)
        if entry.key in self.fail:
            raise self.fail[entry.key]
        outputs = {
            s.name: np.full((request.rows, *(max(d, 1) for d in s.shape)), 0.9, dtype=DATATYPES[s.datatype])
            for s in entry.outputs
        }
        make = self.answers.get(entry.key)
        return SimpleNamespace(outputs=make(outputs) if callable(make) else outputs, entry=entry)


def call(fleet: Fleet, rows: int = 2):  # noqa: ANN201
    body = orjson.dumps(
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": [rows, 4], "data": [0.0] * (4 * rows)}]}
    )
    runner = PipelineRunner(fleet)  # type: ignore[arg-type]
    return asyncio.run(runner.infer("p", None, body, None, None))


def refusal(fleet: Fleet) -> ServingError:
    with pytest.raises(ServingError) as refused:
        call(fleet)
    return refused.value


def test_a_member_routed_to_another_signature_is_a_503_before_it_runs() -> None:
    # given an ensemble whose second model's canary answers FP32 [5] where its stable version answers [4]
    fleet = Fleet([model("a", version("a", 1)), model("b", version("b", 1), version("b", 2, outputs=WIDER))], ENSEMBLE)
    fleet.routed["b"] = 2
    # when it is called / then a 503 that may be retried (not np.stack's 500), and the canary never ran
    refused = refusal(fleet)
    assert refused.status == 503 and refused.retry_after, refused.message
    assert "step 'b'" in refused.message and "version 2" in refused.message, refused.message
    assert "b:2" not in fleet.ran
    # and one that takes another input is refused the same way (it was a 409 that skipped the fallback)
    fleet = Fleet([model("a", version("a", 1)), model("b", version("b", 1), version("b", 2, inputs=WIDER))], ENSEMBLE)
    fleet.routed["b"] = 2
    assert refusal(fleet).status == 503


def test_a_step_mismatch_or_a_broken_version_is_answered_by_the_fallback() -> None:
    fb = model("fb", version("fb", 1))
    # given a routed version of another signature, and the pipeline's fallback of its signature
    fleet = Fleet(
        [model("a", version("a", 1)), model("b", version("b", 1), version("b", 2, outputs=WIDER)), fb],
        ENSEMBLE,
        fallback="fb",
    )
    fleet.routed["b"] = 2
    reply = call(fleet)
    headers = dict(reply.headers)
    assert reply.status == 200 and headers[b"x-ferry-fallback-from"] == b"p:1"
    assert orjson.loads(reply.body)["model_name"] == "fb"
    # given a version the snapshot's check marked broken / then the fallback answers it as well
    fleet = Fleet([model("a", version("a", 1)), model("b", version("b", 1)), fb], ENSEMBLE, "its model changed", "fb")
    reply = call(fleet)
    assert reply.status == 200 and dict(reply.headers)[b"x-ferry-fallback-from"] == b"p:1"
    assert fleet.ran == ["fb:1"]
    # and without a fallback, the broken version's 503 says why
    fleet = Fleet([model("a", version("a", 1)), model("b", version("b", 1))], ENSEMBLE, "its model changed")
    refused = refusal(fleet)
    assert refused.status == 503 and "its model changed" in refused.message


def test_a_fallback_of_another_signature_does_not_answer() -> None:
    # given a step refused (shed), and a fallback whose version gives [5] where the pipeline gives [4]
    fleet = Fleet(
        [model("a", version("a", 1)), model("b", version("b", 1)), model("fb", version("fb", 1, outputs=WIDER))],
        ENSEMBLE,
        fallback="fb",
    )
    fleet.fail["b:1"] = Unavailable("shed", retry_after=1)
    # then the step's refusal is the answer, not the fallback's tensors of another shape, and it never ran
    refused = refusal(fleet)
    assert refused.status == 503 and refused.message == "shed"
    assert "fb:1" not in fleet.ran


@pytest.mark.parametrize(
    ("spec", "apart", "make"),
    [
        # members that answer [2, 4] and [2, 5] although their signatures say [4]: np.stack's ValueError
        (ENSEMBLE, "b:1", lambda out: {"scores": np.ones((2, 5), np.float32)}),
        # a member that answers without the tensor: a KeyError
        (ENSEMBLE, "b:1", lambda out: {"other": out["scores"]}),
        # a switch's branch that answers [1, 6] where the other answers [1, 4]: the merge's ValueError
        (SWITCH, "b:1", lambda out: {"scores": np.ones((len(out["scores"]), 6), np.float32)}),
    ],
)
def test_answers_that_do_not_merge_are_a_503_not_a_500(spec, apart, make) -> None:  # noqa: ANN001
    fleet = Fleet([model(m, version(m, 1)) for m in "abc"], spec)
    if spec is SWITCH:  # row 0 goes to b, row 1 to c
        fleet.answers["a:1"] = lambda out: {"scores": np.array([[0.9] * 4, [0.1] * 4], np.float32)}
    fleet.answers[apart] = make
    refused = refusal(fleet)
    assert refused.status == 503, refused.message
    assert ("ensemble" if spec is ENSEMBLE else "switch") in refused.message


def test_an_answer_of_another_shape_than_the_pipeline_declares_is_refused() -> None:
    # given a one-step pipeline whose node answers [2, 5] though the version's signature says [4]
    fleet = Fleet([model("a", version("a", 1))], {"model": "a"})
    fleet.answers["a:1"] = lambda out: {"scores": np.ones((2, 5), np.float32)}
    # then it is not answered as if it were the declared [4] (the encoder checks no shape)
    refused = refusal(fleet)
    assert refused.status == 503 and "'scores'" in refused.message


def test_an_empty_condition_tensor_is_a_422_not_a_500() -> None:
    # given a switch on a step's variable output, which that step answers empty for this request
    variable = (TensorSpec("scores", "FP32", (-1,), (8,)),)
    fleet = Fleet([model("a", version("a", 1, outputs=variable)), model("b", version("b", 1))], SWITCH)
    fleet.snapshot.models["c"] = model("c", version("c", 1))
    fleet.answers["a:1"] = lambda out: {"scores": np.ones((2, 0), np.float32)}
    # then the condition is not tested on nothing (max of an empty array: a ValueError, a 500)
    refused = refusal(fleet)
    assert refused.status == 422 and "empty" in refused.message, refused.message
    assert fleet.ran == ["a:1"]


def test_the_first_branch_to_fail_cancels_its_siblings() -> None:
    # given an ensemble whose first member is refused at once and whose second waits (a long queue)
    fleet = Fleet([model("a", version("a", 1)), model("b", version("b", 1))], ENSEMBLE)
    fleet.fail["a:1"] = Unavailable("shed", retry_after=1)
    fleet.hold.add("b:1")

    async def run() -> tuple[int, list[str]]:
        runner = PipelineRunner(fleet)  # type: ignore[arg-type]
        body = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [0] * 4}]})
        with pytest.raises(ServingError) as refused:
            await runner.infer("p", None, body, None, None)
        # when the call has answered, before this loop ends (which would cancel what is left anyway)
        return refused.value.status, list(fleet.cancelled)

    status, cancelled = asyncio.run(run())
    # then the waiting member was cancelled: nothing of the call runs on after its answer
    assert status == 503 and cancelled == ["b:1"]


def test_a_reused_name_starts_its_figures_from_nothing() -> None:
    # given tenant 1's pipeline "p" whose step is named after its private model
    stats = PipelineStats()
    first, second = stats_key("p", 1), stats_key("p", 2)
    stats.call(first, fell_back=False)
    stats.step(first, "their-secret", 0.01, 4, refused=False)
    # when the name is tenant 2's pipeline now, and it is called
    stats.call(second, fell_back=False)
    stats.step(second, "mine", 0.01, 4, refused=False)
    # then its figures are its own, and the previous owner's are gone
    assert stats.of(second)["steps"].keys() == {"mine"} and stats.of(second)["calls"] == 1
    assert stats.of(first) == {"calls": 0, "fallbacks": 0, "steps": {}}
    assert set(stats.docs()) == {second}


def test_the_runner_keeps_figures_under_the_pipelines_owner() -> None:
    fleet = Fleet([model("a", version("a", 1)), model("b", version("b", 1))], ENSEMBLE, owner=70)
    call(fleet)
    assert stats.of(stats_key("p", 70))["steps"].keys() == {"a", "b"}
    assert stats.of(stats_key("p", 70))["calls"] == 1


@pytest.mark.django_db(transaction=True)
def test_the_console_shows_a_reused_name_none_of_its_previous_figures(models) -> None:  # noqa: ANN001, F811
    # given another tenant's pipeline "cascade", called in this process, then deleted
    other, acme = Tenant.objects.get(slug="other"), Tenant.objects.get(slug="acme")
    theirs = register_pipeline(name="cascade", spec={"model": "their-secret", "name": "their-step"}, tenant=other)
    stats.call(stats_key("cascade", other.pk), fell_back=False)
    stats.step(stats_key("cascade", other.pk), "their-step", 0.01, 4, refused=False)
    delete_pipeline(pipeline=theirs.pipeline)
    # when Acme registers the name, and a reader of Acme asks for its live figures
    register_pipeline(name="cascade", spec=CASCADE, tenant=acme)
    stats.step(stats_key("cascade", acme.pk), "gone-step", 0.01, 4, refused=False)  # a step no version has
    figures = client_for(models["charlie"]).get("/console/pipelines/cascade/live/").json()
    # then none of the other tenant's figures, nor a step this pipeline does not have
    assert figures["calls"] == 0 and figures["steps"] == {}, figures
