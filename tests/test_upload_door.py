"""Django's door (serving.django_door) grants an upload's body the artifact limit only for a model name the
uploader may upload to, by the view's own rule (serving.api.views.upload_target): a model of a tenant where
it is an engineer, or a new name. An engineer's upload to any other name (another tenant's model, private,
public or a platform one, a pipeline's, a name the router does not take) gets the form bound, refused 413
before a byte of the body is read, in the same words whichever it is.

The door is called as the ASGI server calls it, with a `receive` that counts how often it is drained and an
app standing in for Django that says whether the request reached it; one test goes through a live server
and Django itself. Sessions and users are real (PostgreSQL): the door reads them in a worker thread, hence
`transactional_db`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson
import pytest
from django.contrib.auth.models import User
from django.db import OperationalError

from serving import django_door
from serving.model_names import not_available
from serving.models import Model, Pipeline, Visibility
from tenants.models import Membership, Role, Tenant
from tests.test_front_door import DjangoSeen, credentials, exchange, head, multipart
from tests.test_front_door import django_seen as django_seen  # noqa: F401  (a fixture, used by name)
from tests.test_inference_http import Resp, assert_error

FORM_BOUND = 4096
ARTIFACT_LIMIT = 1024 * 1024
BODY = 2 * FORM_BOUND  # past the form bound, well within the artifact limit
# Every name an engineer of acme may not upload to; the door must answer each the same
REFUSED = ("secret", "open", "platform", "flow", "viewed", "-not-a-name")


@dataclass
class Door:
    """One request through the door: what it answered, how often the body was asked for, whether the app
    (Django) was reached and how many body bytes it got."""

    answer: list[dict] = field(default_factory=list)
    drained: int = 0
    reached: bool = False
    app_received: int = 0

    @property
    def status(self) -> int:
        return self.answer[0]["status"]

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.answer[1:])


async def knock(name: str, headers: dict[str, str], length: int = BODY) -> Door:
    door = Door()

    async def receive() -> dict:
        door.drained += 1
        return {"type": "http.request", "body": b"x" * length, "more_body": False}

    async def send(message: dict) -> None:
        door.answer.append(message)

    async def app(scope: dict, receive, send) -> None:  # noqa: ANN001
        door.reached = True
        message = await receive()
        door.app_received += len(message.get("body", b""))
        if message["type"] == "http.request":
            await send({"type": "http.response.start", "status": 201, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": f"/api/models/{name}/versions/",
        "raw_path": f"/api/models/{name}/versions/".encode(),
        "root_path": "",
        "query_string": b"",
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"multipart/form-data; boundary=x"),
            (b"content-length", str(length).encode()),
            *((key.lower().encode("latin-1"), value.encode("latin-1")) for key, value in headers.items()),
        ],
    }
    await django_door.bounded(app, scope, receive, send)
    return door


@pytest.fixture
def bounds(settings) -> None:  # noqa: ANN001
    settings.FERRY_MAX_FORM_BODY_BYTES = FORM_BOUND
    settings.FERRY_MAX_ARTIFACT_BYTES = ARTIFACT_LIMIT
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def bob(transactional_db) -> User:  # noqa: ANN001
    """An engineer of acme (and a viewer of initech), with models around him: acme's own `mine`; globex's
    private `secret`, public `open` and pipeline `flow`; the platform's `platform`; initech's `viewed`."""
    acme = Tenant.objects.create(name="Acme", slug="acme")
    globex = Tenant.objects.create(name="Globex", slug="globex")
    initech = Tenant.objects.create(name="Initech", slug="initech")
    user = User.objects.create_user("bob", "bob@example.org", "not-a-secret-1")
    Membership.objects.create(user=user, tenant=acme, role=Role.ENGINEER)
    Membership.objects.create(user=user, tenant=initech, role=Role.VIEWER)
    Model.objects.create(name="mine", tenant=acme)
    Model.objects.create(name="secret", tenant=globex, visibility=Visibility.PRIVATE)
    Model.objects.create(name="open", tenant=globex, visibility=Visibility.PUBLIC)
    Model.objects.create(name="platform", tenant=None, visibility=Visibility.PUBLIC)
    Model.objects.create(name="viewed", tenant=initech)
    Pipeline.objects.create(name="flow", tenant=globex)
    return user


@pytest.fixture
def session(bob: User) -> dict[str, str]:
    return credentials(bob, "session")


@pytest.fixture(params=["session", "basic"])
def auth(request: pytest.FixtureRequest, bob: User) -> dict[str, str]:
    """Bob's credentials as a client sends them: a session cookie (with DRF's CSRF pair) or HTTP Basic."""
    return credentials(bob, request.param)


async def test_an_engineers_upload_to_a_name_it_may_not_use_gets_the_form_bound_unread(
    bounds,  # noqa: ANN001
    auth: dict[str, str],
) -> None:
    # when the engineer declares a body past the form bound to each name it may not upload to
    refused = {name: await knock(name, auth) for name in REFUSED}
    # then each is 413 before the body is asked for, and Django is never reached
    for name, door in refused.items():
        assert door.status == 413, (name, door.body)
        assert door.drained == 0, name
        assert not door.reached, name
    # and the answers are one and the same: another tenant's private model reads like any other name
    answers = {door.body for door in refused.values()}
    assert len(answers) == 1, answers
    assert orjson.loads(answers.pop())["error"] == (
        f"request body exceeds {FORM_BOUND} bytes; a larger artifact upload needs an engineer's session or"
        " HTTP Basic credentials, and a model name that engineer may upload to"
    )


async def test_an_engineers_upload_to_its_own_or_a_new_model_gets_the_artifact_limit(
    bounds,  # noqa: ANN001
    auth: dict[str, str],
) -> None:
    for name in ("mine", "brand-new"):
        # when the engineer uploads past the form bound to its tenant's model, or to a name no one has
        door = await knock(name, auth)
        # then the body reaches Django whole
        assert door.reached, (name, door.answer)
        assert door.app_received == BODY, name
        assert door.status == 201, name
        # while past the artifact limit it is still 413 at once
        over = await knock(name, auth, ARTIFACT_LIMIT + django_door.FORM_OVERHEAD + 1)
        assert (over.status, over.drained) == (413, 0), name


async def test_a_database_outage_while_checking_the_name_is_a_503(
    bounds,  # noqa: ANN001
    session: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # given PostgreSQL going out of reach as the door looks the model up
    def unreachable(user: object, name: str) -> None:
        raise OperationalError("connection refused")

    monkeypatch.setattr(django_door, "upload_target", unreachable)
    # when the engineer uploads with its session / then 503 with Retry-After, the body unread
    door = await knock("mine", session)
    assert door.status == 503
    assert (b"retry-after", b"1") in door.answer[0]["headers"]
    assert (door.drained, door.reached) == (0, False)


def test_through_django_a_foreign_model_is_refused_unread_and_a_small_body_gets_the_views_answer(
    bounds,  # noqa: ANN001
    session: dict[str, str],
    django_seen: DjangoSeen,  # noqa: F811
    request: pytest.FixtureRequest,
) -> None:
    server = request.getfixturevalue("live_server")

    def post(name: str, size: int) -> tuple[str, Resp]:
        form, content_type = multipart(b"\0" * size, format="torchscript")
        path = f"/api/models/{name}/versions/"
        headers = {"Content-Type": content_type, "Content-Length": str(len(form)), **session}
        return path, exchange(server.port, head("POST", path, headers), [form])

    # when the engineer's session posts a body past the form bound to another tenant's private model
    path, big = post("secret", 2 * FORM_BOUND)
    # then 413 before Django read a byte: no CSRF check spooled the form
    assert_error(big, 413, f"request body exceeds {FORM_BOUND} bytes")
    assert path not in django_seen.received
    # when a small one / then the view's answer, the same for a private model as for a public one
    _, private = post("secret", 16)
    _, public = post("open", 16)
    assert_error(private, 409, not_available("secret"))
    assert_error(public, 409, not_available("open"))
    # while its own model's upload past the form bound is read whole (and found malformed by the view)
    path, own = post("mine", 2 * FORM_BOUND)
    assert own.status == 400, own.body
    assert django_seen.received[path] > FORM_BOUND
