"""Restricted unpicklers for the pickles inside torch checkpoints: nothing is executed.

Three allow-lists, each a map from a pickled global ``(module, name)`` to a stand-in defined
here; any other global is refused by name (:class:`Refused`), before anything is built:

- ``MetadataUnpickler``: DCP's ``.metadata`` (its metadata classes, Megatron's save plans, torch
  dtypes by name, ``torch.Size``, the layout helper, a few harmless builtins);
- ``DataPklUnpickler``: one tensor's ``data.pkl`` inside a ``torch.save`` archive (the tensor
  rebuild functions and storage classes, whose calls are recorded as :class:`TensorRef`, not run);
- ``LegacyUnpickler``: the whole ``data.pkl`` of a Megatron-LM legacy ``model_optim_rng.pt``
  (see :data:`LEGACY_GLOBALS`): also ``argparse.Namespace`` (a :class:`Record`), NumPy's array
  and dtype reconstruction (NumPy's RNG state: :class:`NumpyArray`, never a real array), the
  ``bytes`` of pickle protocol 2 (``_codecs.encode(text, "latin1")``, rebuilt by
  ``str.encode``; any other encoding is refused), and ``megatron.*`` enums as inert records.

Every pickle is first walked opcode by opcode (:func:`scan_pickle`): unknown opcodes, the
extension registry, out-of-band buffers, INST/OBJ and memo indices an honest pickler never writes
are refused before the C unpickler sees them. No torch, no numpy, no MPI.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from ..manifest.dtypes import DTYPES

__all__ = [
    "LEGACY_GLOBALS", "TORCH_ALIASES", "TORCH_DTYPE_NAMES", "BytesStorageMetadata", "ChunkStorageMetadata",
    "DataPklUnpickler", "DcpMetadata", "Layout", "LegacyUnpickler", "MetadataIndex", "MetadataUnpickler",
    "NumpyArray", "NumpyDType", "NumpyScalar", "Placeholder", "Record", "Refused", "ScanError", "ScanRefused",
    "StorageInfo", "StorageRef", "StorageType", "TensorProperties", "TensorRef", "TensorStorageMetadata",
    "TorchDType", "WriteItemType", "py3_name", "restricted_load", "scan_pickle", "write_item_type",
]


# ------------------------------------------------------------------ stand-ins for DCP's classes


class _Plain:
    """A record built by NEWOBJ + BUILD(dict): attributes only, no behaviour."""

    def __reduce__(self) -> Any:  # never pickled back
        raise TypeError("stand-in objects are not picklable")


class DcpMetadata(_Plain):
    state_dict_metadata: Any = None
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: Any = None


class TensorStorageMetadata(_Plain):
    properties: Any = None
    size: Any = None
    chunks: Any = None


class BytesStorageMetadata(_Plain):
    pass


class ChunkStorageMetadata(_Plain):
    offsets: Any = None
    sizes: Any = None


class TensorProperties(_Plain):
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


class MetadataIndex(_Plain):
    fqn: Any = None
    offset: Any = None
    index: Any = None


class StorageInfo(_Plain):
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
class WriteItemType:
    value: int


def write_item_type(value: Any) -> WriteItemType:
    # the enum pickles as a call of its class with the member's value: take the value, run nothing
    if type(value) is not int:
        raise TypeError("WriteItemType value must be an integer")
    return WriteItemType(value)


@dataclass(frozen=True, slots=True)
class TorchDType:
    name: str


@dataclass(frozen=True, slots=True)
class Layout:
    name: str


def _torch_size(seq: Any = ()) -> tuple[int, ...]:
    t = tuple(seq)
    for x in t:
        if type(x) is not int:
            raise TypeError(f"torch.Size entries must be integers, got {type(x).__name__}")
    return t


def _get_layout(name: Any) -> Layout:
    if not isinstance(name, str):
        raise TypeError("layout name must be a string")
    return Layout(name.removeprefix("torch."))


def _mem_format_encoding(v: Any) -> int:
    if type(v) is not int:
        raise TypeError("memory format encoding must be an integer")
    return v


def _path_as_str(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise TypeError("path parts must be strings")
    return "/".join(parts)


#: every torch dtype name a TensorProperties may carry; only those in DTYPES can be imported
TORCH_DTYPE_NAMES = frozenset(DTYPES) | {
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
    ("torch", "strided"): Layout("strided"),
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
        (_mod, "Metadata"): DcpMetadata,
        (_mod, "TensorStorageMetadata"): TensorStorageMetadata,
        (_mod, "BytesStorageMetadata"): BytesStorageMetadata,
        (_mod, "ChunkStorageMetadata"): ChunkStorageMetadata,
        (_mod, "TensorProperties"): TensorProperties,
        (_mod, "MetadataIndex"): MetadataIndex,
        (_mod, "StorageMeta"): _StorageMeta,
        (_mod, "_MEM_FORMAT_ENCODING"): _mem_format_encoding,
    })
_META_ALLOWED.update({
    ("torch.distributed.checkpoint.planner", "SavePlan"): _SavePlan,
    ("torch.distributed.checkpoint.planner", "WriteItem"): _WriteItem,
    ("torch.distributed.checkpoint.planner", "WriteItemType"): write_item_type,
    ("torch.distributed.checkpoint.planner", "TensorWriteData"): _TensorWriteData,
    ("torch.distributed.checkpoint.planner", "BytesIOWriteData"): _BytesIOWriteData,
})
for _mod in _FS_MODULES:
    _META_ALLOWED.update({(_mod, "_StorageInfo"): StorageInfo, (_mod, "_StoragePrefix"): _StoragePrefix})
for _n in TORCH_DTYPE_NAMES:
    _META_ALLOWED[("torch", _n)] = TorchDType(_n)
TORCH_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "long": "int64", "int": "int32",
                  "short": "int16", "cfloat": "complex64", "cdouble": "complex128", "chalf": "complex32"}


class Refused(Exception):
    """The pickle names a global outside the allow-list (``detail``: why an allowed one was refused)."""

    def __init__(self, module: str, name: str, detail: str = "") -> None:
        super().__init__(f"{module}.{name}{detail}")
        self.module, self.name, self.detail = module, name, detail


def py3_name(module: str, name: str) -> tuple[str, str]:
    """The Python 3 name of a pickled global: protocols 0-2 write Python 2's (``__builtin__.bytes``),
    which ``pickle.Unpickler.find_class`` maps with ``_compat_pickle``; an overriding ``find_class``
    must do the same, so that one allow-list entry covers both spellings."""
    import _compat_pickle

    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def _fresh(obj: Any) -> Any:
    """Value stand-ins are handed out as copies: a pickle may BUILD onto what it is given, and
    must not be able to change the allow-list's own objects for later loads."""
    return replace(obj) if isinstance(obj, (TorchDType, Layout, StorageType)) else obj


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        module, name = py3_name(module, name)
        obj = _META_ALLOWED.get((module, name))
        if obj is None:
            raise Refused(module, name)
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
class StorageType:
    dtype: str | None  # None: UntypedStorage (numel counts bytes)


@dataclass(frozen=True, slots=True)
class StorageRef:
    dtype: str | None
    key: str
    numel: int


@dataclass(frozen=True, slots=True)
class TensorRef:
    storage: StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str | None


def _int_tuple(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, tuple) or not all(type(x) is int for x in v):
        raise TypeError(f"{what} must be a tuple of integers")
    return v


def _rebuild_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                backward_hooks: Any = None, metadata: Any = None) -> TensorRef:
    return _tensor_ref(storage, storage_offset, size, stride, backward_hooks, None)


def _rebuild_v3(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                backward_hooks: Any, dtype: Any, metadata: Any = None) -> TensorRef:
    if not isinstance(dtype, TorchDType):
        raise TypeError("_rebuild_tensor_v3 dtype must be a torch dtype")
    return _tensor_ref(storage, storage_offset, size, stride, backward_hooks, dtype.name)


def _tensor_ref(storage: Any, storage_offset: Any, size: Any, stride: Any, hooks: Any,
                dtype: str | None) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise TypeError("tensor storage must be a persistent storage reference")
    if type(storage_offset) is not int:
        raise TypeError("storage_offset must be an integer")
    if hooks:
        raise TypeError("tensor has backward hooks")
    return TensorRef(storage, storage_offset, _int_tuple(size, "size"), _int_tuple(stride, "stride"),
                      dtype if dtype is not None else storage.dtype)


def _rebuild_parameter(data: Any, requires_grad: Any = False, backward_hooks: Any = None) -> Any:
    if not isinstance(data, TensorRef):
        raise TypeError("parameter data must be a tensor")
    return data


_PKL_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): OrderedDict,
    ("torch.storage", "UntypedStorage"): StorageType(None),
    ("torch", "UntypedStorage"): StorageType(None),
}
_PKL_ALLOWED.update({("torch", k): StorageType(v) for k, v in _LEGACY_STORAGES.items()})
_PKL_ALLOWED.update({("torch", n): TorchDType(n) for n in TORCH_DTYPE_NAMES})


class DataPklUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        module, name = py3_name(module, name)
        obj = _PKL_ALLOWED.get((module, name))
        if obj is None:
            raise Refused(module, name)
        return _fresh(obj)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r:.80}")
        _, st, key, location, numel = pid
        if not isinstance(st, StorageType):
            raise pickle.UnpicklingError("persistent id does not name a storage class")
        if not isinstance(key, str) or not isinstance(location, str) or type(numel) is not int or numel < 0:
            raise pickle.UnpicklingError(f"malformed storage reference {pid!r:.80}")
        return StorageRef(st.dtype, key, numel)


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


class ScanError(ValueError):
    """The pickle is malformed (truncated, unknown opcode)."""


class ScanRefused(ScanError):
    """The pickle is well formed but does something DCP's writers never do."""


def scan_pickle(data: bytes, *, allow_persistent: bool) -> None:
    """Walk the opcodes of ``data`` without building anything; raise ScanError for unknown or
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
                raise ScanRefused(f"opcode {_OP_NAMES[op]} is not allowed")
            continue
        if k is None:
            raise ScanError(f"unknown opcode 0x{op:02x} at byte {i - 1}")
        if k > 0:
            if i + k > n:
                raise ScanError(f"{_OP_NAMES[op]} argument at byte {i} runs past the end")
            if op == _OP_BINPUT or op == _OP_LONG_BINPUT:
                if fb(data[i:i + k], "little") > puts:
                    raise ScanRefused(f"{_OP_NAMES[op]} at byte {i - 1} stores memo index "
                                     f"{fb(data[i:i + k], 'little')} after {puts} entries")
                puts += 1
            elif op in refused:
                raise ScanRefused(f"opcode {_OP_NAMES[op]} is not allowed")
            i += k
            continue
        if k == -11:
            if i >= n:
                raise ScanError("pickle data was truncated")
            i += 1 + data[i]
        elif k == -14:
            i += 4 + fb(data[i:i + 4], "little")
        elif k == -18:
            i += 8 + fb(data[i:i + 8], "little")
        else:
            if op in refused or (op == _OP_PERSID and not allow_persistent):
                raise ScanRefused(f"opcode {_OP_NAMES[op]} is not allowed")
            start = i
            for _ in range(-k):
                j = data.find(b"\n", i)
                if j < 0:
                    raise ScanError(f"{_OP_NAMES[op]} argument at byte {i} has no end of line")
                i = j + 1
            if op == _OP_PUT:
                try:
                    idx = int(data[start:i - 1])
                except ValueError:
                    raise ScanError(f"PUT at byte {start - 1} has a malformed index") from None
                if idx < 0 or idx > puts:
                    raise ScanRefused(f"PUT at byte {start - 1} stores memo index {idx} after {puts} entries")
                puts += 1
        if i > n:
            raise ScanError(f"{_OP_NAMES[op]} argument runs past the end of the pickle")
    raise ScanError("pickle data was truncated (no STOP opcode)")


def restricted_load(unpickler: type[pickle.Unpickler], data: bytes, *, allow_persistent: bool) -> Any:
    import gc

    scan_pickle(data, allow_persistent=allow_persistent)
    was = gc.isenabled()
    gc.disable()  # millions of small objects: the collector would otherwise run thousands of times
    try:
        return unpickler(io.BytesIO(data)).load()
    finally:
        if was:
            gc.enable()


# ------------------------------------------------------------------ Megatron-LM legacy archives


class Record:
    """``argparse.Namespace`` or an inert placeholder's result: attributes only, no behaviour.
    ``fields``: the Namespace's attributes (its pickled ``__dict__``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs
        self.fields: dict[str, Any] = {}

    def __setstate__(self, state: Any) -> None:
        self.fields = {k: v for k, v in state.items() if isinstance(k, str)} if isinstance(state, dict) else {}
        self.state = state

    def get(self, name: str) -> Any:
        return self.plain(all_values=True).get(name)

    def plain(self, *, all_values: bool = False) -> dict[str, Any]:
        """The fields (a Namespace without attributes pickles no state: none); by default only
        ints, floats, strings and bools."""
        fields: dict[str, Any] = getattr(self, "fields", {})
        return dict(fields) if all_values else {k: v for k, v in fields.items() if type(v) in (int, float, str, bool)}

    def __reduce__(self) -> Any:  # never pickled back
        raise TypeError("stand-in objects are not picklable")


@dataclass(frozen=True, slots=True)
class Placeholder:
    """A ``megatron.*`` global (an enum in ``args``, e.g. ``AttnBackend``): calling it records the
    call, runs nothing."""

    module: str
    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> Record:
        # an Enum pickles as a call of its class with the member's value; anything else is refused
        if kwargs or len(args) != 1 or type(args[0]) not in (int, str):
            raise Refused(self.module, self.name, " called with other than one int or str (not an enum member)")
        return Record(*args)


class NumpyDType(Record):
    """``numpy.dtype(spec, align, copy)`` + its BUILD state, recorded (``args[0]``: e.g. ``"u4"``)."""


class NumpyArray(Record):
    """An ndarray rebuilt by ``_reconstruct`` + BUILD ``(version, shape, dtype, fortran, raw)``:
    the state is kept as pickled (``raw`` is bytes); no array is made."""


@dataclass(frozen=True, slots=True)
class NumpyScalar:
    dtype: NumpyDType
    raw: bytes


@dataclass(frozen=True, slots=True)
class _NumpyType:
    """``numpy.ndarray`` as ``_reconstruct``'s first argument."""

    name: str


def _np_reconstruct(subtype: Any, shape: Any, code: Any) -> NumpyArray:
    if not isinstance(subtype, _NumpyType) or subtype.name != "ndarray":
        raise TypeError("numpy _reconstruct must rebuild a numpy.ndarray")
    return NumpyArray(shape, code)


def _np_dtype(spec: Any, align: Any = False, copy: Any = False) -> NumpyDType:
    if not isinstance(spec, str):
        raise TypeError("numpy.dtype spec must be a string")
    return NumpyDType(spec, align, copy)


def _np_scalar(dtype: Any, raw: Any = b"") -> NumpyScalar:
    if not isinstance(dtype, NumpyDType) or not isinstance(raw, bytes):
        raise TypeError("numpy scalar must be a dtype and its bytes")
    return NumpyScalar(dtype, raw)


def _latin1_bytes(text: Any, encoding: Any = None) -> bytes:
    """``_codecs.encode(text, "latin1")``: how pickle protocol 2 stores ``bytes`` (NumPy's RNG
    state in ``rng_state``). Rebuilt with ``str.encode``; ``_codecs`` is never called."""
    if encoding != "latin1" or type(text) is not str:
        raise Refused("_codecs", "encode", f" with encoding {encoding!r:.40}")
    return text.encode("latin-1")


def _empty_bytes(*args: Any) -> bytes:
    # protocol 2 writes b"" as ``bytes()``; ``bytes(n)`` would allocate n bytes: refused
    if args:
        raise Refused("builtins", "bytes", " with arguments")
    return b""


#: what a Megatron-LM legacy ``data.pkl`` names beyond a tensor's, as found in the archives made
#: with megatron-core 0.16.1 (tests/data/megatron/make_fixtures.py): ``argparse.Namespace``,
#: ``_codecs.encode``, ``numpy.dtype``, ``numpy.ndarray``, ``numpy._core.multiarray._reconstruct``
#: (and ``megatron.core.transformer.enums.AttnBackend``, see ``LegacyUnpickler``). NumPy 1.x writes
#: ``numpy.core.multiarray``; ``scalar`` and protocol 2's ``bytes()`` (empty bytes) are the two
#: other ways the same values pickle
LEGACY_GLOBALS: dict[tuple[str, str], Any] = {
    ("argparse", "Namespace"): Record,
    ("_codecs", "encode"): _latin1_bytes,
    ("builtins", "bytes"): _empty_bytes,
    ("numpy", "ndarray"): _NumpyType("ndarray"),
    ("numpy", "dtype"): _np_dtype,
}
for _mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
    LEGACY_GLOBALS[(_mod, "_reconstruct")] = _np_reconstruct
    LEGACY_GLOBALS[(_mod, "scalar")] = _np_scalar


class LegacyUnpickler(DataPklUnpickler):
    """``DataPklUnpickler`` + :data:`LEGACY_GLOBALS` + ``megatron.*`` as inert placeholders."""

    def find_class(self, module: str, name: str) -> Any:
        module, name = py3_name(module, name)
        obj = LEGACY_GLOBALS.get((module, name))
        if obj is not None:
            return replace(obj) if isinstance(obj, _NumpyType) else obj
        if module == "megatron" or module.startswith("megatron."):
            return Placeholder(module, name)
        return super().find_class(module, name)
