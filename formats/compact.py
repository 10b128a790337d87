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
v1 writer lists (:func:`expand`), and :func:`compact_dict` only writes a layout after checking
that it expands to the array's chunks, so ``compact -> expand`` is lossless by construction.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any, Protocol

from .box import Box
from .dtypes import DTYPES
from .layouts.mesh import LayoutError, Mesh, Pin, Placement, Replicate, Shard, check_placements, chunk_regions
from .sidecar import ChecksumTable, ChecksumWriter
from .spec import FORMAT, Chunk, Source

if TYPE_CHECKING:
    from .spec import ArraySpec, Manifest

__all__ = ["ArrayRef", "Layout", "MeshDecl", "array_vars", "compact_dict", "fill_pattern", "is_run", "parse_compact",
           "parse_ref", "parse_run"]

_LAYOUT_KEYS = {"mesh", "placements", "shape", "data_type", "tensor", "file", "shard_order"}
_MESH_KEYS = {"axes", "shape", "ranks"}
_RANGE_KEYS = {"start", "stop", "step"}
_REF_KEYS = {"layout", "block", "checksums"}
_RUN_KEYS = {"experts", "members", "checksums"}
_SEGMENT_KEYS = {"layout", "stop", "block", "step"}
#: an expert array's name: (prefix ending in ``experts``, expert, member suffix)
_EXPERT_RE = re.compile(r"(.*(?<![^.])(?:local_)?experts)\.(\d+)\.(.+)\Z")
RUN_MARK = ".{expert}"
_VAR_OF = {"layers": "layer", "experts": "expert", "local_experts": "expert"}
_VARS_RE = re.compile(r"(?<![^.])(layers|experts|local_experts)\.(\d+)(?![^.])")
_TOKEN_RE = re.compile(r"\{\{|\}\}|\{([a-z]+)(?:([+-])(\d+))?\}|[{}]")
_PLACEMENT_RE = re.compile(r"(R)|([SP])\((\d+)\)\Z")


# ---------------------------------------------------------------- patterns


@lru_cache(maxsize=1 << 18)
def array_vars(fqn: str) -> Mapping[str, int]:
    """The pattern variables of an array name: ``{layer}`` and ``{expert}`` (first occurrence);
    cached (each array's name is read on both sides of a plan and again for its local tensor),
    so the mapping is shared: do not modify it.

    >>> array_vars("model.layers.3.mlp.experts.17.gate_proj.weight")
    {'layer': 3, 'expert': 17}
    """
    # _VARS_RE by components: as exact, several times faster (every array's name is read)
    out: dict[str, int] = {}
    parts = fqn.split(".")
    for name, num in zip(parts, parts[1:]):
        var = _VAR_OF.get(name)
        if var is not None and num.isdecimal():
            out.setdefault(var, int(num))
    return out


def check_pattern(pattern: str) -> str | None:
    """None when ``pattern`` is a well-formed tensor pattern, else what is wrong."""
    for m in _TOKEN_RE.finditer(pattern):
        tok = m.group(0)
        if tok in ("{", "}"):
            return f"tensor pattern {pattern!r} has a lone {tok!r} (write {tok * 2} for a literal brace)"
        if m.group(1) is not None and m.group(1) not in ("layer", "expert"):
            return f"tensor pattern {pattern!r} uses {{{m.group(1)}}} (expected {{layer}} or {{expert}})"
    return None


def fill_pattern(pattern: str, fqn: str, vs: Mapping[str, int] | None = None) -> str:
    """The local tensor name of array ``fqn`` under ``pattern`` (ValueError naming what is missing);
    ``vs``: :func:`array_vars` of ``fqn`` when the caller has it.

    >>> fill_pattern("decoder.layers.{layer-4}.mlp.linear_fc1.weight", "model.layers.6.mlp.up_proj.weight")
    'decoder.layers.2.mlp.linear_fc1.weight'
    """
    if "{" not in pattern and "}" not in pattern:
        return pattern
    if vs is None:
        vs = array_vars(fqn)
    fmt, fields = _format_of(pattern)
    if fmt is not None:  # the common case, one str.format (every array's name is filled)
        try:
            values = [vs[var] + delta for var, delta in fields]
        except KeyError:
            values = [-1]
        if min(values, default=0) >= 0:
            return fmt.format(*values)
    parts: list[str] = []  # the slow path names what is wrong
    for t in _tokens(pattern):
        if isinstance(t, str):
            parts.append(t)
            continue
        tok, var, delta = t
        if var is None or var not in vs:
            raise ValueError(f"tensor pattern {pattern!r} needs {tok} but the array name has no "
                             f"'{'layers' if var == 'layer' else 'experts'}.N' part")
        v = vs[var] + delta
        if v < 0:
            raise ValueError(f"tensor pattern {pattern!r} gives a negative {var} ({v})")
        parts.append(str(v))
    return "".join(parts)


@lru_cache(maxsize=65536)
def _format_of(pattern: str) -> tuple[str | None, tuple[tuple[str, int], ...]]:
    """``pattern`` as a ``str.format`` template and its (variable, shift) fields; None when it
    has a lone brace."""
    fmt: list[str] = []
    fields: list[tuple[str, int]] = []
    for t in _tokens(pattern):
        if isinstance(t, str):
            fmt.append(t.replace("{", "{{").replace("}", "}}"))
        elif t[1] is None:
            return None, ()
        else:
            fmt.append("{}")
            fields.append((t[1], t[2]))
    return "".join(fmt), tuple(fields)


@lru_cache(maxsize=65536)
def _tokens(pattern: str) -> tuple[str | tuple[str, str | None, int], ...]:
    """``pattern`` parsed once: literal text, and ``(token, variable, shift)`` for each
    ``{layer±k}`` / ``{expert±k}`` (variable None: a lone brace). Arrays of a layout share its
    pattern, so validation parses each once, not once per array."""
    out: list[str | tuple[str, str | None, int]] = []
    last = 0
    for m in _TOKEN_RE.finditer(pattern):
        out.append(pattern[last:m.start()])
        tok = m.group(0)
        if tok in ("{{", "}}"):
            out.append(tok[0])
        else:
            shift = int(m.group(3)) if m.group(2) else 0
            out.append((tok, m.group(1), -shift if m.group(2) == "-" else shift))
        last = m.end()
    out.append(pattern[last:])
    return tuple(out)


def templatize(tensor: str, fqn: str, vs: Mapping[str, int] | None = None) -> str:
    """The pattern of local tensor ``tensor`` of array ``fqn``: ``layers.N`` / ``experts.N`` parts
    become ``{layer±k}`` / ``{expert±k}`` relative to the array's own numbers (``vs``: its
    :func:`array_vars`, when the caller has them)."""
    if vs is None:
        vs = array_vars(fqn)
    parts: list[str] = []
    last = 0
    for m in _VARS_RE.finditer(tensor):
        var = _VAR_OF[m.group(1)]
        parts.append(_escape(tensor[last:m.start(2)]))
        if var in vs:
            d = int(m.group(2)) - vs[var]
            parts.append("{" + var + (f"+{d}" if d > 0 else f"-{-d}" if d < 0 else "") + "}")
        else:
            parts.append(m.group(2))
        last = m.end(2)
    parts.append(_escape(tensor[last:]))
    return "".join(parts)


def _escape(s: str) -> str:
    return s.replace("{", "{{").replace("}", "}}")


# ---------------------------------------------------------------- model


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


# ---------------------------------------------------------------- parsing


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


# ---------------------------------------------------------------- writing


def _main_mesh(m: Manifest) -> MeshDecl:
    """The manifest's own mesh when it describes all its ranks, else a 1-axis ``rank`` mesh."""
    mv = m.mesh
    if mv is not None:
        try:
            mesh = Mesh(tuple(mv["axes"]), tuple(mv["shape"]))
        except (LayoutError, KeyError, TypeError):
            mesh = None
        if mesh is not None and mesh.size == m.world_size:
            return MeshDecl(str(mesh), mesh)
    return MeshDecl(f"rank={m.world_size}", Mesh(("rank",), (m.world_size,)))


#: a region as fitted: (offsets, sizes, sorted holders)
Region = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


class Fitter:
    """Finds, for an array's chunks, the layout on ``decl`` that expands to exactly them.

    Equal layouts are one :class:`Layout` object (named ``L0``, ``L1``, ... in order of first
    use), so arrays that share one share its expanded chunks too. Any irregular array (several
    local tensors or offsets, byte ranges, checksums, pieces that are not torch.chunk pieces of
    the mesh) gets no layout and keeps its explicit chunks.
    """

    def __init__(self, decl: MeshDecl) -> None:
        self.decl = decl
        self.layouts: dict[tuple[Any, ...], Layout] = {}
        self._regions: dict[tuple[Any, ...], list[tuple[Box, tuple[int, ...]]] | None] = {}
        self._patterns: dict[tuple[str | int | None, ...], str] = {}
        self._tensor_vars: dict[str, tuple[str, ...]] = {}

    def fit_chunks(self, fqn: str, spec: ArraySpec, checksums: ChecksumWriter | None = None) -> ArrayRef | None:
        """``spec``'s layout reference; with ``checksums`` (a sidecar being written), chunks that
        differ only in their checksums fit too, their checksums going to the sidecar."""
        chunks = spec.chunks
        if not chunks:
            return None
        src = chunks[0].source
        texts: list[str] | None = None
        if checksums is not None and src is not None and src.checksum is not None:
            if any(c.source is None or c.source.checksum is None for c in chunks):
                return None
            texts = [c.source.checksum for c in chunks if c.source is not None and c.source.checksum is not None]
            src = replace(src, checksum=None)
            for c in chunks:
                if c.source is not None and replace(c.source, checksum=None) != src:
                    return None
        else:
            for c in chunks:
                if c.source is not src and c.source != src:
                    return None
        regions = [(c.region.offsets, c.region.sizes, c.holders) for c in chunks]
        ref = self.fit(fqn, spec.shape, spec.data_type, regions, src)
        if ref is None or texts is None or checksums is None:
            return ref
        # the sidecar lists the checksums in expansion order: it must be the chunks' order
        if [c.region for c in ref.layout.chunks(fqn, ref.block)] != [c.region for c in chunks]:
            return None
        start = checksums.add(texts)
        return None if start is None else ArrayRef(ref.layout, ref.block, start)

    def fit(self, fqn: str, shape: tuple[int, ...], data_type: str, regions: Sequence[Region],
            src: Source | None) -> ArrayRef | None:
        """The layout reference for chunks ``regions`` (in v1 order) that all have source ``src``."""
        if not regions:
            return None
        tensor = file = block = None
        if src is not None:
            if src.byte_range is not None or src.stored_shape is not None or src.checksum is not None:
                return None
            if src.tensor is None and src.offsets is None and src.file is None:
                return None  # an explicit empty source: expansion would drop it
            if src.tensor == fqn:
                return None  # written explicitly: expansion would leave it out
            tensor, block, file = src.tensor, src.offsets, src.file
        got = self._geometry(shape, regions)
        if got is None:
            return None
        decl, pl, order = got
        return self.ref(fqn, shape, data_type, decl, pl, order, tensor, block, file)

    def ref(self, fqn: str, shape: tuple[int, ...], data_type: str, decl: MeshDecl, pl: tuple[Placement, ...],
            order: tuple[int, ...] | None, tensor: str | None, block: tuple[int, ...] | None,
            file: str | None) -> ArrayRef | None:
        """The reference to the layout ``decl`` + ``pl`` (+ ``order``) of array ``fqn`` in local
        tensor ``tensor`` (None: its own name) at ``block``; None when the tensor name has no
        pattern in the array's name. Writers that know an array's layout (the presets) call this
        directly instead of :meth:`fit`; both share one :class:`Layout` per distinct layout."""
        pattern = None if tensor is None else self._pattern(tensor, fqn)
        if pattern == "":
            return None
        lkey = (decl.name, pl, shape, data_type, pattern, file, order)
        lay = self.layouts.get(lkey)
        if lay is None:
            lay = self.layouts[lkey] = Layout(f"L{len(self.layouts)}", decl, pl, shape, data_type, pattern, file, order)
        return ArrayRef(lay, block)

    def _pattern(self, tensor: str, fqn: str) -> str:
        """:func:`templatize` of ``tensor`` for ``fqn``, memoised on the variables it depends on:
        those whose ``layers.N`` / ``experts.N`` part ``tensor`` has (every expert of a layer
        shares vLLM's ``w13_weight`` pattern); ``""`` when the pattern does not give ``tensor`` back."""
        vs = array_vars(fqn)
        used = self._tensor_vars.get(tensor)
        if used is None:
            used = self._tensor_vars[tensor] = tuple(sorted(array_vars(tensor)))
        key = (tensor, *(vs.get(v) for v in used))
        got = self._patterns.get(key)
        if got is None:
            got = templatize(tensor, fqn, vs)
            try:
                if fill_pattern(got, fqn, vs) != tensor:
                    got = ""
            except ValueError:
                got = ""
            self._patterns[key] = got
        return got

    def _geometry(self, shape: tuple[int, ...], regions: Sequence[Region]
                  ) -> tuple[MeshDecl, tuple[Placement, ...], tuple[int, ...] | None] | None:
        """Mesh, placements and shard order whose regions are exactly ``regions``: on the job's
        mesh, else on it with one axis split in two (``tp=8`` as ``tp=4,tp_rep=2``: vLLM's kv heads
        replicated over pairs of TP ranks when tp > num_kv_heads)."""
        for decl in (self.decl, *self.factored):
            pl = self._placements(decl, regions)
            if pl is None:
                continue
            for order in self._orders(pl):
                if self._matches(decl, shape, pl, order, regions):
                    return decl, pl, order
        return None

    @cached_property
    def factored(self) -> tuple[MeshDecl, ...]:
        mesh = self.decl.mesh
        out = []
        for a, (name, n) in enumerate(zip(mesh.axes, mesh.shape)):
            inner = f"{name}_rep"
            if inner in mesh.axes:
                continue
            for r in range(2, n):
                if n % r == 0:
                    m = Mesh(mesh.axes[:a] + (name, inner) + mesh.axes[a + 1:],
                             mesh.shape[:a] + (n // r, r) + mesh.shape[a + 1:])
                    out.append(MeshDecl(str(m), m, self.decl.start, self.decl.step))
        return tuple(out)

    def _orders(self, pl: tuple[Placement, ...]) -> list[tuple[int, ...] | None]:
        """Shard orders to try: the mesh order, then (with several sharding axes) the reverse --
        FSDP2 over TP shards the TP piece (DTensor's ``_StridedShard``)."""
        shards = [a for a, q in enumerate(pl) if isinstance(q, Shard)]
        if len(shards) < 2:
            return [None]
        return [None, tuple(range(len(pl) - 1, -1, -1))]

    def _matches(self, decl: MeshDecl, shape: tuple[int, ...], pl: tuple[Placement, ...],
                 order: tuple[int, ...] | None, regions: Sequence[Region]) -> bool:
        key = (decl.name, shape, pl, order)
        if key not in self._regions:
            try:
                self._regions[key] = chunk_regions(shape, decl.mesh, pl, order=order)
            except LayoutError:
                self._regions[key] = None
        want = self._regions[key]
        if want is None or len(want) != len(regions):
            return False
        for (b, hs), (o, z, h) in zip(want, regions):
            if b.offsets != o or b.sizes != z or hs != h:
                return False
        return True

    def _placements(self, decl: MeshDecl, regions: Sequence[Region]) -> tuple[Placement, ...] | None:
        """The placement of each mesh axis, read off the neighbours of the first region's first
        holder: a neighbour holding nothing pins the axis, one in the same region replicates,
        one in a region moved along one dim shards that dim (checked by the caller)."""
        mesh = decl.mesh
        offs0, _, hs0 = regions[0]
        r0 = hs0[0]
        if r0 >= mesh.size or decl.start != 0 or decl.step != 1:
            return None
        coords = mesh.coords(r0)
        pl: list[Placement] = []
        for a, (n, stride) in enumerate(zip(mesh.shape, mesh.strides)):
            if n == 1:
                pl.append(Replicate())
                continue
            nb = r0 + ((coords[a] + 1) % n - coords[a]) * stride
            i = next((k for k, r in enumerate(regions) if nb in r[2]), None)
            if i is None:
                pl.append(Pin(coords[a]))
            elif i == 0:
                pl.append(Replicate())
            else:
                dims = [d for d, (x, y) in enumerate(zip(regions[i][0], offs0)) if x != y]
                if len(dims) != 1:
                    return None
                pl.append(Shard(dims[0]))
        return tuple(pl)


def compact_dict(m: Manifest, checksums: ChecksumWriter | None = None) -> dict[str, Any]:
    """The v2 wire form of ``m``: every array a layout describes exactly is written as a
    reference to it (layouts deduplicated), the others keep their explicit chunks. With
    ``checksums`` (the sidecar written beside it), chunk checksums go there; without, arrays
    with checksums keep explicit chunks (nothing is dropped)."""
    fitter = Fitter(_main_mesh(m))
    meshes: dict[str, MeshDecl] = {}
    layouts: dict[tuple[Any, ...], tuple[str, Layout, str]] = {}
    arrays: dict[str, Any] = {}
    refs: dict[str, tuple[str, tuple[int, ...] | None]] = {}  # compact arrays: layout name, block
    starts: dict[str, tuple[int, int]] = {}  # checksummed ones: first sidecar index, chunks

    def mesh_name(d: MeshDecl) -> str:
        name = d.name
        k = 2
        while name in meshes and meshes[name] != d:
            name, k = f"{d.name}#{k}", k + 1
        meshes[name] = d
        return name

    for fqn, spec in m.arrays.items():
        plain = spec.ref is not None and getattr(spec.ref, "checksums", None) is None
        ref = spec.ref if plain else fitter.fit_chunks(fqn, spec, checksums)
        if ref is None:
            arrays[fqn] = spec.to_dict()
            continue
        lay = ref.layout
        mname = mesh_name(lay.mesh)
        key = (mname, *lay.key[1:])
        hit = layouts.get(key)
        if hit is None:
            hit = layouts[key] = (f"L{len(layouts)}", lay, mname)
        start = getattr(ref, "checksums", None)
        arrays[fqn] = ArrayRef(lay, ref.block, start).to_wire(hit[0])
        refs[fqn] = (hit[0], ref.block)
        if start is not None:
            starts[fqn] = (start, len(lay.regions))
    d: dict[str, Any] = {"format": FORMAT, "format_version": 2}
    head = m.to_dict(arrays=False)
    for k, v in head.items():
        if k not in ("format", "format_version"):
            d[k] = v
    if meshes:
        d["meshes"] = {n: md.to_dict() for n, md in meshes.items()}
    if layouts:
        d["layouts"] = {n: dict(lay.to_dict(), mesh=mn) for n, lay, mn in layouts.values()}
    if checksums:
        d["checksums"] = checksums.table_dict()
    d["arrays"] = _with_runs(arrays, refs, starts)
    return d


def _with_runs(arrays: dict[str, Any], refs: Mapping[str, tuple[str, tuple[int, ...] | None]],
               starts: Mapping[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """``arrays`` with each run of consecutive compact expert arrays (expert ``e0..e1``, each with
    the same member suffixes in the same order) written as one ``PREFIX.{expert}`` entry: per
    member, segments of consecutive experts with one layout and a block growing by ``step``.
    Checksummed arrays (``starts``: first sidecar index, chunk count) form a run only when their
    checksums follow each other in the sidecar in run order: the run gives the first index."""
    items = list(arrays.items())
    out: dict[str, Any] = {}
    i = 0
    while i < len(items):
        run = _run_at(items, i, refs, starts or {})
        if run is None:
            out[items[i][0]] = items[i][1]
            i += 1
            continue
        key, value, n = run
        out[key] = value
        i += n
    return out


def _run_at(items: list[tuple[str, Any]], i: int, refs: Mapping[str, tuple[str, tuple[int, ...] | None]],
            starts: Mapping[str, tuple[int, int]]) -> tuple[str, dict[str, Any], int] | None:
    m = _EXPERT_RE.match(items[i][0])
    if m is None or items[i][0] not in refs or RUN_MARK in items[i][0]:
        return None
    prefix, e0 = m.group(1), int(m.group(2))
    members: list[str] = []
    j = i
    while j < len(items):  # the member suffixes of the first expert
        mj = _EXPERT_RE.match(items[j][0])
        if mj is None or mj.group(1) != prefix or int(mj.group(2)) != e0 or items[j][0] not in refs:
            break
        members.append(mj.group(3))
        j += 1
    if len(set(members)) != len(members):
        return None
    e = e0 + 1
    while True:  # whole experts e0+1, e0+2, ... with the same members
        names = [f"{prefix}.{e}.{s}" for s in members]
        if j + len(names) > len(items) or any(items[j + k][0] != n or n not in refs for k, n in enumerate(names)):
            break
        j += len(names)
        e += 1
    if e - e0 < 2:
        return None
    names = [items[k][0] for k in range(i, j)]
    first: int | None = None
    if any(n in starts for n in names):  # all checksummed, back to back in the sidecar
        if not all(n in starts for n in names):
            return None
        first = at = starts[names[0]][0]
        for n in names:
            if starts[n][0] != at:
                return None
            at += starts[n][1]
    mv: dict[str, Any] = {}
    for s in members:
        segs = _segments([refs[f"{prefix}.{x}.{s}"] for x in range(e0, e)], e0)
        if segs is None:
            return None
        mv[s] = segs
    run: dict[str, Any] = {"experts": {"start": e0, "stop": e}, "members": mv}
    if first is not None:
        run["checksums"] = first
    return prefix + RUN_MARK, run, j - i


def _segments(seq: list[tuple[str, tuple[int, ...] | None]], e0: int) -> list[dict[str, Any]] | None:
    """Segments reproducing ``seq`` (layout, block per expert from ``e0``), or None when a block
    is written as explicit zeros (expansion gives no block for zeros)."""
    out: list[dict[str, Any]] = []
    k = 0
    while k < len(seq):
        name, b0 = seq[k]
        if b0 is not None and not any(b0):
            return None
        base = b0 or (0,) * len(_nd_of(seq))
        step: tuple[int, ...] | None = None
        n = 1
        while k + n < len(seq) and seq[k + n][0] == name:
            bn = seq[k + n][1]
            v = bn or (0,) * len(base)
            st = tuple((x - y) // n for x, y in zip(v, base)) if step is None else step
            want = tuple(x + n * y for x, y in zip(base, st))
            if (want if any(want) else None) != bn:
                break
            step = st
            n += 1
        seg: dict[str, Any] = {"layout": name, "stop": e0 + k + n}
        if any(base):
            seg["block"] = list(base)
        if step is not None and any(step):
            seg["step"] = list(step)
        out.append(seg)
        k += n
    return out


def _nd_of(seq: list[tuple[str, tuple[int, ...] | None]]) -> tuple[int, ...]:
    """Any block of ``seq`` (for its length), or ``()`` when none is given."""
    return next((b for _, b in seq if b is not None), ())

