"""Read a ``torch.distributed.checkpoint`` (DCP) directory into a manifest, executing no pickle.

A DCP directory (torch 2.x ``FileSystemWriter``, default ``TORCH_SAVE`` serialization) holds
``.metadata`` -- a pickle of ``Metadata(state_dict_metadata, planner_data, storage_data, ...)``
-- and ``__R_N.distcp`` files. Each tensor chunk is one item of a ``.distcp`` file at
``[offset, offset + length)``: a complete ``torch.save`` archive (a zip with ``data.pkl`` and the
storage bytes in ``data/<key>``, stored uncompressed). ``read_dcp`` resolves every chunk's
payload once, so the manifest addresses it with ``source.byte_range`` + ``source.stored_shape``
(design §3) and ``convert`` moves it with ranged reads.

Security: both pickles are read with restricted unpicklers. ``.metadata`` may only name DCP's
metadata classes and the planner records Megatron stores in it (``all_local_plans``: ``SavePlan``,
``WriteItem``, ``TensorWriteData``, ``WriteItemType`` taken by value), all mapped onto plain
stand-ins defined here (no torch class is built), torch
dtypes by name, ``torch.Size``, the layout helper and a few harmless builtins. ``data.pkl`` may
only name the tensor-rebuild functions and storage classes, whose calls are recorded, not run.
Anything else is refused with ``FormatError``; so is every malformed file. ``torch`` is never
imported by this module and ``torch.load`` is never called.

No MPI.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, replace
from math import prod
from pathlib import Path
from typing import Any

from .box import Box, is_row_major, row_major_strides
from .dtypes import DTYPES, DType
from .errors import FormatError
from .files import read_bounded
from .limits import INT64_MAX
from .manifest import ArraySpec, Chunk, Manifest, Source

__all__ = ["MAX_METADATA_BYTES", "read_dcp"]

METADATA_FILE = ".metadata"
#: refuse to unpickle a ``.metadata`` bigger than this
MAX_METADATA_BYTES = 1 << 30
#: refuse a ``data.pkl`` bigger than this (a tensor's is ~150 bytes)
MAX_DATA_PKL_BYTES = 1 << 20
#: no single read of a torch.save archive's structure may exceed this (central directory etc.)
MAX_ZIP_READ = 16 << 20


# ------------------------------------------------------------------ stand-ins for DCP's classes


class _Plain:
    """A record built by NEWOBJ + BUILD(dict): attributes only, no behaviour."""

    def __reduce__(self) -> Any:  # never pickled back
        raise TypeError("stand-in objects are not picklable")


class _Metadata(_Plain):
    state_dict_metadata: Any = None
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: Any = None


class _TensorStorageMetadata(_Plain):
    properties: Any = None
    size: Any = None
    chunks: Any = None


class _BytesStorageMetadata(_Plain):
    pass


class _ChunkStorageMetadata(_Plain):
    offsets: Any = None
    sizes: Any = None


class _TensorProperties(_Plain):
    dtype: Any = None
    layout: Any = None
    requires_grad: Any = False
    memory_format: Any = None
    pin_memory: Any = False

    def __setstate__(self, state: Any) -> None:
        # torch pickles TensorProperties as a 5-tuple (dtype, layout, requires_grad,
        # memory-format encoding, pin_memory); older versions as a plain __dict__
        if isinstance(state, tuple) and len(state) == 5:
            self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state
        elif isinstance(state, dict):
            for k, v in state.items():
                if isinstance(k, str):
                    object.__setattr__(self, k, v)
        else:
            raise TypeError(f"unexpected TensorProperties state {type(state).__name__}")


class _MetadataIndex(_Plain):
    fqn: Any = None
    offset: Any = None
    index: Any = None


class _StorageInfo(_Plain):
    relative_path: Any = None
    offset: Any = None
    length: Any = None
    transform_descriptors: Any = None


class _StorageMeta(_Plain):
    checkpoint_id: Any = None
    save_id: Any = None
    load_id: Any = None
    modules: Any = None


class _StoragePrefix(_Plain):
    prefix: Any = None


# Megatron's torch_dist writer attaches every rank's SavePlan to Metadata (``all_local_plans``);
# they are read as plain records and ignored


class _SavePlan(_Plain):
    items: Any = None
    storage_data: Any = None
    planner_data: Any = None
    usable: Any = True


class _WriteItem(_Plain):
    index: Any = None
    type: Any = None
    bytes_io_data: Any = None
    tensor_data: Any = None


class _TensorWriteData(_Plain):
    chunk: Any = None
    properties: Any = None
    size: Any = None


class _BytesIOWriteData(_Plain):
    nbytes: Any = None


@dataclass(frozen=True, slots=True)
class _WriteItemType:
    value: int


def _write_item_type(value: Any) -> _WriteItemType:
    # the enum pickles as a call of its class with the member's value: take the value, run nothing
    if type(value) is not int:
        raise TypeError("WriteItemType value must be an integer")
    return _WriteItemType(value)


@dataclass(frozen=True, slots=True)
class _TorchDType:
    name: str


@dataclass(frozen=True, slots=True)
class _Layout:
    name: str


def _torch_size(seq: Any = ()) -> tuple[int, ...]:
    t = tuple(seq)
    for x in t:
        if type(x) is not int:
            raise TypeError(f"torch.Size entries must be integers, got {type(x).__name__}")
    return t


def _get_layout(name: Any) -> _Layout:
    if not isinstance(name, str):
        raise TypeError("layout name must be a string")
    return _Layout(name.removeprefix("torch."))


def _mem_format_encoding(v: Any) -> int:
    if type(v) is not int:
        raise TypeError("memory format encoding must be an integer")
    return v


def _path_as_str(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise TypeError("path parts must be strings")
    return "/".join(parts)


#: every torch dtype name a TensorProperties may carry; only those in DTYPES can be imported
_TORCH_DTYPE_NAMES = frozenset(DTYPES) | {
    "complex32", "complex64", "complex128", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "qint8", "quint8", "qint32", "quint4x2", "quint2x4", "bits1x8", "bits2x4",
    "bits4x2", "bits8", "bits16", "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7", "half", "float", "double", "long", "int",
    "short", "cfloat", "cdouble", "chalf",
}
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed._shard.checkpoint.metadata")
_FS_MODULES = ("torch.distributed.checkpoint.filesystem", "torch.distributed._shard.checkpoint.filesystem")

_META_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch", "Size"): _torch_size,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("torch", "strided"): _Layout("strided"),
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("pathlib", "PosixPath"): _path_as_str,
    ("pathlib", "PurePosixPath"): _path_as_str,
    ("pathlib", "WindowsPath"): _path_as_str,
    ("pathlib", "PureWindowsPath"): _path_as_str,
}
for _mod in _DCP_MODULES:
    _META_ALLOWED.update({
        (_mod, "Metadata"): _Metadata,
        (_mod, "TensorStorageMetadata"): _TensorStorageMetadata,
        (_mod, "BytesStorageMetadata"): _BytesStorageMetadata,
        (_mod, "ChunkStorageMetadata"): _ChunkStorageMetadata,
        (_mod, "TensorProperties"): _TensorProperties,
        (_mod, "MetadataIndex"): _MetadataIndex,
        (_mod, "StorageMeta"): _StorageMeta,
        (_mod, "_MEM_FORMAT_ENCODING"): _mem_format_encoding,
    })
_META_ALLOWED.update({
    ("torch.distributed.checkpoint.planner", "SavePlan"): _SavePlan,
    ("torch.distributed.checkpoint.planner", "WriteItem"): _WriteItem,
    ("torch.distributed.checkpoint.planner", "WriteItemType"): _write_item_type,
    ("torch.distributed.checkpoint.planner", "TensorWriteData"): _TensorWriteData,
    ("torch.distributed.checkpoint.planner", "BytesIOWriteData"): _BytesIOWriteData,
})
for _mod in _FS_MODULES:
    _META_ALLOWED.update({(_mod, "_StorageInfo"): _StorageInfo, (_mod, "_StoragePrefix"): _StoragePrefix})
for _n in _TORCH_DTYPE_NAMES:
    _META_ALLOWED[("torch", _n)] = _TorchDType(_n)
_TORCH_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "long": "int64", "int": "int32",
                  "short": "int16", "cfloat": "complex64", "cdouble": "complex128", "chalf": "complex32"}


class _Refused(Exception):
    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.module, self.name = module, name


def _fresh(obj: Any) -> Any:
    """Value stand-ins are handed out as copies: a pickle may BUILD onto what it is given, and
    must not be able to change the allow-list's own objects for later loads."""
    return replace(obj) if isinstance(obj, (_TorchDType, _Layout, _StorageType)) else obj


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        obj = _META_ALLOWED.get((module, name))
        if obj is None:
            raise _Refused(module, name)
        return _fresh(obj)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not allowed in DCP metadata")


# ------------------------------------------------------------------ data.pkl (torch.save) stand-ins

#: legacy typed storage classes torch.save names, and their element types
_LEGACY_STORAGES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "LongStorage": "int64",
    "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "BFloat16Storage": "bfloat16", "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64", "QInt8Storage": "qint8", "QInt32Storage": "qint32",
    "QUInt8Storage": "quint8", "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
}


@dataclass(frozen=True, slots=True)
class _StorageType:
    dtype: str | None  # None: UntypedStorage (numel counts bytes)


@dataclass(frozen=True, slots=True)
class _StorageRef:
    dtype: str | None
    key: str
    numel: int


@dataclass(frozen=True, slots=True)
class _TensorRef:
    storage: _StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str | None


def _int_tuple(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, tuple) or not all(type(x) is int for x in v):
        raise TypeError(f"{what} must be a tuple of integers")
    return v


def _rebuild_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                backward_hooks: Any = None, metadata: Any = None) -> _TensorRef:
    return _tensor_ref(storage, storage_offset, size, stride, backward_hooks, None)


def _rebuild_v3(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                backward_hooks: Any, dtype: Any, metadata: Any = None) -> _TensorRef:
    if not isinstance(dtype, _TorchDType):
        raise TypeError("_rebuild_tensor_v3 dtype must be a torch dtype")
    return _tensor_ref(storage, storage_offset, size, stride, backward_hooks, dtype.name)


def _tensor_ref(storage: Any, storage_offset: Any, size: Any, stride: Any, hooks: Any,
                dtype: str | None) -> _TensorRef:
    if not isinstance(storage, _StorageRef):
        raise TypeError("tensor storage must be a persistent storage reference")
    if type(storage_offset) is not int:
        raise TypeError("storage_offset must be an integer")
    if hooks:
        raise TypeError("tensor has backward hooks")
    return _TensorRef(storage, storage_offset, _int_tuple(size, "size"), _int_tuple(stride, "stride"),
                      dtype if dtype is not None else storage.dtype)


def _rebuild_parameter(data: Any, requires_grad: Any = False, backward_hooks: Any = None) -> Any:
    if not isinstance(data, _TensorRef):
        raise TypeError("parameter data must be a tensor")
    return data


_PKL_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): OrderedDict,
    ("torch.storage", "UntypedStorage"): _StorageType(None),
    ("torch", "UntypedStorage"): _StorageType(None),
}
_PKL_ALLOWED.update({("torch", k): _StorageType(v) for k, v in _LEGACY_STORAGES.items()})
_PKL_ALLOWED.update({("torch", n): _TorchDType(n) for n in _TORCH_DTYPE_NAMES})


class _DataPklUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        obj = _PKL_ALLOWED.get((module, name))
        if obj is None:
            raise _Refused(module, name)
        return _fresh(obj)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r:.80}")
        _, st, key, location, numel = pid
        if not isinstance(st, _StorageType):
            raise pickle.UnpicklingError("persistent id does not name a storage class")
        if not isinstance(key, str) or not isinstance(location, str) or type(numel) is not int or numel < 0:
            raise pickle.UnpicklingError(f"malformed storage reference {pid!r:.80}")
        return _StorageRef(st.dtype, key, numel)


# ------------------------------------------------------------------ opcode pre-scan


def _opcode_table() -> tuple[tuple[int | None, ...], dict[int, str]]:
    """Per opcode byte: the argument's size (>= 0), -1/-2 for one/two newline-terminated lines,
    -11/-14/-18 for a 1/4/8-byte little-endian length prefix, None for unknown opcodes."""
    import pickletools

    kinds: list[int | None] = [None] * 256
    names: dict[int, str] = {}
    prefixed = {pickletools.TAKEN_FROM_ARGUMENT1: -11, pickletools.TAKEN_FROM_ARGUMENT4: -14,
                pickletools.TAKEN_FROM_ARGUMENT4U: -14, pickletools.TAKEN_FROM_ARGUMENT8U: -18}
    for op in pickletools.opcodes:
        c = ord(op.code)
        names[c] = op.name
        a = op.arg
        if a is None:
            kinds[c] = 0
        elif op.name in ("GLOBAL", "INST"):
            kinds[c] = -2
        elif a.n >= 0:
            kinds[c] = a.n
        elif a.n == pickletools.UP_TO_NEWLINE:
            kinds[c] = -1
        else:
            kinds[c] = prefixed[a.n]
    return tuple(kinds), names


_OP_KINDS, _OP_NAMES = _opcode_table()
#: opcodes neither DCP pickle needs: extension registry, out-of-band buffers, INST/OBJ instantiation
_OP_REFUSED = frozenset(ord(c) for c in "\x82\x83\x84\x97\x98io")
_OP_PUT, _OP_BINPUT, _OP_LONG_BINPUT, _OP_MEMOIZE = ord("p"), ord("q"), ord("r"), 0x94
_OP_PERSID, _OP_BINPERSID, _OP_STOP = ord("P"), ord("Q"), ord(".")


class _ScanError(ValueError):
    """The pickle is malformed (truncated, unknown opcode)."""


class _ScanRefused(_ScanError):
    """The pickle is well formed but does something DCP's writers never do."""


def _scan_pickle(data: bytes, *, allow_persistent: bool) -> None:
    """Walk the opcodes of ``data`` without building anything; raise _ScanError for unknown or
    refused opcodes, arguments past the end, and memo indices an honest pickler never writes
    (the C unpickler sizes its memo table by the largest index: 5 bytes could claim 64 GiB)."""
    kinds, refused = _OP_KINDS, _OP_REFUSED
    fb = int.from_bytes
    n = len(data)
    i = 0
    puts = 0
    while i < n:
        op = data[i]
        k = kinds[op]
        i += 1
        if k == 0:
            if op == _OP_MEMOIZE:
                puts += 1
            elif op == _OP_STOP:
                return
            elif op in refused or (op == _OP_BINPERSID and not allow_persistent):
                raise _ScanRefused(f"opcode {_OP_NAMES[op]} is not allowed")
            continue
        if k is None:
            raise _ScanError(f"unknown opcode 0x{op:02x} at byte {i - 1}")
        if k > 0:
            if i + k > n:
                raise _ScanError(f"{_OP_NAMES[op]} argument at byte {i} runs past the end")
            if op == _OP_BINPUT or op == _OP_LONG_BINPUT:
                if fb(data[i:i + k], "little") > puts:
                    raise _ScanRefused(f"{_OP_NAMES[op]} at byte {i - 1} stores memo index "
                                     f"{fb(data[i:i + k], 'little')} after {puts} entries")
                puts += 1
            elif op in refused:
                raise _ScanRefused(f"opcode {_OP_NAMES[op]} is not allowed")
            i += k
            continue
        if k == -11:
            if i >= n:
                raise _ScanError("pickle data was truncated")
            i += 1 + data[i]
        elif k == -14:
            i += 4 + fb(data[i:i + 4], "little")
        elif k == -18:
            i += 8 + fb(data[i:i + 8], "little")
        else:
            if op in refused or (op == _OP_PERSID and not allow_persistent):
                raise _ScanRefused(f"opcode {_OP_NAMES[op]} is not allowed")
            start = i
            for _ in range(-k):
                j = data.find(b"\n", i)
                if j < 0:
                    raise _ScanError(f"{_OP_NAMES[op]} argument at byte {i} has no end of line")
                i = j + 1
            if op == _OP_PUT:
                try:
                    idx = int(data[start:i - 1])
                except ValueError:
                    raise _ScanError(f"PUT at byte {start - 1} has a malformed index") from None
                if idx < 0 or idx > puts:
                    raise _ScanRefused(f"PUT at byte {start - 1} stores memo index {idx} after {puts} entries")
                puts += 1
        if i > n:
            raise _ScanError(f"{_OP_NAMES[op]} argument runs past the end of the pickle")
    raise _ScanError("pickle data was truncated (no STOP opcode)")


def _restricted_load(unpickler: type[pickle.Unpickler], data: bytes, *, allow_persistent: bool) -> Any:
    import gc

    _scan_pickle(data, allow_persistent=allow_persistent)
    was = gc.isenabled()
    gc.disable()  # millions of small objects: the collector would otherwise run thousands of times
    try:
        return unpickler(io.BytesIO(data)).load()
    finally:
        if was:
            gc.enable()


# ------------------------------------------------------------------ bounded file window


class _Window(io.RawIOBase):
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


# ------------------------------------------------------------------ reading


@dataclass(frozen=True, slots=True)
class _Item:
    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...]


def _load_metadata(path: Path) -> _Metadata:
    where = str(path)
    data = read_bounded(path, MAX_METADATA_BYTES, ".metadata")
    try:
        obj = _restricted_load(_MetadataUnpickler, data, allow_persistent=False)
    except _Refused as e:
        raise FormatError(f"{where}: .metadata pickle refers to {e.module}.{e.name}, which is not a DCP metadata "
                          "class; refusing to load it") from None
    except _ScanRefused as e:
        raise FormatError(f"{where}: .metadata pickle is not one DCP writes ({e}); refusing to load it") from None
    except MemoryError:
        raise FormatError(f"{where}: .metadata pickle is too large to load") from None
    except Exception as e:  # noqa: BLE001 - every unpickling failure is a bad file
        raise FormatError(f"{where}: .metadata is not a valid DCP metadata pickle ({type(e).__name__}: "
                          f"{_clip(str(e))})") from None
    if not isinstance(obj, _Metadata):
        raise FormatError(f"{where}: .metadata does not hold a DCP Metadata object (got {_kind(obj)})")
    return obj


def _clip(s: str, n: int = 200) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def _kind(v: Any) -> str:
    return type(v).__name__.lstrip("_")


def _safe_rel(rel: Any) -> str | None:
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        return None
    if os.path.isabs(rel) or rel.startswith(("\\", "/")) or any(p in ("..", "") for p in rel.split("/")):
        return None
    if "{" in rel or "}" in rel:  # would read as a {rank} pattern in a manifest
        return None
    return rel


def _nonneg_int(v: Any) -> bool:
    return type(v) is int and 0 <= v <= INT64_MAX


def _storage_index(md: _Metadata, where: str) -> dict[tuple[str, tuple[int, ...] | None], _Item | str]:
    """(fqn, chunk offsets) -> item, or a problem text for a malformed entry."""
    sd = md.storage_data
    if not isinstance(sd, dict):
        raise FormatError(f"{where}: storage_data must be a dict of MetadataIndex -> _StorageInfo (got {_kind(sd)}); "
                          "only FileSystemWriter checkpoints are supported")
    out: dict[tuple[str, tuple[int, ...] | None], _Item | str] = {}
    for k, v in sd.items():
        if not isinstance(k, _MetadataIndex) or not isinstance(k.fqn, str):
            raise FormatError(f"{where}: storage_data key is {_kind(k)}, expected MetadataIndex")
        off = k.offset
        if off is not None and not (isinstance(off, tuple) and all(_nonneg_int(x) for x in off)):
            raise FormatError(f"{where}: {k.fqn}: storage_data offset {off!r:.80} is not a list of integers")
        key = (k.fqn, off)
        if not isinstance(v, _StorageInfo):
            out[key] = f"storage_data entry is {_kind(v)}, expected _StorageInfo"
            continue
        rel = _safe_rel(v.relative_path)
        if rel is None:
            out[key] = (f"relative_path {v.relative_path!r:.80} is not a plain relative path inside the "
                        "checkpoint directory")
            continue
        if not _nonneg_int(v.offset) or not _nonneg_int(v.length) or v.offset + v.length > INT64_MAX:
            out[key] = f"offset {v.offset!r:.40} / length {v.length!r:.40} are not non-negative integers"
            continue
        td = v.transform_descriptors
        if td is None:
            tds: tuple[str, ...] = ()
        elif isinstance(td, (list, tuple)) and all(isinstance(x, str) for x in td):
            tds = tuple(td)
        else:
            out[key] = f"transform_descriptors {td!r:.80} are not a list of strings"
            continue
        out[key] = _Item(rel, v.offset, v.length, tds)
    return out


def _dtype_of(props: Any) -> str | None:
    if not isinstance(props, _TensorProperties) or not isinstance(props.dtype, _TorchDType):
        return None
    n = props.dtype.name
    return _TORCH_ALIASES.get(n, n)


class _Files:
    """Open .distcp files (checked to stay inside the checkpoint directory), by relative path.

    At most ``MAX_OPEN`` stay open (least recently used closed first): a 1024-rank checkpoint
    has 1024 files and its items interleave them.
    """

    MAX_OPEN = 64

    def __init__(self, root: Path) -> None:
        self.root = root
        self.real_root = os.path.realpath(root)
        self.fds: OrderedDict[str, tuple[int, int] | str] = OrderedDict()

    def get(self, rel: str) -> tuple[int, int]:
        """(fd, size), or raise FormatError with the reason."""
        v = self.fds.get(rel)
        if v is None:
            v = self._open(rel)
            self.fds[rel] = v
            if len(self.fds) > self.MAX_OPEN:
                _, old = self.fds.popitem(last=False)
                if isinstance(old, tuple):
                    os.close(old[0])
        else:
            self.fds.move_to_end(rel)
        if isinstance(v, str):
            raise FormatError(v)
        return v

    def _open(self, rel: str) -> tuple[int, int] | str:
        p = self.root / rel
        real = os.path.realpath(p)
        if not real.startswith(self.real_root + os.sep):
            return f"{p}: resolves to {real}, outside the checkpoint directory {self.real_root}"
        try:
            st = os.stat(real)
        except FileNotFoundError:
            return f"{p}: no such file (named by .metadata)"
        except OSError as e:
            return f"{p}: cannot stat ({e.strerror})"
        if not stat.S_ISREG(st.st_mode):
            return f"{p}: not a regular file"
        try:
            fd = os.open(real, os.O_RDONLY)
        except OSError as e:
            return f"{p}: cannot open ({e.strerror})"
        return fd, st.st_size

    def close(self) -> None:
        for v in self.fds.values():
            if isinstance(v, tuple):
                try:
                    os.close(v[0])
                except OSError:
                    pass
        self.fds.clear()


_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")


def _locate_payload(fd: int, item: _Item, sizes: tuple[int, ...], dt: DType) -> tuple[int, int]:
    """Absolute [start, stop) of the tensor bytes of one torch.save item; raises ValueError."""
    win = _Window(fd, item.offset, item.length)
    zf = _open_archive(win)
    infos = {i.filename: i for i in zf.infolist()}
    prefix, pkl = _read_data_pkl(zf, infos)
    t = _load_tensor_ref(pkl)
    need, st_bytes = _check_tensor_ref(t, sizes, dt)
    dinfo = _storage_entry(infos, prefix, t, st_bytes)
    start = item.offset + _payload_offset(win, dinfo, item.length)
    return start, start + need


def _open_archive(win: _Window) -> zipfile.ZipFile:
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
        raise ValueError(f"item is not a readable zip archive ({type(e).__name__}: {_clip(str(e))})") from None


def _read_data_pkl(zf: zipfile.ZipFile, infos: dict[str, zipfile.ZipInfo],
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
        raise ValueError(f"cannot read {pinfo.filename} ({type(e).__name__}: {_clip(str(e))})") from None


def _load_tensor_ref(pkl: bytes) -> _TensorRef:
    """The tensor ``data.pkl`` describes, unpickled by the restricted unpickler."""
    try:
        t = _restricted_load(_DataPklUnpickler, pkl, allow_persistent=True)
    except _Refused as e:
        raise ValueError(f"data.pkl refers to {e.module}.{e.name}, which is not a tensor rebuild function or "
                         "storage class; refusing to load it") from None
    except _ScanRefused as e:
        raise ValueError(f"data.pkl is not one torch.save writes ({e}); refusing to load it") from None
    except Exception as e:  # noqa: BLE001 - every unpickling failure is a bad item
        raise ValueError(f"data.pkl is not a valid torch.save tensor pickle ({type(e).__name__}: "
                         f"{_clip(str(e))})") from None
    if not isinstance(t, _TensorRef):
        raise ValueError(f"data.pkl holds {_kind(t)}, not a tensor")  # noqa: TRY004 - reported as a bad item
    return t


def _check_tensor_ref(t: _TensorRef, sizes: tuple[int, ...], dt: DType) -> tuple[int, int]:
    """The tensor agrees with ``.metadata`` (dtype, shape) and is contiguous row-major from offset
    0: ``(bytes it needs, bytes its storage holds)``."""
    if t.dtype is not None and _TORCH_ALIASES.get(t.dtype, t.dtype) != dt.name:
        raise ValueError(f"stored tensor is {t.dtype}, .metadata says {dt.name}")
    if t.size != sizes:
        raise ValueError(f"stored tensor has shape {list(t.size)}, .metadata says the chunk is {list(sizes)}")
    if t.storage_offset != 0:
        raise ValueError(f"stored tensor starts at storage offset {t.storage_offset} (expected 0)")
    if len(t.stride) != len(sizes):
        raise ValueError(f"stored tensor has {len(t.stride)} strides for {len(sizes)} dims")
    need = prod(sizes) * dt.itemsize
    if need:
        if not is_row_major(sizes, t.stride):
            raise ValueError(f"stored tensor is not contiguous row-major (strides {list(t.stride)}, expected "
                             f"{list(row_major_strides(sizes))}); save it with .contiguous()")
    st_bytes = t.storage.numel if t.storage.dtype is None else t.storage.numel * _itemsize(t.storage.dtype)
    if st_bytes < need:
        raise ValueError(f"storage holds {st_bytes} bytes, the tensor needs {need}")
    return need, st_bytes


def _storage_entry(infos: dict[str, zipfile.ZipInfo], prefix: str, t: _TensorRef, st_bytes: int) -> zipfile.ZipInfo:
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


def _payload_offset(win: _Window, dinfo: zipfile.ZipInfo, length: int) -> int:
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


def _itemsize(name: str) -> int:
    d = DTYPES.get(_TORCH_ALIASES.get(name, name))
    if d is not None:
        return d.itemsize
    return {"complex64": 8, "complex128": 16, "complex32": 4, "qint8": 1, "quint8": 1, "qint32": 4,
            "quint4x2": 1, "quint2x4": 1}.get(name, 1)


def read_dcp(path: str | os.PathLike[str]) -> tuple[Manifest, list[str]]:
    """Describe the DCP checkpoint directory ``path``.

    Returns the manifest (``world_size`` 1: one logical reader holds every chunk; one manifest
    chunk per DCP chunk, addressed by byte range; ``base_dir`` = ``path`` resolved) and the fqns
    of the non-tensor entries (``BytesStorageMetadata``), which are not described. Raises
    ``FormatError`` listing every problem found.
    """
    root = Path(path).resolve()
    meta_path = root / METADATA_FILE
    md = _load_metadata(meta_path)
    where = str(meta_path)
    sdm = md.state_dict_metadata
    if not isinstance(sdm, dict):
        raise FormatError(f"{where}: state_dict_metadata must be a dict (got {_kind(sdm)})")
    index = _storage_index(md, where)
    files = _Files(root)
    problems: list[str] = []
    arrays: dict[str, ArraySpec] = {}
    skipped: list[str] = []
    try:
        for fqn, tm in sdm.items():
            if not isinstance(fqn, str):
                problems.append(f"{where}: state_dict_metadata key {fqn!r:.60} is not a string")
                continue
            if isinstance(tm, _BytesStorageMetadata):
                skipped.append(fqn)
                continue
            if not isinstance(tm, _TensorStorageMetadata):
                problems.append(f"{where}: {fqn}: entry is {_kind(tm)}, expected TensorStorageMetadata or "
                                "BytesStorageMetadata")
                continue
            spec = _array(fqn, tm, index, files, where, problems)
            if spec is not None:
                arrays[fqn] = spec
    finally:
        files.close()
    m = Manifest(world_size=1, arrays=arrays, name=root.name, base_dir=root)
    if not problems:
        from .validate import validate_manifest

        problems.extend(validate_manifest(m, where=where, check_paths=True))
    if problems:
        raise FormatError(problems=problems)
    return m, skipped


def _array(fqn: str, tm: _TensorStorageMetadata, index: dict[Any, _Item | str], files: _Files, where: str,
           problems: list[str]) -> ArraySpec | None:
    size = tm.size
    if not isinstance(size, tuple) or not all(_nonneg_int(x) for x in size):
        problems.append(f"{where}: {fqn}: size {size!r:.80} is not a list of non-negative integers")
        return None
    dname = _dtype_of(tm.properties)
    if dname is None:
        problems.append(f"{where}: {fqn}: properties carry no torch dtype")
        return None
    dt = DTYPES.get(dname)
    if dt is None:
        problems.append(f"{where}: {fqn}: dtype {dname} has no shardstream data_type (supported: "
                        f"{', '.join(DTYPES)})")
        return None
    lay = getattr(tm.properties, "layout", None)
    if lay is not None and lay != _Layout("strided"):
        problems.append(f"{where}: {fqn}: layout {getattr(lay, 'name', lay)!r} is not supported (only strided)")
        return None
    if not isinstance(tm.chunks, list):
        problems.append(f"{where}: {fqn}: chunks must be a list (got {_kind(tm.chunks)})")
        return None
    nd = len(size)
    chunks: list[Chunk] = []
    for i, cm in enumerate(tm.chunks):
        if not isinstance(cm, _ChunkStorageMetadata):
            problems.append(f"{where}: {fqn}: chunk {i} is {_kind(cm)}, expected ChunkStorageMetadata")
            continue
        off, sz = cm.offsets, cm.sizes
        if not (isinstance(off, tuple) and isinstance(sz, tuple) and len(off) == nd and len(sz) == nd
                and all(_nonneg_int(x) for x in off) and all(_nonneg_int(x) for x in sz)):
            problems.append(f"{where}: {fqn}: chunk {i} offsets {off!r:.60} / sizes {sz!r:.60} are not {nd} "
                            "non-negative integers each")
            continue
        if any(s == 0 for s in sz):
            continue  # empty regions are not listed (an uneven torch.chunk shard may be empty)
        ctx = f"{fqn}: chunk {i} (offsets {list(off)}, sizes {list(sz)})"
        item = index.get((fqn, off))
        if item is None:
            problems.append(f"{where}: {ctx}: no storage_data entry for this chunk")
            continue
        if isinstance(item, str):
            problems.append(f"{where}: {ctx}: {item}")
            continue
        fpath = files.root / item.relative_path
        if item.transforms:
            problems.append(f"{fpath}: {ctx}: item uses stream transforms {list(item.transforms)} (e.g. "
                            "compression); only untransformed items can be read by byte range")
            continue
        try:
            fd, fsize = files.get(item.relative_path)
        except FormatError as e:
            problems.append(f"{e} [{ctx}]")
            continue
        if item.offset + item.length > fsize:
            problems.append(f"{fpath}: {ctx}: item byte range [{item.offset}, {item.offset + item.length}) is "
                            f"past the end of the file ({fsize} bytes)")
            continue
        try:
            a, b = _locate_payload(fd, item, sz, dt)
        except ValueError as e:
            problems.append(f"{fpath}: {ctx}: {e}")
            continue
        except Exception as e:  # noqa: BLE001 - a hostile archive must never escape as a traceback
            problems.append(f"{fpath}: {ctx}: unreadable item ({type(e).__name__}: {_clip(str(e))})")
            continue
        chunks.append(Chunk(Box(off, sz), (0,), Source(tensor=fqn, offsets=(0,) * nd, file=item.relative_path,
                                                      byte_range=(a, b), stored_shape=sz)))
    return ArraySpec(size, dt.name, tuple(chunks))

