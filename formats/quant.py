"""Block FP8 quantization in numpy, bit-identical to the torch definitions the engines use.

Two schemes, both with ``float8_e4m3fn`` data:

* ``block`` — DeepGEMM's ``per_block_cast_to_fp8`` (DeepSeek-V3 / vLLM ``weight_scale_inv``):
  per block (128×128 by default; the last block of a dim may be partial)
  ``amax = max(max|w| in float32, 1e-4)``, ``q = e4m3fn(w.float() * (448 / amax))``,
  ``scale_inv = amax / 448`` (float32). ``448 / amax`` is rounded as torch computes a scalar
  divided by a tensor, ``(1 / amax) * 448``, so the bytes match the torch reference. With
  ``ue8m0`` the scale is rounded up to a power of two (DeepGEMM ``use_ue8m0``; exactly, by
  ``frexp``, not through a rounded ``log2``) and ``q = e4m3fn(w.float() * (1 / scale_inv))``.
* ``mx`` — OCP MX (MXFP8): blocks of 32 along the last dim, ``float8_e8m0fnu`` scales
  ``X = 2^(floor(log2 amax) - 8)`` (8: the largest exponent of e4m3), clamped to
  ``[2^-127, 2^127]``; an all-zero block gets ``2^-127``; ``q = e4m3fn(clamp(w / X, ±448))``.

``e4m3fn`` conversion follows torch's ``.to(torch.float8_e4m3fn)`` (checked bit for bit on torch
2.13): round to nearest even, saturating: ``|x| > 464`` and ±inf become ±448; NaN stays NaN.

Non-finite input (a documented choice): ``block`` follows the definition's arithmetic, as torch
does: a block holding ±inf gets ``scale_inv = inf``, its inf elements become NaN (inf·0) and the
others ±0; a block holding NaN gets a NaN scale and NaN elements. NaN sign bits there are the
platform's (x86 and CUDA differ), so only NaN-ness is portable. ``mx`` follows the OCP rule: a
block holding inf or NaN gets the NaN scale (0xFF) and every element is NaN (0x7F).

Pure numpy: no torch, no MPI.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from math import ceil
from typing import Any

import numpy as np

__all__ = ["E4M3_MAX", "MX_BLOCK", "QuantScheme", "e4m3fn_from_f32", "quantize", "to_float32"]

#: the largest finite float8_e4m3fn value
E4M3_MAX = 448.0
#: OCP MX block: 32 elements along the last dim
MX_BLOCK = 32
_E4M3_EMAX = 8  # exponent of E4M3_MAX = 1.75 * 2^8
_AMAX_FLOOR = np.float32(1e-4)

_Arr = np.ndarray[Any, Any]


@dataclass(frozen=True)
class QuantScheme:
    """How one FP8 weight is quantized: ``kind`` ``block`` (float32 scales) or ``mx`` (e8m0)."""

    kind: str
    block: tuple[int, ...]  # weight elements per scale, per dim
    ue8m0: bool = False  # block: scales rounded up to a power of two

    @property
    def scale_dtype(self) -> str:
        return "float8_e8m0fnu" if self.kind == "mx" else "float32"

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(ceil(n / b) for n, b in zip(shape, self.block))

    def describe(self) -> str:
        blk = "x".join(map(str, self.block))
        return f"mxfp8 {blk}" if self.kind == "mx" else f"fp8 block {blk}" + (" ue8m0" if self.ue8m0 else "")


def to_float32(raw: _Arr, dtype: str, shape: tuple[int, ...]) -> _Arr:
    """Row-major bytes (or storage ints) of ``dtype`` elements as float32 (torch's ``.float()``)."""
    b = np.ascontiguousarray(raw).view(np.uint8)
    if dtype == "bfloat16":  # the top half of a float32
        out = (b.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    elif dtype in ("float16", "float32", "float64"):
        out = b.view(np.dtype(dtype).newbyteorder("<")).astype(np.float32)
    else:
        raise ValueError(f"cannot quantize {dtype} (expected bfloat16, float16, float32 or float64)")
    return out.reshape(shape)


def e4m3fn_from_f32(x: _Arr) -> _Arr:
    """float32 -> float8_e4m3fn bits, exactly as torch's ``.to(torch.float8_e4m3fn)``: round to
    nearest even, saturating (``|x| > 464`` and ±inf become ±448), NaN stays NaN (sign kept).

    A table lookup: e4m3fn keeps at most 3 mantissa bits, so the result depends only on the
    top 16 bits of the float32 (sign, exponent, 7 mantissa bits: the kept bits and the rounding
    bit of normals and subnormals) and on whether the low 16 bits are nonzero (the sticky part of
    round-to-nearest-even, and inf vs NaN). The table (128 KiB) is built once by ``_e4m3fn_arith``."""
    halves = np.ascontiguousarray(x, dtype="<f4").view("<u2").reshape(-1, 2)  # [low, high] halves
    idx = halves[:, 1].astype(np.uint32)
    idx <<= np.uint32(1)
    idx |= halves[:, 0] != 0
    out: _Arr = _e4m3fn_table()[idx]
    return out.reshape(np.shape(x))


@functools.cache
def _e4m3fn_table() -> _Arr:
    """``e4m3fn bits [(high 16 bits << 1) | (low 16 bits != 0)]`` of every float32."""
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    return _e4m3fn_arith(np.stack([high, high | np.uint32(1)], axis=1).reshape(-1).view(np.float32))


def _e4m3fn_arith(x: _Arr) -> _Arr:
    """``e4m3fn_from_f32`` by integer arithmetic on the float32 bits (builds its table).

    In place on a few uint32 arrays: the normal path runs on every element, the rare ones
    (subnormal, saturated, NaN) only where they occur."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    f = bits & np.uint32(0x7FFFFFFF)
    # normal: round the mantissa to 3 bits, nearest even, rebias the exponent (7 - 127)
    n = f >> np.uint32(20)
    n &= np.uint32(1)
    n += f
    n += np.uint32((((7 - 127) << 23) + 0x7FFFF) & 0xFFFFFFFF)
    n >>= np.uint32(20)
    out = n.astype(np.uint8)
    small = np.flatnonzero(f < np.uint32(121 << 23))
    if small.size:  # subnormal: let a float32 addition of 2^14 do the rounding
        magic = np.uint32(141 << 23)
        fs = f.reshape(-1)[small]
        out.reshape(-1)[small] = ((fs.view(np.float32) + magic.view(np.float32)).view(np.uint32) - magic
                                  ).astype(np.uint8)
    out[f > np.uint32(0x43E80000)] = 0x7E  # > 464 (incl. inf): saturate to 448
    out[f > np.uint32(0x7F800000)] = 0x7F  # NaN stays NaN
    out |= (bits >> np.uint32(24)).astype(np.uint8) & np.uint8(0x80)
    return out


def _blocked(x: _Arr, block: tuple[int, ...]) -> _Arr:
    """``x`` zero-padded to whole blocks, viewed as ``(n0, b0, n1, b1, ...)``."""
    nb = [ceil(n / b) for n, b in zip(x.shape, block)]
    pad = [(0, k * b - n) for k, b, n in zip(nb, block, x.shape)]
    xp = np.pad(x, pad) if any(p for _, p in pad) else x
    return xp.reshape([d for k, b in zip(nb, block) for d in (k, b)])


def _per_element(v: _Arr) -> _Arr:
    """A per-block value broadcast over the blocked view's axes."""
    return v.reshape([d for k in v.shape for d in (k, 1)])


def _crop(xb: _Arr, shape: tuple[int, ...]) -> _Arr:
    full = [xb.shape[2 * i] * xb.shape[2 * i + 1] for i in range(len(shape))]
    return xb.reshape(full)[tuple(slice(0, n) for n in shape)]


def quantize(x: _Arr, scheme: QuantScheme) -> tuple[_Arr, _Arr]:
    """float32 ``x`` (whole blocks, the last of each dim may be partial) -> (e4m3fn bits of
    ``x``'s shape, scale storage: float32, or e8m0 bits as uint8)."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != len(scheme.block):
        raise ValueError(f"block {list(scheme.block)} has {len(scheme.block)} dims, the weight {x.ndim}")
    shape = tuple(x.shape)
    if x.size == 0:
        return np.zeros(shape, np.uint8), np.zeros(scheme.scale_shape(shape), np.float32 if scheme.kind != "mx"
                                                   else np.uint8)
    xb = _blocked(x, scheme.block)
    axes = tuple(range(1, xb.ndim, 2))
    amax = np.abs(xb).max(axis=axes)  # NaN propagates, as torch's amax does
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if scheme.kind == "mx":
            return _mx(xb, amax, shape, scheme)
        amax = np.where(amax < _AMAX_FLOOR, _AMAX_FLOOR, amax)  # torch.clamp(min=): keeps NaN
        if scheme.ue8m0:
            scale = _ceil_pow2(amax / np.float32(E4M3_MAX))
            factor = np.float32(1.0) / scale
        else:
            scale = amax / np.float32(E4M3_MAX)
            # torch evaluates DeepGEMM's ``448.0 / amax`` as ``amax.reciprocal() * 448``: two roundings
            factor = (np.float32(1.0) / amax) * np.float32(E4M3_MAX)
        q = xb * _per_element(factor)
    return e4m3fn_from_f32(_crop(q, shape)), scale.astype(np.float32)


def _ceil_pow2(s: _Arr) -> _Arr:
    """The smallest power of two >= ``s`` (> 0), exactly (``frexp``, not a rounded ``log2``)."""
    m, e = np.frexp(s)
    e = np.where(m == np.float32(0.5), e - 1, e)
    out = np.ldexp(np.float32(1.0), e).astype(np.float32)
    return np.where(np.isfinite(s), out, s)


def _mx(xb: _Arr, amax: _Arr, shape: tuple[int, ...], scheme: QuantScheme) -> tuple[_Arr, _Arr]:
    bad = ~np.isfinite(amax)
    _, e = np.frexp(np.where(bad | (amax == 0), np.float32(0), amax))
    # floor(log2 amax) = frexp exponent - 1; all-zero blocks take the smallest scale
    exp = np.where(amax == 0, -127, np.clip(e - 1 - _E4M3_EMAX, -127, 127))
    exp = np.where(bad, 0, exp)
    scale = np.ldexp(np.float32(1.0), exp).astype(np.float32)
    q = np.clip(xb / _per_element(scale), -E4M3_MAX, E4M3_MAX).astype(np.float32)
    bits = e4m3fn_from_f32(_crop(q, shape))
    bad_el = _crop(np.broadcast_to(_per_element(bad), xb.shape), shape)
    bits = np.where(bad_el, np.uint8(0x7F), bits).astype(np.uint8)
    return bits, np.where(bad, 0xFF, exp + 127).astype(np.uint8)
