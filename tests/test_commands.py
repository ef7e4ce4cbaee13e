"""Management commands: register_model, ensure_demo_user, create_api_key and revoke_api_key.

build_demo_models is left to `make run`: it trains for about a minute.
"""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

pytestmark = pytest.mark.django_db

DIGITS_ARGS = ["--format", "torchscript", "--input", "input:FP32:64", "--output", "scores:FP32:10"]


def register_cli(name: str, artifact: object, *extra: str) -> str:
    out = StringIO()
    call_command("register_model", name, str(artifact), *extra, stdout=out)
    return out.getvalue()


def test_register_model_validates_and_prints_ready(model_files) -> None:  # noqa: ANN001
    from serving.models import ModelVersion, State

    # given the digits artifact / when registered from the command line with a batching option
    output = register_cli(
        "digits-cli", model_files.digits, *DIGITS_ARGS, "--max-batch-size", "8", "--metrics", '{"accuracy": 0.9}'
    )

    # then it reports the version ready, with its sha256 and latency profile
    assert "digits-cli:1 ready" in output
    version = ModelVersion.objects.get(model__name="digits-cli", version=1)
    assert version.artifact_id in output
    assert "b8=" in output
    # and the registry holds it validated, with the signature and options given
    assert version.state == State.READY
    assert version.max_batch_size == 8
    assert version.inputs == [{"name": "input", "datatype": "FP32", "shape": [64]}]
    assert version.outputs == [{"name": "scores", "datatype": "FP32", "shape": [10]}]
    assert version.metrics == {"accuracy": 0.9}
    assert set(version.latency_profile) == {"1", "2", "4", "8"}

    # when the same artifact is registered again / then it becomes version 2 of the same model
    assert "digits-cli:2 ready" in register_cli("digits-cli", model_files.digits, *DIGITS_ARGS)


def test_register_model_variable_length_signature(model_files) -> None:  # noqa: ANN001
    # given the tokens artifact / when registered with a -1 dimension / then it is ready
    output = register_cli(
        "tokens-cli",
        model_files.tokens,
        "--format",
        "torchscript",
        "--input",
        "tokens:INT64:-1",
        "--output",
        "scores:FP32:2",
    )
    assert "tokens-cli:1 ready" in output


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("input:FP32", "is not NAME:DATATYPE:DIMS"),
        ("input:FP32:sixty-four", "is not NAME:DATATYPE:DIMS"),
        ("input:FP32:64:64:1", "is not NAME:DATATYPE:DIMS"),
        ("input:FP32:64:1", "max_shape must equal shape on fixed dimensions"),
        ("input:FP33:64", "unsupported datatype 'FP33'"),
        ("input:FP32:-2", "shape must be a list of integers"),
        (":FP32:64", "non-empty"),
    ],
)
def test_register_model_rejects_bad_tensor_spec(model_files, spec: str, reason: str) -> None:  # noqa: ANN001
    from serving.models import Model

    # given a malformed --input / when the command runs / then CommandError says why, nothing is registered
    with pytest.raises(CommandError, match=reason):
        register_cli(
            "bad-spec", model_files.digits, "--format", "torchscript", "--input", spec, "--output", "scores:FP32:10"
        )
    assert not Model.objects.filter(name="bad-spec").exists()


def test_register_model_rejects_mismatched_signature(model_files) -> None:  # noqa: ANN001
    from serving.models import ModelVersion, State

    # given a signature the artifact does not produce / when registered / then CommandError with the reason
    with pytest.raises(CommandError, match=r"failed: .*scores"):
        register_cli(
            "wrong-sig",
            model_files.digits,
            "--format",
            "torchscript",
            "--input",
            "input:FP32:64",
            "--output",
            "scores:FP32:3",
        )
    # and the version is recorded as failed, with that reason
    version = ModelVersion.objects.get(model__name="wrong-sig")
    assert version.state == State.FAILED and "scores" in version.failure_reason


def test_register_model_rejects_broken_artifacts(model_files, tmp_path) -> None:  # noqa: ANN001
    # given a file that is not an archive / when registered / then CommandError saying so
    with pytest.raises(CommandError, match="not a zip file"):
        register_cli("broken", model_files.not_a_zip, *DIGITS_ARGS)
    # given a zip that is not a loadable model / then CommandError naming why the upload check refused it
    with pytest.raises(CommandError, match=r"archive refused: .*malformed pickle"):
        register_cli("broken", model_files.corrupt_zip, *DIGITS_ARGS)
    # given a torch.export program declared as TorchScript / then it fails to load, not crash
    with pytest.raises(CommandError, match="cannot load torchscript artifact"):
        register_cli("mislabelled", model_files.digits_export, *DIGITS_ARGS)
    # given a missing file / then CommandError naming the path
    missing = tmp_path / "nowhere.pt"
    with pytest.raises(CommandError, match="cannot read .*nowhere.pt"):
        register_cli("missing", missing, *DIGITS_ARGS)
    # given a bad model name / then CommandError from the registry's rules
    with pytest.raises(CommandError, match="model name"):
        register_cli("-bad name", model_files.digits, *DIGITS_ARGS)
    # given a sha256 that does not match / then CommandError with the mismatch
    with pytest.raises(CommandError, match="sha256 mismatch"):
        register_cli("digits-sha", model_files.digits, *DIGITS_ARGS, "--sha256", "0" * 64)
    # given an impossible batching option / then CommandError
    with pytest.raises(CommandError, match="max_batch_size"):
        register_cli("digits-zero", model_files.digits, *DIGITS_ARGS, "--max-batch-size", "0")


def test_ensure_demo_user_is_idempotent(monkeypatch, django_user_model, settings, tmp_path) -> None:  # noqa: ANN001
    from tenants.models import Membership, Role

    settings.DATA_DIR = tmp_path
    monkeypatch.setenv("FERRY_ADMIN_USER", "operator")
    monkeypatch.setenv("FERRY_ADMIN_PASSWORD", "first-password")

    # given no account / when the command runs / then it creates a staff superuser and says how to log in,
    # without printing the password
    out = StringIO()
    call_command("ensure_demo_user", stdout=out)
    assert "console login: operator with the password of FERRY_ADMIN_PASSWORD" in out.getvalue()
    assert "first-password" not in out.getvalue()
    user = django_user_model.objects.get(username="operator")
    assert user.is_staff and user.is_superuser
    assert user.check_password("first-password")
    membership = Membership.objects.get(user=user, tenant__slug="default")
    assert membership.role == Role.ADMIN

    # when it runs again, even with another password in the environment
    monkeypatch.setenv("FERRY_ADMIN_PASSWORD", "second-password")
    again = StringIO()
    call_command("ensure_demo_user", stdout=again)

    # then nothing changes: one account, the first password, one membership, and no password printed
    assert "existing account" in again.getvalue()
    assert "second-password" not in again.getvalue()
    assert django_user_model.objects.filter(username="operator").count() == 1
    user.refresh_from_db()
    assert user.check_password("first-password")
    assert Membership.objects.filter(user=user).count() == 2  # default and demo


def test_ensure_demo_user_gives_the_demo_tenant_its_models_and_a_key(  # noqa: ANN001
    monkeypatch, django_user_model, settings, tmp_path, model_files
) -> None:
    import stat

    from serving.management.commands.ensure_demo_user import key_still_valid
    from serving.models import Model
    from tenants.models import ApiKey, Membership, Role

    settings.DATA_DIR = tmp_path
    monkeypatch.setenv("FERRY_ADMIN_USER", "admin")
    # given a demo model and another model registered without a tenant
    register_cli("digits", model_files.digits, *DIGITS_ARGS)
    register_cli("mine", model_files.digits, *DIGITS_ARGS)
    # when the command runs
    out = StringIO()
    call_command("ensure_demo_user", stdout=out)
    # then tenant demo exists, admin is its operator, and the demo model is its public model; the other is not
    admin = django_user_model.objects.get(username="admin")
    assert Membership.objects.get(user=admin, tenant__slug="demo").role == Role.ADMIN
    digits = Model.objects.get(name="digits")
    assert digits.tenant.slug == "demo" and digits.visibility == "public"
    assert Model.objects.get(name="mine").tenant is None
    # and one key with infer and manage, its token in demo-api-key (mode 600), never printed: the examples read it
    path = tmp_path / "demo-api-key"
    token = path.read_text().strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert key_still_valid(token)
    key = ApiKey.objects.get(tenant__slug="demo")
    assert key.scopes == ["infer", "manage"] and token.startswith(f"fy_{key.prefix}_")
    assert token not in out.getvalue() and str(path) in out.getvalue()
    assert "curl" in out.getvalue() and "headers=" in out.getvalue()
    assert token not in key.digest and key.digest != token

    # when it runs again / then the key is kept and its token is not printed again
    again = StringIO()
    call_command("ensure_demo_user", stdout=again)
    assert token not in again.getvalue() and "existing" in again.getvalue()
    assert ApiKey.objects.filter(tenant__slug="demo").count() == 1
    assert path.read_text().strip() == token

    # when the key was revoked / then the next run makes a new one and writes it
    call_command("revoke_api_key", key.prefix, stdout=StringIO())
    third = StringIO()
    call_command("ensure_demo_user", stdout=third)
    fresh = path.read_text().strip()
    assert fresh != token and fresh not in third.getvalue() and key_still_valid(fresh)


def test_create_and_revoke_api_key_commands() -> None:
    from django.conf import settings

    from tenants.keys import matches, pepper_from, split
    from tenants.models import ApiKey, Tenant

    Tenant.objects.create(slug="acme", name="Acme")
    # given a tenant / when a key is created with both scopes and an expiry / then only its token is printed
    out, err = StringIO(), StringIO()
    call_command(
        "create_api_key",
        "acme",
        "checkout",
        "--scope",
        "infer",
        "--scope",
        "manage",
        "--expires-in-days",
        "30",
        stdout=out,
        stderr=err,
    )
    token = out.getvalue().strip()
    prefix, secret = split(token)
    key = ApiKey.objects.get(prefix=prefix)
    assert key.scopes == ["infer", "manage"] and key.expires_at is not None and key.name == "checkout"
    assert prefix in err.getvalue() and secret not in err.getvalue()
    assert matches(pepper_from(settings.SECRET_KEY), secret, key.digest)
    # when revoked by prefix / then revoked_at is set; again says so
    revoked = StringIO()
    call_command("revoke_api_key", prefix, stdout=revoked)
    key.refresh_from_db()
    assert key.revoked_at is not None and "revoked" in revoked.getvalue()
    again = StringIO()
    call_command("revoke_api_key", token, stdout=again)
    assert "already revoked" in again.getvalue()
    # and bad requests are refused with the reason
    with pytest.raises(CommandError, match="no tenant"):
        call_command("create_api_key", "nobody", "x", "--scope", "infer", stdout=StringIO(), stderr=StringIO())
    with pytest.raises(CommandError, match="positive"):
        call_command(
            "create_api_key",
            "acme",
            "x",
            "--scope",
            "infer",
            "--expires-in-days",
            "0",
            stdout=StringIO(),
            stderr=StringIO(),
        )
    with pytest.raises(CommandError, match="no API key"):
        call_command("revoke_api_key", "zzzzzzzzzz", stdout=StringIO())


@pytest.mark.django_db
def test_set_quota_validates_audits_and_changes_the_limits() -> None:
    from tenants.models import AuditEntry, Quota, Tenant

    acme = Tenant.objects.create(name="Acme", slug="acme")
    call_command("set_quota", "acme", "requests_per_second=5000", "burst=9000", stdout=StringIO())
    quota = Quota.objects.get(tenant=acme)
    assert (quota.requests_per_second, quota.burst) == (5000, 9000)
    entry = AuditEntry.objects.get(action="quota.set")
    assert entry.actor_name == "system" and entry.before["burst"] != 9000 and entry.after["burst"] == 9000
    for bad in (["burst=0"], ["bogus=1"], ["burst"], ["burst=lots"]):
        with pytest.raises(CommandError):
            call_command("set_quota", "acme", *bad)
    with pytest.raises(CommandError, match="no tenant"):
        call_command("set_quota", "nobody", "burst=1")
    assert Quota.objects.get(tenant=acme).burst == 9000
