"""What a rank hands to ``push``/``pull``: its local tensors, checked against its manifest.

A trainer hands a state dict of DTensors, plain tensors or numpy arrays, or an ``nn.Module``.
DTensors give their local shard (never gathered); ``Partial`` ones are refused (their local
tensors are addends, not values). Every local tensor is then held to the manifest: a dtype or
shape that differs is refused by name, with both values, before any byte moves. Bytes are never
reinterpreted: a float16 tensor is not bfloat16 because both are 2 bytes.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from formats.manifest.dtypes import DTYPES, by_name, np_storage
from formats.manifest.wire import TensorSpec

__all__ = ["collect_local", "check_local", "dtype_name"]


def _is_module(obj: Any) -> bool:
    # never import torch here: a caller with an nn.Module has imported it already
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def _dtensor_type() -> Any:
    # importing torch.distributed.tensor costs seconds; a caller with DTensors has done it
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None)


def collect_local(obj: Any) -> tuple[dict[str, Any], list[str]]:
    """(local name -> buffer, problems). ``obj``: a mapping, an ``nn.Module`` (its state dict), or
    a megatron-core model (or its list of virtual-pipeline chunks): its parameters under the names
    ``manifest_from_megatron`` gives them."""
    if "megatron.core" in sys.modules:
        from .megatron import is_megatron_model, megatron_tensors

        if is_megatron_model(obj):
            return megatron_tensors(obj), []
    if _is_module(obj):
        obj = obj.state_dict()
    if not isinstance(obj, Mapping):
        return {}, [f"push()/pull() take a state dict or an nn.Module, got {type(obj).__name__}"]
    dtensor = _dtensor_type()
    out: dict[str, Any] = {}
    problems: list[str] = []
    for name, v in obj.items():
        if dtensor is not None and isinstance(v, dtensor):
            partial = [str(p) for p in v.placements if p.is_partial()]
            if partial:
                problems.append(f"local tensor {name!r} is a DTensor with a Partial placement ({partial[0]}): "
                                "reduce it first (its local values are addends, not the weights)")
                continue
            v = v.to_local()
        out[str(name)] = v
    return out, problems


def dtype_name(v: Any) -> str:
    """The manifest ``data_type`` a buffer holds, or what it is when it has none."""
    if isinstance(v, np.ndarray):
        return str(v.dtype)
    name = str(getattr(v, "dtype", type(v).__name__)).removeprefix("torch.")
    return name


def _dtype_ok(v: Any, data_type: str) -> bool:
    if isinstance(v, np.ndarray):
        # numpy has no bfloat16 / fp8: those travel in their storage type (uint16 / uint8)
        want = by_name(data_type)
        return v.dtype == np_storage(want) or (want.storage == want.name and v.dtype == np.dtype(want.name))
    name = dtype_name(v)
    return name in DTYPES and name == data_type


def check_local(tensors: Mapping[str, Any], specs: Mapping[str, TensorSpec], who: str) -> list[str]:
    """Every local tensor of ``specs`` present, with the manifest's shape and dtype, contiguous."""
    problems = []
    for name, spec in specs.items():
        v = tensors.get(name)
        if v is None:
            problems.append(f"{who}: local tensor {name!r} is missing (the manifest names it; "
                            f"expected {spec.data_type} {list(spec.shape)})")
            continue
        shape = tuple(int(d) for d in getattr(v, "shape", ()))
        if not _dtype_ok(v, spec.data_type) or shape != tuple(spec.shape):
            problems.append(f"{who}: local tensor {name!r} is {dtype_name(v)} {list(shape)} but the manifest says "
                            f"{spec.data_type} {list(spec.shape)} (refused: bytes are never reinterpreted)")
        elif not _contiguous(v):
            problems.append(f"{who}: local tensor {name!r} is not contiguous (its bytes are read and written in "
                            "place, as laid out): hand contiguous memory")
    return problems


def _contiguous(v: Any) -> bool:
    if isinstance(v, np.ndarray):
        return bool(v.flags.c_contiguous)
    test = getattr(v, "is_contiguous", None)
    return bool(test()) if callable(test) else True
