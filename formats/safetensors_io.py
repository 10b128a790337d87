"""Streaming safetensors I/O: bounded header parse, ranged region reads, plan-driven writer.

The format, as the official implementation reads and writes it::

    [8 bytes]  N, a little-endian u64
    [N bytes]  a UTF-8 JSON object, padded with spaces so that 8 + N is a multiple of 8:
               {"__metadata__": {str: str},
                NAME: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...}
    [rest]     the data section. Offsets are relative to its start (byte 8 + N). Tensors are
               packed back to back: sorted by begin, the first at 0, no gaps, no overlaps, and
               nothing after the last one. Elements are little-endian, row-major.

``read_header`` treats every file as hostile: it never allocates more than the file holds, and
every broken rule is one ``FormatError`` line naming the file, the tensor and the rule.
``read_region`` reads only the bytes of a region, coalescing runs whose gaps are small, through a
bounded buffer. ``layout_file`` is the pure planner of a file; ``SafetensorsWriter`` streams
regions into the file it lays out, atomically (temp file + rename).

No MPI. No torch at import time: ``save_tensors`` imports it only when handed a torch tensor.
"""

from __future__ import annotations

import contextlib
import json
import operator
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .box import Box, uniform_runs
from .dtypes import DTYPES, DType, by_safetensors, from_torch, np_storage
from .errors import FormatError, RegionOutOfBoundsError, ShardNotFoundError
from .limits import INT64_MAX

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "MAX_HEADER_BYTES",
    "Header",
    "ReadStats",
    "SafetensorsReader",
    "SafetensorsWriter",
    "StoredTensor",
    "layout_file",
    "read_header",
    "read_region",
    "save_tensors",
]

MAX_HEADER_BYTES = 100_000_000  # the official limit (safetensors MAX_HEADER_SIZE)
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})
_METADATA = "__metadata__"
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: opening a FIFO planted where a file should be must not hang (no effect on files).
_O_READ = os.O_RDONLY | _O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)
# O_NOFOLLOW: never write through a symlink planted at the temp name.
_O_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_HAVE_PREADV = hasattr(os, "preadv")
_HAVE_FADVISE = hasattr(os, "posix_fadvise")
#: a sequential stream of this many written bytes gets its writeback started (SafetensorsWriter)
WRITEBACK_BYTES = 8 << 20


# --------------------------------------------------------------------------- data model


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """One tensor of a safetensors file, as its header describes it."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first data byte
    nbytes: int

    @property
    def stop(self) -> int:
        """Absolute file offset one past the last data byte."""
        return self.start + self.nbytes


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed, validated safetensors header."""

    path: str
    tensors: dict[str, StoredTensor]  # in data-offset order
    metadata: dict[str, str] | None
    data_start: int  # absolute offset of the data section (8 + header length)
    file_size: int


@dataclass(slots=True)
class ReadStats:
    """Counters ``read_region`` adds to: bytes returned by the OS and read syscalls made."""

    bytes_read: int = 0
    reads: int = 0


# --------------------------------------------------------------------------- small helpers


def _q(name: object, limit: int = 80) -> str:
    """repr() of a (possibly hostile, huge) name, cut to ``limit`` characters."""
    r = repr(name)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _json_type(v: object) -> str:
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    return "null" if v is None else type(v).__name__


def _short(v: object, limit: int = 80) -> str:
    r = json.dumps(v) if isinstance(v, (list, dict, str, int, float, bool)) or v is None else repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _fspath(path: str | os.PathLike[str]) -> str:
    return os.fspath(path)


def _open_read(path: str | os.PathLike[str]) -> int:
    try:
        return os.open(path, _O_READ)
    except FileNotFoundError as e:
        raise ShardNotFoundError(f"{_fspath(path)}: safetensors file not found") from e


def _pread_exact(fd: int, n: int, offset: int, label: str) -> bytes:
    parts: list[bytes] = []
    got = 0
    while got < n:
        b = os.pread(fd, n - got, offset + got)
        if not b:
            raise FormatError(f"{label}: truncated: expected {n} bytes at offset {offset}, got {got}")
        parts.append(b)
        got += len(b)
    return b"".join(parts)


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


def _pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    done = 0
    n = len(mv)
    while done < n:
        done += os.pwrite(fd, mv[done:], offset + done)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | _O_CLOEXEC)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _region_misfit(box: Box, shape: Sequence[int]) -> str:
    """Why ``box`` does not fit ``shape`` (precondition: it does not)."""
    if box.ndim != len(shape):
        return f"region {box} has {box.ndim} dims but the stored tensor has {len(shape)} (shape {list(shape)})"
    for d, (stop, n) in enumerate(zip(box.stops, shape)):
        if stop > n:
            return f"region {box} exceeds stored shape {list(shape)}: dim {d} stops at {stop} > {n}"
    return f"region {box} does not fit stored shape {list(shape)}"  # pragma: no cover


def _as_bytes(data: Any) -> memoryview:
    """A flat byte view of a bytes-like object or numpy array (arrays are made C-contiguous)."""
    if isinstance(data, np.ndarray):
        arr = np.ascontiguousarray(data)
        return arr.reshape(-1).view(np.uint8).data
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("data must be a C-contiguous buffer")
    return mv if (mv.format == "B" and mv.ndim == 1) else mv.cast("B")


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


class _DuplicateKey(Exception):
    pass


def _object_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return d


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_json(raw: bytes, label: str) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{label}: header is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    try:
        return json.loads(text, object_pairs_hook=_object_hook, parse_constant=_reject_constant)
    except _DuplicateKey as e:
        # json.loads would keep the last value silently; two readers could then disagree on what
        # the file holds, so an ambiguous header is refused.
        raise FormatError(f"{label}: header repeats the key {_q(e.args[0])}; refusing an ambiguous file") \
            from None
    except RecursionError:
        raise FormatError(f"{label}: header JSON nests too deeply to be a safetensors header") from None
    except ValueError as e:  # JSONDecodeError, over-long integer literals, NaN/Infinity
        raise FormatError(f"{label}: header is not valid JSON ({_q(str(e), 120)[1:-1]})") from None


def _parse_metadata(v: Any, label: str) -> dict[str, str] | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise FormatError(f"{label}: __metadata__ must be an object of string values, got {_json_type(v)}")
    for k, s in v.items():
        if not isinstance(s, str):
            raise FormatError(f"{label}: __metadata__[{_q(k)}] must be a string, got {_json_type(s)} "
                              f"{_short(s)}")
    return v


def _parse_entry(name: str, entry: Any, label: str, data_start: int, file_size: int) -> StoredTensor:
    # Hot path (once per tensor, 100k+ per file): messages are only formatted on failure.
    def where() -> str:
        return f"{label}: tensor {_q(name)}"

    if not isinstance(entry, dict):
        raise FormatError(f"{where()}: entry must be an object with dtype, shape and data_offsets, "
                          f"got {_json_type(entry)}")
    keys = entry.keys()
    if keys != _ENTRY_KEYS:
        problems = []
        missing = sorted(_ENTRY_KEYS - keys)
        unknown = sorted(keys - _ENTRY_KEYS)
        if missing:
            problems.append("missing " + ", ".join(missing))
        if unknown:
            problems.append("unknown key " + ", ".join(_q(k) for k in unknown[:5]))
        raise FormatError(f"{where()}: {'; '.join(problems)} (expected exactly dtype, shape, data_offsets)")
    try:
        dt = by_safetensors(entry["dtype"])
    except FormatError as e:
        raise FormatError(f"{where()}: {e}") from None
    shape = entry["shape"]
    if type(shape) is not list:
        raise FormatError(f"{where()}: shape must be an array of non-negative integers, got {_short(shape)}")
    # Python ints do not wrap; stop at the first partial product past int64 (like the official
    # checked_mul), which also bounds the work a hostile shape of huge numbers can cause.
    count = 1
    for v in shape:
        if type(v) is not int or v < 0:
            raise FormatError(f"{where()}: shape must be an array of non-negative integers, "
                              f"got {_short(shape)}")
        if count <= INT64_MAX:
            count *= v
    offs = entry["data_offsets"]
    if not (type(offs) is list and len(offs) == 2 and type(offs[0]) is int and type(offs[1]) is int):
        raise FormatError(f"{where()}: data_offsets must be an array of two integers [begin, end], "
                          f"got {_short(offs)}")
    begin, end = offs
    if begin < 0 or end < begin:
        raise FormatError(f"{where()}: data_offsets [{begin}, {end}] must satisfy 0 <= begin <= end")
    data_len = file_size - data_start
    if end > data_len:
        raise FormatError(f"{where()}: data_offsets [{begin}, {end}] run past the end of the file: the data "
                          f"section holds {data_len} bytes (file {file_size} bytes, data starts at "
                          f"{data_start})")
    need = count * dt.itemsize
    if need > INT64_MAX:
        raise FormatError(f"{where()}: shape {_short(shape)} x {dt.safetensors} overflows int64 "
                          f"(element count x itemsize > 2**63-1)")
    if end - begin != need:
        raise FormatError(f"{where()}: data_offsets [{begin}, {end}] hold {end - begin} bytes but shape "
                          f"{_short(shape)} x {dt.safetensors} needs {need}")
    return StoredTensor(name, dt, tuple(shape), data_start + begin, need)


def _parse_header(obj: Any, label: str, data_start: int, file_size: int) -> Header:
    if not isinstance(obj, dict):
        raise FormatError(f"{label}: header must be a JSON object, got {_json_type(obj)}")
    metadata: dict[str, str] | None = None
    tensors: list[StoredTensor] = []
    for name, entry in obj.items():
        if name == _METADATA:
            metadata = _parse_metadata(entry, label)
        else:
            tensors.append(_parse_entry(name, entry, label, data_start, file_size))
    tensors.sort(key=lambda t: (t.start, t.nbytes))
    # The official reader requires the data section to be tiled exactly, in offset order.
    prev: StoredTensor | None = None
    end = data_start
    for t in tensors:
        rel = (t.start - data_start, t.stop - data_start)
        if t.start < end:
            assert prev is not None
            raise FormatError(f"{label}: tensor {_q(t.name)}: data_offsets [{rel[0]}, {rel[1]}] overlap tensor "
                              f"{_q(prev.name)} at [{prev.start - data_start}, {prev.stop - data_start}]")
        if t.start > end:
            if prev is None:
                raise FormatError(f"{label}: tensor {_q(t.name)}: data_offsets [{rel[0]}, {rel[1]}] leave "
                                  f"{rel[0]} unused bytes at the start of the data section; safetensors "
                                  f"requires tensors packed back to back from offset 0")
            raise FormatError(f"{label}: tensor {_q(t.name)}: data_offsets [{rel[0]}, {rel[1]}] leave a gap "
                              f"of {t.start - end} bytes after tensor {_q(prev.name)} (ends at "
                              f"{end - data_start}); safetensors requires tensors packed back to back")
        prev, end = t, t.stop
    if end != file_size:
        after = f"after tensor {_q(prev.name)} " if prev is not None else ""
        raise FormatError(f"{label}: {file_size - end} trailing bytes {after}(tensors end at data offset "
                          f"{end - data_start}, the data section holds {file_size - data_start} bytes); "
                          f"safetensors requires the last tensor to end the file")
    return Header(label, {t.name: t for t in tensors}, metadata, data_start, file_size)


def _read_header_fd(fd: int, label: str) -> Header:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{label}: not a regular file")
    size = st.st_size
    if size < 8:
        raise FormatError(f"{label}: truncated: file is {size} bytes, shorter than the 8-byte header "
                          f"length prefix")
    n = int.from_bytes(_pread_exact(fd, 8, 0, label), "little")
    if n > MAX_HEADER_BYTES:
        raise FormatError(f"{label}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit; "
                          f"not a safetensors file, or a hostile one")
    if n > size - 8:
        raise FormatError(f"{label}: header length {n} runs past the end of the file ({size} bytes leave "
                          f"{size - 8} for the header); the file is truncated or not safetensors")
    obj = _parse_json(_pread_exact(fd, n, 8, label), label)
    return _parse_header(obj, label, 8 + n, size)


def read_header(path: str | os.PathLike[str]) -> Header:
    """Parse and validate the header of the safetensors file at ``path``.

    Only the 8-byte prefix and the header are read. Raises ``ShardNotFoundError`` when the file
    does not exist and ``FormatError`` (one line: file, tensor, rule) when anything is wrong.
    Duplicate JSON keys are refused rather than resolved (``json`` would keep the last).
    """
    label = _fspath(path)
    fd = _open_read(path)
    try:
        return _read_header_fd(fd, label)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- ranged reads

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
        raise RegionOutOfBoundsError(_region_misfit(box, shape))
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


# --------------------------------------------------------------------------- reader


class SafetensorsReader:
    """An open safetensors file: its validated header and region reads.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); p = os.path.join(d, "t.safetensors")
    >>> save_tensors(p, {"w": np.arange(12, dtype=np.int32).reshape(3, 4)})
    >>> with SafetensorsReader(p) as r:
    ...     r.read("w", Box((1, 1), (2, 2))).tolist()
    [[5, 6], [9, 10]]
    """

    def __init__(self, path: str | os.PathLike[str], *, max_gap: int = 1 << 16,
                 budget: int = 64 << 20) -> None:
        self.path = _fspath(path)
        self.max_gap = max_gap
        self.budget = budget
        fd = _open_read(path)
        try:
            self.header: Header = _read_header_fd(fd, self.path)
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
                shown = ", ".join(_q(n) for n in have[:5])
                more = f" and {len(have) - 5} more" if len(have) > 5 else ""
                listing = f"it holds {shown}{more}"
            raise ShardNotFoundError(f"{self.path}: no tensor {_q(name)}; {listing}")
        return t

    def read(self, name: str, box: Box | None = None, stats: ReadStats | None = None) -> np.ndarray[Any, Any]:
        """The region ``box`` (default: all) of tensor ``name``, as its storage dtype (bf16 ->
        uint16, fp8 -> uint8), shaped ``box.sizes``."""
        t = self.tensor(name)
        if box is None:
            box = Box.whole(t.shape)
        elif not box.fits_in(t.shape):
            raise RegionOutOfBoundsError(f"{self.path}: tensor {_q(name)}: {_region_misfit(box, t.shape)}")
        arr = np.empty(box.sizes, dtype=np_storage(t.dtype))
        try:
            read_region(self.fd, t.start, t.shape, t.dtype.itemsize, box, arr, max_gap=self.max_gap,
                        budget=self.budget, stats=stats)
        except FormatError as e:
            raise FormatError(f"{self.path}: tensor {_q(name)}: {e}") from e
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


# --------------------------------------------------------------------------- layout and writer


def layout_file(
    specs: Sequence[tuple[str, DType, tuple[int, ...]]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Lay out a safetensors file. Pure: no I/O.

    Tensors are packed back to back in the order given (the format allows no gaps); the header is
    compact JSON, ``__metadata__`` first, padded with spaces so that the data starts at a multiple
    of 8, as the official writer does. Returns the file's prefix (8-byte length + header) and each
    tensor's absolute ``(begin, end)`` byte range.

    >>> prefix, ranges = layout_file([("a", DTYPES["float32"], (2,)), ("b", DTYPES["int16"], (3,))])
    >>> len(prefix), prefix[:8], prefix[8:]
    (120, b'p\\x00\\x00\\x00\\x00\\x00\\x00\\x00', b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"I16","shape":[3],"data_offsets":[8,14]}}    ')
    >>> ranges
    {'a': (120, 128), 'b': (128, 134)}
    """
    header: dict[str, Any] = {}
    if metadata is not None:
        md: dict[str, str] = {}
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"metadata must map str to str, got {_q(key)}: {_q(value)}")
            md[key] = value
        header[_METADATA] = md
    rel: dict[str, tuple[int, int]] = {}
    offset = 0
    for spec in specs:
        name, dt, shape_in = spec
        if not isinstance(name, str):
            raise TypeError(f"tensor name must be a string, got {_q(name)}")
        if name == _METADATA:
            raise ValueError(f"{_METADATA!r} is reserved for metadata and cannot name a tensor")
        if name in rel:
            raise ValueError(f"duplicate tensor name {_q(name)} in layout")
        if not isinstance(dt, DType):
            raise TypeError(f"tensor {_q(name)}: dtype must be a DType, got {_q(dt)}")
        try:
            shape = [operator.index(v) for v in shape_in]
        except TypeError:
            raise TypeError(f"tensor {_q(name)}: shape must hold integers, got {_q(shape_in)}") from None
        if any(v < 0 for v in shape):
            raise ValueError(f"tensor {_q(name)}: negative size in shape {shape}")
        nbytes = dt.itemsize
        for v in shape:
            nbytes *= v
            if nbytes > INT64_MAX:
                break
        if nbytes > INT64_MAX or offset + nbytes > INT64_MAX:
            raise ValueError(f"tensor {_q(name)}: shape {shape} x {dt.safetensors} does not fit in int64 "
                             f"(file would exceed 2**63-1 bytes)")
        header[name] = {"dtype": dt.safetensors, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        rel[name] = (offset, offset + nbytes)
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER_BYTES:
        raise ValueError(f"header would be {len(text)} bytes, over the {MAX_HEADER_BYTES}-byte limit readers "
                         f"accept; split the tensors over more files")
    prefix = len(text).to_bytes(8, "little") + text
    base = len(prefix)
    return prefix, {n: (base + b, base + e) for n, (b, e) in rel.items()}


class SafetensorsWriter:
    """Stream a safetensors file laid out by ``layout_file``, atomically.

    The header is written first into ``.{name}.tmp-{pid}`` beside ``path`` and the file is sized
    in full (sparse); ``write``/``write_box`` then fill tensor bytes in any order. ``commit()``
    fsyncs and renames into place. Leaving the ``with`` block without ``commit()`` (an exception
    included) aborts: the temp file is removed, so no complete-looking file is ever left.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> with SafetensorsWriter(p, [("w", DTYPES["uint8"], (2, 3))]) as w:
    ...     w.write_box("w", Box((0, 0), (2, 2)), np.array([[1, 2], [4, 5]], dtype=np.uint8))
    ...     w.write_box("w", Box((0, 2), (2, 1)), np.array([[3], [6]], dtype=np.uint8))
    ...     w.commit()
    >>> with SafetensorsReader(p) as r:
    ...     r.read("w").tolist()
    [[1, 2, 3], [4, 5, 6]]
    """

    def __init__(self, path: str | os.PathLike[str], specs: Sequence[tuple[str, DType, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None) -> None:
        specs = list(specs)
        prefix, ranges = layout_file(specs, metadata)  # every input is checked before any I/O
        self._path = Path(path)
        self._tmp = self._path.with_name(f".{self._path.name}.tmp-{os.getpid()}")
        self._ranges = ranges
        self._specs: dict[str, tuple[DType, tuple[int, ...]]] = {
            name: (dt, tuple(int(v) for v in shape)) for name, dt, shape in specs}
        self._size = max((e for _, e in ranges.values()), default=len(prefix))
        self._data_start = len(prefix)
        self.bytes_written = 0
        # [lo, hi): the sequential run of written bytes whose writeback has not been started
        self._wb_lo = self._wb_hi = 0
        fd = os.open(self._tmp, _O_WRITE, 0o644)
        try:
            _pwrite_all(fd, memoryview(prefix), 0)
            os.ftruncate(fd, self._size)
        except BaseException:
            os.close(fd)
            self._tmp.unlink(missing_ok=True)
            raise
        self._fd = fd
        self._state = "open"

    # -- properties

    @property
    def path(self) -> Path:
        return self._path

    @property
    def temp_path(self) -> Path:
        return self._tmp

    @property
    def file_size(self) -> int:
        return self._size

    @property
    def data_start(self) -> int:
        """Absolute offset of the data section (the first tensor's first byte)."""
        return self._data_start

    @property
    def tensor_ranges(self) -> dict[str, tuple[int, int]]:
        """Absolute ``(begin, end)`` byte range of each tensor, in layout order."""
        return dict(self._ranges)

    @property
    def committed(self) -> bool:
        return self._state == "committed"

    # -- writing

    def _check_open(self) -> None:
        if self._state != "open":
            raise ValueError(f"{self._path}: writer is {self._state}")

    def _lookup(self, name: str) -> tuple[int, int]:
        r = self._ranges.get(name)
        if r is None:
            raise ValueError(f"{self._path}: no tensor {_q(name)} in this file's layout")
        return r

    def write(self, name: str, byte_offset: int, data: Any) -> None:
        """Write the bytes of ``data`` at ``byte_offset`` inside tensor ``name``."""
        self._check_open()
        begin, end = self._lookup(name)
        mv = _as_bytes(data)
        n = mv.nbytes
        if byte_offset < 0 or byte_offset + n > end - begin:
            raise ValueError(f"{self._path}: tensor {_q(name)}: {n} bytes at byte offset {byte_offset} "
                             f"overflow its {end - begin} bytes")
        _pwrite_all(self._fd, mv, begin + byte_offset)
        self.bytes_written += n
        self._start_writeback(begin + byte_offset, n)

    def write_at(self, offset: int, data: Any) -> None:
        """Write the bytes of ``data`` at absolute file ``offset``, inside the data section. For a
        caller streaming the file in layout order: one write may span several tensors."""
        self._check_open()
        mv = _as_bytes(data)
        n = mv.nbytes
        if offset < self._data_start or offset + n > self._size:
            raise ValueError(f"{self._path}: {n} bytes at offset {offset} fall outside the data section "
                             f"[{self._data_start}, {self._size})")
        _pwrite_all(self._fd, mv, offset)
        self.bytes_written += n
        self._start_writeback(offset, n)

    def _start_writeback(self, offset: int, n: int) -> None:
        """Start (not wait for) writeback of a sequential run of writes every WRITEBACK_BYTES.

        Otherwise the whole file stays dirty in the page cache until ``commit``'s fsync, which
        then writes all of it while nothing else runs: 0.8-0.9 s of a 2.3 GB convert (3 files),
        where it now takes ~0.03 s because the device wrote while the next slabs were filled.
        On Linux POSIX_FADV_DONTNEED starts asynchronous writeback of the dirty range (and drops
        only pages already clean); it is a hint: durability still comes from fsync alone.
        Writes out of order (``write_box`` of strided regions) are left to fsync.
        """
        if not _HAVE_FADVISE:
            return
        if offset != self._wb_hi:
            self._wb_lo = offset
        self._wb_hi = offset + n
        if self._wb_hi - self._wb_lo >= WRITEBACK_BYTES:
            with contextlib.suppress(OSError):  # a hint: a file system may refuse it
                os.posix_fadvise(self._fd, self._wb_lo, self._wb_hi - self._wb_lo, os.POSIX_FADV_DONTNEED)
            self._wb_lo = self._wb_hi

    def write_box(self, name: str, box: Box, data: Any) -> None:
        """Write region ``box`` (tensor element coordinates) of tensor ``name`` from ``data``, a
        numpy array shaped ``box.sizes`` (or a bytes-like object of the region in row-major order),
        as one write per longest contiguous run."""
        self._check_open()
        begin, _ = self._lookup(name)
        dt, shape = self._specs[name]
        if not box.fits_in(shape):
            raise RegionOutOfBoundsError(f"{self._path}: tensor {_q(name)}: {_region_misfit(box, shape)}")
        if isinstance(data, np.ndarray) and tuple(data.shape) != box.sizes:
            raise ValueError(f"{self._path}: tensor {_q(name)}: data shape {list(data.shape)} != region "
                             f"{box} sizes {list(box.sizes)}")
        mv = _as_bytes(data)
        isz = dt.itemsize
        need = box.volume * isz
        if mv.nbytes != need:
            raise ValueError(f"{self._path}: tensor {_q(name)}: data holds {mv.nbytes} bytes but region {box} "
                             f"x {dt.safetensors} needs {need}")
        pos = 0
        for s, count, stride, length in uniform_runs(box, shape):
            run = length * isz
            off = begin + s * isz
            step = stride * isz
            for _ in range(count):
                _pwrite_all(self._fd, mv[pos : pos + run], off)
                pos += run
                off += step
        self.bytes_written += need

    # -- finishing

    def commit(self) -> None:
        """fsync, close, rename into place, fsync the directory."""
        self._check_open()
        fd, self._fd = self._fd, -1
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(self._tmp, self._path)
        self._state = "committed"
        _fsync_dir(self._path.parent)

    def abort(self) -> None:
        """Close and delete the temp file. Idempotent; does nothing after ``commit``."""
        if self._state == "committed":
            return
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.close(fd)
            except OSError:
                pass
        self._tmp.unlink(missing_ok=True)
        self._state = "aborted"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._state != "committed":
            self.abort()

    def __del__(self) -> None:
        # Dropped without commit(): nothing was written, so remove the temp file too.
        if getattr(self, "_state", None) == "open":
            with contextlib.suppress(OSError):  # best effort
                self.abort()

    def __repr__(self) -> str:
        return f"SafetensorsWriter({str(self._path)!r}, {len(self._ranges)} tensors, {self._state})"


# --------------------------------------------------------------------------- whole-tensor helper


def _is_torch_tensor(v: object) -> bool:
    return type(v).__module__.partition(".")[0] == "torch" and hasattr(v, "numpy") and hasattr(v, "dtype")


def _to_storage_array(name: str, value: Any, want: DType | None) -> tuple[np.ndarray[Any, Any], DType]:
    if _is_torch_tensor(value):
        import torch  # only now: the caller handed us a torch tensor

        t = value.detach().cpu().contiguous()
        dt = from_torch(t.dtype)
        if dt.storage != dt.name:  # bf16 / fp8: numpy has no such dtype
            t = t.view(torch.int16 if dt.itemsize == 2 else torch.uint8)
        arr = t.numpy().view(np_storage(dt))
    else:
        arr = np.asarray(value)
        found = DTYPES.get(arr.dtype.name)  # ml_dtypes' bfloat16/float8 names match ours too
        if found is not None:
            dt = found
        elif want is not None:
            dt = want
        else:
            raise ValueError(f"tensor {_q(name)}: numpy dtype {arr.dtype} has no safetensors dtype; "
                             f"pass dtypes={{{name!r}: ...}}")
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
    if want is not None:
        if want.itemsize != arr.dtype.itemsize:
            raise ValueError(f"tensor {_q(name)}: dtype {want.name} has {want.itemsize}-byte elements but the "
                             f"data has {arr.dtype.itemsize}-byte {arr.dtype}")
        dt = want
    # not np.ascontiguousarray: it turns 0-d arrays into 1-d ones
    return (arr if arr.flags.c_contiguous else arr.copy(order="C")), dt


def save_tensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, Any],
    dtypes: Mapping[str, DType] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Atomically write whole tensors (numpy arrays or torch tensors), in mapping order.

    ``dtypes`` overrides the stored dtype per tensor (same itemsize), e.g. to store a uint16
    numpy array as bfloat16. For tests and demos; conversions stream with ``SafetensorsWriter``.
    """
    items: list[tuple[str, np.ndarray[Any, Any], DType]] = []
    for name, value in tensors.items():
        arr, dt = _to_storage_array(name, value, (dtypes or {}).get(name))
        items.append((name, arr, dt))
    with SafetensorsWriter(path, [(name, dt, tuple(arr.shape)) for name, arr, dt in items], metadata) as w:
        for name, arr, _ in items:
            w.write(name, 0, arr)
        w.commit()
