"""The manifest builder the presets share: chunks ``(array, region, local tensor, local offsets)
-> holders`` over the ranks of a mesh, declared local tensors, and the FP8 scales that go along with
their weights."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ...box import Box
from ...compact import Fitter, MeshDecl
from ...spec import ArraySpec, Chunk, Manifest, Source, TensorSpec
from ..mesh import LayoutError, Mesh
from .geometry import PresetError, divide

__all__ = ["Arrays", "Builder", "scale_tensor"]

Arrays = dict[str, tuple[tuple[int, ...], str]]


class Builder:
    """Collects chunks ``(array, region, local tensor, local offsets) -> holders`` and declared
    local tensors, over the ranks of ``mesh`` selected by fixed coordinates."""

    def __init__(self, mesh: Mesh, arrays: Arrays, file_pattern: str | None, *, label: str = "layout",
                 fp8_block: tuple[int, int] | None = None) -> None:
        self.mesh = mesh
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
        n = divide(self.arrays[fqn][0][0], T, msg)
        for t in range(T):
            self.rows(fqn, t * n, n, tensor, l0, self.ranks(pp=stage, tp=t))

    def row_parallel(self, fqn: str, T: int, stage: int, tensor: str, msg: str) -> None:
        """Row-parallel: the input dim (1) split evenly over TP."""
        n = divide(self.arrays[fqn][0][1], T, msg)
        for t in range(T):
            self.cols(fqn, t * n, n, tensor, 0, self.ranks(pp=stage, tp=t))

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

    def whole(self, fqn: str, tensor: str, holders: Iterable[int]) -> None:
        shape = self.arrays[fqn][0]
        z = (0,) * len(shape)
        self.put(fqn, z, shape, tensor, z, holders)

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

    def build(self, *, name: str | None, domain_size: int | None, compact: bool = True) -> Manifest:
        """The manifest. ``compact``: arrays a mesh layout describes exactly refer to it (their
        chunks are expanded on first use, equal to the explicit ones); the others list chunks."""
        if domain_size is not None and (not isinstance(domain_size, int) or domain_size < 1):
            raise LayoutError(f"domain_size must be an integer >= 1, got {domain_size!r}")
        out: dict[str, ArraySpec] = {}
        fitter = Fitter(MeshDecl(str(self.mesh), self.mesh))
        for fqn, (shape, dt) in self.arrays.items():
            spec = self._compact(fqn, tuple(shape), dt, fitter) if compact else None
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


def scale_tensor(tensor: str) -> str:
    """The local tensor holding the FP8 scales of the local weight ``tensor``: its last ``weight``
    becomes ``weight_scale_inv`` (``q_b_proj.weight_scale_inv``, vLLM's ``w13_weight_scale_inv``,
    Megatron grouped-GEMM ``linear_fc1.weight_scale_inv3``).

    >>> scale_tensor("model.layers.0.mlp.experts.w13_weight"), scale_tensor("x.linear_fc1.weight3")
    ('model.layers.0.mlp.experts.w13_weight_scale_inv', 'x.linear_fc1.weight_scale_inv3')
    """
    head, sep, tail = tensor.rpartition("weight")
    return head + "weight_scale_inv" + tail if sep else tensor + "_scale_inv"


