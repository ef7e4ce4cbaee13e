"""The docs stay navigable: the files docs/architecture.md names exist (with the functions it names), no page
grows past what a newcomer reads in one sitting, and every relative link lands on a file."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
ARCHITECTURE = DOCS / "architecture.md"
MAX_LINES = 300

# `path/to/file.py` or `path/to/file.py:Class.method`, and `folder/` (a room); in backticks.
NAMED = re.compile(r"`((?:[\w.-]+/)+(?:[\w.-]+\.(?:py|md|sh|yaml|yml|toml|json|html))?)(?::([\w.]+))?`")
# The target layout is a plan: its folders do not exist yet.
PLAN = re.compile(r"<!-- plan:start -->.*?<!-- plan:end -->", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def named_in_architecture() -> list[tuple[str, str | None]]:
    text = PLAN.sub("", ARCHITECTURE.read_text())
    return [(m.group(1), m.group(2)) for m in NAMED.finditer(text)]


def rooms() -> list[str]:
    """The folders of the rooms' tree (the first fenced block under "## The rooms"): a line's first column."""
    text = ARCHITECTURE.read_text()
    block = text.split("## The rooms", 1)[1].split("```", 2)[1]
    found = []
    for line in block.splitlines():
        head = line.split("  ", 1)[0].strip()
        found += [name.strip() for name in head.split(",") if name.strip()]
    return found


def defined(path: Path, dotted: str) -> bool:
    """Whether `dotted` (a function, a class, or Class.method) is defined at the top of `path`'s module."""
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        found = [
            n for n in scope if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name == part
        ]
        if not found:
            return False
        scope = found[0].body if isinstance(found[0], ast.ClassDef) else []
    return True


def test_architecture_names_enough_to_be_checked() -> None:
    # Each of the three paths is a list of files; without this the test below would pass on an empty page.
    text = ARCHITECTURE.read_text()
    for heading in ("## A request", "## A rollout", "## A placement"):
        assert heading in text, heading
    assert len(named_in_architecture()) >= 40
    assert len(rooms()) >= 15


@pytest.mark.parametrize(("path", "name"), named_in_architecture(), ids=lambda v: v or "")
def test_architecture_names_real_files(path: str, name: str | None) -> None:
    target = ROOT / path
    assert target.exists(), f"docs/architecture.md names {path}, which does not exist"
    if name is not None:
        assert target.suffix == ".py", path
        assert defined(target, name), f"docs/architecture.md names {path}:{name}, which {path} does not define"


@pytest.mark.parametrize("room", rooms())
def test_architecture_rooms_exist(room: str) -> None:
    assert room.endswith("/") and (ROOT / room).is_dir(), f"docs/architecture.md names the room {room}: no folder"


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_no_page_is_over_300_lines(page: Path) -> None:
    lines = len(page.read_text().splitlines())
    assert lines <= MAX_LINES, f"{page.relative_to(ROOT)} has {lines} lines; split it (CONTRIBUTING.md)"


@pytest.mark.parametrize(
    "page", [*pages(), ROOT / "README.md", ROOT / "CONTRIBUTING.md"], ids=lambda p: str(p.relative_to(ROOT))
)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor on the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_bench_writers_pages_hold_their_sections() -> None:
    # bench/report.py's PAGES is where each writer splices its section: a page moved or a marker lost would
    # have the next `--record` append a stray copy instead of replacing the section.
    from bench.report import PAGES  # bench imports torch: only this test pays for it

    for name, page in PAGES.items():
        target = DOCS / page
        assert target.exists(), page
        if name != "served":  # bench.run writes that page whole
            text = target.read_text()
            assert f"<!-- {name}:start -->" in text and f"<!-- {name}:end -->" in text, (name, page)
