"""A module for tests/test_layout.py only: it reaches the ORM through an import inside a function, and the
check must find it (nothing imports this module)."""


def count_versions() -> int:
    from serving.models import ModelVersion  # noqa: PLC0415 (hidden on purpose: the check must see it)

    return ModelVersion.objects.count()
