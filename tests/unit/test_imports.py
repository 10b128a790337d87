"""The layering holds: no import cycle among the project's modules (issue: consolidation).

Every import counts, also those inside functions and under ``if TYPE_CHECKING:`` (a lazy or
type-only import that closes a cycle is still a cycle for a reader). The planner and the file formats stay
free of MPI and torch.distributed (tested in test_plan_purity.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("formats", "streamer")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = name.split(".")
                    base = base if is_pkg else base[:-1]
                    base = base[:len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                out.add(mod)
                out.update(f"{mod}.{a.name}" for a in child.names)  # `from pkg import module`
            visit(child)

    visit(tree)
    resolved = set()
    for m in out:
        while m and m not in known:
            m = m.rpartition(".")[0]
        if m and m != name:
            resolved.add(m)
    return resolved


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    known = {_module_name(p) for p in files}
    graph = {_module_name(p): _imports(p, _module_name(p), known) for p in files}
    # a package's __init__ re-exporting its modules is not a dependency of those modules on it
    for mod, deps in graph.items():
        graph[mod] = {d for d in deps if not mod.startswith(d + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state:
                found = dfs(v)
                if found:
                    return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state:
            found = dfs(u)
            if found:
                return found
    return None


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checker_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_type_checking_and_lazy_imports_count(tmp_path: Path) -> None:
    """An import under ``if TYPE_CHECKING:`` or inside a function is an edge of the graph."""
    a = tmp_path / "a.py"
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import X\n"
                 "def f():\n    from pkg.c import Y\n")
    assert _imports(a, "pkg.a", {"pkg.a", "pkg.b", "pkg.c"}) == {"pkg.b", "pkg.c"}
