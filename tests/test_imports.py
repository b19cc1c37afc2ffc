"""The core's modules import each other without a circle: a module that must tell another of a
change (the registry telling dispatch that decisions are stale) does it through a hook, so each
module can be read, tested and loaded after the ones it depends on."""

from __future__ import annotations

import ast
from pathlib import Path

import rope_dispatch

CORE = Path(rope_dispatch.__file__).parent


def _imports(path: Path) -> set[str]:
    """The core modules ``path`` imports, at its top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            found.update(name.split(".")[0] for name in names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rope_dispatch."):
            found.add(node.module.split(".")[1])
    return found


def test_the_core_modules_import_each_other_without_a_circle():
    modules = {p.stem: p for p in CORE.glob("*.py") if p.stem != "__init__"}
    graph = {name: _imports(path) & modules.keys() for name, path in modules.items()}
    state: dict[str, str] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", f"import circle: {' -> '.join(path + (name,))}"
        state[name] = "open"
        for dep in sorted(graph[name]):
            visit(dep, path + (name,))
        state[name] = "done"

    for name in sorted(graph):
        visit(name, ())
    assert "registry" in graph["dispatch"]  # the walk saw the edges it checks
