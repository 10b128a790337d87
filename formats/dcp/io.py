"""Read a ``torch.distributed.checkpoint`` (DCP) directory into a manifest, executing no pickle.

A DCP directory (torch 2.x ``FileSystemWriter``, default ``TORCH_SAVE`` serialization) holds
``.metadata`` -- a pickle of ``Metadata(state_dict_metadata, planner_data, storage_data, ...)``
-- and ``__R_N.distcp`` files. Each tensor chunk is one item of a ``.distcp`` file at
``[offset, offset + length)``: a complete ``torch.save`` archive (a zip with ``data.pkl`` and the
storage bytes in ``data/<key>``, stored uncompressed). ``read_dcp`` resolves every chunk's
payload once, so the manifest addresses it with ``source.byte_range`` + ``source.stored_shape``
(design §3) and ``convert`` moves it with ranged reads.

Security: both pickles are read with the restricted unpicklers of :mod:`formats.dcp.unpickle`
(``MetadataUnpickler``, ``DataPklUnpickler``): they build plain stand-ins, record tensor
rebuilds instead of running them, and refuse every other global. Anything else is refused with
``FormatError``; so is every malformed file. ``torch`` is never imported by this module and
``torch.load`` is never called.

No MPI.
"""

from __future__ import annotations

import os
import stat
from collections import OrderedDict
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

from ..errors import FormatError
from ..files.bounded import read_bounded
from ..manifest.box import Box, is_row_major, row_major_strides
from ..manifest.dtypes import DTYPES, DType
from ..manifest.limits import INT64_MAX
from ..manifest.wire import ArraySpec, Chunk, Manifest, Source
from .torch_archive import ArchiveWindow, clip, open_archive, payload_offset, read_data_pkl, storage_entry
from .unpickle import (
    TORCH_ALIASES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    DataPklUnpickler,
    DcpMetadata,
    Layout,
    MetadataIndex,
    MetadataUnpickler,
    Refused,
    ScanRefused,
    StorageInfo,
    TensorProperties,
    TensorRef,
    TensorStorageMetadata,
    TorchDType,
    restricted_load,
)

__all__ = ["MAX_METADATA_BYTES", "read_dcp"]

METADATA_FILE = ".metadata"
#: refuse to unpickle a ``.metadata`` bigger than this
MAX_METADATA_BYTES = 1 << 30


# ------------------------------------------------------------------ reading


@dataclass(frozen=True, slots=True)
class _Item:
    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...]


def _load_metadata(path: Path) -> DcpMetadata:
    where = str(path)
    data = read_bounded(path, MAX_METADATA_BYTES, ".metadata")
    try:
        obj = restricted_load(MetadataUnpickler, data, allow_persistent=False)
    except Refused as e:
        raise FormatError(f"{where}: .metadata pickle refers to {e.module}.{e.name}, which is not a DCP metadata "
                          "class; refusing to load it") from None
    except ScanRefused as e:
        raise FormatError(f"{where}: .metadata pickle is not one DCP writes ({e}); refusing to load it") from None
    except MemoryError:
        raise FormatError(f"{where}: .metadata pickle is too large to load") from None
    except Exception as e:  # noqa: BLE001 - every unpickling failure is a bad file
        raise FormatError(f"{where}: .metadata is not a valid DCP metadata pickle ({type(e).__name__}: "
                          f"{clip(str(e))})") from None
    if not isinstance(obj, DcpMetadata):
        raise FormatError(f"{where}: .metadata does not hold a DCP Metadata object (got {_kind(obj)})")
    return obj


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


def _storage_index(md: DcpMetadata, where: str) -> dict[tuple[str, tuple[int, ...] | None], _Item | str]:
    """(fqn, chunk offsets) -> item, or a problem text for a malformed entry."""
    sd = md.storage_data
    if not isinstance(sd, dict):
        raise FormatError(f"{where}: storage_data must be a dict of MetadataIndex -> _StorageInfo (got {_kind(sd)}); "
                          "only FileSystemWriter checkpoints are supported")
    out: dict[tuple[str, tuple[int, ...] | None], _Item | str] = {}
    for k, v in sd.items():
        if not isinstance(k, MetadataIndex) or not isinstance(k.fqn, str):
            raise FormatError(f"{where}: storage_data key is {_kind(k)}, expected MetadataIndex")
        off = k.offset
        if off is not None and not (isinstance(off, tuple) and all(_nonneg_int(x) for x in off)):
            raise FormatError(f"{where}: {k.fqn}: storage_data offset {off!r:.80} is not a list of integers")
        key = (k.fqn, off)
        if not isinstance(v, StorageInfo):
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
    if not isinstance(props, TensorProperties) or not isinstance(props.dtype, TorchDType):
        return None
    n = props.dtype.name
    return TORCH_ALIASES.get(n, n)


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


def _locate_payload(fd: int, item: _Item, sizes: tuple[int, ...], dt: DType) -> tuple[int, int]:
    """Absolute [start, stop) of the tensor bytes of one torch.save item; raises ValueError."""
    win = ArchiveWindow(fd, item.offset, item.length)
    zf = open_archive(win)
    infos = {i.filename: i for i in zf.infolist()}
    prefix, pkl = read_data_pkl(zf, infos)
    t = _load_tensor_ref(pkl)
    need, st_bytes = _check_tensor_ref(t, sizes, dt)
    dinfo = storage_entry(infos, prefix, t, st_bytes)
    start = item.offset + payload_offset(win, dinfo, item.length)
    return start, start + need


def _load_tensor_ref(pkl: bytes) -> TensorRef:
    """The tensor ``data.pkl`` describes, unpickled by the restricted unpickler."""
    try:
        t = restricted_load(DataPklUnpickler, pkl, allow_persistent=True)
    except Refused as e:
        raise ValueError(f"data.pkl refers to {e.module}.{e.name}, which is not a tensor rebuild function or "
                         "storage class; refusing to load it") from None
    except ScanRefused as e:
        raise ValueError(f"data.pkl is not one torch.save writes ({e}); refusing to load it") from None
    except Exception as e:  # noqa: BLE001 - every unpickling failure is a bad item
        raise ValueError(f"data.pkl is not a valid torch.save tensor pickle ({type(e).__name__}: "
                         f"{clip(str(e))})") from None
    if not isinstance(t, TensorRef):
        raise ValueError(f"data.pkl holds {_kind(t)}, not a tensor")  # noqa: TRY004 - reported as a bad item
    return t


def _check_tensor_ref(t: TensorRef, sizes: tuple[int, ...], dt: DType) -> tuple[int, int]:
    """The tensor agrees with ``.metadata`` (dtype, shape) and is contiguous row-major from offset
    0: ``(bytes it needs, bytes its storage holds)``."""
    if t.dtype is not None and TORCH_ALIASES.get(t.dtype, t.dtype) != dt.name:
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


def _itemsize(name: str) -> int:
    d = DTYPES.get(TORCH_ALIASES.get(name, name))
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
            if isinstance(tm, BytesStorageMetadata):
                skipped.append(fqn)
                continue
            if not isinstance(tm, TensorStorageMetadata):
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
        from ..validate.manifest import validate_manifest

        problems.extend(validate_manifest(m, where=where, check_paths=True))
    if problems:
        raise FormatError(problems=problems)
    return m, skipped


def _array(fqn: str, tm: TensorStorageMetadata, index: dict[Any, _Item | str], files: _Files, where: str,
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
    if lay is not None and lay != Layout("strided"):
        problems.append(f"{where}: {fqn}: layout {getattr(lay, 'name', lay)!r} is not supported (only strided)")
        return None
    if not isinstance(tm.chunks, list):
        problems.append(f"{where}: {fqn}: chunks must be a list (got {_kind(tm.chunks)})")
        return None
    nd = len(size)
    chunks: list[Chunk] = []
    for i, cm in enumerate(tm.chunks):
        if not isinstance(cm, ChunkStorageMetadata):
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
            problems.append(f"{fpath}: {ctx}: unreadable item ({type(e).__name__}: {clip(str(e))})")
            continue
        chunks.append(Chunk(Box(off, sz), (0,), Source(tensor=fqn, offsets=(0,) * nd, file=item.relative_path,
                                                      byte_range=(a, b), stored_shape=sz)))
    return ArraySpec(size, dt.name, tuple(chunks))


