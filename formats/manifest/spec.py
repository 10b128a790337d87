"""The in-memory model of a manifest (design §3): Manifest, ArraySpec, Chunk, Source, TensorSpec.

Frozen values, no parsing and no I/O (``wire.py`` reads and writes the wire forms). A compact
array (format_version 2) holds a reference to its layout (``compact.py``) and expands its
chunks on first use.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypedDict

from ..errors import ManifestError
from .box import Box
from .dtypes import DTYPES, DType

__all__ = ["ArrayRef", "ArraySpec", "COMPACT_FORMAT_VERSION", "Chunk", "FORMAT", "FORMAT_VERSION", "FORMAT_VERSIONS", "Manifest",
           "RegionDict", "Source", "TensorSpec"]

FORMAT = "shardstream.manifest"
FORMAT_VERSION = 1
#: the compact form (meshes + layouts, compact.py); readers take both
COMPACT_FORMAT_VERSION = 2
FORMAT_VERSIONS = (FORMAT_VERSION, COMPACT_FORMAT_VERSION)


class RegionDict(TypedDict):
    offsets: list[int]
    sizes: list[int]


@dataclass(frozen=True, slots=True)
class Source:
    """Where a chunk's bytes live on each holder. Every field is optional on the wire."""

    tensor: str | None = None
    offsets: tuple[int, ...] | None = None
    file: str | None = None
    byte_range: tuple[int, int] | None = None
    stored_shape: tuple[int, ...] | None = None
    checksum: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.tensor is not None:
            d["tensor"] = self.tensor
        if self.offsets is not None:
            d["offsets"] = list(self.offsets)
        if self.file is not None:
            d["file"] = self.file
        if self.byte_range is not None:
            d["byte_range"] = list(self.byte_range)
        if self.stored_shape is not None:
            d["stored_shape"] = list(self.stored_shape)
        if self.checksum is not None:
            d["checksum"] = self.checksum
        return d


@dataclass(frozen=True, slots=True)
class Chunk:
    region: Box
    holders: tuple[int, ...]
    source: Source | None = None

    def tensor(self, fqn: str) -> str:
        """Local tensor name on the holders (default: the array's own name)."""
        return self.source.tensor if self.source and self.source.tensor is not None else fqn

    @property
    def local_offsets(self) -> tuple[int, ...]:
        if self.source and self.source.offsets is not None:
            return self.source.offsets
        return (0,) * self.region.ndim

    @property
    def local_box(self) -> Box:
        """The region's place inside its local tensor."""
        return Box(self.local_offsets, self.region.sizes)

    def file_for(self, rank: int) -> str | None:
        """The file holding this chunk's copy on ``rank`` (``{rank}`` patterns expanded)."""
        f = self.source.file if self.source else None
        if f is None or "{" not in f:
            return f
        return f.format(rank=rank)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "region": {"offsets": list(self.region.offsets), "sizes": list(self.region.sizes)},
            "holders": list(self.holders),
        }
        if self.source is not None:
            d["source"] = self.source.to_dict()
        return d


class ArrayRef(Protocol):
    """What a compact array holds (``formats.manifest.compact.ArrayRef``): its layout (shared by arrays), the
    block of its region inside the local tensor, and the expansion into chunks."""

    @property
    def layout(self) -> Any: ...

    @property
    def block(self) -> tuple[int, ...] | None: ...

    def expand(self, fqn: str) -> tuple[Chunk, ...]: ...

    def local_stops(self, fqn: str, rank: int) -> list[tuple[str, tuple[int, ...]]]: ...


class ArraySpec:
    """One array: global shape, data type and its chunks.

    ``chunks`` is given (v1, or any writer) or computed on first use from ``ref``, the array's
    layout in a compact (v2) manifest, then kept: a manifest expands array by array, only the
    arrays something asks about. ``ArraySpec(shape, data_type, chunks)`` works as it always did.
    """

    __slots__ = ("shape", "data_type", "_chunks", "ref", "_fqn")

    shape: tuple[int, ...]
    data_type: str
    ref: ArrayRef | None
    _chunks: tuple[Chunk, ...] | None
    _fqn: str | None

    def __init__(self, shape: tuple[int, ...], data_type: str, chunks: tuple[Chunk, ...] | None = None, *,
                 ref: ArrayRef | None = None, fqn: str | None = None) -> None:
        if (chunks is None) == (ref is None):
            raise TypeError("ArraySpec needs chunks or a layout reference (ref=, with fqn=), not both")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "data_type", data_type)
        object.__setattr__(self, "_chunks", chunks)
        object.__setattr__(self, "ref", ref)
        object.__setattr__(self, "_fqn", fqn)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"ArraySpec is immutable (cannot set {name!r})")

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        got: tuple[Chunk, ...] | None = self._chunks
        if got is None:
            assert self.ref is not None and self._fqn is not None
            try:
                got = self.ref.expand(self._fqn)
            except ValueError as e:  # a bad layout (LayoutError) or tensor pattern: say which array
                raise ManifestError(f"{self._fqn}: {e}") from e
            object.__setattr__(self, "_chunks", got)
        return got

    @property
    def chunk_count(self) -> int:
        """``len(chunks)``, without expanding a compact array."""
        if self._chunks is None and self.ref is not None:
            try:
                return len(self.ref.layout.regions)
            except ValueError as e:
                raise ManifestError(f"{self._fqn}: {e}") from e
        return len(self.chunks)

    @property
    def expanded(self) -> bool:
        """Whether the chunks are at hand (given, or already expanded from the layout)."""
        return self._chunks is not None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ArraySpec):
            return NotImplemented
        return (self.shape, self.data_type, self.chunks) == (other.shape, other.data_type, other.chunks)

    def __hash__(self) -> int:
        return hash((self.shape, self.data_type, self.chunks))

    def __repr__(self) -> str:
        if self._chunks is None and self.ref is not None:
            return f"ArraySpec(shape={self.shape!r}, data_type={self.data_type!r}, ref={self.ref.layout.name!r})"
        return f"ArraySpec(shape={self.shape!r}, data_type={self.data_type!r}, chunks={self.chunks!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (ArraySpec, (self.shape, self.data_type, self.chunks))

    @property
    def dtype(self) -> DType:
        return DTYPES[self.data_type]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "data_type": self.data_type,
                "chunks": [c.to_dict() for c in self.chunks]}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Declared shape/dtype of a local tensor (``tensors`` section)."""

    shape: tuple[int, ...]
    data_type: str

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.data_type].itemsize
        for s in self.shape:
            n *= s
        return n

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "data_type": self.data_type}


@dataclass(frozen=True)
class Manifest:
    world_size: int
    arrays: Mapping[str, ArraySpec]
    name: str | None = None
    mesh: Mapping[str, Any] | None = None
    topology: Mapping[str, Any] | None = None
    partial: bool = False
    tensors: Mapping[int, Mapping[str, TensorSpec]] = field(default_factory=dict)
    #: directory that relative ``source.file`` paths resolve against (not serialised)
    base_dir: Path | None = None
    #: arrays whose dim-0 length the receiving side decides (a vocabulary the trainer holds padded
    #: and whose real size only the serving side knows): described at the padded length, every
    #: local tensor declared in ``tensors``; a refit clips them to the receivers' rows before planning
    open_rows: tuple[str, ...] = ()

    @property
    def domain_size(self) -> int | None:
        if self.topology and "domain_size" in self.topology:
            return int(self.topology["domain_size"])
        return None

    def iter_chunks(self) -> Iterator[tuple[str, ArraySpec, Chunk]]:
        for fqn, spec in self.arrays.items():
            for c in spec.chunks:
                yield fqn, spec, c

    def local_tensors(self, rank: int) -> dict[str, TensorSpec]:
        """Shape and dtype of every local tensor on ``rank``: declared in ``tensors``, else the
        per-dim maximum of ``offsets + sizes`` over the chunks that name it (design §3)."""
        out: dict[str, TensorSpec] = {}
        stops: dict[str, list[int]] = {}
        dts: dict[str, str] = {}
        for fqn, spec, t, st in self._local_stops(rank):
            cur = stops.get(t)
            if cur is None:
                stops[t] = list(st)
                dts[t] = spec.data_type
            elif len(cur) == len(st):
                for i, v in enumerate(st):
                    if v > cur[i]:
                        cur[i] = v
        for t, stop in stops.items():
            out[t] = TensorSpec(tuple(stop), dts[t])
        for t, ts in self.tensors.get(rank, {}).items():
            out[t] = ts
        return out

    def _local_stops(self, rank: int) -> Iterator[tuple[str, ArraySpec, str, tuple[int, ...]]]:
        """(array, spec, local tensor, stop of the local box) of every chunk ``rank`` holds, in
        manifest order; compact arrays answer from their layout without expanding."""
        for fqn, spec in self.arrays.items():
            if spec.ref is not None and not spec.expanded:
                for t, st in spec.ref.local_stops(fqn, rank):
                    yield fqn, spec, t, st
                continue
            for c in spec.chunks:
                if rank in c.holders:
                    yield fqn, spec, c.tensor(fqn), c.local_box.stops

    def chunk_count(self) -> int:
        """Chunks over all arrays, without expanding compact ones."""
        return sum(a.chunk_count for a in self.arrays.values())

    def ranks_holding(self) -> list[int]:
        s: set[int] = set()
        seen: set[int] = set()  # layouts already counted
        for spec in self.arrays.values():
            if spec.ref is not None and not spec.expanded:
                if id(spec.ref.layout) not in seen:
                    seen.add(id(spec.ref.layout))
                    s.update(spec.ref.layout.holders)
                continue
            for c in spec.chunks:
                s.update(c.holders)
        return sorted(s)

    def with_arrays(self, arrays: Mapping[str, ArraySpec]) -> Manifest:
        return replace(self, arrays=dict(arrays))

    def to_dict(self, *, arrays: bool = True) -> dict[str, Any]:
        """The v1 wire form (every chunk listed); ``arrays=False``: everything but the arrays."""
        d: dict[str, Any] = {"format": FORMAT, "format_version": FORMAT_VERSION}
        if self.name is not None:
            d["name"] = self.name
        d["world_size"] = self.world_size
        if self.mesh is not None:
            d["mesh"] = dict(self.mesh)
        if self.topology is not None:
            d["topology"] = dict(self.topology)
        if self.partial:
            d["partial"] = True
        if self.open_rows:
            d["open_rows"] = list(self.open_rows)
        if self.tensors:
            d["tensors"] = {str(r): {n: t.to_dict() for n, t in ts.items()}
                            for r, ts in sorted(self.tensors.items())}
        if arrays:
            d["arrays"] = {fqn: a.to_dict() for fqn, a in self.arrays.items()}
        return d
