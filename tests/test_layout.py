"""The package's layout: the paper's parts at the top, plumbing in subpackages, no import cycle.

Every `import periodic_async...` is counted, including those inside functions (a cycle hidden
behind a function-level import is still a cycle), and the graph of modules must be acyclic.
"""

from __future__ import annotations

import ast
from pathlib import Path

import periodic_async

PACKAGE = Path(periodic_async.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its body). `from pkg import name`
    counts as importing `pkg.name` when that is a module, else `pkg`."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None (depth-first search, three colours).
    A package's `__init__` re-exporting its own submodules is not a cycle with them."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def edges(m: str):  # a submodule importing its own package's __init__ is not counted
        return sorted(d for d in graph[m] if not m.startswith(d + "."))

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in edges(m):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_package_has_no_import_cycle():
    """No module of periodic_async imports, directly or through others, itself."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    """Negative control: the checker reports a cycle when one is there."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_paper_parts_stand_at_the_top():
    """Where a reader of the paper looks: the method's parts are top-level modules."""
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert {"pipeline", "modes", "producer", "consumer", "group", "grpo", "trimodel", "shared_prompt",
            "attention", "config"} <= top
    assert {"data", "reward", "engine", "parallel", "scale", "bench"} <= {p.name for p in PACKAGE.iterdir()
                                                                          if (p / "__init__.py").is_file()}
