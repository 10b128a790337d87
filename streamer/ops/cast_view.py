"""Cast a byte view of a region from one float type to another, on its own device.

The refit sender casts while it packs (fp32 master weights -> bf16 for the server), so the
wire carries destination-sized bytes; ``convert`` casts the same way (``convert.cast``), so a
refit and a conversion give the same bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from formats.manifest.dtypes import by_name

__all__ = ["cast_view"]


def cast_view(view: Any, src: str, dst: str) -> Any:
    """A new ``sizes + (dst itemsize,)`` byte array holding ``view``'s elements cast to ``dst``."""
    from streamer.ops.cast import cast_into

    shape = tuple(view.shape[:-1]) + (by_name(dst).itemsize,)
    if isinstance(view, np.ndarray):
        out: Any = np.empty(shape, dtype=np.uint8)
    else:
        import torch

        out = torch.empty(shape, dtype=torch.uint8, device=view.device)
    cast_into(out, view, src, dst)
    return out
