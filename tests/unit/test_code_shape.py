"""The code stays readable in pieces (issue: consolidation): no function of 80 lines or more and
no module over 800 lines in ``formats/`` or ``streamer/``. A long function is split where a reader
would name the parts; a long module along its seams (issue 26)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 80
MAX_MODULE_LINES = 800

def test_no_function_of_80_lines_or_more() -> None:
    long = []
    for pkg in ("formats", "streamer"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = (node.end_lineno or node.lineno) - node.lineno + 1
                    if n >= MAX_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert long == [], "\n".join(long)


def test_no_module_over_800_lines() -> None:
    long = {}
    for pkg in ("formats", "streamer"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > MAX_MODULE_LINES:
                long[path.relative_to(ROOT).as_posix()] = n
    assert long == {}, "\n".join(f"{k}: {v} lines" for k, v in long.items())
