"""Resolve a manifest's on-disk sources and read regions of their stored tensors.

A stored tensor is identified by (file, tensor name) for safetensors files, by
``source.byte_range`` + ``source.stored_shape`` for raw byte ranges (DCP payloads), or by
(zarr group directory, array path) for zarr v3 stores (read by zarr slicing, arrays cached). Headers are
parsed once per file and file descriptors are cached, so ranged reads cost one ``pread`` per
coalesced run. No MPI.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import FormatError, ManifestError, RegionOutOfBoundsError, ShardNotFoundError
from .files.bounded import read_bounded
from .manifest.box import Box
from .manifest.dtypes import DType, by_name
from .manifest.wire import Chunk, Manifest

__all__ = ["ResolvedTensor", "SourceStore", "resolve_path", "read_bounded"]


@dataclass(frozen=True, slots=True)
class ResolvedTensor:
    path: str
    name: str
    dtype: DType
    shape: tuple[int, ...]
    start: int  # absolute file offset of element 0


def resolve_path(base_dir: Path | None, rel: str) -> Path:
    """``base_dir / rel``, refusing anything that escapes ``base_dir`` (absolute, ``..``, symlink)."""
    if base_dir is None:
        raise ManifestError(f"{rel}: manifest has no directory to resolve files against")
    if os.path.isabs(rel) or rel.startswith("\\") or any(p == ".." for p in Path(rel).parts):
        raise ManifestError(f"source.file {rel!r} escapes the manifest directory (absolute or '..')")
    p = base_dir / rel
    real = os.path.realpath(p)
    root = os.path.realpath(base_dir)
    if real != root and not real.startswith(root + os.sep):
        raise ManifestError(f"source.file {rel!r} resolves to {real}, outside the manifest directory {root}")
    return Path(real)


class SourceStore:
    """Reads regions of the local tensors a manifest's chunks live in."""

    def __init__(self, manifest: Manifest) -> None:
        self.m = manifest
        self._headers: dict[str, Any] = {}
        self._fds: dict[str, int] = {}
        from .safetensors.read import ReadStats

        self.stats = ReadStats()
        #: the largest span one coalesced read may buffer (convert sets it from --memory-limit)
        self.read_budget = 64 << 20
        #: runs closer than this are read as one span (a page: the kernel reads it whole anyway)
        self.max_gap = 4096
        #: zarr arrays opened by ``resolve`` (metadata checked once), keyed by (group path, array)
        self._zarr: Any = None
        self._zarr_arrays: dict[tuple[str, str], Any] = {}
        #: source.file -> (real path, is a directory). A convert resolves every source chunk, most
        #: of them in the same few files, and each realpath() is an lstat per path component:
        #: uncached that was ~0.5 s of a 2.3 GB convert's main thread (10k lstat calls).
        self._paths: dict[str, tuple[str, bool]] = {}

    # -- resolution
    def header(self, path: str) -> Any:
        h = self._headers.get(path)
        if h is None:
            from .safetensors.header import read_header

            h = read_header(path)
            self._headers[path] = h
        return h

    def fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                st = os.stat(path)
            except FileNotFoundError as e:
                raise ShardNotFoundError(f"{path}: no such file") from e
            if not stat.S_ISREG(st.st_mode):
                raise FormatError(f"{path}: not a regular file")
            fd = os.open(path, os.O_RDONLY)
            self._fds[path] = fd
        return fd

    def resolve(self, fqn: str, chunk: Chunk, rank: int) -> ResolvedTensor:
        rel = chunk.file_for(rank)
        if rel is None:
            raise ManifestError(f"{fqn}: chunk {chunk.region} has no source.file (a live manifest names no "
                                "files; describe files with `shardstream import` or `layout --file-pattern`)")
        cached = self._paths.get(rel)
        if cached is None:
            real = str(resolve_path(self.m.base_dir, rel))
            cached = self._paths[rel] = (real, os.path.isdir(real))
        path, is_dir = cached
        src = chunk.source
        assert src is not None
        name = chunk.tensor(fqn)
        if is_dir:  # a zarr group: the stored tensor is its array `name` (design §3)
            return self._resolve_zarr(path, name, fqn, src.byte_range is not None)
        if src.byte_range is not None and src.stored_shape is not None:
            dt = by_name(self.m.arrays[fqn].data_type)
            size = os.stat(path).st_size
            if src.byte_range[1] > size:
                raise FormatError(f"{path}: byte_range {list(src.byte_range)} of {fqn} is past the end of "
                                  f"the file ({size} bytes)")
            return ResolvedTensor(path, name, dt, src.stored_shape, src.byte_range[0])
        h = self.header(path)
        st = h.tensors.get(name)
        if st is None:
            avail = ", ".join(list(h.tensors)[:5])
            raise ShardNotFoundError(f"{path}: tensor {name!r} (for {fqn}) not in file (has: {avail}...)")
        want = self.m.arrays[fqn].data_type
        if st.dtype.name != want:
            raise FormatError(f"{path}: tensor {name!r} is {st.dtype.name}, manifest says {want} for {fqn}")
        return ResolvedTensor(path, name, st.dtype, tuple(st.shape), st.start)

    def _resolve_zarr(self, path: str, name: str, fqn: str, has_byte_range: bool) -> ResolvedTensor:
        from .zarr.io import ZarrReader

        if has_byte_range:
            raise FormatError(f"{path}: source.byte_range of {fqn} names a directory (a zarr group is read "
                              "by array, not by byte range)")
        if self._zarr is None:
            self._zarr = ZarrReader()
        za = self._zarr.open(path, name)
        want = self.m.arrays[fqn].data_type
        if za.info.data_type != want:
            raise FormatError(f"{za.info.where}: zarr array {name!r} is {za.info.data_type}, manifest says {want} "
                              f"for {fqn}")
        self._zarr_arrays[(path, name)] = za
        return ResolvedTensor(path, name, za.info.dtype, za.info.shape, -1)

    # -- reading
    def read(self, rt: ResolvedTensor, box: Box, out: np.ndarray | None = None) -> np.ndarray:
        """Read ``box`` (in stored-tensor coordinates) into a C-contiguous uint8 array."""
        if not box.fits_in(rt.shape):
            raise RegionOutOfBoundsError(f"{rt.path}: region {box} is outside tensor {rt.name!r} of shape "
                                         f"{list(rt.shape)}")
        za = self._zarr_arrays.get((rt.path, rt.name)) if self._zarr_arrays else None
        if za is not None:
            from .zarr.io import read_box

            n = box.volume * rt.dtype.itemsize
            out = read_box(za, box, out)
            self.stats.reads += 1
            self.stats.bytes_read += n
            return out
        from .safetensors.read import read_region

        n = box.volume * rt.dtype.itemsize
        if out is None:
            out = np.empty(n, dtype=np.uint8)
        read_region(self.fd(rt.path), rt.start, rt.shape, rt.dtype.itemsize, box, out, stats=self.stats,
                    budget=self.read_budget, max_gap=self.max_gap)
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        self._zarr_arrays.clear()
        if self._zarr is not None:
            self._zarr.close()

    def __enter__(self) -> SourceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
