import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import uvicorn
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from uvicorn.supervisors import Multiprocess

from serving.dataplane.http.frontdoor import uvicorn_config

HOST_START_TIMEOUT_S = 600.0  # the node host loads every model before it listens
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux


def fresh_metrics_dir(run_dir: Path) -> Path:
    """This run's folder for the web processes' metrics files: an earlier run's counts are not this one's."""
    path = run_dir / "metrics"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700, parents=True)
    return path


class Command(BaseCommand):
    help = "Serve the console, the REST API and /v2 inference (embedded node unless FERRY_EMBEDDED_NODE=false)."

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument(
            "--workers",
            type=int,
            default=1,
            help="web processes sharing the port (uvicorn's supervisor restarts any that dies); each has its"
            " own gateway. In embedded mode a node host process beside them holds the models and the quotas"
            " (`manage.py nodehost`); in distributed mode the nodes are `runnode` processes"
            " (FERRY_EMBEDDED_NODE=false).",
        )

    def handle(self, *args: object, **options: object) -> None:
        mode = "embedded" if settings.EMBEDDED else "distributed"
        database = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
        workers = int(options["workers"])  # type: ignore[call-overload]
        if workers < 1:
            raise CommandError("--workers must be at least 1")
        if workers > 1 and not settings.EMBEDDED and settings.FERRY_EMBEDDED_NODE:
            raise CommandError(
                "several web processes would each load every model: run nodes with `manage.py"
                " runnode` and set FERRY_EMBEDDED_NODE=false"
            )
        self.stdout.write(
            f"Ferry on http://{options['host']}:{options['port']} ({mode} mode, database {database},"
            f" {workers} web process{'es' if workers > 1 else ''})"
        )
        config = uvicorn_config("config.asgi:application", options["host"], options["port"], workers=workers)
        if workers > 1:
            host = NodeHost(Path(settings.DATA_DIR) / "run" / "node.sock") if settings.EMBEDDED else None
            try:
                if host is not None:
                    host.start()
                    os.environ["FERRY_NODE_SOCKET"] = str(host.path)  # what the web processes read
                    os.environ.setdefault("FERRY_QUOTA_GATEWAYS", str(workers))
                # /metrics on the port answers for every web process (serving.dataplane.metrics.process_set)
                os.environ["FERRY_METRICS_DIR"] = str(fresh_metrics_dir(Path(settings.DATA_DIR) / "run"))
                Multiprocess(config, sockets=[config.bind_socket()]).run()
            except KeyboardInterrupt:
                pass
            finally:
                if host is not None:
                    host.stop()
            return
        server = uvicorn.Server(config)
        try:
            server.run()
        except KeyboardInterrupt:
            pass
        if not server.started:
            raise CommandError("the server did not start (see the log above)")


class NodeHost:
    """`manage.py nodehost` beside the web processes: started before them (it loads the models first), and
    started again if it dies; its socket is what the web processes connect to."""

    def __init__(self, path: Path) -> None:
        if len(str(path)) > MAX_SOCKET_PATH:
            raise CommandError(f"the node host's socket path is too long for a Unix socket: {path}")
        self.path = path
        self.proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None

    def _spawn(self) -> subprocess.Popen[bytes]:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # The host's own metrics are on FERRY_NODE_METRICS_PORT, not merged into the web processes'.
        env = {k: v for k, v in os.environ.items() if k not in ("FERRY_NODE_SOCKET", "FERRY_METRICS_DIR")}
        cmd = [sys.executable, str(Path(settings.BASE_DIR) / "manage.py"), "nodehost", "--socket", str(self.path)]
        return subprocess.Popen(cmd, env=env)

    def start(self) -> None:
        if self.path.exists():
            self.path.unlink()  # a host that died left it: readiness is the new one's socket
        self.proc = self._spawn()
        deadline = time.monotonic() + HOST_START_TIMEOUT_S
        while not self.path.exists():
            if self.proc.poll() is not None:
                raise CommandError(f"the node host exited with {self.proc.returncode} before it listened")
            if time.monotonic() > deadline:
                self.stop()
                raise CommandError(f"the node host did not listen within {HOST_START_TIMEOUT_S:.0f} s")
            time.sleep(0.1)
        self._watch = threading.Thread(target=self._keep_running, name="ferry-node-host", daemon=True)
        self._watch.start()

    def _keep_running(self) -> None:
        while not self._stopping.is_set():
            assert self.proc is not None
            code = self.proc.poll()
            if code is not None and not self._stopping.is_set():
                # Meanwhile the web processes answer 503 with Retry-After; they reconnect on their own.
                print(f"the node host exited with {code}; starting it again", file=sys.stderr, flush=True)
                self.proc = self._spawn()
            self._stopping.wait(0.5)

    def stop(self) -> None:
        self._stopping.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
