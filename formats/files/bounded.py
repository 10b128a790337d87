"""Bounded reads of small metadata files (zarr metadata, DCP ``.metadata``): a leaf module, so that
the readers that need it (:mod:`formats.store`, :mod:`formats.zarr.io`, :mod:`formats.dcp.io`) do
not import each other."""

from __future__ import annotations

import os
import stat

from ..errors import FormatError, ShardNotFoundError

__all__ = ["read_bounded"]


def read_bounded(path: str | os.PathLike[str], limit: int, what: str,
                 too_big: str = "{what} is {size} bytes, over the {limit} byte limit") -> bytes:
    """The bytes of a small metadata file, refusing missing, non-regular and oversized files
    before reading (a hostile file must not make us allocate its claimed size). ``too_big``
    words the oversize line (callers keep their own)."""
    where = str(path)
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        raise ShardNotFoundError(f"{where}: no such file") from e
    except OSError as e:
        raise FormatError(f"{where}: cannot stat ({e.strerror})") from e
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{where}: not a regular file")
    if st.st_size > limit:
        raise FormatError(f"{where}: " + too_big.format(what=what, size=st.st_size, limit=limit))
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise FormatError(f"{where}: cannot read ({e.strerror})") from e
    if len(data) > limit:  # grew after the stat
        raise FormatError(f"{where}: {what} is over the {limit} byte limit")
    return data
