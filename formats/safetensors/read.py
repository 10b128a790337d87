"""Ranged reads of safetensors files: only the bytes of a region, runs with small gaps
coalesced, through a bounded buffer (``read_region``), and ``SafetensorsReader`` (an open file:
its validated header and region reads).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..errors import FormatError, RegionOutOfBoundsError, ShardNotFoundError
from ..manifest.box import Box, uniform_runs
from ..manifest.dtypes import np_storage
from .header import Header, StoredTensor, cut_repr, open_read, read_header_fd, region_misfit

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["ReadStats", "SafetensorsReader", "read_region"]

_HAVE_PREADV = hasattr(os, "preadv")


@dataclass(slots=True)
class ReadStats:
    """Counters ``read_region`` adds to: bytes returned by the OS and read syscalls made."""

    bytes_read: int = 0
    reads: int = 0


def _read_into(fd: int, mv: memoryview, offset: int, stats: ReadStats | None) -> None:
    """Fill ``mv`` from ``fd`` at ``offset``; a short file is a FormatError."""
    want = len(mv)
    got = 0
    while got < want:
        if _HAVE_PREADV:
            k = os.preadv(fd, [mv[got:]], offset + got)
        else:  # pragma: no cover - platforms without preadv
            data = os.pread(fd, want - got, offset + got)
            k = len(data)
            mv[got : got + k] = data
        if stats is not None:
            stats.reads += 1
            stats.bytes_read += k
        if k == 0:
            raise FormatError(f"file truncated: expected {want} bytes at offset {offset}, got {got}")
        got += k


def _writable_bytes(out: memoryview | np.ndarray[Any, Any] | bytearray) -> np.ndarray[Any, Any]:
    """A flat, writable uint8 array over ``out``'s memory (no copy)."""
    if isinstance(out, np.ndarray):
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("out must be a C-contiguous, writable array")
        return out.reshape(-1).view(np.uint8)
    mv = memoryview(out)
    if mv.readonly or not mv.c_contiguous:
        raise ValueError("out must be a C-contiguous, writable buffer")
    if mv.nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer(mv if (mv.format == "B" and mv.ndim == 1) else mv.cast("B"), dtype=np.uint8)


# --------------------------------------------------------------------------- header


# One piece of a batch: (absolute file offset, number of runs, run bytes, stride bytes, out offset).
_Piece = tuple[int, int, int, int, int]


class _Batcher:
    """Reads batches of pieces with one syscall each, through one reused buffer."""

    __slots__ = ("buf", "dst", "fd", "mv", "stats")

    def __init__(self, fd: int, dst: np.ndarray[Any, Any], stats: ReadStats | None) -> None:
        self.fd = fd
        self.dst = dst
        self.mv = dst.data
        self.stats = stats
        self.buf: np.ndarray[Any, Any] | None = None

    def direct(self, offset: int, dpos: int, nbytes: int) -> None:
        _read_into(self.fd, self.mv[dpos : dpos + nbytes], offset, self.stats)

    def flush(self, batch: list[_Piece], lo: int, hi: int) -> None:
        first = batch[0]
        if len(batch) == 1 and first[1] == 1:  # a single run: straight into out, no copy
            self.direct(first[0], first[4], first[2])
            return
        span = hi - lo
        if self.buf is None or self.buf.size < span:
            self.buf = np.empty(span, dtype=np.uint8)
        buf = self.buf
        _read_into(self.fd, buf.data[:span], lo, self.stats)
        m = len(batch)
        _, n0, run, step, dpos0 = first
        if m > 1 and all(p[1] == n0 for p in batch):
            delta = batch[1][0] - first[0]
            if all(p[0] - first[0] == i * delta for i, p in enumerate(batch)):
                # Equally spaced groups (the common 3-d case): one copy for the whole batch.
                src = as_strided(buf[first[0] - lo :], shape=(m, n0, run), strides=(delta, step, 1),
                                 writeable=False)
                self.dst[dpos0 : dpos0 + m * n0 * run].reshape(m, n0, run)[...] = src
                return
        for off, n, run, step, dpos in batch:
            src = as_strided(buf[off - lo :], shape=(n, run), strides=(step, 1), writeable=False)
            self.dst[dpos : dpos + n * run].reshape(n, run)[...] = src


def _region_target(start: int, shape: tuple[int, ...], itemsize: int, box: Box,
                   out: memoryview | bytearray | np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``out`` as writable bytes, after checking :func:`read_region`'s arguments: a positive
    itemsize, a non-negative start, a region inside the stored shape, and room for exactly it."""
    if itemsize <= 0:
        raise ValueError(f"itemsize must be positive, got {itemsize}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if not box.fits_in(shape):
        raise RegionOutOfBoundsError(region_misfit(box, shape))
    dst = _writable_bytes(out)
    need = box.volume * itemsize
    if dst.nbytes != need:
        raise ValueError(f"out holds {dst.nbytes} bytes but region {box} x {itemsize} bytes needs {need}")
    return dst


def read_region(
    fd: int,
    start: int,
    stored_shape: tuple[int, ...],
    itemsize: int,
    box: Box,
    out: memoryview | bytearray | np.ndarray[Any, Any],
    *,
    max_gap: int = 1 << 16,
    budget: int = 64 << 20,
    stats: ReadStats | None = None,
) -> None:
    """Read the region ``box`` of a row-major tensor stored at absolute offset ``start`` of ``fd``.

    ``out`` is a C-contiguous writable buffer of exactly ``box.volume * itemsize`` bytes; it
    receives the region in row-major order. Runs of the region separated by at most ``max_gap``
    bytes are read together (skipping the gap costs more than reading it), in spans of at most
    ``budget`` bytes, and copied out with one strided numpy copy per batch; runs farther apart are
    read one syscall each, straight into ``out``. With ``max_gap=0`` exactly the region's bytes
    are read. A file too short for the region raises ``FormatError``.

    >>> import tempfile
    >>> with tempfile.TemporaryFile() as f:
    ...     _ = f.write(bytes(range(32))); f.flush()
    ...     out = bytearray(4)
    ...     read_region(f.fileno(), 0, (4, 8), 1, Box((1, 2), (2, 2)), memoryview(out))
    >>> list(out)
    [10, 11, 18, 19]
    """
    shape = tuple(stored_shape)
    dst = _region_target(start, shape, itemsize, box, out)
    if dst.nbytes == 0:
        return
    budget = max(1, budget)
    io = _Batcher(fd, dst, stats)
    batch: list[_Piece] = []
    lo = hi = 0
    pos = 0  # next byte of out
    for s, count, stride, length in uniform_runs(box, shape):
        run = length * itemsize
        step = stride * itemsize
        base = start + s * itemsize
        if count > 1 and step - run > max_gap:
            # Runs too far apart to read through their gaps: one syscall each, into out. (All groups
            # of one uniform_runs call share count/stride/length, so no batch is pending here today.)
            if batch:
                io.flush(batch, lo, hi)
                batch = []
            for i in range(count):
                io.direct(base + i * step, pos, run)
                pos += run
            continue
        # Runs per piece so that one piece spans at most budget bytes (at least one run).
        per = count if count == 1 else max(1, min(count, (budget - run) // step + 1 if run < budget else 1))
        i = 0
        while i < count:
            n = min(per, count - i)
            p_lo = base + i * step
            p_hi = p_lo + (n - 1) * step + run
            if batch and p_lo - hi <= max_gap and p_hi - lo <= budget:
                batch.append((p_lo, n, run, step, pos))
                hi = p_hi
            else:
                if batch:
                    io.flush(batch, lo, hi)
                batch = [(p_lo, n, run, step, pos)]
                lo, hi = p_lo, p_hi
            pos += n * run
            i += n
    if batch:
        io.flush(batch, lo, hi)


class SafetensorsReader:
    """An open safetensors file: its validated header and region reads.

    >>> import tempfile, os
    >>> from formats.safetensors.write import save_tensors
    >>> d = tempfile.mkdtemp(); p = os.path.join(d, "t.safetensors")
    >>> save_tensors(p, {"w": np.arange(12, dtype=np.int32).reshape(3, 4)})
    >>> with SafetensorsReader(p) as r:
    ...     r.read("w", Box((1, 1), (2, 2))).tolist()
    [[5, 6], [9, 10]]
    """

    def __init__(self, path: str | os.PathLike[str], *, max_gap: int = 1 << 16,
                 budget: int = 64 << 20) -> None:
        self.path = os.fspath(path)
        self.max_gap = max_gap
        self.budget = budget
        fd = open_read(path)
        try:
            self.header: Header = read_header_fd(fd, self.path)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    @property
    def fd(self) -> int:
        if self._fd < 0:
            raise ValueError(f"{self.path}: reader is closed")
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def __contains__(self, name: object) -> bool:
        return name in self.header.tensors

    def names(self) -> list[str]:
        return list(self.header.tensors)

    def tensor(self, name: str) -> StoredTensor:
        """The stored tensor ``name``; ``ShardNotFoundError`` naming some that exist if missing."""
        t = self.header.tensors.get(name)
        if t is None:
            have = list(self.header.tensors)
            if not have:
                listing = "the file holds no tensors"
            else:
                shown = ", ".join(cut_repr(n) for n in have[:5])
                more = f" and {len(have) - 5} more" if len(have) > 5 else ""
                listing = f"it holds {shown}{more}"
            raise ShardNotFoundError(f"{self.path}: no tensor {cut_repr(name)}; {listing}")
        return t

    def read(self, name: str, box: Box | None = None, stats: ReadStats | None = None) -> np.ndarray[Any, Any]:
        """The region ``box`` (default: all) of tensor ``name``, as its storage dtype (bf16 ->
        uint16, fp8 -> uint8), shaped ``box.sizes``."""
        t = self.tensor(name)
        if box is None:
            box = Box.whole(t.shape)
        elif not box.fits_in(t.shape):
            raise RegionOutOfBoundsError(f"{self.path}: tensor {cut_repr(name)}: {region_misfit(box, t.shape)}")
        arr = np.empty(box.sizes, dtype=np_storage(t.dtype))
        try:
            read_region(self.fd, t.start, t.shape, t.dtype.itemsize, box, arr, max_gap=self.max_gap,
                        budget=self.budget, stats=stats)
        except FormatError as e:
            raise FormatError(f"{self.path}: tensor {cut_repr(name)}: {e}") from e
        return arr

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:  # a reader dropped without close() must not leak its fd
        if getattr(self, "_fd", -1) >= 0:
            self.close()

    def __repr__(self) -> str:
        return f"SafetensorsReader({self.path!r}, {len(self.header.tensors)} tensors)"
