"""The manifest builder the presets share: chunks ``(array, region, local tensor, local offsets)
-> holders`` over the ranks of a mesh, declared local tensors, and the FP8 scales that go along with
their weights.

Regular placements (:meth:`Builder.spread`: an array whole or split evenly over one mesh axis, on
the ranks some fixed coordinates select, at one offset of its local tensor) become layout
references directly when the manifest is compact: O(1) per array instead of one chunk per holder
group, which is what makes DeepSeek-V3 on 256 ranks (1.44M chunks) a matter of seconds. The v1
builder (``compact=False``) lists the same placements chunk by chunk, as it always did; the
irregular ones (vocab padding, Megatron's per-group QKV interleave) are chunks in both, fitted to
a layout at :meth:`Builder.build` where one describes them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ...manifest.box import Box
from ...manifest.compact import ArrayRef, Layout, MeshDecl
from ...manifest.compact_fit import Fitter
from ...manifest.spec import ArraySpec, Chunk, Manifest, Source, TensorSpec
from ..mesh import LayoutError, Mesh, Pin, Placement, Replicate, Shard, chunk_regions
from .geometry import PresetError, divide

__all__ = ["Arrays", "Builder", "scale_tensor"]

Arrays = dict[str, tuple[tuple[int, ...], str]]


class Builder:
    """Collects chunks ``(array, region, local tensor, local offsets) -> holders`` and declared
    local tensors, over the ranks of ``mesh`` selected by fixed coordinates."""

    def __init__(self, mesh: Mesh, arrays: Arrays, file_pattern: str | None, *, label: str = "layout",
                 fp8_block: tuple[int, int] | None = None, compact: bool = True) -> None:
        self.mesh = mesh
        self.compact = compact
        self.arrays = arrays
        self.file = file_pattern
        self.label = label
        self.block = fp8_block
        #: FP8 weight -> its ``weight_scale_inv`` sibling, placed together with the weight by :meth:`put`
        #: (only with ``fp8_block``: fsdp2 / hf shard the scales as arrays of their own)
        self.scale_of = {n.removesuffix("_scale_inv"): n for n in arrays if fp8_block is not None
                         and n.endswith(".weight_scale_inv") and n.removesuffix("_scale_inv") in arrays}
        self.scales = frozenset(self.scale_of.values())
        self.strides = dict(zip(mesh.axes, mesh.strides))
        self.sizes = dict(zip(mesh.axes, mesh.shape))
        self.chunks: dict[str, dict[tuple[Any, ...], set[int]]] = {n: {} for n in arrays}
        self.tensors: dict[int, dict[str, TensorSpec]] = {}
        self._rank_cache: dict[tuple[tuple[str, int], ...], tuple[int, ...]] = {}
        self.fitter = Fitter(MeshDecl(str(mesh), mesh))
        #: arrays placed as layout references (compact only)
        self.refs: dict[str, ArrayRef] = {}
        #: (weight layout, scale layout) -> whether the scale's regions are the weight's in block units
        self._scale_ok: dict[tuple[int, int], bool] = {}
        self._orders: dict[tuple[tuple[int, ...], tuple[Placement, ...]], tuple[int, ...]] = {}

    def size(self, axis: str) -> int:
        return self.sizes.get(axis, 1)

    def ranks(self, **fixed: int) -> tuple[int, ...]:
        """Sorted ranks whose coordinates equal ``fixed`` (absent axes must be 0)."""
        key = tuple(fixed.items())  # call sites pass the same axes in the same order
        got = self._rank_cache.get(key)
        if got is not None:
            return got
        base = 0
        for a, c in fixed.items():
            if a not in self.sizes:
                if c != 0:
                    raise AssertionError(f"coordinate {c} on absent axis {a}")
                continue
            base += c * self.strides[a]
        offs = [0]
        for a in self.mesh.axes:
            if a in fixed:
                continue
            offs = [o + c * self.strides[a] for o in offs for c in range(self.sizes[a])]
        out = tuple(sorted(base + o for o in offs))
        self._rank_cache[key] = out
        return out

    def put(self, fqn: str, offsets: Sequence[int], sizes: Sequence[int], tensor: str,
            local: Sequence[int], holders: Iterable[int], *, scale_row: int | None = None) -> None:
        """One chunk. An FP8 weight's ``weight_scale_inv`` goes along, in block units (``scale_row``:
        its row in the local scale tensor when that is not ``local[0] / block``, e.g. stacked experts
        whose row count is not a multiple of the block)."""
        if any(s == 0 for s in sizes):
            return
        holders = tuple(holders)
        key = (tuple(offsets), tuple(sizes), tensor, tuple(local))
        self.chunks[fqn].setdefault(key, set()).update(holders)
        if fqn in self.scale_of:
            self._put_scale(fqn, offsets, sizes, tensor, local, holders, scale_row)

    def _put_scale(self, fqn: str, offsets: Sequence[int], sizes: Sequence[int], tensor: str,
                   local: Sequence[int], holders: tuple[int, ...], scale_row: int | None) -> None:
        """The scale blocks of a weight chunk: a piece must start on a block boundary and end on
        one (or at the end of the array), and sit on one in its local tensor -- else the shard's
        scales would not be whole blocks of the scale grid (vLLM's block-FP8 loader refuses
        such shards too)."""
        sfqn = self.scale_of[fqn]
        if self.block is None:
            raise AssertionError(f"{sfqn}: FP8 scales without a block size")
        shape = self.arrays[fqn][0]
        so: list[int] = []
        ss: list[int] = []
        sl: list[int] = []
        for d, (o, n, lo, b, full) in enumerate(zip(offsets, sizes, local, self.block, shape)):
            end = o + n
            if o % b or (end % b and end != full):
                raise PresetError(f"{self.label}: {fqn}: its shard [{o}, {end}) of dim {d} (size {full}) does not "
                                   f"start and end on FP8 block boundaries (multiples of {b}), so {sfqn} cannot be "
                                   f"split with it; pick parallel sizes that split dim {d} into multiples of {b}")
            if d == 0 and scale_row is not None:
                sl.append(scale_row)
            elif lo % b:
                raise PresetError(f"{self.label}: {fqn}: it sits at offset {lo} of dim {d} of the fused local tensor "
                                   f"{tensor}, not on an FP8 block boundary (a multiple of {b}), so {sfqn} cannot "
                                   f"be fused the same way; pick parallel sizes that keep the fused parts "
                                   f"multiples of {b}")
            else:
                sl.append(lo // b)
            so.append(o // b)
            ss.append(-(-end // b) - o // b)
        self.put(sfqn, so, ss, scale_tensor(tensor), sl, holders)

    def rows(self, fqn: str, r0: int, n: int, tensor: str, l0: int, holders: Iterable[int], *,
             scale_row: int | None = None) -> None:
        """Rows ``[r0, r0+n)`` (all of the other dims) at row ``l0`` of ``tensor``."""
        shape = self.arrays[fqn][0]
        z = (0,) * (len(shape) - 1)
        self.put(fqn, (r0, *z), (n, *shape[1:]), tensor, (l0, *z), holders, scale_row=scale_row)

    def cols(self, fqn: str, c0: int, n: int, tensor: str, l0: int, holders: Iterable[int], *,
             scale_row: int | None = None) -> None:
        """Columns ``[c0, c0+n)`` of a 2-D array at ``(l0, 0)`` of ``tensor``."""
        shape = self.arrays[fqn][0]
        self.put(fqn, (0, c0), (shape[0], n), tensor, (l0, 0), holders, scale_row=scale_row)

    def column(self, fqn: str, T: int, stage: int, tensor: str, l0: int, msg: str) -> None:
        """Column-parallel: dim 0 split evenly over TP, at row ``l0`` of each TP rank's ``tensor``
        (``msg``: the error when tp does not divide it)."""
        divide(self.arrays[fqn][0][0], T, msg)
        self.spread(fqn, tensor, {"pp": stage}, split=("tp", 0), l0=l0)

    def row_parallel(self, fqn: str, T: int, stage: int, tensor: str, msg: str) -> None:
        """Row-parallel: the input dim (1) split evenly over TP."""
        divide(self.arrays[fqn][0][1], T, msg)
        self.spread(fqn, tensor, {"pp": stage}, split=("tp", 1))

    def gate_up(self, fqn: str, T: int, stage: int, tensor: str, label: str) -> None:
        """A column-parallel gate or up array into the fused ``[gate_shard; up_shard]`` local
        tensor of each TP rank (Megatron ``linear_fc1``, vLLM ``gate_up_proj``)."""
        shape = self.arrays[fqn][0]
        msg = f"{label}: intermediate_size ({shape[0]}) must be divisible by tp ({T})"
        n = divide(shape[0], T, msg)
        self.column(fqn, T, stage, tensor, n if ".up_proj." in fqn else 0, msg)

    def down(self, fqn: str, T: int, stage: int, tensor: str, label: str) -> None:
        """The row-parallel down projection: its input dim split over TP."""
        shape = self.arrays[fqn][0]
        self.row_parallel(fqn, T, stage, tensor, f"{label}: intermediate_size ({shape[1]}) must be divisible by "
                                                 f"tp ({T})")

    def vocab_parallel(self, fqn: str, tensor: str, stages: Sequence[int], per: int) -> None:
        """Vocab-parallel embedding / output layer: TP rank ``t`` holds padded-vocab rows
        ``[t·per, (t+1)·per)`` (rows past the real vocab are padding no chunk covers), on every
        stage of ``stages``."""
        shape, dt = self.arrays[fqn]
        for t in range(self.size("tp")):
            hs = sorted({r for s in stages for r in self.ranks(pp=s, tp=t)})
            lo, hi = t * per, min((t + 1) * per, shape[0])
            if hi > lo:
                self.rows(fqn, lo, hi - lo, tensor, 0, hs)
            self.declare(hs, tensor, (per, *shape[1:]), dt)

    def whole(self, fqn: str, tensor: str, **fixed: int) -> None:
        """The whole array at the origin of ``tensor`` on every rank whose coordinates are ``fixed``."""
        self.spread(fqn, tensor, fixed)

    def spread(self, fqn: str, tensor: str, fixed: Mapping[str, int], *, split: tuple[str, int] | None = None,
               replicas: int = 1, l0: int = 0, scale_row: int | None = None) -> None:
        """The array on the ranks whose coordinates are ``fixed`` (other axes replicate): whole, or
        with ``split = (axis, dim)`` its dim split evenly over ``axis``, coordinate ``t`` holding
        piece ``t // replicas`` (vLLM's kv heads replicated over neighbouring TP ranks); every
        piece at row ``l0`` of ``tensor``. The caller has checked that the pieces divide evenly.
        Compact: one layout reference (the FP8 scale's too), else the chunks one by one."""
        if self.compact and self._spread_ref(fqn, tensor, fixed, split, replicas, l0, scale_row):
            return
        shape = self.arrays[fqn][0]
        local = (l0, *(0,) * (len(shape) - 1)) if shape else ()
        if split is None:
            self.put(fqn, (0,) * len(shape), shape, tensor, local, self.ranks(**fixed), scale_row=scale_row)
            return
        axis, dim = split
        T = self.size(axis)
        n, rest = divmod(shape[dim], T // replicas)
        if rest or T % replicas:
            raise AssertionError(f"{fqn}: dim {dim} ({shape[dim]}) does not split evenly over {axis} = {T}")
        for t in range(T):
            offs = [0] * len(shape)
            sizes = list(shape)
            offs[dim], sizes[dim] = t // replicas * n, n
            self.put(fqn, offs, sizes, tensor, local, self.ranks(**fixed, **{axis: t}), scale_row=scale_row)

    def _spread_ref(self, fqn: str, tensor: str, fixed: Mapping[str, int], split: tuple[str, int] | None,
                    replicas: int, l0: int, scale_row: int | None) -> bool:
        """:meth:`spread` as layout references (the array's and its FP8 scale's); False (nothing
        recorded) when either needs explicit chunks: an empty array, a scale that does not follow
        its weight block for block (the chunk path then names the problem)."""
        shape, dt = self.arrays[fqn]
        if not shape or 0 in shape:
            return False
        got = self._geometry(fixed, split, replicas)
        if got is None:
            return False
        decl, pl = got
        local = (l0, *(0,) * (len(shape) - 1))
        ref = self._ref(fqn, shape, dt, decl, pl, tensor, local)
        if ref is None:
            return False
        sfqn = self.scale_of.get(fqn)
        if sfqn is not None:
            sref = self._scale_ref(fqn, sfqn, decl, pl, tensor, local, scale_row, ref.layout)
            if sref is None:
                return False
            self.refs[sfqn] = sref
        self.refs[fqn] = ref
        return True

    def _ref(self, fqn: str, shape: tuple[int, ...], dt: str, decl: MeshDecl, pl: tuple[Placement, ...],
             tensor: str, local: tuple[int, ...], order: tuple[int, ...] | None = None) -> ArrayRef | None:
        return self.fitter.ref(fqn, shape, dt, decl, pl, order, None if tensor == fqn else tensor,
                               local if any(local) else None, self.file)

    def sharded(self, fqn: str, fixed: Mapping[str, int], splits: Sequence[tuple[str, int]]) -> bool:
        """FSDP2's placement as one layout reference: the array (its own local tensor, at the
        origin) on the ranks whose coordinates are ``fixed``, its dims split by torch.chunk over
        the ``(axis, dim)`` of ``splits``, each split cutting the piece the previous ones left (TP
        first, then FSDP: the ``_StridedShard`` order). True when recorded; False (compact off,
        or a split that leaves an empty piece, which the chunk path lists as it always did) tells
        the caller to put the chunks itself."""
        shape, dt = self.arrays[fqn]
        if not self.compact or not shape or 0 in shape or not _no_empty_piece(shape, splits, self.sizes):
            return False
        by_axis = dict(splits)
        pl = tuple(Replicate() if n == 1 else Pin(fixed[a]) if a in fixed else
                   Shard(by_axis[a]) if a in by_axis else Replicate() for a, n in zip(self.mesh.axes, self.mesh.shape))
        ref = self._ref(fqn, shape, dt, self.fitter.decl, pl, fqn, (0,) * len(shape),
                        self._shard_order(shape, pl, [a for a, _ in splits]))
        if ref is None:
            return False
        self.refs[fqn] = ref
        return True

    def _shard_order(self, shape: tuple[int, ...], pl: tuple[Placement, ...],
                     split_axes: Sequence[str]) -> tuple[int, ...] | None:
        """The ``order`` :class:`~formats.manifest.compact_fit.Fitter` writes for splits in
        ``split_axes`` order: None when mesh order gives the same regions, else every mesh axis
        reversed (its only other candidate, which puts the two split axes the other way round)."""
        idx = [self.mesh.axes.index(a) for a in split_axes if self.size(a) > 1]
        if idx == sorted(idx):
            return None
        key = (shape, pl)
        got = self._orders.get(key)
        if got is None:
            rev = tuple(range(self.mesh.ndim - 1, -1, -1))
            same = chunk_regions(shape, self.mesh, pl) == chunk_regions(shape, self.mesh, pl, order=rev)
            got = self._orders[key] = () if same else rev
        return got or None

    def _geometry(self, fixed: Mapping[str, int], split: tuple[str, int] | None,
                  replicas: int) -> tuple[MeshDecl, tuple[Placement, ...]] | None:
        """The mesh and placements of a :meth:`spread`, as :class:`~formats.manifest.compact_fit.Fitter` reads
        them off the chunks (so both write the same layouts): axes of size 1 replicate, a fixed
        axis pins, the split axis shards; replicated pieces split the axis in two (``tp`` as
        ``tp, tp_rep``: pieces over the first, replicas over the second)."""
        axis, dim = split if split is not None else ("", 0)
        pieces = self.size(axis) // replicas if split is not None else 1
        decl = self.fitter.decl
        names, sizes = list(self.mesh.axes), list(self.mesh.shape)
        if pieces > 1 and replicas > 1:
            k = names.index(axis)
            rep = axis + "_rep"
            if rep in names:
                return None
            names[k + 1:k + 1] = [rep]
            sizes[k:k + 1] = [pieces, replicas]
            m = Mesh(tuple(names), tuple(sizes))
            decl = MeshDecl(str(m), m, decl.start, decl.step)
        pl: list[Placement] = []
        for a, n in zip(names, sizes):
            if n == 1:
                pl.append(Replicate())
            elif a in fixed:
                pl.append(Pin(fixed[a]))
            elif a == axis and pieces > 1:
                pl.append(Shard(dim))
            else:
                pl.append(Replicate())
        return decl, tuple(pl)

    def _scale_ref(self, fqn: str, sfqn: str, decl: MeshDecl, pl: tuple[Placement, ...], tensor: str,
                   local: tuple[int, ...], scale_row: int | None, weight: Layout) -> ArrayRef | None:
        """The FP8 scale of a weight placed by layout: the same mesh and placements over the scale
        grid, at the weight's local offset in block units -- when that gives exactly the chunks
        :meth:`_put_scale` would (checked once per pair of layouts), else None."""
        assert self.block is not None
        slocal: list[int] = []
        for d, (lo, b) in enumerate(zip(local, self.block)):
            if d == 0 and scale_row is not None:
                slocal.append(scale_row)
            elif lo % b:
                return None
            else:
                slocal.append(lo // b)
        sshape, sdt = self.arrays[sfqn]
        sref = self._ref(sfqn, sshape, sdt, decl, pl, scale_tensor(tensor), tuple(slocal))
        if sref is None:
            return None
        key = (id(weight), id(sref.layout))
        ok = self._scale_ok.get(key)
        if ok is None:
            ok = self._scale_ok[key] = self._scale_follows(weight, sref.layout)
        return sref if ok else None

    def _scale_follows(self, weight: Layout, scale: Layout) -> bool:
        """Whether ``scale``'s regions are ``weight``'s in block units, every piece starting and
        ending on the block grid (the rule :meth:`_put_scale` enforces chunk by chunk)."""
        assert self.block is not None
        want: list[tuple[Box, tuple[int, ...]]] = []
        for box, hs in weight.regions:
            so: list[int] = []
            ss: list[int] = []
            for o, n, b, full in zip(box.offsets, box.sizes, self.block, weight.shape):
                end = o + n
                if o % b or (end % b and end != full):
                    return False
                so.append(o // b)
                ss.append(-(-end // b) - o // b)
            want.append((Box(tuple(so), tuple(ss)), hs))
        return want == list(scale.regions)

    def declare(self, holders: Iterable[int], tensor: str, shape: Sequence[int], data_type: str) -> None:
        for r in holders:
            self.tensors.setdefault(r, {})[tensor] = TensorSpec(tuple(shape), data_type)

    def _source(self, fqn: str, tensor: str, local: tuple[int, ...]) -> Source | None:
        offsets = tuple(local) if any(local) else None
        if tensor != fqn or offsets is not None or self.file is not None:
            return Source(tensor=tensor if tensor != fqn else None, offsets=offsets, file=self.file)
        return None

    def _compact(self, fqn: str, shape: tuple[int, ...], dt: str, fitter: Fitter) -> ArraySpec | None:
        """The array as a layout reference (chunks expanded lazily), when one local tensor at one
        offset holds it and a layout on the mesh describes its chunks exactly."""
        items = self.chunks[fqn]
        if not items:
            return None
        (_, _, tensor, local) = next(iter(items))
        if any(k[2] != tensor or k[3] != local for k in items):
            return None
        regions = sorted((offs, sizes, tuple(sorted(hs))) for (offs, sizes, _, _), hs in items.items())
        ref = fitter.fit(fqn, shape, dt, regions, self._source(fqn, tensor, tuple(local)))
        return None if ref is None else ArraySpec(shape, dt, ref=ref, fqn=fqn)

    def build(self, *, name: str | None, domain_size: int | None) -> Manifest:
        """The manifest. Compact: arrays a mesh layout describes exactly refer to it (their chunks
        are expanded on first use, equal to the explicit ones); the others list chunks."""
        if domain_size is not None and (not isinstance(domain_size, int) or domain_size < 1):
            raise LayoutError(f"domain_size must be an integer >= 1, got {domain_size!r}")
        out: dict[str, ArraySpec] = {}
        for fqn, (shape, dt) in self.arrays.items():
            ref = self.refs.get(fqn)
            if ref is not None:
                out[fqn] = ArraySpec(tuple(shape), dt, ref=ref, fqn=fqn)
                continue
            spec = self._compact(fqn, tuple(shape), dt, self.fitter) if self.compact else None
            if spec is not None:
                out[fqn] = spec
                continue
            chunks = []
            for (offs, sizes, tensor, local), hs in self.chunks[fqn].items():
                chunks.append(Chunk(Box(offs, sizes), tuple(sorted(hs)), self._source(fqn, tensor, tuple(local))))
            chunks.sort(key=lambda c: (c.region.offsets, c.holders))
            out[fqn] = ArraySpec(tuple(shape), dt, tuple(chunks))
        return Manifest(world_size=self.mesh.size, arrays=out, name=name, mesh=self.mesh.to_dict(),
                        topology={"domain_size": domain_size} if domain_size is not None else None,
                        tensors={r: dict(sorted(ts.items())) for r, ts in sorted(self.tensors.items())})


def _no_empty_piece(shape: Sequence[int], splits: Sequence[tuple[str, int]], sizes: Mapping[str, int]) -> bool:
    """Whether nested torch.chunk splits of ``shape`` (``(axis, dim)`` in order, ``sizes[axis]``
    pieces each) leave every piece non-empty (an empty piece makes the fitted layout a pin).

    >>> _no_empty_piece((10, 4), [("tp", 0), ("fsdp", 0)], {"tp": 3, "fsdp": 2}), _no_empty_piece((5,), [("f", 0)], {"f": 4})
    (True, False)
    """
    extents: dict[int, set[int]] = {}
    for axis, dim in splits:
        n = sizes.get(axis, 1)
        nxt: set[int] = set()
        for size in extents.get(dim, {shape[dim]}):
            c = -(-size // n)  # torch.chunk: n - 1 pieces of c, then the rest
            if (n - 1) * c >= size:
                return False
            nxt.update((c, size - (n - 1) * c))
        extents[dim] = nxt
    return True


def scale_tensor(tensor: str) -> str:
    """The local tensor holding the FP8 scales of the local weight ``tensor``: its last ``weight``
    becomes ``weight_scale_inv`` (``q_b_proj.weight_scale_inv``, vLLM's ``w13_weight_scale_inv``,
    Megatron grouped-GEMM ``linear_fc1.weight_scale_inv3``).

    >>> scale_tensor("model.layers.0.mlp.experts.w13_weight"), scale_tensor("x.linear_fc1.weight3")
    ('model.layers.0.mlp.experts.w13_weight_scale_inv', 'x.linear_fc1.weight_scale_inv3')
    """
    head, sep, tail = tensor.rpartition("weight")
    return head + "weight_scale_inv" + tail if sep else tensor + "_scale_inv"


