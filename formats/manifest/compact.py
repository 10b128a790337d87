"""Compact manifest form (``format_version`` 2): meshes and layouts instead of chunk lists.

A v1 manifest lists every chunk of every array. Most arrays of a framework's layout are regular:
a mesh, one placement per mesh axis (DTensor vocabulary) and one local tensor. Version 2 says so
once and lets arrays refer to it::

    "meshes":  {"dp=8,tp=32": {"axes": ["dp", "tp"], "shape": [8, 32],
                               "ranks": {"start": 0, "stop": 256}}},
    "layouts": {"L0": {"mesh": "dp=8,tp=32", "placements": ["R", "S(0)"],
                       "shape": [2048, 7168], "data_type": "bfloat16",
                       "tensor": "model.layers.{layer}.mlp.experts.w13_weight"}},
    "arrays":  {"model.layers.3.mlp.experts.0.gate_proj.weight": "L0",
                "model.layers.3.mlp.experts.0.up_proj.weight": {"layout": "L0", "block": [64, 0]}}

* a **mesh** names its axes and sizes (row-major, last axis fastest) and its ranks as a range
  (``start``, ``stop``, optional ``step``): mesh index ``i`` is rank ``start + i·step``;
* a **layout** is a mesh, its placements (``R``, ``S(d)``: torch.chunk split of dim ``d``,
  nested in mesh-axis order; ``P(c)``: held only where the axis coordinate is ``c`` -- a
  pipeline stage, an expert block), the array's ``shape`` and ``data_type``, and optionally the
  local ``tensor`` name pattern (default: the array's own name) and ``file`` (``{rank}``, as v1);
* an **array** names a layout, and optionally ``block``: where its region sits inside the local
  tensor on every holder (a fused sub-block: ``q``/``k``/``v`` in ``qkv_proj``, ``gate``/``up`` in
  ``gate_up_proj``; default: the region is at the local origin).

Tensor patterns take ``{layer}`` (the integer after ``layers.`` in the array's name) and
``{expert}`` (after ``experts.``), optionally shifted: ``{layer-4}`` (Megatron numbers layers
within a stage). ``{{`` / ``}}`` are literal braces. Arrays that a layout does not describe keep
v1's explicit ``chunks``; both kinds mix freely. Expanding an array gives exactly the chunks a
v1 writer lists (:meth:`ArrayRef.expand`), and ``compact_dict`` (:mod:`formats.manifest.compact_fit`)
only writes a layout after checking that it expands to the array's chunks, so
``compact -> expand`` is lossless by construction.

This module holds the model (meshes, layouts, array references) and the parsing of the wire
form; :mod:`formats.manifest.compact_patterns` the tensor name patterns (re-exported here);
:mod:`formats.manifest.compact_fit` the writing (fitting layouts to chunks).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Protocol

from ..integrity.sidecar import ChecksumTable
from ..layouts.mesh import (
    LayoutError,
    Mesh,
    Pin,
    Placement,
    Replicate,
    Shard,
    check_placements,
    chunk_regions,
)
from .box import Box
from .compact_patterns import array_vars, check_pattern, fill_pattern, templatize
from .dtypes import DTYPES
from .spec import Chunk, Source

__all__ = ["RUN_MARK", "ArrayRef", "Layout", "MeshDecl", "array_vars", "check_pattern", "fill_pattern", "is_run",
           "parse_compact", "parse_ref", "parse_run", "templatize"]

_LAYOUT_KEYS = {"mesh", "placements", "shape", "data_type", "tensor", "file", "shard_order"}
_MESH_KEYS = {"axes", "shape", "ranks"}
_RANGE_KEYS = {"start", "stop", "step"}
_REF_KEYS = {"layout", "block", "checksums"}
_RUN_KEYS = {"experts", "members", "checksums"}
_SEGMENT_KEYS = {"layout", "stop", "block", "step"}
RUN_MARK = ".{expert}"
_PLACEMENT_RE = re.compile(r"(R)|([SP])\((\d+)\)\Z")



@dataclass(frozen=True)
class MeshDecl:
    """A named mesh over the ranks ``start + i·step`` (``i`` the row-major mesh index)."""

    name: str
    mesh: Mesh
    start: int = 0
    step: int = 1

    def rank(self, i: int) -> int:
        return self.start + i * self.step

    @property
    def last_rank(self) -> int:
        return self.rank(self.mesh.size - 1)

    def to_dict(self) -> dict[str, Any]:
        ranks: dict[str, int] = {"start": self.start, "stop": self.start + self.mesh.size * self.step}
        if self.step != 1:
            ranks["step"] = self.step
        return {"axes": list(self.mesh.axes), "shape": list(self.mesh.shape), "ranks": ranks}


@dataclass(frozen=True, eq=False)
class Layout:
    """A regular layout shared by arrays: mesh + placements + shape + dtype + local tensor/file."""

    name: str
    mesh: MeshDecl
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    data_type: str
    tensor: str | None = None  # pattern; None: the array's own name
    file: str | None = None
    #: the order in which the sharding axes split (mesh axis indices); None: mesh order
    order: tuple[int, ...] | None = None
    #: expanded chunks by (local tensor, block): arrays that agree share one tuple (the planner
    #: memoises per tuple)
    _chunks: dict[tuple[str | None, tuple[int, ...] | None], tuple[Chunk, ...]] = field(
        default_factory=dict, repr=False)

    @property
    def key(self) -> tuple[Any, ...]:
        """What makes two layouts the same (everything but the name)."""
        return (self.mesh.name, self.placements, self.shape, self.data_type, self.tensor, self.file, self.order)

    @cached_property
    def regions(self) -> tuple[tuple[Box, tuple[int, ...]], ...]:
        """The non-empty regions and their holders (ranks, not mesh indices), sorted by offsets."""
        rs = chunk_regions(self.shape, self.mesh.mesh, self.placements, what=f"layout {self.name!r}",
                           order=self.order)
        if self.mesh.start == 0 and self.mesh.step == 1:
            return tuple(rs)
        return tuple((b, tuple(self.mesh.rank(h) for h in hs)) for b, hs in rs)

    @cached_property
    def holders(self) -> tuple[int, ...]:
        """Every rank holding some region."""
        return tuple(sorted({h for _, hs in self.regions for h in hs}))

    @cached_property
    def extent(self) -> tuple[int, ...]:
        """Per dim, the largest region size: a region's local box is ``[block, block + extent)`` at most."""
        return tuple(max((b.sizes[d] for b, _ in self.regions), default=0) for d in range(len(self.shape)))

    def check(self, world_size: int) -> list[str]:
        """What is wrong with the layout itself (checked once, whatever number of arrays use it)."""
        out: list[str] = []
        try:
            check_placements(self.shape, self.mesh.mesh, self.placements, what=f"layout {self.name!r}")
        except LayoutError as e:
            out.append(str(e))
        if self.mesh.last_rank >= world_size or self.mesh.start >= world_size:
            out.append(f"layout {self.name!r}: mesh {self.mesh.name!r} reaches rank {self.mesh.last_rank}, "
                       f"outside world_size {world_size}")
        return out

    @cached_property
    def sizes_by_rank(self) -> dict[int, list[tuple[int, ...]]]:
        """The region sizes each holder holds, in region order."""
        out: dict[int, list[tuple[int, ...]]] = {}
        for b, hs in self.regions:
            for h in hs:
                out.setdefault(h, []).append(b.sizes)
        return out

    def chunks(self, fqn: str, block: tuple[int, ...] | None) -> tuple[Chunk, ...]:
        tensor = None if self.tensor is None else fill_pattern(self.tensor, fqn)
        if tensor == fqn:
            tensor = None
        key = (tensor, block)
        hit = self._chunks.get(key)
        if hit is not None:
            return hit
        src = None
        if tensor is not None or block is not None or self.file is not None:
            src = Source(tensor=tensor, offsets=block, file=self.file)
        out = tuple(Chunk(b, hs, src) for b, hs in self.regions)
        self._chunks[key] = out
        return out

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mesh": self.mesh.name, "placements": [str(p) for p in self.placements],
                             "shape": list(self.shape), "data_type": self.data_type}
        d.update((k, v) for k, v in (("tensor", self.tensor), ("file", self.file)) if v is not None)
        if self.order is not None:
            d["shard_order"] = [self.mesh.mesh.axes[a] for a in self.order]
        return d


@dataclass(frozen=True, slots=True)
class ArrayRef:
    """An array described by a layout, its region at ``block`` inside the local tensor."""

    layout: Layout
    block: tuple[int, ...] | None = None
    #: the index of its first chunk checksum in ``table`` (the manifest's sidecar); None: none
    checksums: int | None = None
    table: ChecksumTable | None = None

    def expand(self, fqn: str) -> tuple[Chunk, ...]:
        base = self.layout.chunks(fqn, self.block)
        if self.checksums is None or self.table is None:
            return base
        texts = self.table.texts(self.checksums, len(base))
        return tuple(Chunk(c.region, c.holders, replace(c.source, checksum=ck) if c.source is not None
                           else Source(checksum=ck)) for c, ck in zip(base, texts))

    def local_stops(self, fqn: str, rank: int) -> list[tuple[str, tuple[int, ...]]]:
        """(local tensor, stop of the local box) of each region ``rank`` holds, without expanding."""
        sizes = self.layout.sizes_by_rank.get(rank)
        if not sizes:
            return []
        lay = self.layout
        tensor = fqn if lay.tensor is None else fill_pattern(lay.tensor, fqn)
        off = self.block or (0,) * len(lay.shape)
        return [(tensor, tuple([o + z for o, z in zip(off, sz)])) for sz in sizes]

    def to_wire(self, name: str) -> str | dict[str, Any]:
        if self.block is None and self.checksums is None:
            return name
        out: dict[str, Any] = {"layout": name}
        if self.block is not None:
            out["block"] = list(self.block)
        if self.checksums is not None:
            out["checksums"] = self.checksums
        return out


class _Problems(Protocol):
    def bad(self, ctx: str, msg: str) -> None: ...

    def keys(self, obj: Mapping[str, Any], allowed: set[str], ctx: str) -> None: ...

    def ints(self, v: object, ctx: str, what: str, *, ndim: int | None = None,
             nonneg: bool = True) -> tuple[int, ...] | None: ...


def _int(p: _Problems, v: object, ctx: str, what: str, lo: int) -> int | None:
    if type(v) is not int or v < lo:
        p.bad(ctx, f"{what} must be an integer >= {lo}, got {v!r}")
        return None
    return v


def _object(p: _Problems, v: object, ctx: str, allowed: set[str], what: str = "") -> dict[str, Any] | None:
    """``v`` when it is an object (its unknown keys reported), else None (reported)."""
    if not isinstance(v, dict):
        p.bad(ctx, f"{what or 'must be'} an object, got {v!r}")
        return None
    p.keys(v, allowed, ctx)
    return v


def _parse_mesh(p: _Problems, name: str, v: object) -> MeshDecl | None:
    ctx = f"meshes.{name}"
    if _object(p, v, ctx, _MESH_KEYS) is None:
        return None
    assert isinstance(v, dict)
    axes = v.get("axes")
    shape = p.ints(v.get("shape"), ctx, "shape")
    if not (isinstance(axes, list) and all(isinstance(a, str) for a in axes)):
        p.bad(ctx, f"axes must be a list of strings, got {axes!r}")
        return None
    if shape is None:
        return None
    try:
        mesh = Mesh(tuple(axes), shape)
    except LayoutError as e:
        p.bad(ctx, str(e))
        return None
    rv = v.get("ranks", {"start": 0, "stop": mesh.size})
    if not isinstance(rv, dict):
        p.bad(ctx, f"ranks must be an object {{\"start\", \"stop\"[, \"step\"]}}, got {rv!r}")
        return None
    p.keys(rv, _RANGE_KEYS, ctx + ".ranks")
    start = _int(p, rv.get("start"), ctx, "ranks.start", 0)
    stop = _int(p, rv.get("stop"), ctx, "ranks.stop", 0)
    step = _int(p, rv.get("step", 1), ctx, "ranks.step", 1)
    if start is None or stop is None or step is None:
        return None
    n = len(range(start, stop, step))
    if n != mesh.size:
        p.bad(ctx, f"ranks range({start}, {stop}, {step}) has {n} ranks but the mesh {mesh} has {mesh.size}")
        return None
    return MeshDecl(name, mesh, start, step)


def _parse_placement(text: object) -> Placement | None:
    if not isinstance(text, str):
        return None
    m = _PLACEMENT_RE.match(text)
    if m is None:
        return None
    if m.group(1):
        return Replicate()
    return Shard(int(m.group(3))) if m.group(2) == "S" else Pin(int(m.group(3)))


def _parse_layout(p: _Problems, name: str, v: object, meshes: Mapping[str, MeshDecl]) -> Layout | None:
    ctx = f"layouts.{name}"
    if _object(p, v, ctx, _LAYOUT_KEYS) is None:
        return None
    assert isinstance(v, dict)
    miss = [k for k in ("mesh", "placements", "shape", "data_type") if k not in v]
    if miss:
        p.bad(ctx, f"missing required key(s) {', '.join(miss)}")
        return None
    ok = True
    mesh = meshes.get(v["mesh"]) if isinstance(v["mesh"], str) else None
    if mesh is None:
        p.bad(ctx, f"mesh {v['mesh']!r} is not declared in 'meshes'")
        ok = False
    shape = p.ints(v["shape"], ctx, "shape")
    dt = v["data_type"]
    if not isinstance(dt, str) or dt not in DTYPES:
        p.bad(ctx, f"unknown data_type {dt!r} (expected one of {', '.join(DTYPES)})")
        ok = False
    pv = v["placements"]
    pl: list[Placement] = []
    if not isinstance(pv, list):
        p.bad(ctx, f"placements must be a list like [\"R\", \"S(0)\"], got {pv!r}")
        ok = False
    else:
        for x in pv:
            q = _parse_placement(x)
            if q is None:
                p.bad(ctx, f"bad placement {x!r} (expected \"R\", \"S(d)\" or \"P(c)\")")
                ok = False
            else:
                pl.append(q)
        if mesh is not None and len(pv) != mesh.mesh.ndim:
            p.bad(ctx, f"{len(pv)} placement(s) for the {mesh.mesh.ndim}-axis mesh {mesh.name!r} "
                       f"(expected one per mesh axis)")
            ok = False
    tensor = v.get("tensor")
    if tensor is not None:
        why = check_pattern(tensor) if isinstance(tensor, str) and tensor else "tensor must be a non-empty string"
        if why is not None:
            p.bad(ctx, why)
            ok = False
    file = v.get("file")
    if file is not None and (not isinstance(file, str) or not file):
        p.bad(ctx, f"file must be a non-empty string, got {file!r}")
        ok = False
    order = None
    if "shard_order" in v and mesh is not None:
        so = v["shard_order"]
        axes = mesh.mesh.axes
        if not (isinstance(so, list) and sorted(map(str, so)) == sorted(axes) and len(so) == len(axes)):
            p.bad(ctx, f"shard_order must list the axes of mesh {mesh.name!r} ({', '.join(axes)}) once each, "
                       f"got {so!r}")
            ok = False
        else:
            order = tuple(axes.index(a) for a in so)
    if not ok or shape is None or mesh is None:
        return None
    return Layout(name, mesh, tuple(pl), shape, dt, tensor, file, order)


def parse_compact(p: _Problems, meshes_v: object, layouts_v: object) -> dict[str, Layout]:
    """The ``layouts`` of a v2 manifest (their meshes resolved); problems go to ``p``."""
    meshes: dict[str, MeshDecl] = {}
    if meshes_v is not None:
        if not isinstance(meshes_v, dict):
            p.bad("", f"meshes must be an object keyed by mesh name, got {meshes_v!r}")
        else:
            for name, v in meshes_v.items():
                d = _parse_mesh(p, name, v)
                if d is not None:
                    meshes[name] = d
    layouts: dict[str, Layout] = {}
    if layouts_v is not None:
        if not isinstance(layouts_v, dict):
            p.bad("", f"layouts must be an object keyed by layout name, got {layouts_v!r}")
        else:
            for name, v in layouts_v.items():
                lay = _parse_layout(p, name, v, meshes)
                if lay is not None:
                    layouts[name] = lay
    return layouts


def parse_ref(p: _Problems, fqn: str, v: str | dict[str, Any], layouts: Mapping[str, Layout],
              table: ChecksumTable | None = None) -> ArrayRef | None:
    """An array given by a layout: ``"NAME"`` or ``{"layout": "NAME", "block": [...], "checksums":
    N}`` (N: its first chunk checksum in the manifest's sidecar ``table``)."""
    if isinstance(v, str):
        name: object = v
        block = None
    else:
        p.keys(v, _REF_KEYS, fqn)
        name = v.get("layout")
        block = None
    lay = layouts.get(name) if isinstance(name, str) else None
    if lay is None:
        p.bad(fqn, f"layout {name!r} is not declared in 'layouts'")
        return None
    if isinstance(v, dict) and "block" in v:
        block = p.ints(v["block"], fqn, "block", ndim=len(lay.shape))
        if block is None:
            return None
    start = None
    if isinstance(v, dict) and "checksums" in v:
        if table is None:
            p.bad(fqn, "'checksums' needs the top-level 'checksums' object naming the sidecar file")
            return None
        start = _int(p, v["checksums"], fqn, "checksums", 0)
        if start is None:
            return None
        try:
            n = len(lay.regions)
        except ValueError:
            n = 0  # a bad layout: reported by validation, by name
        if start + n > table.count:
            p.bad(fqn, f"checksums {start}..{start + n - 1} run past the sidecar's {table.count} checksums")
            return None
    return ArrayRef(lay, block, start, table if start is not None else None)


def is_run(key: str) -> bool:
    """Whether an ``arrays`` key of a v2 manifest is a run of expert arrays (``PREFIX.{expert}``)."""
    return key.endswith(RUN_MARK)


def parse_run(p: _Problems, key: str, v: object, layouts: Mapping[str, Layout],
              table: ChecksumTable | None = None) -> list[tuple[str, ArrayRef]]:
    """A run of expert arrays, in order: for each expert, each member (see :func:`compact_dict`);
    with ``checksums``, their chunk checksums follow each other in the sidecar in that order."""
    if not isinstance(v, dict):
        p.bad(key, f"a run of expert arrays must be an object {{\"experts\", \"members\"}}, got {v!r}")
        return []
    p.keys(v, _RUN_KEYS, key)
    ev, mv = v.get("experts"), v.get("members")
    if not isinstance(ev, dict) or not isinstance(mv, dict) or not mv:
        p.bad(key, "a run needs 'experts' {\"start\", \"stop\"} and a non-empty 'members' object")
        return []
    p.keys(ev, {"start", "stop"}, key + ".experts")
    e0 = _int(p, ev.get("start"), key, "experts.start", 0)
    e1 = _int(p, ev.get("stop"), key, "experts.stop", 0 if e0 is None else e0 + 1)
    if e0 is None or e1 is None:
        return []
    prefix = key[: -len(RUN_MARK)]
    per: dict[str, list[ArrayRef]] = {}
    for suffix, segs in mv.items():
        refs = _parse_segments(p, f"{key}.members.{suffix}", segs, e0, e1, layouts)
        if refs is None:
            return []
        per[suffix] = refs
    out = [(f"{prefix}.{e}.{suffix}", refs[e - e0]) for e in range(e0, e1) for suffix, refs in per.items()]
    if "checksums" not in v:
        return out
    if table is None:
        p.bad(key, "'checksums' needs the top-level 'checksums' object naming the sidecar file")
        return []
    at = _int(p, v["checksums"], key, "checksums", 0)
    if at is None:
        return []
    with_ck = []
    for fqn, ref in out:
        try:
            n = len(ref.layout.regions)
        except ValueError:
            n = 0  # a bad layout: reported by validation, by name
        with_ck.append((fqn, ArrayRef(ref.layout, ref.block, at, table)))
        at += n
    if at > table.count:
        p.bad(key, f"checksums run to index {at - 1}, past the sidecar's {table.count} checksums")
        return []
    return with_ck


def _parse_segments(p: _Problems, ctx: str, segs: object, e0: int, e1: int,
                    layouts: Mapping[str, Layout]) -> list[ArrayRef] | None:
    if not isinstance(segs, list) or not segs:
        p.bad(ctx, f"must be a non-empty list of segments, got {segs!r}")
        return None
    out: list[ArrayRef] = []
    start = e0
    for k, sv in enumerate(segs):
        sctx = f"{ctx}[{k}]"
        if _object(p, sv, sctx, _SEGMENT_KEYS, "a segment must be") is None:
            return None
        assert isinstance(sv, dict)
        lname = sv.get("layout")
        lay = layouts.get(lname) if isinstance(lname, str) else None
        if lay is None:
            p.bad(sctx, f"layout {lname!r} is not declared in 'layouts'")
            return None
        stop = _int(p, sv.get("stop"), sctx, "stop", start + 1)
        if stop is None:
            return None
        nd = len(lay.shape)
        block = p.ints(sv.get("block", [0] * nd), sctx, "block", ndim=nd)
        step = p.ints(sv.get("step", [0] * nd), sctx, "step", ndim=nd)
        if block is None or step is None:
            return None
        for i in range(stop - start):
            b = tuple(x + i * y for x, y in zip(block, step))
            out.append(ArrayRef(lay, b if any(b) else None))
        start = stop
    if start != e1:
        p.bad(ctx, f"segments end at expert {start}, expected experts.stop {e1}")
        return None
    return out
