import uvicorn
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from uvicorn.supervisors import Multiprocess

from serving.dataplane.http.frontdoor import uvicorn_config


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
            " own gateway. More than one needs distributed mode with FERRY_EMBEDDED_NODE=false.",
        )

    def handle(self, *args: object, **options: object) -> None:
        mode = "embedded" if settings.EMBEDDED else "distributed"
        database = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
        workers = int(options["workers"])  # type: ignore[call-overload]
        if workers < 1:
            raise CommandError("--workers must be at least 1")
        if workers > 1 and settings.EMBEDDED:
            # Quotas, snapshots and the node would each be per process: a tenant would get N times its limits.
            raise CommandError("several web processes need REDIS_URL (shared quotas and routing snapshots)")
        if workers > 1 and settings.FERRY_EMBEDDED_NODE:
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
            try:
                Multiprocess(config, sockets=[config.bind_socket()]).run()
            except KeyboardInterrupt:
                pass
            return
        server = uvicorn.Server(config)
        try:
            server.run()
        except KeyboardInterrupt:
            pass
        if not server.started:
            raise CommandError("the server did not start (see the log above)")
