"""``--cast``: floating-point arrays change data_type on the way (round to nearest even)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from formats.errors import UsageError
from formats.manifest.wire import ArraySpec, Manifest, TensorSpec

__all__ = ["FLOATS", "cast_bytes", "cast_into", "cast_manifest"]

FLOATS = ("float16", "bfloat16", "float32", "float64")

_U8 = np.ndarray[Any, np.dtype[np.uint8]]


def _to_float(raw: np.ndarray[Any, Any], dt: str) -> np.ndarray[Any, Any]:
    """Elements of ``dt`` as float32 (float64 stays float64: nothing is lost on the way)."""
    if dt == "bfloat16":  # bfloat16 is the top half of a float32
        return (raw.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    return raw.view(np.dtype(dt).newbyteorder("<")).astype(np.float32 if dt != "float64" else np.float64)


#: sources whose every value is exact in float32: torch's one-step cast gives the same bits as
#: the numpy path below (round to nearest even, NaN -> quiet NaN), about 30x faster
_EXACT_IN_F32 = ("float16", "bfloat16", "float32")
#: casts this large import torch for the fast path when it is installed but not yet loaded
_IMPORT_TORCH_BYTES = 16 << 20


def _torch(nbytes: int) -> Any:
    """torch, when it is loaded already or worth loading for ``nbytes``; else None."""
    torch = sys.modules.get("torch")
    if torch is None and nbytes >= _IMPORT_TORCH_BYTES:
        try:
            import torch
        except ImportError:
            return None
    return torch


def cast_bytes(raw: np.ndarray[Any, Any], src: str, dst: str) -> _U8:
    """Row-major bytes of ``src`` elements -> bytes of ``dst`` elements (round to nearest even)."""
    torch = _torch(raw.nbytes) if src in _EXACT_IN_F32 else None
    if torch is not None:
        t = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1)).view(getattr(torch, src))
        out: _U8 = t.to(getattr(torch, dst)).view(torch.uint8).numpy()
        return out
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is the IEEE answer
        return _cast(raw, src, dst)


def cast_into(dst: Any, src: Any, src_dt: str, dst_dt: str) -> None:
    """Cast byte view ``src`` (``sizes + (src itemsize,)``, any strides, numpy or torch, any
    device) into byte view ``dst`` (``sizes + (dst itemsize,)``) in one pass, no temporary."""
    host = isinstance(src, np.ndarray)
    torch = (_torch(src.nbytes) if src_dt in _EXACT_IN_F32 else None) if host else sys.modules["torch"]
    if torch is None:
        dst[...] = cast_bytes(np.ascontiguousarray(src).reshape(-1), src_dt, dst_dt).reshape(dst.shape)
        return
    s = torch.from_numpy(src) if host else src
    d = torch.from_numpy(dst) if isinstance(dst, np.ndarray) else dst
    d.view(getattr(torch, dst_dt))[..., 0].copy_(s.view(getattr(torch, src_dt))[..., 0])


def _cast(raw: np.ndarray[Any, Any], src: str, dst: str) -> _U8:
    f = _to_float(raw, src)
    if dst == "bfloat16":
        f32 = f.astype(np.float32)
        u = f32.view(np.uint32)
        out = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
        out[np.isnan(f32)] = 0x7FC0  # keep NaN a NaN (rounding could carry it into infinity)
        return out.view(np.uint8)
    return f.astype(np.dtype(dst).newbyteorder("<")).view(np.uint8)


def cast_manifest(m: Manifest, to: str) -> Manifest:
    """``m`` with every floating-point array (and declared local tensor) stored as ``to``."""
    if to not in FLOATS:
        raise UsageError(f"--cast {to}: only floating-point targets are supported ({', '.join(FLOATS)})")
    arrays = {f: (ArraySpec(a.shape, to, a.chunks) if a.data_type in FLOATS else a) for f, a in m.arrays.items()}
    tensors = {r: {n: (TensorSpec(t.shape, to) if t.data_type in FLOATS else t) for n, t in ts.items()}
               for r, ts in m.tensors.items()}
    return replace(m, arrays=arrays, tensors=tensors)


def with_dtypes(m: Manifest, dtypes: Mapping[str, str]) -> Manifest:
    """``m`` with array ``fqn`` (and the declared local tensors holding it) typed ``dtypes[fqn]``.

    A destination may ask for another float type than its source has (fp32 masters, a bf16
    server): the plan then moves the source's type (``with_dtypes(dst, source types)``) and the
    sink casts while it writes, as with ``--cast``.
    """
    if not dtypes:
        return m
    arrays = {f: (ArraySpec(a.shape, dtypes[f], a.chunks) if f in dtypes else a) for f, a in m.arrays.items()}
    holding: dict[tuple[int, str], str] = {}
    for fqn, to in dtypes.items():
        for c in m.arrays[fqn].chunks:
            for h in c.holders:
                holding[(h, c.tensor(fqn))] = to
    tensors = {r: {n: (TensorSpec(t.shape, holding[(r, n)]) if (r, n) in holding else t) for n, t in ts.items()}
               for r, ts in m.tensors.items()}
    return replace(m, arrays=arrays, tensors=tensors)
