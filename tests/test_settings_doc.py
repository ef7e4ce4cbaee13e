"""docs/settings.md against config/settings.py, both ways: every variable the settings read has a row (or, for a
`PREFIX_*` row, is named on a page the row links to), every row names a variable they read, and every row gives
a default. The manifests' side (every variable they set is a setting) is tests/test_platform.py's."""

from __future__ import annotations

import re

import pytest

from tests import deployment_checks as checks

DOCS = checks.ROOT / "docs"
SETTINGS_DOC = DOCS / "settings.md"
NAME = re.compile(r"`([A-Z][A-Z0-9_]*\*?)`")
LINK = re.compile(r"\]\(([\w./-]+\.md)(?:#[\w-]*)?\)")


def rows(text: str) -> list[list[str]]:
    """The cells of each table row but headers and rules."""
    found = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) >= 3 and cells[0] != "variable":
            found.append(cells)
    return found


def read_names() -> tuple[set[str], set[str]]:
    """What config/settings.py reads: every name, and the names without the NAME_FILE of each string setting
    (env_str reads both; the page says so once, for all)."""
    every = checks.settings_env_names()
    return every, {n for n in every if not (n.endswith("_FILE") and n.removesuffix("_FILE") in every)}


def problems(text: str, every: set[str], settings: set[str]) -> list[str]:
    found: list[str] = []
    documented: set[str] = set()
    prefixes: dict[str, list[str]] = {}  # a `PREFIX_*` row's prefix: the pages the row links to
    for cells in rows(text):
        names = NAME.findall(cells[0])
        if not names:
            found.append(f"a row names no variable: {cells[0]}")
        for name in names:
            if name.endswith("*"):
                prefixes[name.rstrip("*")] = LINK.findall(cells[2])
            else:
                documented.add(name)
                if name not in every:
                    found.append(f"{name} has a row but config/settings.py does not read it")
        if not all(n.endswith("*") for n in names) and not cells[1]:
            found.append(f"{', '.join(names)}: no default given")
    for name in sorted(settings - documented):
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        if prefix is None:
            found.append(f"{name} is read by config/settings.py but has no row in docs/settings.md")
        elif not any(name in (DOCS / page).read_text() for page in prefixes[prefix]):
            found.append(f"{name} is not named on {prefixes[prefix]}, where the {prefix}* row sends readers")
    return found


def test_every_setting_has_a_row_with_a_default_and_every_row_is_a_setting() -> None:
    every, settings = read_names()
    assert problems(SETTINGS_DOC.read_text(), every, settings) == []


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            lambda t: re.sub(r"^\| `FERRY_RUNTIME_ISOLATION` \|.*\n", "", t, flags=re.M),
            "FERRY_RUNTIME_ISOLATION is read",
        ),
        (lambda t: t.replace("`FERRY_GRPC_HOST`, ", ""), "FERRY_GRPC_HOST is read"),
        (lambda t: t + "| `FERRY_NOT_A_SETTING` | 1 | nothing |\n", "FERRY_NOT_A_SETTING has a row"),
        (lambda t: t.replace("| `FERRY_LOG_LEVEL` | `INFO` |", "| `FERRY_LOG_LEVEL` | |"), "no default given"),
    ],
)
def test_the_check_catches_a_missing_row_a_stray_row_and_a_missing_default(change, expected: str) -> None:  # noqa: ANN001
    every, settings = read_names()
    text = SETTINGS_DOC.read_text()
    changed = change(text)
    assert changed != text
    assert any(expected in p for p in problems(changed, every, settings)), problems(changed, every, settings)


def test_operating_sends_readers_to_the_settings_page() -> None:
    assert "](settings.md)" in (DOCS / "operating.md").read_text()
