"""The layout keeps the planes apart: the data plane and the policies never reach the ORM.

Read statically (every import, at any depth of a function, followed through first-party modules),
so an import hidden inside a function counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = ("serving", "tenants", "usage", "rollout", "config", "bench")
# The ORM and what reads the registry: a data-plane module reaching any of these could query the
# database per request, or fail when it is down.
ORM = (
    "django.db",
    "django.contrib",
    "serving.wiring",
    "serving.publish",
    "serving.actions",
    "serving.artifacts",
    "serving.validation",
    "serving.quota_counts",
    "serving.django_door",
)


def module_file(name: str) -> Path | None:
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imports_of(name: str) -> set[str]:
    """Every module `name` imports, at any depth, with `from a import b` giving a.b where b is a module."""
    path = module_file(name)
    if path is None:
        return set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.add(base)
            for alias in node.names:
                if module_file(f"{base}.{alias.name}") is not None:
                    found.add(f"{base}.{alias.name}")
    return found


def reaches(start: str) -> dict[str, list[str]]:
    """Every module reachable from `start`, with the chain of imports that reaches it."""
    chains = {start: [start]}
    todo = [start]
    while todo:
        current = todo.pop()
        for imported in sorted(imports_of(current)):
            if imported in chains:
                continue
            chains[imported] = chains[current] + [imported]
            if imported.split(".")[0] in FIRST_PARTY:
                todo.append(imported)
    return chains


def forbidden(start: str, banned: tuple[str, ...]) -> list[str]:
    chains = reaches(start)
    return [
        " -> ".join(chain)
        for name, chain in sorted(chains.items())
        if name.endswith(".models") or any(name == b or name.startswith(b + ".") for b in banned)
    ]


def modules_under(package: str) -> list[str]:
    folder = ROOT.joinpath(*package.split("."))
    found = []
    for path in folder.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found.append(".".join(parts[:-1] if path.name == "__init__.py" else parts))
    return sorted(found)


@pytest.mark.parametrize("module", modules_under("serving.dataplane"))
def test_data_plane_never_reaches_the_orm(module: str) -> None:
    assert forbidden(module, ORM) == []


@pytest.mark.parametrize("module", [*modules_under("serving.policies"), "rollout.routing", "rollout.gates"])
def test_policies_import_no_django(module: str) -> None:
    # Plain Python, shared with the simulator: not even settings.
    assert forbidden(module, ("django", "channels", "celery", *ORM)) == []


def test_the_check_finds_an_orm_import_hidden_in_a_function() -> None:
    # serving.wiring imports serving.models only inside its functions, and the ORM through publish.
    found = forbidden("serving.wiring", ORM)
    assert any(chain.endswith("serving.models") for chain in found)
    assert any("django.db" in chain for chain in found)
