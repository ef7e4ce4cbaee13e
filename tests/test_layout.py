"""The layout keeps the planes apart: the data plane and the policies never reach the ORM.

Read statically (every import, at any depth of a function, followed through first-party modules),
so an import hidden inside a function counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
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
    # tests/layout_hidden_import.py imports serving.models only inside a function, and the ORM through it
    found = forbidden("tests.layout_hidden_import", ORM)
    assert any(chain.endswith("serving.models") for chain in found)
    assert any("django.db" in chain for chain in found)


# --- no import cycle, at any depth of a function ------------------------------------------------------------

FIRST_PARTY_PACKAGES = ("serving", "rollout", "tenants", "usage", "autoscaling", "sim", "bench", "config")


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan's algorithm, iterative): each is a cycle,
    or several that share modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def first_party_graph() -> dict[str, set[str]]:
    """Module -> the first-party modules it imports, from grimp (import-linter's graph): every import statement,
    inside functions and under TYPE_CHECKING included."""
    graph = grimp.build_graph(*FIRST_PARTY_PACKAGES, cache_dir=None)
    return {
        module: {m for m in graph.find_modules_directly_imported_by(module) if m.split(".")[0] in FIRST_PARTY_PACKAGES}
        for module in graph.modules
    }


def test_no_module_imports_itself_back_through_others() -> None:
    cycles = import_cycles(first_party_graph())
    print("import cycles among first-party modules:", cycles or "none")
    assert cycles == []


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import() -> None:
    # a -> b at the top, b -> c inside a function, c -> a under TYPE_CHECKING: one cycle of three; d is outside it
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert import_cycles(edges) == [["a", "b", "c"]]
    # and grimp sees an import inside a function: serving.signals queues the reconciler from one
    assert "serving.tasks" in first_party_graph()["serving.signals"]
