"""The demo's story as a newcomer meets it: `make run` in a fresh data directory, then the console in Chromium.

The test runs `make run` itself (embedded mode: SQLite in a data directory of its own, a free port), with the
rollout evaluated, and usage and shadow pairs flushed, every 2 s instead of every 10 s, and its phases baking
5 s instead of 30 s, so the rollout reaches its approval step sooner; everything else is as a user gets it: the
models trained (from scratch on a fresh clone; from serving.demo's cache, var/demo-model-cache or
FERRY_DEMO_MODEL_CACHE, when this code trained them before, as a user's next `make run` in a new data directory
would), the second `digits` version, the rollout and its shadow, the background traffic. With FERRY_DEMO_URL set
it drives a server started by hand instead (`make run` on a fresh clone), logging in as FERRY_ADMIN_USER /
_PASSWORD, or with the password `make run` generated beside FERRY_DEMO_KEY_FILE.

Screenshots of the model page and the shadow report go to FERRY_SCREENSHOT_DIR (docs/console.md's come from
`FERRY_SCREENSHOT_DIR=docs/img`), else to the test's temporary directory.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import orjson
import pytest
from sklearn.datasets import load_digits

from tests.conftest import free_port
from tests.test_console_browser import CHROMIUM, CHROMIUM_ARGS, WAIT_MS, log_in

# Not `solo`: the story mostly waits (for the server, each phase's evidence, the evaluations), and its deadlines
# are minutes; it runs in the parallel part's group of deployments (tests/xdist_workers.py), one at a time.
pytestmark = [pytest.mark.browser]
ROOT = Path(__file__).resolve().parent.parent
START_S = 40 * 60  # `make run` trains four models, then the second digits version: minutes on a shared machine
# The rollout's shadow and each canary step bake this long instead of the demo's 30 s: each phase still moves on
# only once its gates have their evidence (100 answers or comparisons, seconds at the demo's 20 requests/s).
PHASE_S = 5
STORY_S = 15 * 60  # from the first request to the approval step: shadow, two canary steps, flushes, evaluations
# Variables of the test run that must not reach `make run`: it is embedded mode, on its own SQLite.
NOT_PASSED = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "FERRY_QUOTA_REDIS_URL")


@dataclass
class Demo:
    url: str
    key: str
    username: str
    password: str

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 80


def _wait_for_login_page(url: str, proc: subprocess.Popen | None, log: Path | None) -> None:
    deadline = time.monotonic() + START_S
    parts = urlsplit(url)
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-4000:] if log else ""
            pytest.fail(f"make run exited with {proc.returncode}:\n{tail}")
        try:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
            conn.request("GET", "/login/")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(2)
    pytest.fail(f"no login page at {url} within {START_S} s")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    username = os.environ.get("FERRY_ADMIN_USER", "admin")
    password = os.environ.get("FERRY_ADMIN_PASSWORD", "")  # empty: the one ensure_demo_user generated
    given = os.environ.get("FERRY_DEMO_URL")
    if given:
        key_file = Path(os.environ.get("FERRY_DEMO_KEY_FILE", ROOT / "var" / "demo-api-key"))
        key = key_file.read_text().strip()
        password = password or (key_file.parent / "demo-admin-password").read_text().strip()
        _wait_for_login_page(given, None, None)
        yield Demo(given.rstrip("/"), key, username, password)
        return
    data = tmp_path_factory.mktemp("demo-data")
    log = data / "make-run.log"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in NOT_PASSED and not k.startswith("FERRY_")}
    if password:
        env["FERRY_ADMIN_PASSWORD"] = password
    env |= {
        "FERRY_DATA_DIR": str(data),
        "FERRY_ROLLOUT_EVALUATE_SECONDS": "2",
        "FERRY_USAGE_FLUSH_SECONDS": "2",
        "FERRY_SHADOW_FLUSH_SECONDS": "2",
        "FERRY_ADMIN_USER": username,
        "FERRY_GRPC_PORT": "0",  # no gRPC listener: another server on this machine may hold the default port
    }
    if os.environ.get("FERRY_DEMO_MODEL_CACHE"):  # where the demo models trained before are kept (.ci/run sets it)
        env["FERRY_DEMO_MODEL_CACHE"] = os.environ["FERRY_DEMO_MODEL_CACHE"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["make", "run", f"PORT={port}", f"DEMO_STORY_ARGS=--phase-seconds {PHASE_S}"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_for_login_page(f"http://127.0.0.1:{port}", proc, log)
        key = (data / "demo-api-key").read_text().strip()
        password = password or (data / "demo-admin-password").read_text().strip()
        yield Demo(f"http://127.0.0.1:{port}", key, username, password)
    finally:
        # The process group `make run` leads (it was started in a session of its own): make, the server the
        # recipe exec'd, the traffic loop; SIGINT as a Ctrl-C would send it.
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        print(log.read_text()[-3000:])


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    target = Path(os.environ.get("FERRY_SCREENSHOT_DIR", tmp_path))
    target = target if target.is_absolute() else ROOT / target
    target.mkdir(parents=True, exist_ok=True)
    return target


def infer(demo: Demo) -> tuple[int, str]:
    """One request for digits with the demo key: its status and the version that answered."""
    x = load_digits().data[:1].astype("float32")
    body = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": x[0].tolist()}]})
    conn = http.client.HTTPConnection("127.0.0.1", demo.port, timeout=60)
    try:
        conn.request(
            "POST",
            "/v2/models/digits/infer",
            body=body,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {demo.key}"},
        )
        resp = conn.getresponse()
        resp.read()
        return resp.status, resp.getheader("x-ferry-model-version", "")
    finally:
        conn.close()


def drawn(page, selector: str) -> int:  # noqa: ANN001
    """How many of the elements `selector` names are drawn taller than nothing (bars of empty bins are 0 high)."""
    return page.locator(selector).evaluate_all(
        "els => els.filter(e => parseFloat(e.getAttribute('height')) > 0).length"
    )


def test_admin_sees_the_shadow_approves_the_promotion_and_the_quota(demo: Demo, shots: Path) -> None:
    if not CHROMIUM.exists():
        pytest.fail(f"Chromium is missing at {CHROMIUM}: install Debian's chromium package")
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(base_url=demo.url, viewport={"width": 1280, "height": 900})
            context.set_default_timeout(WAIT_MS)
            page = context.new_page()
            # given the admin, logged in, on digits' shadow report
            page.goto("/login/?next=/console/models/digits/shadow/")
            log_in(page, demo.username, demo.password)
            panel = page.locator("article.rollout").first
            # when the demo's traffic has taken the rollout through its shadow and canary steps (the page is
            # reloaded until it shows the approval step: a deadline, not a timing assertion)
            deadline = time.monotonic() + STORY_S
            while panel.locator(".rollout-state").inner_text() != "Awaiting Approval":
                state = panel.locator(".rollout-state").inner_text()
                assert state in ("Shadowing", "Canary"), f"the rollout ended as {state}: {panel.inner_text()}"
                assert time.monotonic() < deadline, f"still {state} after {STORY_S} s: {panel.inner_text()}"
                time.sleep(5)
                page.reload()
            # then the shadow report's charts have data: agreement points, difference and latency bars
            expect(page.locator("span.agreement")).to_have_text(re.compile(r"0\.9\d\d|1\.000"))
            assert page.locator("svg.shadow-agreement circle.point").count() > 0
            assert drawn(page, "svg.shadow-differences rect.bar") > 0
            assert drawn(page, "svg.shadow-latency rect.bar.baseline") > 0
            assert drawn(page, "svg.shadow-latency rect.bar.candidate") > 0
            page.screenshot(path=str(shots / "console-shadow.png"), full_page=True)
            _, candidate = map(int, re.findall(r"version (\d+) → (\d+)", panel.inner_text())[0])

            # and the model page shows each serving version's last hour: latency, batch sizes, answers by kind
            page.goto("/console/models/digits/")
            hour = page.locator(f'section.version-hour[data-version="{candidate}"]')
            expect(hour).to_be_visible()
            assert hour.locator("svg.version-latency circle.point").count() > 0
            assert drawn(page, f'section.version-hour[data-version="{candidate}"] svg.version-batches rect.bar') > 0
            assert hour.locator("svg.version-answers rect.served").count() > 0
            expect(hour.locator(".hour-summary")).to_contain_text("served")
            page.screenshot(path=str(shots / "console-model.png"), full_page=True)

            # when the admin approves the promotion / then the rollout is promoted, nothing left to press
            panel = page.locator("article.rollout").first
            panel.get_by_role("button", name="Approve").click()
            expect(panel.locator(".rollout-state")).to_have_text("Promoted")
            expect(panel).to_contain_text(f"approved by {demo.username}")
            expect(panel.get_by_role("button")).to_have_count(0)
            # and the next request is served by the promoted version
            assert infer(demo) == (200, str(candidate))

            # when the admin approves acme's pending quota request / then nothing is pending
            page.goto("/console/quota-requests/")
            row = page.locator("tr", has_text="Acme Analytics")
            expect(row).to_contain_text("requests_per_second")
            row.get_by_role("button", name="Approve").click()
            expect(page.locator("table.requests")).to_contain_text("Nothing pending.")
            context.close()
        finally:
            browser.close()
