"""A key created on the console is shown once, and its token is stored nowhere on the server: not in the
session, whose store is the database, where a token whose page was never loaded would stay in clear."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.contrib.sessions.models import Session
from django.test import Client

from tenants.models import ApiKey, Membership, Role, Tenant
from tenants.views import NEW_TOKEN

pytestmark = pytest.mark.django_db

PAGE = "/console/tenants/acme/keys/"


@pytest.fixture
def admin() -> Client:
    tenant = Tenant.objects.create(slug="acme", name="Acme")
    user = User.objects.create_user("ada")
    Membership.objects.create(user=user, tenant=tenant, role=Role.ADMIN)
    client = Client()
    client.force_login(user)
    return client


def test_the_new_token_is_in_no_session_and_shown_once(admin: Client) -> None:
    # when the admin creates a key
    created = admin.post(PAGE, {"name": "billing-app", "scopes": ["infer"]})
    assert created.status_code == 302 and created["Location"] == PAGE
    # then the token travels to the page in a cookie of its own, for that page only, not readable by scripts
    cookie = created.cookies[NEW_TOKEN]
    assert cookie["path"] == PAGE and cookie["httponly"] and cookie["samesite"] == "Strict"
    # and no session row holds it, though the page that shows it has not been loaded yet
    assert ApiKey.objects.count() == 1
    token_prefix = ApiKey.objects.get().prefix
    stored = [session.get_decoded() for session in Session.objects.all()]
    assert stored and not any(token_prefix in repr(data) for data in stored)
    # when the page is loaded / then it shows the token, and deletes the cookie
    shown = admin.get(PAGE)
    assert shown.context["new_token"].startswith(f"fy_{token_prefix}_")
    assert shown["Cache-Control"] == "no-store"
    assert shown.cookies[NEW_TOKEN]["max-age"] == 0
    # and a second load shows it no more
    assert admin.get(PAGE).context["new_token"] is None


def test_a_forged_token_cookie_is_not_shown(admin: Client) -> None:
    # given a cookie that was not signed by this server / then the page shows nothing from it
    admin.cookies[NEW_TOKEN] = "fy_forged"
    assert admin.get(PAGE).context["new_token"] is None
