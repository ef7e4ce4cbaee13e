"""Checks of the deployment files (platform/k8s, platform/compose.yaml) against the code they start.

The schemas (kubernetes-validate, the Compose Specification) say a file is well formed; these say it is
right for Ferry: every command is a real entry point whose arguments parse, every variable set is one
config/settings.py reads, probes hit real paths, references between objects resolve, and the pods keep
least privilege (a registered model is code: docs/security.md). Each check returns problems as strings,
so a test can show a broken copy is caught.
"""

from __future__ import annotations

import ast
import shlex
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "platform" / "k8s"
COMPOSE = ROOT / "platform" / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
# Set in a manifest but not a Ferry setting: the pod's own name, which the node's command line uses.
DOWNWARD_API = {"POD_NAME"}
IMAGES = {"ferry", "ferry-cuda"}  # what the Dockerfile builds (docs/operating.md, "Kubernetes")
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
GPU = "nvidia.com/gpu"

Doc = dict[str, Any]


def load(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def manifest_files() -> list[Path]:
    """Every Kubernetes object file under platform/k8s: not kustomizations, nor the patches they apply."""
    skip = set(kustomizations())
    for kustomization in kustomizations():
        for patch in load(kustomization)[0].get("patches", []):
            if "path" in patch:
                skip.add((kustomization.parent / patch["path"]).resolve())
    return sorted(p for p in K8S.rglob("*.yaml") if p.resolve() not in skip)


def manifests() -> list[Doc]:
    return [doc for path in manifest_files() for doc in load(path)]


def settings_env_names() -> set[str]:
    """The environment variables config/settings.py reads through config.env (and `NAME_FILE` for strings)."""
    names: set[str] = set()
    tree = ast.parse((ROOT / "config" / "settings.py").read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id.startswith("env_")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
            if node.func.id == "env_str":
                names.add(node.args[0].value + "_FILE")
    return names


def settings_default(name: str) -> object:
    """The default config/settings.py gives `name` (the second argument of its config.env call), unset: None."""
    tree = ast.parse((ROOT / "config" / "settings.py").read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id.startswith("env_")
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == name
        ):
            return ast.literal_eval(node.args[1])
    return None


def grpc_address(env: dict[str, str | None]) -> tuple[str, int] | None:
    """Where a web process with environment `env` serves gRPC (serving.dataplane.grpc.server); None: off."""
    port = int(env.get("FERRY_GRPC_PORT") or settings_default("FERRY_GRPC_PORT"))  # type: ignore[arg-type]
    if not port:
        return None
    return str(env.get("FERRY_GRPC_HOST") or settings_default("FERRY_GRPC_HOST")), port


def loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


# Entry points -------------------------------------------------------------------------------------------


def command_problem(argv: list[str], missing_ok: Iterable[str] = ()) -> str | None:
    """None if `argv` starts one of Ferry's entry points with arguments it accepts, else what is wrong.
    `missing_ok`: manage.py commands not on this branch yet, accepted unparsed."""
    if argv[:2] == ["sh", "-c"] and len(argv) == 3:
        for part in argv[2].split("&&"):
            problem = command_problem(shlex.split(part), missing_ok)
            if problem:
                return problem
        return None
    if argv[:2] == ["python", "manage.py"] and len(argv) > 2:
        return _manage_problem(argv[2], argv[3:], set(missing_ok))
    if argv[:1] == ["celery"]:
        return _celery_problem(argv[1:])
    return f"{shlex.join(argv)!r} is none of Ferry's entry points (python manage.py ..., celery -A config ...)"


def _manage_problem(name: str, args: list[str], missing_ok: set[str]) -> str | None:
    from django.core.management import get_commands, load_command_class
    from django.core.management.base import CommandError

    commands = get_commands()
    if name not in commands:
        return None if name in missing_ok else f"manage.py has no command {name!r}"
    parser = load_command_class(commands[name], name).create_parser("manage.py", name)
    try:
        parser.parse_args(args)
    except (CommandError, SystemExit) as exc:
        return f"manage.py {name} refuses {shlex.join(args)!r}: {exc}"
    return None


def _celery_problem(args: list[str]) -> str | None:
    import click
    from celery.app.utils import find_app
    from celery.bin.base import CLIContext
    from celery.bin.celery import celery as cli

    try:
        ctx = cli.make_context("celery", list(args))
        if ctx.params.get("app") != "config":
            return f"celery runs app {ctx.params.get('app')!r}, not Ferry's (-A config)"
        # Option callbacks of the subcommands read the app's configuration.
        ctx.obj = CLIContext(app=find_app("config"), no_color=True, workdir=None, quiet=True)
        # Click 8.2 keeps the subcommand apart in a private field; later versions leave it in args.
        rest = [*vars(ctx).get("_protected_args", vars(ctx).get("protected_args", [])), *ctx.args]
        if not rest:
            return "celery without a subcommand"
        name, command, sub_args = cli.resolve_command(ctx, rest)
        if name not in ("worker", "beat"):
            return f"celery {name}: Ferry runs only worker and beat"
        command.make_context(name, sub_args, parent=ctx)
    except click.ClickException as exc:
        return f"celery refuses {shlex.join(args)!r}: {exc.format_message()}"
    return None


def cpu_cores(quantity: str | int | float) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


# Kubernetes ---------------------------------------------------------------------------------------------


def pod_spec(doc: Doc) -> Doc | None:
    if doc.get("kind") in WORKLOADS:
        return doc["spec"]["template"]["spec"]
    return None


def pod_labels(doc: Doc) -> dict[str, str]:
    return doc["spec"]["template"]["metadata"].get("labels", {})


def containers(spec: Doc) -> Iterator[Doc]:
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    wanted = selector.get("matchLabels", selector if "matchExpressions" not in selector else {})
    if any(labels.get(k) != v for k, v in wanted.items()):
        return False
    for expression in selector.get("matchExpressions", []):
        value = labels.get(expression["key"])
        if expression["operator"] == "In" and value not in expression["values"]:
            return False
        if expression["operator"] == "NotIn" and value in expression["values"]:
            return False
        if expression["operator"] == "Exists" and value is None:
            return False
        if expression["operator"] == "DoesNotExist" and value is not None:
            return False
    return bool(wanted or selector.get("matchExpressions"))


def check_manifests(
    docs: list[Doc], *, missing_commands: Iterable[str] = (), path_answers: Callable[[str], bool] | None = None
) -> list[str]:
    """Problems in a set of Kubernetes objects (empty when none). `path_answers(path)` says whether a
    live server answers 200 on an HTTP path, for probes; None skips that check."""
    problems: list[str] = []
    by_kind: dict[str, dict[str, Doc]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    config_keys = {name: set(doc.get("data", {})) for name, doc in by_kind.get("ConfigMap", {}).items()}
    secret_keys = {
        name: set(doc.get("stringData", {})) | set(doc.get("data", {}))
        for name, doc in by_kind.get("Secret", {}).items()
    }
    settings_names = settings_env_names()
    for name, keys in [*config_keys.items(), *secret_keys.items()]:
        for key in sorted(keys - settings_names):
            problems.append(f"{name}: {key} is not a setting config/settings.py reads")
    workloads = [doc for doc in docs if pod_spec(doc) is not None]
    for doc in workloads:
        problems += _workload_problems(
            doc, by_kind, config_keys, secret_keys, settings_names, set(missing_commands), path_answers
        )
    for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
        for name, doc in by_kind.get(kind, {}).items():
            selector = doc["spec"]["podSelector"] if kind == "NetworkPolicy" else doc["spec"]["selector"]
            selected = [w for w in workloads if selects(selector, pod_labels(w))]
            if not selected:
                problems.append(f"{kind} {name}: its selector matches no workload's pods")
            if kind != "Service":
                continue
            named = {port.get("name") for w in selected for c in containers(pod_spec(w)) for port in c.get("ports", [])}
            for port in doc["spec"].get("ports", []):
                if isinstance(port.get("targetPort"), str) and port["targetPort"] not in named:
                    problems.append(f"Service {name}: targetPort {port['targetPort']} is no port its pods name")
    problems += _quota_gateway_problems(workloads, by_kind)
    for name, doc in by_kind.get("HorizontalPodAutoscaler", {}).items():
        target = doc["spec"]["scaleTargetRef"]
        if target["name"] not in by_kind.get(target["kind"], {}):
            problems.append(f"HorizontalPodAutoscaler {name}: no {target['kind']} {target['name']}")
        elif "replicas" in by_kind[target["kind"]][target["name"]]["spec"]:
            problems.append(
                f"{target['kind']} {target['name']} sets replicas, which every apply would reset "
                "under its HorizontalPodAutoscaler"
            )
    return problems


def _quota_gateway_problems(workloads: list[Doc], by_kind: dict[str, dict[str, Doc]]) -> list[str]:
    """While Redis is down each web process allows a tenant 1/FERRY_QUOTA_GATEWAYS of its quota: the setting must
    be at least the most web processes that can run (the HPA's maxReplicas, times `serve --workers`), or the
    gateways together allow more than the quota."""
    problems = []
    autoscalers = {
        doc["spec"]["scaleTargetRef"]["name"]: doc["spec"]["maxReplicas"]
        for doc in by_kind.get("HorizontalPodAutoscaler", {}).values()
    }
    for doc in workloads:
        if pod_labels(doc).get("app.kubernetes.io/component") != "web":
            continue
        pods = autoscalers.get(doc["metadata"]["name"], doc["spec"].get("replicas", 1))
        for container in pod_spec(doc)["containers"]:
            argv = [*container.get("command", []), *container.get("args", [])]
            env = {}
            for source in container.get("envFrom", []):
                name = source.get("configMapRef", {}).get("name")
                env.update(by_kind.get("ConfigMap", {}).get(name, {}).get("data", {}))
            env.update({var["name"]: var.get("value", "") for var in container.get("env", [])})
            most = pods * int(option(argv, "--workers") or 1)
            gateways = int(env.get("FERRY_QUOTA_GATEWAYS") or settings_default("FERRY_QUOTA_GATEWAYS") or 1)
            if gateways < most:
                problems.append(
                    f"{doc['kind']} {doc['metadata']['name']}: FERRY_QUOTA_GATEWAYS {gateways} is below the {most} web"
                    " processes it may run: while Redis is down tenants could exceed their quota"
                )
    return problems


def _workload_problems(
    doc: Doc,
    by_kind: dict[str, dict[str, Doc]],
    config_keys: dict[str, set[str]],
    secret_keys: dict[str, set[str]],
    settings_names: set[str],
    missing_commands: set[str],
    path_answers: Callable[[str], bool] | None,
) -> list[str]:
    where = f"{doc['kind']} {doc['metadata']['name']}"
    spec = pod_spec(doc)
    labels = pod_labels(doc)
    component = labels.get("app.kubernetes.io/component")
    problems: list[str] = []
    if doc["kind"] != "Job" and not selects(doc["spec"]["selector"], labels):
        problems.append(f"{where}: its selector does not match its own pods")
    pod_security = spec.get("securityContext", {})
    if pod_security.get("runAsNonRoot") is not True:
        problems.append(f"{where}: pods must set runAsNonRoot")
    if pod_security.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        problems.append(f"{where}: pods must use the RuntimeDefault seccomp profile")
    if spec.get("automountServiceAccountToken") is not False:
        if component == "autoscaler":
            problems += _api_token_problems(where, spec, by_kind)
        else:
            problems.append(f"{where}: pods need no Kubernetes API token (automountServiceAccountToken: false)")
    volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
    for volume in volumes.values():
        claim = volume.get("persistentVolumeClaim", {}).get("claimName")
        if claim and claim not in by_kind.get("PersistentVolumeClaim", {}):
            problems.append(f"{where}: volume {volume['name']} claims a missing PersistentVolumeClaim {claim}")
    if doc["kind"] == "StatefulSet" and doc["spec"].get("serviceName") not in by_kind.get("Service", {}):
        problems.append(f"{where}: its serviceName names no Service")
    if component == "beat" and (
        doc["spec"].get("replicas") != 1 or doc["spec"].get("strategy", {}).get("type") != "Recreate"
    ):
        problems.append(f"{where}: beat must be exactly one (replicas 1, strategy Recreate)")
    for container in containers(spec):
        problems += _container_problems(
            f"{where}/{container['name']}",
            container,
            volumes,
            component,
            labels,
            by_kind,
            config_keys,
            secret_keys,
            settings_names,
            missing_commands,
            path_answers,
        )
    for container in spec["containers"]:  # probes: not on init containers, which run to completion
        if component == "web" and not container.get("readinessProbe"):
            problems.append(
                f"{where}/{container['name']}: web needs a readiness probe (out of the Service while not ready)"
            )
        if component in ("node", "worker") and not container.get("livenessProbe"):
            problems.append(
                f"{where}/{container['name']}: a {component} needs a liveness probe (else a hung one stays)"
            )
    if component in USES_DATABASE and not any(
        [*c.get("command", []), *c.get("args", [])] == WAIT_FOR_MIGRATIONS for c in spec.get("initContainers", [])
    ):
        problems.append(
            f"{where}: waits for no migrations: an initContainer running {shlex.join(WAIT_FOR_MIGRATIONS)}"
            " keeps a new image off the old schema while the Job migrates"
        )
    if component == "node" and not (spec.get("nodeSelector") or spec.get("affinity", {}).get("nodeAffinity")):
        problems.append(f"{where}: a node must be placed by accelerator type (nodeSelector or node affinity)")
    return problems


# The init container of every pod that uses the database (not nodes, which never do, nor the Job that migrates):
# it fails until this release's migrations are applied, and the kubelet runs it again with back-off.
WAIT_FOR_MIGRATIONS = ["python", "manage.py", "migrate", "--check"]
# The pods that must wait for it, by their component label.
USES_DATABASE = {"web", "worker", "beat", "autoscaler"}


# What the autoscaler's token may do: read and set the node pools' StatefulSet replicas, nothing else.
SCALER_RULE = {"apiGroups": ["apps"], "resources": ["statefulsets/scale"]}
SCALER_VERBS = {"get", "patch"}


def _api_token_problems(where: str, spec: Doc, by_kind: dict[str, dict[str, Doc]]) -> list[str]:
    """The one pod with an API token: its service account may only scale StatefulSets, and it runs no task but
    the autoscaler's (so no model, which is code, runs beside the token)."""
    problems = []
    account = spec.get("serviceAccountName")
    if account not in by_kind.get("ServiceAccount", {}):
        return [f"{where}: mounts an API token without a ServiceAccount of its own"]
    if any(
        s.get("kind") == "ServiceAccount" and s.get("name") == account
        for b in by_kind.get("ClusterRoleBinding", {}).values()
        for s in b.get("subjects", [])
    ):
        problems.append(f"{where}: its service account is bound cluster-wide")
    bindings = [
        b
        for b in by_kind.get("RoleBinding", {}).values()
        if any(s.get("kind") == "ServiceAccount" and s.get("name") == account for s in b.get("subjects", []))
    ]
    if not bindings:
        problems.append(f"{where}: its service account is bound to no Role")
    for binding in bindings:
        ref = binding["roleRef"]
        role = by_kind.get("Role", {}).get(ref["name"]) if ref["kind"] == "Role" else None
        if role is None:
            problems.append(f"{where}: RoleBinding {binding['metadata']['name']} grants a missing or cluster role")
            continue
        for rule in role.get("rules", []):
            if {k: rule.get(k) for k in SCALER_RULE} != SCALER_RULE or not set(rule.get("verbs", [])) <= SCALER_VERBS:
                problems.append(f"{where}: Role {ref['name']} grants more than get/patch of statefulsets/scale")
    for container in containers(spec):
        argv = [*container.get("command", []), *container.get("args", [])]
        if container in spec.get("initContainers", []) and argv == WAIT_FOR_MIGRATIONS:
            continue  # runs no task and no model
        if option(argv, "-Q") != "autoscale":
            problems.append(f"{where}/{container['name']}: with an API token it must consume only the autoscale queue")
    return problems


def _container_problems(
    where: str,
    container: Doc,
    volumes: dict[str, Doc],
    component: str | None,
    labels: dict[str, str],
    by_kind: dict[str, dict[str, Doc]],
    config_keys: dict[str, set[str]],
    secret_keys: dict[str, set[str]],
    settings_names: set[str],
    missing_commands: set[str],
    path_answers: Callable[[str], bool] | None,
) -> list[str]:
    problems: list[str] = []
    argv = [*container.get("command", []), *container.get("args", [])]
    problem = command_problem(argv, missing_commands) if argv else "no command (the image's default is web)"
    if problem:
        problems.append(f"{where}: {problem}")
    image = container["image"].rsplit("/", 1)[-1].rsplit(":", 1)[0]  # a registry's prefix and the tag aside
    if image not in IMAGES:
        problems.append(f"{where}: image {container['image']} is not one the Dockerfile builds ({sorted(IMAGES)})")
    # Environment: what it sets, and what it takes from ConfigMaps and Secrets.
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if var["name"] not in settings_names and var["name"] not in DOWNWARD_API:
            problems.append(f"{where}: {var['name']} is not a setting config/settings.py reads")
        if var["name"] in DOWNWARD_API and f"$({var['name']})" not in argv:
            problems.append(f"{where}: sets {var['name']} but its command does not use it")
        env[var["name"]] = var.get("value", "")
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            name = source["configMapRef"]["name"]
            if name not in config_keys:
                problems.append(f"{where}: envFrom names a missing ConfigMap {name}")
            env.update(by_kind.get("ConfigMap", {}).get(name, {}).get("data", {}))
        if "secretRef" in source:
            name = source["secretRef"]["name"]
            if name not in secret_keys:
                problems.append(f"{where}: envFrom names a Secret {name} that secret.example.yaml does not describe")
            elif component == "node" and "SECRET_KEY" in secret_keys[name]:
                problems.append(f"{where}: a node runs models (code) and must not hold SECRET_KEY")
            env.update(dict.fromkeys(secret_keys.get(name, ())))
    # Least privilege and a read-only root: whatever the process writes must be a mounted volume.
    security = container.get("securityContext", {})
    if security.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{where}: allowPrivilegeEscalation must be false")
    if "ALL" not in security.get("capabilities", {}).get("drop", []):
        problems.append(f"{where}: must drop ALL capabilities")
    if security.get("readOnlyRootFilesystem") is not True:
        problems.append(f"{where}: the root filesystem must be read-only")
    mounts = {mount["mountPath"]: mount for mount in container.get("volumeMounts", [])}
    for mount in mounts.values():
        if mount["name"] not in volumes:
            problems.append(f"{where}: mounts a missing volume {mount['name']}")
    writable = {path for path, mount in mounts.items() if not mount.get("readOnly")}
    needed = {"/tmp", env.get("FERRY_DATA_DIR") or "/var/lib/ferry"}
    if argv[:1] == ["celery"] and "beat" in argv and not {"-s", "--schedule"} & set(argv):
        needed.add(container.get("workingDir", IMAGE_WORKDIR))  # beat's schedule file, in its working directory
    for path in sorted(needed - writable):
        problems.append(f"{where}: writes {path}, which is no writable volume on a read-only root")
    artifacts = env.get("FERRY_ARTIFACT_ROOT")
    if component == "node" and artifacts and not mounts.get(artifacts, {}).get("readOnly"):
        problems.append(f"{where}: a node must mount the artifact store ({artifacts}) read-only")
    # Resources: requests and limits for both, and a whole GPU per node.
    resources = container.get("resources", {})
    for kind in ("requests", "limits"):
        for resource in ("cpu", "memory"):
            if resource not in resources.get(kind, {}):
                problems.append(f"{where}: no {resource} in resources.{kind}")
    if component == "node":
        if str(resources.get("limits", {}).get(GPU)) != "1":
            problems.append(f"{where}: a node hosts one GPU: limits {GPU}: 1")
        threads = env.get("FERRY_TORCH_THREADS")
        cores = cpu_cores(resources.get("limits", {}).get("cpu", "0"))
        if not threads or not 0 < int(threads) < max(cores, 2):
            problems.append(
                f"{where}: set FERRY_TORCH_THREADS below its CPU limit ({cores:g}): the default "
                "counts the machine's cores, not the pod's"
            )
        accelerator = option(argv, "--accelerator")
        if accelerator != labels.get("ferry.dev/accelerator"):
            problems.append(
                f"{where}: --accelerator {accelerator} differs from its pods' label "
                f"ferry.dev/accelerator={labels.get('ferry.dev/accelerator')}"
            )
    # Probes: on the serving port, on paths a real server answers.
    ports = {port.get("name"): port["containerPort"] for port in container.get("ports", [])}
    serve_port = option(argv, "--port")
    if serve_port is not None and int(serve_port) not in ports.values():
        problems.append(f"{where}: serves on {serve_port}, which is not a declared containerPort")
    for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container.get(probe_name, {}).get("httpGet")
        if not get:
            continue
        port = ports.get(get["port"], get["port"])
        if serve_port is not None and str(port) != serve_port:
            problems.append(f"{where}: {probe_name} probes port {get['port']}, not the served {serve_port}")
        if path_answers is not None and not path_answers(get["path"]):
            problems.append(f"{where}: {probe_name} path {get['path']} does not answer 200 on a live server")
    metrics_port = option(argv, "--metrics-port")
    for probe_name in ("startupProbe", "livenessProbe"):
        probe = " ".join(container.get(probe_name, {}).get("exec", {}).get("command", []))
        if component == "node" and probe and f"127.0.0.1:{metrics_port}/metrics" not in probe:
            problems.append(f"{where}: {probe_name} does not ask its metrics port ({metrics_port}) for /metrics")
    # gRPC: a web process serves it beside HTTP; it must listen where the Service can reach it.
    grpc = grpc_address(env) if argv[1:3] == ["manage.py", "serve"] else None
    if grpc is not None:
        host, port = grpc
        if loopback(host):
            problems.append(f"{where}: serves gRPC on {host}:{port}, its loopback: set FERRY_GRPC_HOST=0.0.0.0")
        names = [name for name, number in ports.items() if number == port]
        if not names:
            problems.append(f"{where}: serves gRPC on {port}, which is not a declared containerPort")
        services = [d for d in by_kind.get("Service", {}).values() if selects(d["spec"].get("selector", {}), labels)]
        if not any(p.get("targetPort") in (port, *names) for d in services for p in d["spec"].get("ports", [])):
            problems.append(f"{where}: no Service routes to its gRPC port {port}")
    return problems


# The image ----------------------------------------------------------------------------------------------


def dockerfile_final_stage(text: str) -> dict[str, str]:
    """WORKDIR, USER and the ENV values of the Dockerfile's last stage (continuation lines joined)."""
    lines = text.replace("\\\n", " ").splitlines()
    stage: dict[str, str] = {}
    for line in lines:
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "FROM":
            stage = {}
        elif words[0] in ("WORKDIR", "USER"):
            stage[words[0]] = words[1]
        elif words[0] == "ENV":
            for pair in words[1:]:
                key, _, value = pair.partition("=")
                stage[f"ENV {key}"] = value
    return stage


IMAGE = dockerfile_final_stage(DOCKERFILE.read_text())
IMAGE_WORKDIR = IMAGE.get("WORKDIR", "/")  # on the read-only root


def check_image_agrees(docs: list[Doc], stage: dict[str, str] = IMAGE) -> list[str]:
    """The pods run as the image's user, and find its data directory where the image puts it."""
    problems: list[str] = []
    uid = stage.get("USER", "root").split(":")[0]
    if not uid.isdigit() or uid == "0":
        problems.append(f"Dockerfile: USER {uid} must be a numeric non-root uid (runAsNonRoot checks it)")
    for doc in docs:
        spec = pod_spec(doc)
        if spec is not None and str(spec.get("securityContext", {}).get("runAsUser")) != uid:
            problems.append(f"{doc['kind']} {doc['metadata']['name']}: runAsUser is not the image's user {uid}")
        if doc["kind"] == "ConfigMap":
            data_dir = doc.get("data", {}).get("FERRY_DATA_DIR")
            if data_dir and data_dir != stage.get("ENV FERRY_DATA_DIR"):
                problems.append(
                    f"ConfigMap {doc['metadata']['name']}: FERRY_DATA_DIR {data_dir} is not the image's "
                    f"{stage.get('ENV FERRY_DATA_DIR')} (owned by its user)"
                )
    return problems


# Compose ------------------------------------------------------------------------------------------------


def compose_environment(service: Doc) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): str(v) for k, v in env.items()}


def check_compose(doc: Doc, *, missing_commands: Iterable[str] = ()) -> list[str]:
    problems: list[str] = []
    services = doc.get("services", {})
    settings_names = settings_env_names()
    for required in ("postgres", "redis", "web", "worker", "beat"):
        if required not in services:
            problems.append(f"compose: no {required} service")
    accelerators: dict[str, str] = {}
    for name, service in services.items():
        image = str(service.get("image", "")).rsplit(":", 1)[0]
        if image not in IMAGES:
            continue
        argv = service.get("command")
        if isinstance(argv, str):
            argv = shlex.split(argv)
        problem = command_problem(argv, missing_commands) if argv else "no command"
        if problem:
            problems.append(f"compose {name}: {problem}")
            continue
        for key in sorted(set(compose_environment(service)) - settings_names):
            problems.append(f"compose {name}: {key} is not a setting config/settings.py reads")
        grpc = grpc_address(compose_environment(service)) if argv[:3] == ["python", "manage.py", "serve"] else None
        if grpc is not None:
            host, port = grpc
            if loopback(host):
                problems.append(f"compose {name}: serves gRPC on {host}:{port}, its loopback: set FERRY_GRPC_HOST")
            published = {
                str(m["target"]) if isinstance(m, dict) else str(m).rsplit(":", 1)[-1].split("/")[0]
                for m in service.get("ports", [])
            }  # the container's side of each mapping: "[host:]published:target[/protocol]", or the long form
            if str(port) not in published:
                problems.append(f"compose {name}: does not publish its gRPC port {port}")
        if argv[:3] == ["python", "manage.py", "runnode"]:
            accelerators[name] = option(argv, "--accelerator") or ""
            if "cpus" not in service:
                problems.append(f"compose {name}: a node declares its CPU budget (cpus)")
            if "SECRET_KEY" in compose_environment(service):
                problems.append(f"compose {name}: a node runs models (code) and must not hold SECRET_KEY")
    problems += _compose_migration_problems(services)
    if len(accelerators) < 2 or len(set(accelerators.values())) < 2:
        problems.append(f"compose: wants two nodes with different accelerator labels, has {accelerators}")
    return problems


def _compose_argv(service: Doc) -> list[list[str]]:
    """A service's command, each `&&` part of an `sh -c` apart."""
    argv = service.get("command") or []
    if isinstance(argv, str):
        argv = shlex.split(argv)
    if argv[:2] == ["sh", "-c"] and len(argv) == 3:
        return [shlex.split(part) for part in argv[2].split("&&")]
    return [argv]


def _compose_migration_problems(services: dict[str, Doc]) -> list[str]:
    """Every service of Ferry's image that uses the database (all but nodes, which never do) starts after one
    that migrates it has completed: compose starts the rest at once otherwise, on the old schema."""
    migrating = {
        name
        for name, service in services.items()
        if any(
            argv[:3] == ["python", "manage.py", "migrate"] and "--check" not in argv for argv in _compose_argv(service)
        )
    }

    def after_migrations(name: str, seen: frozenset[str] = frozenset()) -> bool:
        depends = services[name].get("depends_on", {})
        completed = [
            d
            for d, how in (depends.items() if isinstance(depends, dict) else [])
            if d in services and d not in seen
            if how.get("condition") == "service_completed_successfully"
        ]
        return any(d in migrating or after_migrations(d, seen | {name}) for d in completed)

    problems = []
    for name, service in services.items():
        if str(service.get("image", "")).rsplit(":", 1)[0] not in IMAGES or name in migrating:
            continue
        if any(argv[:3] == ["python", "manage.py", "runnode"] for argv in _compose_argv(service)):
            continue
        if not after_migrations(name):
            problems.append(f"compose {name}: starts before the migrations (depend on {sorted(migrating)} completing)")
    return problems
