from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from serving import demo_story
from serving.demo import demo_cache_dir


class Command(BaseCommand):
    help = (
        "Set up the demo's story (serving/demo_story.py): a second digits version rolled out with a shadow up to"
        " its approval step, and tenant acme with a pending quota request. FERRY_DEMO_TRAFFIC=0: no rollout."
    )

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument(
            "--epoch-scale",
            type=float,
            default=1.0,
            help="train the second version for this share of its epochs (tests: the same path, briefly)",
        )
        parser.add_argument(
            "--phase-seconds",
            type=int,
            default=None,
            help="the rollout's shadow and canary steps bake this long instead of 30 s (tests: the same story,"
            " sooner; a phase still waits for its gates' evidence)",
        )

    def handle(self, *args: object, **options: object) -> None:
        def say(line: str) -> None:
            self.stdout.write(line)
            self.stdout.flush()

        if options["phase_seconds"] is not None and options["phase_seconds"] < 1:  # type: ignore[operator]
            raise CommandError("--phase-seconds must be at least 1 (a shadow of 0 s would skip the shadow)")
        demo_story.second_tenant(say)
        if not settings.FERRY_DEMO_TRAFFIC:
            say("FERRY_DEMO_TRAFFIC=0: no demo rollout and no demo traffic")
            return
        epoch_scale = float(options["epoch_scale"])  # type: ignore[arg-type]
        version = demo_story.candidate(say, epoch_scale, cache=demo_cache_dir())
        if version is not None:
            demo_story.rollout(version, say, options["phase_seconds"])  # type: ignore[arg-type]
