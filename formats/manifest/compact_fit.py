"""Writing compact manifests: for each array, the layout on the manifest's mesh whose expansion
is exactly its chunks (:class:`Fitter`), and the v2 wire form with meshes, layouts, expert runs
and segments (:func:`compact_dict`). Arrays no layout describes keep their explicit chunks.
No I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ..integrity.sidecar import ChecksumWriter
from ..layouts.mesh import LayoutError, Mesh, Pin, Placement, Replicate, Shard, chunk_regions
from .box import Box
from .compact import RUN_MARK, ArrayRef, Layout, MeshDecl
from .compact_patterns import array_vars, fill_pattern, templatize
from .spec import FORMAT, Source

if TYPE_CHECKING:
    from .spec import ArraySpec, Manifest

__all__ = ["Fitter", "Region", "compact_dict"]

#: an expert array's name: (prefix ending in ``experts``, expert, member suffix)
_EXPERT_RE = re.compile(r"(.*(?<![^.])(?:local_)?experts)\.(\d+)\.(.+)\Z")


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
