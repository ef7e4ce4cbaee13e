import os
import signal
import threading
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand
from sklearn.datasets import load_digits

from serving.demo_traffic import DemoTraffic
from serving.management.commands.ensure_demo_user import KEY_FILE

REPORT_SECONDS = 60  # how often failures (never successes) are reported


class Command(BaseCommand):
    help = (
        "Send the demo's background traffic (FERRY_DEMO_TRAFFIC_RPS requests/s of scikit-learn's digits to"
        " `digits`, with the demo tenant's key) to a server on this machine, until it is stopped or, with"
        " --with-parent, until the process that started it exits (`make run`: the server). FERRY_DEMO_TRAFFIC=0:"
        " nothing is sent."
    )

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("--host", default="127.0.0.1", help="the server's address (0.0.0.0 and :: mean this host)")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--model", default="digits")
        parser.add_argument("--with-parent", action="store_true", help="stop when the parent process exits")

    def handle(self, *args: object, **options: object) -> None:
        if not settings.FERRY_DEMO_TRAFFIC:
            return
        key_path = Path(settings.DATA_DIR) / KEY_FILE
        try:
            key = key_path.read_text().strip()
        except OSError:
            self.stderr.write(f"demo traffic: no key in {key_path} (run manage.py ensure_demo_user): not sending")
            return
        host = str(options["host"])
        host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        parent = os.getppid()
        stopped = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stopped.set())

        def stop() -> bool:
            return stopped.is_set() or (bool(options["with_parent"]) and os.getppid() != parent)

        traffic = DemoTraffic(
            host=host,
            port=int(options["port"]),  # type: ignore[call-overload]
            key=key,
            rows=load_digits().data,
            model=str(options["model"]),
            rate=settings.FERRY_DEMO_TRAFFIC_RPS,
            in_flight=settings.FERRY_DEMO_TRAFFIC_IN_FLIGHT,
        )
        try:
            while not stop() and not traffic.ready():
                stopped.wait(1.0)
            if stop():
                return
            self.stdout.write(
                f"demo traffic: {traffic.rate} requests/s to {traffic.model} as tenant demo"
                " (FERRY_DEMO_TRAFFIC=0 make run turns it off)"
            )
            self.stdout.flush()
            reporter = threading.Thread(target=self._report, args=(traffic, stopped), daemon=True)
            reporter.start()
            traffic.run(stop)
        finally:
            stopped.set()
            traffic.close()

    def _report(self, traffic: DemoTraffic, stopped: threading.Event) -> None:
        while not stopped.wait(REPORT_SECONDS):
            statuses = traffic.take_statuses()
            failed = {status: n for status, n in sorted(statuses.items()) if status != 200}
            if failed:
                answers = ", ".join(f"{n} x {status or 'no answer'}" for status, n in failed.items())
                self.stderr.write(
                    f"demo traffic: {sum(failed.values())} of {sum(statuses.values())} requests failed in the"
                    f" last {REPORT_SECONDS} s ({answers})"
                )
