"""Local tensors as bytes: uint8 views that share memory, on the host or on a device.

Every mover (executor, baseline, replica checks, transports) addresses a local tensor as a view
shaped ``shape + (itemsize,)``, so a region is plain slicing whatever the dtype (bf16 and FP8
included) and bytes are never reinterpreted as another type.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from formats.manifest.box import Box

__all__ = ["byte_view", "host_bytes", "region_view", "torch_byte_view"]


def byte_view(t: Any) -> np.ndarray:
    """A uint8 view of a local tensor shaped ``shape + (itemsize,)`` that shares its memory.

    Accepts numpy arrays and CPU torch tensors (any dtype, bf16/fp8 included). The tensor must
    be C-contiguous: receivers write into it in place.
    """
    if isinstance(t, np.ndarray):
        if not t.flags.c_contiguous:
            raise ValueError("local tensor must be C-contiguous")
        return t.reshape(-1).view(np.uint8).reshape(t.shape + (t.itemsize,))
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"local tensor must be a numpy array or torch tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError("this transport moves CPU tensors; use the nccl transport for GPU tensors")
    if not t.is_contiguous():
        raise ValueError("local tensor must be contiguous")
    isz = t.element_size()
    flat = t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    return flat.numpy().reshape(tuple(t.shape) + (isz,))


def torch_byte_view(t: Any) -> Any:
    """Like ``byte_view`` but a torch uint8 view (any device); numpy arrays are wrapped, not copied."""
    import torch

    if isinstance(t, np.ndarray):
        return torch.from_numpy(byte_view(t))
    if not t.is_contiguous():
        raise ValueError("local tensor must be contiguous")
    isz = t.element_size()
    flat = t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    return flat.reshape(tuple(t.shape) + (isz,))


def _copy(dst: Any, src: Any) -> None:
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        dst.copy_(src)


def _copy_host(dst: Any, src: np.ndarray) -> None:
    """``dst[...] = src``: ``src`` host bytes (a decoded or staged delta), ``dst`` a numpy or CPU
    torch byte view (a torch transport's regions are torch views, and ``copy_`` takes no numpy)."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        import torch

        dst.copy_(torch.from_numpy(np.ascontiguousarray(src)))


def _xor_into(dst: Any, src: np.ndarray) -> None:
    """``dst ^= src`` in place (a numpy or CPU torch byte view; ``src`` host bytes)."""
    if isinstance(dst, np.ndarray):
        np.bitwise_xor(dst, src, out=dst)
    else:
        import torch

        dst.bitwise_xor_(torch.from_numpy(np.ascontiguousarray(src)).to(dst.device))


def host_bytes(x: Any) -> np.ndarray:
    """The bytes of a (byte-view) region as a flat host numpy array (copied when needed)."""
    if isinstance(x, np.ndarray):
        flat: np.ndarray = np.ascontiguousarray(x).reshape(-1)
        return flat
    host: np.ndarray = x.contiguous().cpu().numpy().reshape(-1)
    return host


def region_view(t: Any, box: Box) -> Any:
    """A byte view (``sizes + (itemsize,)``) of ``box`` inside local tensor ``t``, on its device."""
    on_host = isinstance(t, np.ndarray) or getattr(getattr(t, "device", None), "type", "cpu") == "cpu"
    v = byte_view(t) if on_host else torch_byte_view(t)
    return v[box.slices] if box.ndim else v
