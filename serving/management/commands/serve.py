import uvicorn
from django.conf import settings
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Serve the console, the REST API and /v2 inference (embedded node unless FERRY_EMBEDDED_NODE=false)."

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)

    def handle(self, *args: object, **options: object) -> None:
        mode = "embedded" if settings.EMBEDDED else "distributed"
        database = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
        self.stdout.write(f"Ferry on http://{options['host']}:{options['port']} ({mode} mode, database {database})")
        uvicorn.run(
            "config.asgi:application", host=options["host"], port=options["port"], loop="uvloop",
            http="httptools", lifespan="on", access_log=False, proxy_headers=False,
            limit_concurrency=settings.FERRY_MAX_CONCURRENCY, log_level="info", timeout_graceful_shutdown=10,
        )
