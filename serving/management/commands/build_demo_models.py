from django.core.management.base import BaseCommand

from serving.demo import build_all, demo_cache_dir


class Command(BaseCommand):
    help = "Train and register the demo models (digits, digits-small, token-sentiment); skips ones already built."

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("--rebuild", action="store_true", help="register new versions even if built")

    def handle(self, *args: object, **options: object) -> None:
        # Artifacts trained earlier by the same code are registered again rather than retrained (serving.demo's
        # cache; FERRY_DEMO_MODEL_CACHE=off trains every time).
        built = build_all(only_missing=not options["rebuild"], cache=demo_cache_dir())
        self.stdout.write(f"built: {', '.join(built) or 'nothing (all present)'}")
