"""Checks on the data files a manifest names (``validate data``): existence, safetensors
headers, zarr arrays, stored dtypes and shapes, byte ranges and checksums. Returns all problems,
one line each (design §8); never raises on bad input. No MPI, no torch.distributed.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Sequence
from math import prod
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import FormatError, ShardNotFoundError, ShardstreamError, UsageError
from ..integrity.checksum import new_hasher
from ..manifest.box import Box, contiguous_slabs
from ..manifest.dtypes import DTYPES, DType
from ..manifest.wire import Chunk, Manifest
from .paths import check_file_path, check_file_pattern, expand_file, file_kind
from .problems import Report, fmt_dims

__all__ = ["declared_dtype", "validate_data"]

#: checksum reads go through buffers of at most this many bytes
_CHECKSUM_SLAB = 16 << 20


def declared_dtype(m: Manifest, holders: Iterable[int], tensor: str) -> DType | None:
    for hr in holders:
        ts = m.tensors.get(hr, {}).get(tensor)
        if ts is not None and ts.data_type in DTYPES:
            return DTYPES[ts.data_type]
    return None



class _StoredLike(Protocol):
    name: str
    dtype: DType
    shape: tuple[int, ...]
    start: int
    nbytes: int


def _header_reader() -> Callable[[Path], Any]:
    # imported lazily: validate_manifest never needs it, and it keeps this module's imports light
    from ..safetensors.header import read_header

    return read_header


def _same_checksum(a: str, b: str) -> bool:
    aa, _, ah = a.partition(":")
    ba, _, bh = b.partition(":")
    try:
        return aa == ba and int(ah, 16) == int(bh, 16)
    except ValueError:
        return False


def _region_checksum(path: Path, start: int, shape: tuple[int, ...], itemsize: int, box: Box,
                     spec: str) -> str:
    """Checksum of ``box`` inside a row-major tensor of ``shape`` stored at byte ``start`` of ``path``.

    Reads through a memory map of just that tensor, in slabs of at most ``_CHECKSUM_SLAB`` bytes.
    """
    h = new_hasher(spec)
    nbytes = prod(shape) * itemsize
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(nbytes,))
    try:
        if box.ndim == 0:
            h.update(np.ascontiguousarray(raw[:itemsize]))
            return h.result()
        view = raw.view(np.dtype(f"u{itemsize}") if itemsize in (1, 2, 4, 8) else np.uint8)
        arr = view.reshape(shape)
        region = arr[box.slices]
        for slab in contiguous_slabs(region.shape, itemsize, _CHECKSUM_SLAB):
            piece = np.ascontiguousarray(region[slab.slices])
            h.update(piece.view(np.uint8))
        return h.result()
    finally:
        mm = getattr(raw, "_mmap", None)
        del raw
        if mm is not None:
            try:
                mm.close()
            except (BufferError, ValueError):  # views still alive; the GC closes it
                pass


def validate_data(m: Manifest, *, where: str = "<manifest>", verify_checksums: bool = True) -> list[str]:
    """Problems found in the files ``m`` names, one line each; ``[]`` when all is well.

    Assumes ``m`` passed ``validate_manifest``: files whose paths ``check_file_path`` rejects are
    not opened (and not re-reported). Each file is stat'ed once and each safetensors header read
    once. A directory is a zarr group (``formats.zarr.io``): its array must exist with sane
    metadata and the chunk's dtype and shape. Checksums are computed from ranged reads with
    bounded memory.
    """
    dc = _DataChecker(m, Report(where), verify_checksums)
    for fqn, spec in m.arrays.items():
        adt = DTYPES.get(spec.data_type)
        if adt is None:
            continue
        for ci, c in enumerate(spec.chunks):
            src = c.source
            if src is None or src.file is None or not c.holders or check_file_pattern(src.file) is not None:
                continue
            per_rank = "{" in src.file
            for hr in (c.holders if per_rank else c.holders[:1]):
                try:
                    dc.check(fqn, adt, ci, c, hr, per_rank)
                except Exception as e:  # noqa: BLE001 - pragma: no cover - safety net, validation never raises
                    dc.rep.add(fqn, "internal errors",
                               f"chunk {ci}: internal error while checking data ({type(e).__name__}: {e})")
    return dc.rep.finish()


class _DataChecker:
    def __init__(self, m: Manifest, rep: Report, verify_checksums: bool) -> None:
        self.m = m
        self.rep = rep
        self.verify = verify_checksums
        self.base = m.base_dir
        self.read_header: Callable[[Path], Any] | None = None
        self.reader_error: str | None = None
        self.path_ok: dict[str, bool] = {}
        self.stats: dict[str, os.stat_result | None] = {}
        self.headers: dict[str, Any] = {}
        self.reported: set[tuple[Any, ...]] = set()
        self.crc_missing = False
        self.zarr: Any = None  # formats.zarr.io.ZarrReader, made on the first zarr group
        self.zarr_bad: dict[tuple[str, str], bool] = {}

    def _once(self, *key: Any) -> bool:
        if key in self.reported:
            return False
        self.reported.add(key)
        return True

    def _reader(self) -> Callable[[Path], Any] | None:
        if self.read_header is None and self.reader_error is None:
            try:
                self.read_header = _header_reader()
            except Exception as e:  # noqa: BLE001 - a broken formats.safetensors must not crash validation
                self.reader_error = f"{type(e).__name__}: {e}"
        return self.read_header

    def _stat(self, fqn: str, ci: int, rel: str, full: Path, on: str) -> os.stat_result | None:
        if rel not in self.stats:
            try:
                self.stats[rel] = os.stat(full)
            except FileNotFoundError:
                self.stats[rel] = None
                self.rep.add(fqn, "missing files", f"chunk {ci}: file {rel!r}{on} not found (expected a file at {full})")
            except OSError as e:
                self.stats[rel] = None
                self.rep.add(fqn, "file problems", f"chunk {ci}: cannot stat {rel!r}{on} ({e.strerror or e})")
        return self.stats[rel]

    def _header(self, fqn: str, ci: int, rel: str, full: Path, on: str) -> Any:
        if rel not in self.headers:
            self.headers[rel] = None
            reader = self._reader()
            if reader is None:
                if self._once("reader"):
                    self.rep.add(fqn, "file problems",
                                 f"chunk {ci}: cannot read safetensors headers "
                                 f"(formats.safetensors.io failed to import: {self.reader_error})")
                return None
            try:
                self.headers[rel] = reader(full)
            except FormatError as e:
                self.rep.add(fqn, "file problems", f"chunk {ci}: {rel!r}{on} is not a valid safetensors file ({e})")
            except OSError as e:
                self.rep.add(fqn, "file problems", f"chunk {ci}: cannot read {rel!r}{on} ({e.strerror or e})")
            except Exception as e:  # noqa: BLE001 - never raise on bad input
                self.rep.add(fqn, "file problems",
                             f"chunk {ci}: cannot read the header of {rel!r}{on} ({type(e).__name__}: {e})")
        return self.headers[rel]

    def _check_zarr(self, fqn: str, adt: DType, ci: int, c: Chunk, hr: int, rel: str, full: Path, on: str,
                    per_rank: bool) -> None:
        """A chunk stored in a zarr group: the array exists, its metadata is sane, its dtype and
        shape fit the chunk, and its checksum (when recorded) matches the bytes."""
        src = c.source
        assert src is not None
        tensor = c.tensor(fqn)
        key = (rel, tensor)
        if self.zarr_bad.get(key):
            return  # reported once per array
        try:
            from ..zarr.io import ZarrReader, region_checksum

            if self.zarr is None:
                self.zarr = ZarrReader()
            za = self.zarr.open(full, tensor)
        except ShardNotFoundError:
            self.zarr_bad[key] = True
            self.rep.add(fqn, "missing tensors", f"chunk {ci}: zarr array {tensor!r} not found in {rel!r}{on} "
                         f"(expected {full / tensor / 'zarr.json'})")
            return
        except (FormatError, UsageError) as e:
            self.zarr_bad[key] = True
            self.rep.add(fqn, "file problems", f"chunk {ci}: zarr array {tensor!r} in {rel!r}{on} is unusable ({e})")
            return
        except Exception as e:  # noqa: BLE001 - never raise on bad input
            self.zarr_bad[key] = True
            self.rep.add(fqn, "file problems",
                         f"chunk {ci}: cannot open zarr array {tensor!r} in {rel!r}{on} ({type(e).__name__}: {e})")
            return
        ranks = [hr] if per_rank else list(c.holders)
        exp = declared_dtype(self.m, ranks, tensor) or adt
        info = za.info
        lbox = c.local_box
        what = f"zarr array {tensor!r} in {rel!r}{on}"
        if not self._stored_fits(fqn, ci, what, (rel, tensor), exp, info.data_type, info.shape, lbox):
            return
        if src.checksum is not None and self.verify:
            want = src.checksum
            self._verify_checksum(fqn, ci, want, lambda: region_checksum(za, lbox, want),
                                  (ShardstreamError, OSError, ValueError),
                                  f"cannot read zarr array {tensor!r} in {rel!r}{on} for its checksum",
                                  f"checksum mismatch for chunk {ci} region {c.region} on rank {hr} in zarr array "
                                  f"{tensor!r} of {rel!r}")

    def _stored_fits(self, fqn: str, ci: int, what: str, key: tuple[str, str], exp: DType, got_dtype: str,
                     shape: Sequence[int], lbox: Box) -> bool:
        """The stored tensor ``what`` (at ``key`` = (file, tensor)) has the expected dtype, the local
        box's number of dims, and room for the local box; else reported, False."""
        if got_dtype != exp.name:
            if self._once("dtype", *key, exp.name):
                self.rep.add(fqn, "data_type problems",
                             f"chunk {ci}: {what} has the wrong data_type (expected {exp.name}, got {got_dtype})")
            return False
        if len(shape) != lbox.ndim:
            self.rep.add(fqn, "shape problems", f"chunk {ci}: {what} has {len(shape)} dims "
                         f"(expected {lbox.ndim}, got shape {fmt_dims(shape)})")
            return False
        if not lbox.fits_in(shape):
            self.rep.add(fqn, "shape problems",
                         f"chunk {ci}: {what} is too small for local box {lbox} "
                         f"(expected shape >= {fmt_dims(lbox.stops)} in every dim, got {fmt_dims(shape)})")
            return False
        return True

    def _verify_checksum(self, fqn: str, ci: int, want: str, compute: Callable[[], str],
                         errors: tuple[type[Exception], ...], cannot_read: str, mismatch: str) -> None:
        """Compare ``compute()`` with the recorded checksum ``want``; a missing crc32c module is
        reported once per run, a read error or a mismatch per chunk."""
        try:
            got = compute()
        except ImportError as e:
            if not self.crc_missing:
                self.crc_missing = True
                self.rep.add(fqn, "checksum problems", f"chunk {ci}: cannot verify checksum {want} ({e})")
            return
        except errors as e:
            self.rep.add(fqn, "checksum problems", f"chunk {ci}: {cannot_read} ({e})")
            return
        if not _same_checksum(got, want):
            self.rep.add(fqn, "checksum mismatches", f"{mismatch} (expected {want}, got {got})")

    def check(self, fqn: str, adt: DType, ci: int, c: Chunk, hr: int, per_rank: bool) -> None:
        src = c.source
        assert src is not None and src.file is not None
        rel = expand_file(src.file, hr)
        if rel not in self.path_ok:
            self.path_ok[rel] = check_file_path(self.base, rel) is None
        if not self.path_ok[rel]:
            return  # reported by validate_manifest; never open it
        full = (self.base / rel) if self.base is not None else Path(rel)
        on = f" for rank {hr}" if per_rank else ""
        st = self._stat(fqn, ci, rel, full, on)
        if st is None:
            return  # missing (reported)
        if stat.S_ISDIR(st.st_mode):
            self._check_zarr(fqn, adt, ci, c, hr, rel, full, on, per_rank)
            return
        if not stat.S_ISREG(st.st_mode):
            if self._once("special", rel):
                self.rep.add(fqn, "file problems",
                             f"chunk {ci}: {rel!r}{on} is a {file_kind(st.st_mode)} (expected a regular file)")
            return
        tensor = c.tensor(fqn)
        ranks = [hr] if per_rank else list(c.holders)
        exp = declared_dtype(self.m, ranks, tensor) or adt
        lbox = c.local_box
        if src.byte_range is not None and src.stored_shape is not None:
            loc = self._locate_range(fqn, ci, src.byte_range, src.stored_shape, st.st_size, exp, lbox, rel, on)
        else:
            loc = self._locate_tensor(fqn, ci, tensor, exp, lbox, rel, full, on)
        if loc is None or src.checksum is None or not self.verify:
            return
        base_off, sshape, isz = loc
        want = src.checksum
        self._verify_checksum(fqn, ci, want, lambda: _region_checksum(full, base_off, sshape, isz, lbox, want),
                              (OSError, ValueError), f"cannot read {rel!r}{on} for its checksum",
                              f"checksum mismatch for chunk {ci} region {c.region} on rank {hr} in {rel!r}")

    def _locate_range(self, fqn: str, ci: int, byte_range: tuple[int, int], sshape: tuple[int, ...], size: int,
                      exp: DType, lbox: Box, rel: str, on: str) -> tuple[int, tuple[int, ...], int] | None:
        """A raw byte range (DCP payload): ``(start, stored shape, itemsize)``, or None when it is
        past the end of the file (reported) or inconsistent (reported by validate_manifest)."""
        a, b = byte_range
        if b > size:
            self.rep.add(fqn, "byte range problems",
                         f"chunk {ci}: source.byte_range [{a}, {b}] is past the end of {rel!r}{on} "
                         f"(expected stop <= file size {size}, got {b})")
            return None
        if b - a != prod(sshape) * exp.itemsize or not lbox.fits_in(sshape):
            return None  # reported by validate_manifest
        return a, sshape, exp.itemsize

    def _locate_tensor(self, fqn: str, ci: int, tensor: str, exp: DType, lbox: Box, rel: str, full: Path,
                       on: str) -> tuple[int, tuple[int, ...], int] | None:
        """A tensor of a safetensors file: ``(data start, stored shape, itemsize)``, or None when
        the header is unreadable, the tensor missing, or its dtype / shape wrong (reported)."""
        hdr = self._header(fqn, ci, rel, full, on)
        if hdr is None:
            return None
        stt: _StoredLike | None = hdr.tensors.get(tensor)
        if stt is None:
            if self._once("missing", rel, tensor):
                names = sorted(hdr.tensors)
                avail = ", ".join(repr(x) for x in names[:5])
                if len(names) > 5:
                    avail += f" and {len(names) - 5} more"
                self.rep.add(fqn, "missing tensors",
                             f"chunk {ci}: tensor {tensor!r} not found in {rel!r}{on} "
                             f"(available: {avail or 'none'})")
            return None
        sshape = tuple(stt.shape)
        if not self._stored_fits(fqn, ci, f"stored tensor {tensor!r} in {rel!r}{on}", (rel, tensor), exp,
                                 stt.dtype.name, sshape, lbox):
            return None
        return stt.start, sshape, stt.dtype.itemsize
