"""The controller's modules form no import cycle: each component gets its collaborators from
the composition root (`core.py`) instead of importing the controller back.

Every import counts, those under `if TYPE_CHECKING:` too: a cycle of type-only imports is still
two modules that each need the other to be read."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(30)

PACKAGES = ("server/controller", "server/db")


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, known: set[str], root: Path = REPO) -> set[str]:
    """The modules of `known` that `path` imports (absolute or relative, any depth)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from .pkg import mod` imports the module `pkg.mod` when there is one
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]
    known = {module_name(p) for p in files}
    return {module_name(p): imported_modules(p, known) for p in files}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                return [*path[path.index(n):], n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_controller_modules_import_no_cycle() -> None:
    edges = graph()
    assert "server.controller.dispatch" in edges and "server.db.writer" in edges
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_only_the_entry_points_and_the_servicer_know_the_controller() -> None:
    edges = graph()
    users = sorted(m for m, deps in edges.items() if "server.controller.core" in deps)
    assert users == ["server.controller.__main__", "server.controller.app", "server.controller.servicer"]


def test_the_cycle_finder_finds_a_cycle(tmp_path: Path) -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    pkg = tmp_path / "server" / "controller"
    pkg.mkdir(parents=True)
    mod = pkg / "dispatch.py"
    mod.write_text("from typing import TYPE_CHECKING\nfrom . import errors\nfrom ..db.models import Row\n"
                   "if TYPE_CHECKING:\n    from .core import Controller\n")
    known = {"server.controller.core", "server.controller.errors", "server.db.models", "server.db"}
    assert imported_modules(mod, known, tmp_path) == known - {"server.db"}
