"""The update audit (streamer/vllm/audit.py) on plain torch modules: derived state that an update
left as it was is named; state rebuilt (a new closure, a new tensor) or freed is not. The vLLM tier
runs it inside real engines (tests/vllm/test_vllm_matrix.py, with a sabotaged engine too)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from streamer.vllm.audit import derived_state, snapshot, stale  # noqa: E402


def _pack(layer: Any) -> None:
    """What the CPU build's processing does: a packed copy inside a closure on the layer."""
    packed = layer.weight.detach().clone()
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, packed, bias)


def _model() -> Any:
    m = torch.nn.Module()
    m.embed = torch.nn.Linear(4, 8, bias=False)
    m.head = torch.nn.Linear(4, 8, bias=False)
    m.norm = torch.nn.LayerNorm(4)
    _pack(m.embed)
    _pack(m.head)
    m.head.scale = torch.ones(8)  # a tensor attribute (FP8 methods keep such)
    m.head.fallback = torch.nn.functional.linear  # no closure: holds no weights
    return m


def test_derived_state_is_closures_and_tensor_attributes_only() -> None:
    m = _model()
    assert set(derived_state(m.head)) == {"cpu_linear", "scale"}
    assert derived_state(m.norm) == {}  # parameters and buffers are not derived state


def test_rebuilt_state_passes_and_kept_state_is_named() -> None:
    m = _model()
    before = snapshot(m, ["embed", "head", "norm"])
    _pack(m.embed)
    assert stale(before) == [
        "head.cpu_linear: built from the previous weights and not rebuilt by this update (function)",
        "head.scale: built from the previous weights and not rebuilt by this update (Tensor)"]
    _pack(m.head)
    m.head.scale = torch.ones(8)
    assert stale(before) == []


def test_the_snapshot_keeps_nothing_alive() -> None:
    m = _model()
    before = snapshot(m, ["head"])
    del m.head.cpu_linear  # freed during the update: gone, so not stale
    assert before["head"][1]["cpu_linear"]() is None
    assert stale(before) == ["head.scale: built from the previous weights and not rebuilt by this update (Tensor)"]
