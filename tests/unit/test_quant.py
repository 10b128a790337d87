"""formats.quant: bit for bit against the torch references written from the definitions."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from quant_reference import ref_block_fp8, ref_mxfp8

from formats.quant import MX_BLOCK, QuantScheme, e4m3fn_from_f32, quantize, to_float32

torch = pytest.importorskip("torch")


def _bits(t: Any) -> np.ndarray:
    return t.contiguous().view(torch.uint8).cpu().numpy()


def _weights(shape: tuple[int, int], seed: int, dtype: Any = None) -> Any:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[1])  # columns of very different scale
    w[: min(7, shape[0]), :5] = 0.0
    return w.to(dtype or torch.bfloat16)


def _np(w: Any) -> np.ndarray:
    """``w``'s bytes decoded as float32 through formats.quant.to_float32 (the convert path)."""
    name = str(w.dtype).removeprefix("torch.")
    return to_float32(w.contiguous().view(torch.uint8).numpy(), name, tuple(w.shape))


def test_e4m3fn_cast_matches_torch_on_every_exponent() -> None:
    rng = np.random.default_rng(0)
    bits = np.concatenate([rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32),
                           np.arange(0x3A000000, 0x44000000, 251, dtype=np.uint32),  # subnormals .. past 448
                           np.array([0x43E80000, 0x43E7FFFF, 0x43E80001, 0x7F800000, 0x7FC00000, 0x7F800001],
                                    np.uint32)])
    x = np.concatenate([bits, bits | np.uint32(0x80000000)]).view(np.float32)
    assert np.array_equal(e4m3fn_from_f32(x), _bits(torch.from_numpy(x.copy()).to(torch.float8_e4m3fn)))


def test_e4m3fn_cast_matches_torch_on_every_high_half() -> None:
    """The cast is a table over the high 16 bits and whether the low 16 are nonzero: every high
    half with low halves 0, 1, 0x8000 and 0xFFFF checks the whole table against torch."""
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    x = np.concatenate([high | np.uint32(lo) for lo in (0, 1, 0x8000, 0xFFFF)]).view(np.float32)
    assert np.array_equal(e4m3fn_from_f32(x), _bits(torch.from_numpy(x.copy()).to(torch.float8_e4m3fn)))
    assert e4m3fn_from_f32(x.reshape(4, -1)).shape == (4, 1 << 16)


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (1, 129), (128, 1), (5, 7)])
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_block_fp8_matches_deepgemm_definition(shape: tuple[int, int], ue8m0: bool, dtype: str) -> None:
    w = _weights(shape, 1, getattr(torch, dtype))
    q, s = quantize(_np(w), QuantScheme("block", (128, 128), ue8m0))
    rq, rs = ref_block_fp8(w, ue8m0=ue8m0)
    assert np.array_equal(q, _bits(rq))
    assert np.array_equal(s.view(np.uint32), rs.numpy().view(np.uint32))


def test_block_fp8_all_zero_block_takes_the_amax_floor() -> None:
    w = torch.zeros((200, 130), dtype=torch.bfloat16)
    w[150:, 129] = 3.0
    q, s = quantize(_np(w), QuantScheme("block", (128, 128)))
    assert s[0, 0] == np.float32(1e-4) / np.float32(448) and not q[:128, :128].any()
    rq, rs = ref_block_fp8(w)
    assert np.array_equal(q, _bits(rq)) and np.array_equal(s, rs.numpy())


def test_blocks_cut_by_shard_boundaries_quantize_like_the_whole() -> None:
    """A TP shard on the block grid (the last block partial) gives the whole array's bytes."""
    w = _weights((300, 260), 2)
    q, s = quantize(_np(w), QuantScheme("block", (128, 128)))
    for r0, r1, c0, c1 in [(0, 128, 0, 260), (128, 300, 0, 260), (0, 300, 256, 260), (256, 300, 128, 256)]:
        qs, ss = quantize(_np(w[r0:r1, c0:c1]), QuantScheme("block", (128, 128)))
        assert np.array_equal(qs, q[r0:r1, c0:c1])
        assert np.array_equal(ss, s[r0 // 128:-(-r1 // 128), c0 // 128:-(-c1 // 128)])


def test_block_fp8_non_finite_follows_the_arithmetic() -> None:
    """Documented: a block with inf gets scale inf, its inf elements NaN, the rest ±0; with NaN,
    a NaN scale and NaN elements (the definition's own arithmetic, as torch computes it)."""
    w = _weights((256, 256), 3, torch.float32)
    w[3, 4], w[130, 7], w[200, 200] = float("inf"), float("nan"), -float("inf")
    q, s = quantize(_np(w), QuantScheme("block", (128, 128)))
    rq, rs = ref_block_fp8(w)
    assert np.array_equal(q, _bits(rq)) and np.array_equal(s.view(np.uint32), rs.numpy().view(np.uint32))
    assert np.isinf(s[0, 0]) and np.isnan(s[1, 0]) and np.isfinite(s[0, 1])
    assert (q[:128, :128] & 0x7F == 0x7F).sum() == 1  # only the inf element is NaN (inf * 0)


@pytest.mark.parametrize("shape", [(4, 64), (3, 100), (2, 5, 33), (1, 32)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mxfp8_matches_ocp_definition(shape: tuple[int, ...], dtype: str) -> None:
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(shape, generator=g) * 10.0 ** torch.randint(-30, 30, shape, generator=g)).to(getattr(torch, dtype))
    w.view(-1)[:40] = 0.0  # an all-zero block
    w.view(-1)[-1] = 2.0 ** -140 if dtype == "float32" else 0.0  # a scale clamped at 2^-127
    block = (1,) * (len(shape) - 1) + (MX_BLOCK,)
    q, s = quantize(_np(w), QuantScheme("mx", block))
    rq, rs = ref_mxfp8(w)
    assert np.array_equal(q, rq.numpy()) and np.array_equal(s, rs.numpy())
    assert s.reshape(-1)[0] == 0  # all-zero block: 2^-127


def test_mxfp8_non_finite_block_is_nan() -> None:
    """OCP: a block holding inf or NaN has the NaN scale (0xFF) and NaN elements."""
    w = torch.randn((2, 64))
    w[0, 3], w[1, 40] = float("inf"), float("nan")
    q, s = quantize(_np(w), QuantScheme("mx", (1, 32)))
    rq, rs = ref_mxfp8(w)
    assert np.array_equal(q, rq.numpy()) and np.array_equal(s, rs.numpy())
    assert s.tolist() == [[0xFF, s[0, 1]], [s[1, 0], 0xFF]] and (q[0, :32] == 0x7F).all()


def test_formats_quant_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, formats.quant; assert 'torch' not in sys.modules and 'mpi4py' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@settings(max_examples=30)
@given(rows=st.integers(1, 200), cols=st.integers(1, 200), br=st.integers(1, 64), bc=st.integers(1, 64),
       ue8m0=st.booleans(), seed=st.integers(0, 2**16))
def test_block_fp8_any_shape_and_block(rows: int, cols: int, br: int, bc: int, ue8m0: bool, seed: int) -> None:
    w = _weights((rows, cols), seed)
    q, s = quantize(_np(w), QuantScheme("block", (br, bc), ue8m0))
    rq, rs = ref_block_fp8(w, (br, bc), ue8m0)
    assert np.array_equal(q, _bits(rq)) and np.array_equal(s.view(np.uint32), rs.numpy().view(np.uint32))
