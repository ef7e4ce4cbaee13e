from django.core.management.base import BaseCommand

from serving.demo import build_all


class Command(BaseCommand):
    help = "Train and register the demo models (digits, digits-small, token-sentiment); skips ones already built."

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("--rebuild", action="store_true", help="register new versions even if built")

    def handle(self, *args: object, **options: object) -> None:
        built = build_all(only_missing=not options["rebuild"])
        self.stdout.write(f"built: {', '.join(built) or 'nothing (all present)'}")
