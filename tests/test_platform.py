"""The deployment files validate: Kubernetes manifests against the API's schemas (kubernetes-validate ships
them, so this runs offline), the compose file against the Compose Specification (vendored by
check-jsonschema), and both against Ferry itself (tests/deployment_checks.py). Each check is also shown
to refuse a broken copy.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from django.core.management import get_commands

from serving.dataplane.metrics import node_metrics
from tests import deployment_checks as checks

# The oldest Kubernetes the manifests are written for, and the newest whose schemas the checker ships.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())
# The node process lands with issue 7's node work; until then its command line is checked for shape only.
PENDING = () if "runnode" in get_commands() else ("runnode",)


def k8s_valid(doc: dict) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def web_deployment(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "ferry-web")


def compose_schema() -> dict:
    path = resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json")
    return json.loads(path.read_text())


def compose_valid(doc: dict) -> None:
    schema = compose_schema()
    jsonschema.validators.validator_for(schema)(schema).validate(doc)


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return checks.manifests()


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(checks.COMPOSE.read_text())


# Schemas ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", checks.manifest_files(), ids=lambda p: str(p.relative_to(checks.K8S)))
def test_every_manifest_matches_the_kubernetes_schema(path: Path) -> None:
    for doc in checks.load(path):
        k8s_valid(doc)


@pytest.mark.parametrize(
    "breakage",
    [
        ("misspelt field", lambda d: d["spec"].update(replica=2)),
        (
            "port as a word",
            lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="eight thousand"),
        ),
        ("no containers", lambda d: d["spec"]["template"]["spec"].pop("containers")),
        (
            "probe without a port",
            lambda d: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"].update(
                httpGet={"path": "/v2/health/ready"}
            ),
        ),
    ],
    ids=lambda breakage: breakage[0],
)
def test_the_schema_check_refuses_a_broken_manifest(docs: list[dict], breakage: tuple) -> None:
    # Given the web Deployment, broken one way
    broken = copy.deepcopy(web_deployment(docs))
    breakage[1](broken)
    # Then the schema check refuses it
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_valid(broken)


def test_the_base_kustomization_lists_every_manifest_but_the_secret_template() -> None:
    base = checks.K8S / "base"
    listed = {base / name for name in checks.load(base / "kustomization.yaml")[0]["resources"]}
    on_disk = {p for p in base.glob("*.yaml") if p.name not in ("kustomization.yaml", "secret.example.yaml")}
    assert listed == on_disk


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for its built-in kustomize) is not installed")
@pytest.mark.parametrize("overlay", ["base", "overlays/production"])
def test_kustomize_renders_valid_objects(overlay: str) -> None:
    # When kustomize renders the layer
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(checks.K8S / overlay)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    # Then every object is valid, in Ferry's namespace, and passes Ferry's own checks
    for doc in docs:
        k8s_valid(doc)
        assert doc["kind"] == "Namespace" or doc["metadata"].get("namespace") == "ferry", doc["metadata"]
    secrets = checks.load(checks.K8S / "base" / "secret.example.yaml")
    assert checks.check_manifests(docs + secrets, missing_commands=PENDING) == []
    assert {d["kind"] for d in docs} >= {
        "Deployment",
        "StatefulSet",
        "Service",
        "ConfigMap",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    }


def test_compose_matches_the_compose_specification(compose: dict) -> None:
    compose_valid(compose)


def test_the_compose_check_refuses_a_misspelt_key(compose: dict) -> None:
    broken = copy.deepcopy(compose)
    broken["services"]["web"]["comand"] = broken["services"]["web"].pop("command")
    with pytest.raises(jsonschema.ValidationError):
        compose_valid(broken)


# Ferry's own checks ---------------------------------------------------------------------------------------


def answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status == 200
    except urllib.error.HTTPError:
        return False


def test_manifests_start_real_entry_points_with_real_settings_and_probes(
    docs: list[dict], transactional_db, request
) -> None:  # noqa: ANN001
    # Given a running server that is ready (probes are anonymous, so no key is sent). pytest-django treats
    # a `live_server` argument as its own fixture, so it is asked for by name.
    server = request.getfixturevalue("live_server")
    deadline = time.monotonic() + 60
    while not (server.plane() and server.plane().ready) and time.monotonic() < deadline:
        time.sleep(0.05)

    def path_answers(path: str) -> bool:
        return answers_200(server.url + path)

    # Then every manifest passes: commands, settings, probes, references, least privilege
    assert checks.check_manifests(docs, missing_commands=PENDING, path_answers=path_answers) == []
    # And a probe on a path the server does not answer is caught
    broken = copy.deepcopy(docs)
    web_deployment(broken)["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["path"] = (
        "/v2/health/alive"
    )
    assert checks.check_manifests(broken, missing_commands=PENDING, path_answers=path_answers) == [
        "Deployment ferry-web/web: livenessProbe path /v2/health/alive does not answer 200 on a live server"
    ]


def test_web_as_the_manifest_runs_it_answers_its_liveness_probe(
    docs: list[dict], transactional_db, settings, request
) -> None:  # noqa: ANN001
    # Given a server configured as the web container is: no embedded node, Redis to reach the node processes
    # (none runs here: liveness is about the web process itself)
    web = container(docs, "ferry-web")
    assert {"name": "FERRY_EMBEDDED_NODE", "value": "false"} in web["env"]
    settings.FERRY_EMBEDDED_NODE = False
    settings.REDIS_URL = os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    # The server follows snapshots from Redis, whose serials outrank this process's own: put the process's
    # snapshot back after the server stops (finalizers run last-registered first), for the tests after this.
    from serving.dataplane.gateway.snapshot import hub

    held = hub.current
    request.addfinalizer(lambda: setattr(hub, "current", held))
    server = request.getfixturevalue("live_server")
    # Then the liveness probe's path answers 200 (or the kubelet restarts every web pod)
    assert answers_200(server.url + web["livenessProbe"]["httpGet"]["path"])


def container(docs: list[dict], name: str) -> dict:
    return next(d for d in docs if d["metadata"]["name"] == name)["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(
    "breakage, expected",
    [
        (
            lambda d: container(d, "ferry-web").update(command=["python", "manage.py", "serv", "--port", "8000"]),
            "manage.py has no command 'serv'",
        ),
        (
            lambda d: container(d, "ferry-web").update(
                command=["python", "manage.py", "serve", "--host", "0.0.0.0", "--prot", "8000"]
            ),
            "manage.py serve refuses",
        ),
        (
            lambda d: container(d, "ferry-worker").update(
                command=["celery", "-A", "config", "worker", "--concurency", "2"]
            ),
            "celery refuses",
        ),
        (
            lambda d: container(d, "ferry-beat").update(command=["celery", "-A", "ferry", "beat"]),
            "not Ferry's (-A config)",
        ),
        (
            lambda d: container(d, "ferry-web")["env"].append({"name": "FERRY_EMBEDED_NODE", "value": "false"}),
            "FERRY_EMBEDED_NODE is not a setting",
        ),
        (
            lambda d: next(x for x in d if x["kind"] == "ConfigMap")["data"].update(FERRY_DATADIR="/x"),
            "FERRY_DATADIR is not a setting",
        ),
        (
            lambda d: container(d, "ferry-web")["ports"][0].update(containerPort=8080),
            "serves on 8000, which is not a declared containerPort",
        ),
        (
            lambda d: container(d, "ferry-node-a10g")["securityContext"].update(readOnlyRootFilesystem=False),
            "the root filesystem must be read-only",
        ),
        (
            lambda d: container(d, "ferry-node-a10g")["securityContext"]["capabilities"].update(drop=["NET_RAW"]),
            "must drop ALL capabilities",
        ),
        (
            lambda d: next(x for x in d if x["metadata"]["name"] == "ferry-node-a10g")["spec"]["template"]["spec"][
                "securityContext"
            ].pop("runAsNonRoot"),
            "pods must set runAsNonRoot",
        ),
        (lambda d: container(d, "ferry-node-a10g")["env"].pop(), "set FERRY_TORCH_THREADS below its CPU limit (4)"),
        (
            lambda d: container(d, "ferry-node-a10g")["resources"]["limits"].update(cpu="2000m"),
            "set FERRY_TORCH_THREADS below its CPU limit (2)",
        ),
        (
            lambda d: container(d, "ferry-node-a10g")["resources"]["limits"].pop("nvidia.com/gpu"),
            "a node hosts one GPU",
        ),
        (
            lambda d: container(d, "ferry-node-a10g")["envFrom"][1]["secretRef"].update(name="ferry-secrets"),
            "must not hold SECRET_KEY",
        ),
        (
            lambda d: container(d, "ferry-node-a10g")["volumeMounts"][1].pop("readOnly"),
            "must mount the artifact store (/var/lib/ferry/artifacts) read-only",
        ),
        (lambda d: container(d, "ferry-beat").pop("workingDir"), "writes /app"),  # the image's read-only WORKDIR
        (
            lambda d: next(x for x in d if x["metadata"]["name"] == "ferry-beat")["spec"].update(replicas=2),
            "beat must be exactly one",
        ),
        (lambda d: web_deployment(d)["spec"].update(replicas=3), "sets replicas, which every apply would reset"),
        (
            lambda d: next(x for x in d if x["metadata"]["name"] == "ferry-worker")["spec"]["template"]["spec"].update(
                automountServiceAccountToken=True
            ),
            "pods need no Kubernetes API token",
        ),
        (
            lambda d: next(x for x in d if x["kind"] == "Role")["rules"][0].update(resources=["statefulsets"]),
            "grants more than get/patch of statefulsets/scale",
        ),
        (
            lambda d: next(x for x in d if x["kind"] == "Role")["rules"][0].update(verbs=["get", "patch", "delete"]),
            "grants more than get/patch of statefulsets/scale",
        ),
        (
            lambda d: container(d, "ferry-autoscaler")["command"].__setitem__(7, "celery"),
            "must consume only the autoscale queue",
        ),
        (
            lambda d: next(x for x in d if x["kind"] == "Service" and x["metadata"]["name"] == "ferry-web")["spec"][
                "ports"
            ][0].update(targetPort="htp"),
            "targetPort htp is no port its pods name",
        ),
        (
            lambda d: next(x for x in d if x["kind"] == "PodDisruptionBudget")["spec"]["selector"][
                "matchLabels"
            ].update({"app.kubernetes.io/component": "wbe"}),
            "its selector matches no workload's pods",
        ),
        # gRPC as shipped before: on the pod's loopback, no port declared, no Service port
        (
            lambda d: container(d, "ferry-web").update(
                env=[v for v in container(d, "ferry-web")["env"] if v["name"] != "FERRY_GRPC_HOST"]
            ),
            "serves gRPC on 127.0.0.1:8001, its loopback",
        ),
        (
            lambda d: container(d, "ferry-web").update(ports=container(d, "ferry-web")["ports"][:1]),
            "serves gRPC on 8001, which is not a declared containerPort",
        ),
        (
            lambda d: next(x for x in d if x["kind"] == "Service" and x["metadata"]["name"] == "ferry-web")[
                "spec"
            ].update(ports=[{"name": "http", "port": 80, "targetPort": "http"}]),
            "no Service routes to its gRPC port 8001",
        ),
        # Pods of a new image on the old schema: no wait for the migration Job
        (lambda d: web_deployment(d)["spec"]["template"]["spec"].pop("initContainers"), "waits for no migrations"),
        (
            lambda d: next(x for x in d if x["metadata"]["name"] == "ferry-worker")["spec"]["template"]["spec"][
                "initContainers"
            ][0].update(command=["python", "manage.py", "migrate", "--noinput"]),
            "waits for no migrations",
        ),
        # During a Redis outage each of 20 web pods allows a tenant a tenth of its quota: twice the quota
        (
            lambda d: next(x for x in d if x["kind"] == "HorizontalPodAutoscaler")["spec"].update(maxReplicas=20),
            "FERRY_QUOTA_GATEWAYS 10 is below the 20 web processes",
        ),
        # A hung node or worker never restarted
        (lambda d: container(d, "ferry-node-a10g").pop("livenessProbe"), "a node needs a liveness probe"),
        (lambda d: container(d, "ferry-worker").pop("livenessProbe"), "a worker needs a liveness probe"),
        (
            lambda d: container(d, "ferry-node-a10g")["command"].__setitem__(-1, "9465"),
            "livenessProbe does not ask its metrics port (9465)",
        ),
    ],
)
def test_ferrys_checks_catch_a_broken_manifest(docs: list[dict], breakage, expected: str) -> None:
    # Given the manifests, broken one way (probes are checked against a server in the test above)
    broken = copy.deepcopy(docs)
    breakage(broken)
    problems = checks.check_manifests(broken, missing_commands=PENDING)
    # Then it is reported
    assert any(expected in problem for problem in problems), problems


def test_the_pods_run_as_the_images_user_with_its_data_directory(docs: list[dict]) -> None:
    assert checks.IMAGE["WORKDIR"] == "/app"
    assert checks.check_image_agrees(docs) == []


def test_the_image_check_catches_a_root_image_and_a_moved_data_directory(docs: list[dict]) -> None:
    # Given a Dockerfile whose last stage runs as root with its data elsewhere
    stage = checks.dockerfile_final_stage(
        checks.DOCKERFILE.read_text() + "\nFROM x\nUSER root\nENV FERRY_DATA_DIR=/data \\\n    OTHER=1\n"
    )
    assert stage == {"USER": "root", "ENV FERRY_DATA_DIR": "/data", "ENV OTHER": "1"}
    problems = checks.check_image_agrees(docs, stage)
    # Then both are reported
    assert "Dockerfile: USER root must be a numeric non-root uid (runAsNonRoot checks it)" in problems
    assert any("FERRY_DATA_DIR /var/lib/ferry is not the image's /data" in p for p in problems), problems


def test_compose_starts_real_entry_points_with_real_settings(compose: dict) -> None:
    assert checks.check_compose(compose, missing_commands=PENDING) == []


@pytest.mark.parametrize(
    "breakage, expected",
    [
        (lambda c: c["services"]["worker"].update(command=["celery", "-A", "config", "wroker"]), "celery refuses"),
        (
            lambda c: c["services"]["web"].update(environment={"REDIS_URI": "redis://redis"}),
            "REDIS_URI is not a setting",
        ),
        (lambda c: c["services"]["node-b"]["command"].__setitem__(6, "a10g"), "two nodes with different accelerator"),
        (lambda c: c["services"]["node-a"].pop("cpus"), "declares its CPU budget"),
        (lambda c: c["services"]["node-a"]["environment"].update(SECRET_KEY="x"), "must not hold SECRET_KEY"),
        (lambda c: c["services"].pop("beat"), "no beat service"),
        (lambda c: c["services"]["web"]["environment"].pop("FERRY_GRPC_HOST"), "serves gRPC on 127.0.0.1:8001"),
        (lambda c: c["services"]["web"].update(ports=["127.0.0.1:8000:8000"]), "does not publish its gRPC port"),
        (
            lambda c: c["services"]["worker"].update(depends_on={"postgres": {"condition": "service_healthy"}}),
            "compose worker: starts before the migrations",
        ),
    ],
)
def test_the_compose_check_catches_a_broken_file(compose: dict, breakage, expected: str) -> None:
    broken = copy.deepcopy(compose)
    breakage(broken)
    problems = checks.check_compose(broken, missing_commands=PENDING)
    assert any(expected in problem for problem in problems), problems


def test_the_image_holds_what_s3_artifact_storage_needs() -> None:
    # FERRY_ARTIFACT_STORAGE=s3 selects django-storages' S3 backend (config/settings.py); the image's root is
    # read-only, so without it in the image the first artifact access fails with ModuleNotFoundError.
    project = tomllib.loads((checks.ROOT / "pyproject.toml").read_text())["project"]
    assert "storages.backends.s3.S3Storage" in (checks.ROOT / "config" / "settings.py").read_text()
    assert any(r.startswith("django-storages[s3]") for r in project["optional-dependencies"]["s3"])
    assert "p['optional-dependencies']['s3']" in checks.DOCKERFILE.read_text()


def test_the_node_probe_passes_with_the_metrics_token_only(docs: list[dict], settings) -> None:  # noqa: ANN001
    # Given a node metrics server that answers only the token (as in the pods: Secret ferry-metrics), and the
    # node's probe command, pointed at it instead of 9464
    settings.FERRY_METRICS_TOKEN = "probe-token"
    settings.FERRY_METRICS_ALLOW = []
    server = node_metrics.serve_registry(lambda: None, 0, "127.0.0.1")
    try:
        node = container(docs, "ferry-node-a10g")
        assert node["startupProbe"]["exec"] == node["livenessProbe"]["exec"]
        command = [
            part.replace("127.0.0.1:9464", f"127.0.0.1:{server.server_port}")
            for part in node["livenessProbe"]["exec"]["command"]
        ]
        assert command[0] == "python"  # the image's, on its PATH; this one's here
        command[0] = sys.executable

        def probe(token: str) -> int:
            env = {**os.environ, "FERRY_METRICS_TOKEN": token}
            return subprocess.run(command, env=env, capture_output=True, timeout=60, check=False).returncode

        # Then it passes with the pod's token, and fails with another (401), so a node that answers
        # nothing, or not as itself, is restarted
        assert probe("probe-token") == 0
        assert probe("another-token") != 0
    finally:
        server.shutdown()
        server.server_close()
