"""Element types: zarr v3 names (the manifest's ``data_type``) <-> safetensors names <-> numpy.

No I/O, no MPI, no torch import at module load (torch is resolved lazily).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import FormatError, ManifestError

__all__ = ["DType", "DTYPES", "by_name", "by_safetensors", "from_torch", "np_storage"]


@dataclass(frozen=True, slots=True)
class DType:
    name: str  # zarr v3 name, used in manifests
    safetensors: str  # safetensors header name
    itemsize: int
    storage: str  # numpy dtype with the same bytes (bf16/fp8 move as raw unsigned ints)


_ALL = [
    DType("bool", "BOOL", 1, "bool"),
    DType("int8", "I8", 1, "int8"),
    DType("int16", "I16", 2, "int16"),
    DType("int32", "I32", 4, "int32"),
    DType("int64", "I64", 8, "int64"),
    DType("uint8", "U8", 1, "uint8"),
    DType("uint16", "U16", 2, "uint16"),
    DType("uint32", "U32", 4, "uint32"),
    DType("uint64", "U64", 8, "uint64"),
    DType("float16", "F16", 2, "float16"),
    DType("bfloat16", "BF16", 2, "uint16"),
    DType("float32", "F32", 4, "float32"),
    DType("float64", "F64", 8, "float64"),
    DType("float8_e4m3fn", "F8_E4M3", 1, "uint8"),
    DType("float8_e5m2", "F8_E5M2", 1, "uint8"),
    DType("float8_e8m0fnu", "F8_E8M0", 1, "uint8"),  # MX block scales: a biased power of two, 0xFF = NaN
]
DTYPES: dict[str, DType] = {d.name: d for d in _ALL}
_BY_ST: dict[str, DType] = {d.safetensors: d for d in _ALL}


def by_name(name: object) -> DType:
    if not isinstance(name, str) or name not in DTYPES:
        raise ManifestError(f"unknown data_type {name!r} (expected one of {', '.join(DTYPES)})")
    return DTYPES[name]


def by_safetensors(name: object) -> DType:
    if not isinstance(name, str) or name not in _BY_ST:
        raise FormatError(f"unsupported safetensors dtype {name!r} (supported: {', '.join(_BY_ST)})")
    return _BY_ST[name]


def np_storage(dt: DType) -> np.dtype[Any]:
    """Numpy dtype whose bytes equal the element's (bf16 -> uint16, fp8 -> uint8)."""
    return np.dtype(dt.storage).newbyteorder("<") if dt.itemsize > 1 else np.dtype(dt.storage)


def from_torch(tdtype: Any) -> DType:
    name = str(tdtype).removeprefix("torch.")
    if name not in DTYPES:
        raise FormatError(f"torch dtype {tdtype} has no shardstream data_type")
    return DTYPES[name]
