"""A ``torch.save`` archive (a zip: ``<name>/data.pkl``, ``<name>/data/<key>`` storages stored
uncompressed) read through a bounded window: the structure is parsed with a few small reads, the
tensor payloads are only located (``payload_offset``), never read. Shared by the DCP reader
(each ``.distcp`` item is one archive) and Megatron's legacy ``model_optim_rng.pt`` files.

No torch, no MPI.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from typing import Any

from .unpickle import TensorRef

__all__ = ["MAX_DATA_PKL_BYTES", "MAX_ZIP_READ", "ArchiveWindow", "clip", "open_archive", "payload_offset",
           "read_data_pkl", "storage_entry"]

#: refuse a ``data.pkl`` bigger than this (a tensor's is ~150 bytes)
MAX_DATA_PKL_BYTES = 1 << 20
#: no single read of a torch.save archive's structure may exceed this (central directory etc.)
MAX_ZIP_READ = 16 << 20

class ArchiveWindow(io.RawIOBase):
    """A read-only, seekable view of ``[start, start + length)`` of an open file (pread based).

    The first and last ``_EDGE`` bytes are read once: a torch.save archive keeps everything but
    the tensor payload there (data.pkl and small entries first, the central directory last), so
    parsing an item costs two ``pread`` calls and never touches the payload.
    """

    _EDGE = 8192

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._len, self._pos = fd, start, length, 0
        e = self._EDGE
        if length <= 2 * e:
            self._head, self._tail_at, self._tail = os.pread(fd, length, start), length, b""
        else:
            self._head = os.pread(fd, e, start)
            self._tail_at = length - e
            self._tail = os.pread(fd, e, start + self._tail_at)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0:
            new = pos
        elif whence == 1:
            new = self._pos + pos
        elif whence == 2:
            new = self._len + pos
        else:
            raise ValueError(f"bad whence {whence}")
        if new < 0:
            raise OSError("seek before the start of the item")
        self._pos = new
        return new

    def read(self, n: int | None = -1) -> bytes:
        avail = max(0, self._len - self._pos)
        if n is None or n < 0:
            n = avail
        n = min(n, avail)
        if n > MAX_ZIP_READ:
            raise OSError(f"refusing to read {n} bytes of archive structure at once (limit {MAX_ZIP_READ})")
        p = self._pos
        if p + n <= len(self._head):
            data = self._head[p:p + n]
        elif p >= self._tail_at and p + n <= self._tail_at + len(self._tail):
            data = self._tail[p - self._tail_at:p - self._tail_at + n]
        else:
            data = os.pread(self._fd, n, self._start + p) if n else b""
        self._pos += len(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)



def clip(s: str, n: int = 200) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")


def open_archive(win: ArchiveWindow) -> zipfile.ZipFile:
    """The item as a zip archive (torch.save's format)."""
    head = win.read(4)
    win.seek(0)
    if head != b"PK\x03\x04":
        raise ValueError("item is not a torch.save zip archive (only DCP's default TORCH_SAVE serialization "
                         "is supported)")
    try:
        return zipfile.ZipFile(win)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, struct.error, OverflowError,
            EOFError, KeyError, IndexError, UnicodeDecodeError) as e:
        raise ValueError(f"item is not a readable zip archive ({type(e).__name__}: {clip(str(e))})") from None


def read_data_pkl(zf: zipfile.ZipFile, infos: dict[str, zipfile.ZipInfo],
                   limit: int = MAX_DATA_PKL_BYTES) -> tuple[str, bytes]:
    """The archive's directory prefix and its ``data.pkl`` bytes (stored, bounded, little-endian)."""
    pkls = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkls) != 1:
        raise ValueError(f"archive has {len(pkls)} top-level data.pkl entries (expected 1)")
    prefix = pkls[0][: -len("data.pkl")]
    pinfo = infos[pkls[0]]
    if pinfo.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{pinfo.filename} is compressed (method {pinfo.compress_type}); torch.save stores it")
    if pinfo.file_size > limit:
        raise ValueError(f"{pinfo.filename} is {pinfo.file_size} bytes, over the {limit} byte limit")
    bo = infos.get(prefix + "byteorder")
    if bo is not None:
        if bo.file_size > 16:
            raise ValueError("byteorder entry is too large")
        order = zf.read(bo).strip()
        if order != b"little":
            raise ValueError(f"tensor bytes are {order.decode('ascii', 'replace')!r}-endian (only little-endian "
                             "is supported)")
    try:
        return prefix, zf.read(pinfo)
    except (zipfile.BadZipFile, OSError, ValueError, struct.error, EOFError) as e:
        raise ValueError(f"cannot read {pinfo.filename} ({type(e).__name__}: {clip(str(e))})") from None


def storage_entry(infos: dict[str, zipfile.ZipInfo], prefix: str, t: TensorRef, st_bytes: int) -> zipfile.ZipInfo:
    """The zip entry of the tensor's storage: present, stored uncompressed and unencrypted, whole."""
    dinfo = infos.get(f"{prefix}data/{t.storage.key}")
    if dinfo is None:
        raise ValueError(f"archive has no entry {prefix}data/{t.storage.key} for the tensor's storage")
    if dinfo.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"storage entry {dinfo.filename} is compressed (method {dinfo.compress_type}); only "
                         "stored (uncompressed) payloads can be read by byte range")
    if dinfo.flag_bits & 0x1:
        raise ValueError(f"storage entry {dinfo.filename} is encrypted")
    if dinfo.file_size != st_bytes or dinfo.compress_size != dinfo.file_size:
        raise ValueError(f"storage entry {dinfo.filename} holds {dinfo.file_size} bytes (compressed "
                         f"{dinfo.compress_size}), expected {st_bytes}")
    return dinfo


def payload_offset(win: ArchiveWindow, dinfo: zipfile.ZipInfo, length: int) -> int:
    """Where the storage entry's bytes start inside the item (of ``length`` bytes)."""
    # the payload starts after the *local* header, whose extra field (alignment padding) may differ
    # from the central directory's
    win.seek(dinfo.header_offset)
    raw = win.read(_LOCAL_HEADER.size)
    if len(raw) != _LOCAL_HEADER.size:
        raise ValueError(f"local header of {dinfo.filename} is past the end of the item")
    sig, _v, _flags, method, _t, _d, _crc, _cs, _us, nlen, elen = _LOCAL_HEADER.unpack(raw)
    if sig != b"PK\x03\x04" or method != zipfile.ZIP_STORED:
        raise ValueError(f"bad local header for {dinfo.filename}")
    name = win.read(nlen)
    if name.decode("utf-8", "replace") != dinfo.filename:
        raise ValueError(f"local header names {name!r:.60}, central directory {dinfo.filename!r}")
    rel_start: int = dinfo.header_offset + _LOCAL_HEADER.size + nlen + elen
    if rel_start + dinfo.file_size > length:
        raise ValueError(f"storage entry {dinfo.filename} runs past the end of the item ({rel_start} + "
                         f"{dinfo.file_size} > {length} bytes)")
    return rel_start
