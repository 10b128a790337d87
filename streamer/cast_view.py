"""Cast a byte view of a region from one float type to another, on its own device.

The refit sender casts while it packs (fp32 master weights -> bf16 for the server), so the
wire carries destination-sized bytes. Host regions use numpy's round-to-nearest-even cast
(``convert.cast_bytes``, the one ``convert --cast`` uses); torch regions (gloo/NCCL buffers, GPU
memory included) use ``Tensor.to``, which rounds the same way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from formats.dtypes import by_name

__all__ = ["cast_view"]


def cast_view(view: Any, src: str, dst: str) -> Any:
    """``view`` (``sizes + (src itemsize,)`` bytes) as ``sizes + (dst itemsize,)`` bytes of ``dst``."""
    sizes = tuple(view.shape[:-1])
    isz = by_name(dst).itemsize
    if isinstance(view, np.ndarray):
        from .convert import cast_bytes

        return cast_bytes(np.ascontiguousarray(view).reshape(-1), src, dst).reshape(sizes + (isz,))
    import torch

    typed = view.contiguous().reshape(-1).view(getattr(torch, src))
    return typed.to(getattr(torch, dst)).view(torch.uint8).reshape(sizes + (isz,))
