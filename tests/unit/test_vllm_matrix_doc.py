"""docs/vllm.md's coverage matrix says what the vLLM tier tests: one row per architecture of
tests/vllm/tiny_models.MATRIX, ✓ at TP 1 and TP 2 for the served ones, "refused" for the others."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
import tiny_models  # noqa: E402  (transformers is imported only when a model is made)


def _table() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "vllm.md").read_text()
    start = text.index("<!-- coverage matrix: tests/unit/test_vllm_matrix_doc.py -->")
    body = text[start:text.index("<!-- end coverage matrix -->")].splitlines()[3:]
    rows = {}
    for line in body:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[2:]
    return rows


def test_the_docs_table_lists_every_architecture_the_tier_runs() -> None:
    rows = _table()
    assert list(rows) == list(tiny_models.MATRIX)
    for name, why in tiny_models.MATRIX.items():
        if why is None:
            assert rows[name] == ["✓", "✓"], (name, rows[name])
        else:
            assert all(c.startswith("refused") for c in rows[name]), (name, rows[name])
