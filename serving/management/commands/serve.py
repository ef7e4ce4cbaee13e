import uvicorn
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from serving.dataplane.frontdoor import uvicorn_config


class Command(BaseCommand):
    help = "Serve the console, the REST API and /v2 inference (embedded node unless FERRY_EMBEDDED_NODE=false)."

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)

    def handle(self, *args: object, **options: object) -> None:
        mode = "embedded" if settings.EMBEDDED else "distributed"
        database = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
        self.stdout.write(f"Ferry on http://{options['host']}:{options['port']} ({mode} mode, database {database})")
        server = uvicorn.Server(uvicorn_config("config.asgi:application", options["host"], options["port"]))
        try:
            server.run()
        except KeyboardInterrupt:
            pass
        if not server.started:
            raise CommandError("the server did not start (see the log above)")
