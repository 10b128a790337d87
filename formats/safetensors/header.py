"""The safetensors header: the stored tensors a file holds, parsed from a hostile file.

``read_header`` never allocates more than the file holds, and every broken rule is one
``FormatError`` line naming the file, the tensor and the rule (the format:
:mod:`formats.safetensors.io`). No I/O beyond the 8-byte prefix and the header.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError, ShardNotFoundError
from ..manifest.box import Box
from ..manifest.dtypes import DType, by_safetensors
from ..manifest.limits import INT64_MAX

__all__ = ["MAX_HEADER_BYTES", "METADATA_KEY", "Header", "StoredTensor", "cut_repr", "open_read", "read_header",
           "read_header_fd", "region_misfit"]

MAX_HEADER_BYTES = 100_000_000  # the official limit (safetensors MAX_HEADER_SIZE)
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})
METADATA_KEY = "__metadata__"
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: opening a FIFO planted where a file should be must not hang (no effect on files).
_O_READ = os.O_RDONLY | _O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)


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


def cut_repr(name: object, limit: int = 80) -> str:
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


def open_read(path: str | os.PathLike[str]) -> int:
    try:
        return os.open(path, _O_READ)
    except FileNotFoundError as e:
        raise ShardNotFoundError(f"{os.fspath(path)}: safetensors file not found") from e


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


def region_misfit(box: Box, shape: Sequence[int]) -> str:
    """Why ``box`` does not fit ``shape`` (precondition: it does not)."""
    if box.ndim != len(shape):
        return f"region {box} has {box.ndim} dims but the stored tensor has {len(shape)} (shape {list(shape)})"
    for d, (stop, n) in enumerate(zip(box.stops, shape)):
        if stop > n:
            return f"region {box} exceeds stored shape {list(shape)}: dim {d} stops at {stop} > {n}"
    return f"region {box} does not fit stored shape {list(shape)}"  # pragma: no cover


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
        raise FormatError(f"{label}: header repeats the key {cut_repr(e.args[0])}; refusing an ambiguous file") \
            from None
    except RecursionError:
        raise FormatError(f"{label}: header JSON nests too deeply to be a safetensors header") from None
    except ValueError as e:  # JSONDecodeError, over-long integer literals, NaN/Infinity
        raise FormatError(f"{label}: header is not valid JSON ({cut_repr(str(e), 120)[1:-1]})") from None


def _parse_metadata(v: Any, label: str) -> dict[str, str] | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise FormatError(f"{label}: __metadata__ must be an object of string values, got {_json_type(v)}")
    for k, s in v.items():
        if not isinstance(s, str):
            raise FormatError(f"{label}: __metadata__[{cut_repr(k)}] must be a string, got {_json_type(s)} "
                              f"{_short(s)}")
    return v


def _parse_entry(name: str, entry: Any, label: str, data_start: int, file_size: int) -> StoredTensor:
    # Hot path (once per tensor, 100k+ per file): messages are only formatted on failure.
    def where() -> str:
        return f"{label}: tensor {cut_repr(name)}"

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
            problems.append("unknown key " + ", ".join(cut_repr(k) for k in unknown[:5]))
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
        if name == METADATA_KEY:
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
            raise FormatError(f"{label}: tensor {cut_repr(t.name)}: data_offsets [{rel[0]}, {rel[1]}] overlap tensor "
                              f"{cut_repr(prev.name)} at [{prev.start - data_start}, {prev.stop - data_start}]")
        if t.start > end:
            if prev is None:
                raise FormatError(f"{label}: tensor {cut_repr(t.name)}: data_offsets [{rel[0]}, {rel[1]}] leave "
                                  f"{rel[0]} unused bytes at the start of the data section; safetensors "
                                  f"requires tensors packed back to back from offset 0")
            raise FormatError(f"{label}: tensor {cut_repr(t.name)}: data_offsets [{rel[0]}, {rel[1]}] leave a gap "
                              f"of {t.start - end} bytes after tensor {cut_repr(prev.name)} (ends at "
                              f"{end - data_start}); safetensors requires tensors packed back to back")
        prev, end = t, t.stop
    if end != file_size:
        after = f"after tensor {cut_repr(prev.name)} " if prev is not None else ""
        raise FormatError(f"{label}: {file_size - end} trailing bytes {after}(tensors end at data offset "
                          f"{end - data_start}, the data section holds {file_size - data_start} bytes); "
                          f"safetensors requires the last tensor to end the file")
    return Header(label, {t.name: t for t in tensors}, metadata, data_start, file_size)


def read_header_fd(fd: int, label: str) -> Header:
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
    label = os.fspath(path)
    fd = open_read(path)
    try:
        return read_header_fd(fd, label)
    finally:
        os.close(fd)
