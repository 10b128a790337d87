"""The FP8 quantization references on CUDA give the bytes formats.quant gives on CPU (the bytes
convert writes). Skipped without CUDA."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from quant_reference import ref_block_fp8, ref_mxfp8

from formats.quant import QuantScheme, quantize, to_float32

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _weights(shape: tuple[int, int], dtype: Any) -> Any:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[1])
    w[:130, :128] = 0.0  # an all-zero block
    return w.to(dtype)


def _cpu_bits(w: Any, scheme: QuantScheme) -> tuple[np.ndarray, np.ndarray]:
    name = str(w.dtype).removeprefix("torch.")
    raw = w.contiguous().view(torch.uint8).numpy()
    return quantize(to_float32(raw, name, tuple(w.shape)), scheme)


@pytest.mark.parametrize("shape", [(1024, 2048), (300, 700)])
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_block_fp8_cuda_matches_cpu(shape: tuple[int, int], ue8m0: bool, dtype: str) -> None:
    w = _weights(shape, getattr(torch, dtype))
    q, s = ref_block_fp8(w.cuda(), ue8m0=ue8m0)
    cq, cs = _cpu_bits(w, QuantScheme("block", (128, 128), ue8m0))
    assert np.array_equal(q.view(torch.uint8).cpu().numpy(), cq)
    assert np.array_equal(s.cpu().numpy().view(np.uint32), cs.view(np.uint32))


@pytest.mark.parametrize("shape", [(64, 4096), (37, 100)])
def test_mxfp8_cuda_matches_cpu(shape: tuple[int, int]) -> None:
    w = _weights(shape, torch.bfloat16)
    q, s = ref_mxfp8(w.cuda())
    cq, cs = _cpu_bits(w, QuantScheme("mx", (1, 32)))
    assert np.array_equal(q.cpu().numpy(), cq) and np.array_equal(s.cpu().numpy(), cs)
