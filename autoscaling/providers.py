"""Node providers: how the autoscaler's demand for nodes per accelerator type becomes running nodes.

Plain Python, no Django: a provider is built from the pools' settings and told how many nodes each pool
should run (`apply`). A pool is sized for every placed version's desired replicas, autoscaled or not, packed
as placement packs them (`pool_sizes`: `serving.policies.placement.nodes_wanted`, first fit decreasing, one
replica of a version per node), and never below the nodes that hold assigned replicas now (`scale_in_floor`).

- `LocalProvider` starts and stops `manage.py runnode` processes on this machine, named
  `<prefix>-<type>-<i>`, with each pool's memory budget and labels, at most `max_total` of them. It keeps
  a pid file per node, so any worker process (Celery's pool children come and go) sees the nodes another
  one started; nodes are started detached (init is their parent), so whichever process stops one, none
  is left a zombie. Scale-in stops the highest-numbered nodes with SIGTERM (a node drains its batches first).
- `KubernetesProvider` sets the replicas of each pool's StatefulSet (`platform/k8s`, one per GPU type)
  through the API server: GET and then, if it differs, a merge PATCH of the `scale` subresource, with the
  pod's service account token (re-read every call: the kubelet rotates it) and the cluster's CA.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from serving.policies.placement import VersionSpec
from serving.policies.placement import nodes_wanted as packed_nodes

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class ProviderError(RuntimeError):
    pass


@dataclass(frozen=True)
class Pool:
    """Nodes of one accelerator type."""

    accelerator: str
    memory_bytes: int  # one node's memory budget
    min_nodes: int = 0
    max_nodes: int = 1
    labels: dict[str, str] = field(default_factory=dict)
    statefulset: str = ""  # Kubernetes: the pool's StatefulSet (default ferry-node-<accelerator>)

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"pool {self.accelerator}: memory must be positive")
        if not 0 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"pool {self.accelerator}: need 0 <= min_nodes <= max_nodes")

    @property
    def workload(self) -> str:
        return self.statefulset or f"ferry-node-{self.accelerator}"


def pools_from(raw: Mapping[str, Mapping]) -> dict[str, Pool]:
    """Pools from the settings' JSON: {"a10g": {"memory": "24GiB", "min_nodes": 0, "max_nodes": 4, ...}}."""
    from serving.dataplane.node.node_process import parse_bytes

    pools = {}
    for accelerator, spec in raw.items():
        unknown = set(spec) - {"memory", "min_nodes", "max_nodes", "labels", "statefulset"}
        if unknown:
            raise ValueError(f"pool {accelerator}: unknown settings {sorted(unknown)}")
        memory = spec.get("memory")
        if memory is None:
            raise ValueError(f"pool {accelerator}: memory is required")
        pools[accelerator] = Pool(
            accelerator,
            parse_bytes(str(memory)),
            int(spec.get("min_nodes", 0)),
            int(spec.get("max_nodes", 1)),
            {str(k): str(v) for k, v in dict(spec.get("labels", {})).items()},
            str(spec.get("statefulset", "")),
        )
    return pools


def pool_sizes(
    wants: Mapping[str, int], specs: Mapping[str, VersionSpec], pools: Mapping[str, Pool], floor: Mapping[str, int]
) -> dict[str, int]:
    """Nodes per pool: as many as packing `wants` (version key -> desired replicas, every placed version's, as the
    placement reconciler places them) needs on the pools' nodes, in the pools' order of preference; never fewer
    than `floor` (`scale_in_floor`); within the pool's bounds. Total bytes over a node's is only a lower bound
    (three 13 GiB replicas need three 24 GiB nodes, not two), and a version's minimum replicas need nodes whether
    or not it is autoscaled. Versions no pool can hold are left out: the reconciler marks them unschedulable."""
    packed, _impossible = packed_nodes(wants, specs, {kind: pool.memory_bytes for kind, pool in pools.items()})
    return {
        kind: min(max(packed.get(kind, 0), floor.get(kind, 0), pool.min_nodes), pool.max_nodes)
        for kind, pool in pools.items()
    }


def scale_in_floor(holding: Iterable[tuple[str, str]]) -> dict[str, int]:
    """Per accelerator type, the fewest nodes a pool may run and keep every node given as (name, type): those
    holding assigned replicas. Both providers scale in from the highest-numbered node (`<prefix>-<type>-<i>`, a
    StatefulSet's ordinal), so it is the highest such number plus one: scaling in by count alone could stop a
    node that holds a version's minimum replicas while an empty one stays. A name without a number is no
    provider's node, and no provider stops it."""
    floor: dict[str, int] = {}
    for name, kind in holding:
        ordinal = name.rsplit("-", 1)[-1]
        if "-" in name and ordinal.isdigit():
            floor[kind] = max(floor.get(kind, 0), int(ordinal) + 1)
    return floor


class NodeProvider(Protocol):
    def apply(self, wanted: Mapping[str, int]) -> dict[str, int]:
        """Make each pool run `wanted[type]` nodes (as far as the provider's bounds allow); the counts set."""


class LocalProvider:
    def __init__(
        self,
        pools: Mapping[str, Pool],
        run_dir: Path,
        *,
        max_total: int,
        prefix: str = "local",
        command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.pools = dict(pools)
        self.run_dir = Path(run_dir)
        self.max_total = max_total
        self.prefix = prefix
        self.command = list(command or [sys.executable, "manage.py", "runnode"])
        self.env = dict(env) if env is not None else None
        self.cwd = cwd

    def name(self, accelerator: str, index: int) -> str:
        return f"{self.prefix}-{accelerator}-{index}"

    def running(self) -> dict[str, list[str]]:
        """Names of the live nodes this provider started, per pool, in index order."""
        found: dict[str, list[tuple[int, str]]] = {kind: [] for kind in self.pools}
        for kind in self.pools:
            for pid_file in self.run_dir.glob(f"{self.prefix}-{kind}-*.pid"):
                name = pid_file.stem
                suffix = name.removeprefix(f"{self.prefix}-{kind}-")
                if not suffix.isdigit():
                    continue
                if _alive(pid_file):
                    found[kind].append((int(suffix), name))
                else:
                    pid_file.unlink(missing_ok=True)
        return {kind: [name for _, name in sorted(names)] for kind, names in found.items()}

    def apply(self, wanted: Mapping[str, int]) -> dict[str, int]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        running = self.running()
        result = {}
        for kind, pool in self.pools.items():
            names = running[kind]
            want = min(max(wanted.get(kind, pool.min_nodes), pool.min_nodes), pool.max_nodes)
            for name in names[want:][::-1]:
                self._stop(name)
            names = names[:want]
            taken = {int(n.rsplit("-", 1)[1]) for n in names}
            index = 0
            while len(names) < want:
                total = sum(len(v) for k, v in running.items() if k != kind) + len(names)
                if total >= self.max_total:
                    log.warning(
                        "local nodes: %d running, the limit; pool %s gets %d of %d", total, kind, len(names), want
                    )
                    break
                while index in taken:
                    index += 1
                taken.add(index)
                names.append(self._start(pool, self.name(kind, index)))
            running[kind] = names
            result[kind] = len(names)
        return result

    def _start(self, pool: Pool, name: str) -> str:
        args = [*self.command, "--name", name, "--accelerator", pool.accelerator, "--memory", str(pool.memory_bytes)]
        if pool.labels:
            args += ["--labels", ",".join(f"{k}={v}" for k, v in sorted(pool.labels.items()))]
        # Through a shell that starts the node in the background and exits: the node is then nobody's child
        # here (init reaps it), since the worker process that stops it may not be the one that started it.
        # Its own session: a signal to the worker's process group does not reach the node.
        launcher = ["sh", "-c", '"$@" >>"$0" 2>&1 </dev/null & echo $!', str(self.run_dir / f"{name}.log"), *args]
        pid = int(
            subprocess.run(
                launcher,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
                check=True,
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.split()[0]
        )
        (self.run_dir / f"{name}.pid").write_text(f"{pid} {name}\n")
        log.info("local nodes: started %s (pid %d, %s, %d bytes)", name, pid, pool.accelerator, pool.memory_bytes)
        return name

    def _stop(self, name: str) -> None:
        pid_file = self.run_dir / f"{name}.pid"
        pid = _pid(pid_file)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
                log.info("local nodes: stopping %s (pid %d)", name, pid)
            except ProcessLookupError:
                pass
        pid_file.unlink(missing_ok=True)


def _pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid_file: Path) -> bool:
    """The process in the pid file runs and is the node it names (a reused pid is some other program)."""
    pid = _pid(pid_file)
    if pid is None:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in {"Z", "X"} and b"runnode" in cmdline and pid_file.stem.encode() in cmdline


class KubernetesProvider:
    def __init__(
        self,
        pools: Mapping[str, Pool],
        *,
        namespace: str = "",
        base_url: str = "",
        token_file: Path = SERVICE_ACCOUNT / "token",
        ca_file: Path | None = SERVICE_ACCOUNT / "ca.crt",
        timeout: float = 5.0,
    ) -> None:
        self.pools = dict(pools)
        if not base_url:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ProviderError("not in a cluster: KUBERNETES_SERVICE_HOST is not set and no API URL was given")
            base_url = f"https://{host}:{port}" if ":" not in host else f"https://[{host}]:{port}"
        self.base_url = base_url.rstrip("/")
        if not namespace:
            try:
                namespace = (SERVICE_ACCOUNT / "namespace").read_text().strip()
            except OSError as exc:
                raise ProviderError(f"no namespace given and none in the service account: {exc}") from None
        self.namespace = namespace
        self.token_file = Path(token_file)
        self.ca_file = ca_file
        self.timeout = timeout

    def scale_url(self, pool: Pool) -> str:
        return f"{self.base_url}/apis/apps/v1/namespaces/{self.namespace}/statefulsets/{pool.workload}/scale"

    def apply(self, wanted: Mapping[str, int]) -> dict[str, int]:
        result, errors = {}, []
        for kind, pool in self.pools.items():
            want = min(max(wanted.get(kind, pool.min_nodes), pool.min_nodes), pool.max_nodes)
            try:
                current = self._request("GET", pool)["spec"].get("replicas", 0)
                if current != want:
                    self._request("PATCH", pool, {"spec": {"replicas": want}})
                    log.info(
                        "kubernetes: %s/%s scaled from %d to %d nodes", self.namespace, pool.workload, current, want
                    )
                result[kind] = want
            except (ProviderError, KeyError, TypeError) as exc:
                errors.append(f"{pool.workload}: {exc}")
        if errors:
            raise ProviderError("; ".join(errors))
        return result

    def _request(self, method: str, pool: Pool, body: dict | None = None) -> dict:
        headers = {"Authorization": f"Bearer {self.token_file.read_text().strip()}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/merge-patch+json"
        request = urllib.request.Request(self.scale_url(pool), data=data, headers=headers, method=method)
        context = None
        if self.base_url.startswith("https:"):
            context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=context) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode(errors="replace")
            raise ProviderError(f"{method} scale answered {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ProviderError(f"{method} scale failed: {exc}") from None
