"""No module of ``formats/`` uses another module's private names (issue 26: the unpickler got a
module of its own with public names because ``megatron_legacy`` reached into five of
``dcp_io``'s). Checked on the source: ``from X import _name`` and ``X._name`` on an imported module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _project(node: ast.ImportFrom) -> bool:
    return node.level > 0 or (node.module or "").split(".")[0] in ("formats", "streamer")


def test_formats_modules_use_no_private_names_of_other_modules() -> None:
    found = []
    for path in sorted((ROOT / "formats").rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules: set[str] = set()  # names bound to project modules in this file
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and _project(node):
                for a in node.names:
                    if _private(a.name):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name}")
                    modules.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in ("formats", "streamer"):
                        modules.add(a.asname or a.name.split(".")[0])
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in modules):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert found == [], "\n".join(found)
