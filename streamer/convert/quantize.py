"""Quantize on convert: a ``float8_e4m3fn`` destination array with a ``…_scale_inv`` (or
``…_scale``) sibling, fed from a bf16/fp16/fp32/fp64 source array without scales, is quantized
while it is written (``formats.quant``).

The plan moves the weight in its source dtype (as for a cast, ``with_dtypes``) and knows nothing
of the scale array. While a sink fills a slab of the FP8 local tensor, or of its scale local
tensor (safetensors: the ``Quantizer``), or a unit of the FP8 or scale zarr array
(``quantized_box``), the source elements of the whole blocks it meets are read through the
weight's transfers and quantized, and its part is written. Every block lies in one
destination chunk (the destination is block-aligned, which ``quant_targets`` checks), so a
block's scale is the same on every holder and in every slab that computes it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from formats.box import Box
from formats.dtypes import by_name
from formats.errors import PlanError
from formats.manifest import ArraySpec, Chunk, Manifest
from formats.quant import MX_BLOCK, QuantScheme, quantize, to_float32

from ..plan import Transfer
from .cast import FLOATS, with_dtypes
from .fill import U8, Buffer, Filler

__all__ = ["FP8_BLOCK", "QuantTarget", "Quantizer", "block_image", "blocks_of", "on_grid", "planned_destination",
           "quant_report", "quant_targets", "steps"]

#: DeepSeek-V3 / vLLM block of block-FP8 weights (one float32 scale per 128×128 elements)
FP8_BLOCK = (128, 128)
#: scale siblings of weight ``W``: ``W_scale_inv`` (DeepSeek, vLLM) or ``W_scale`` (MX checkpoints)
SCALE_SUFFIXES = ("_scale_inv", "_scale")
#: float32 elements one quantization step may hold (a few temporaries of this size are live)
STEP_ELEMENTS = 1 << 22
#: scales kept from filling the FP8 data for filling the scale tensor (per destination file)
SCALE_CACHE_BYTES = 64 << 20


@dataclass(frozen=True)
class QuantTarget:
    """One destination weight quantized on write, with the scale array computed beside it."""

    weight: str
    scale: str
    src_dtype: str
    scheme: QuantScheme


def _scheme(fqn: str, w: ArraySpec, s: ArraySpec, block: tuple[int, int], ue8m0: bool) -> QuantScheme | str:
    """The scheme the destination asks for ``fqn``, or the one problem line."""
    nd = len(w.shape)
    if nd == 0:
        return f"{fqn}: a 0-d FP8 array cannot be block-quantized"
    if s.data_type == "float8_e8m0fnu":
        sch = QuantScheme("mx", (1,) * (nd - 1) + (MX_BLOCK,))
    elif s.data_type == "float32":
        sch = QuantScheme("block", ((1,) * (nd - 2) + block)[-nd:], ue8m0)
    else:
        return (f"{fqn}: scale array has data_type {s.data_type} (expected float32 for block FP8, "
                "float8_e8m0fnu for MXFP8)")
    want = sch.scale_shape(tuple(w.shape))
    if tuple(s.shape) != want:
        return (f"{fqn}: scale array shape {list(s.shape)} does not match {sch.describe()} blocks "
                f"(expected {list(want)}; block FP8 sizes are set with --fp8-block)")
    return sch


def on_grid(r: Box, block: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether ``r`` is whole blocks (the last block of a dim may be partial)."""
    return all(o % b == 0 and ((o + n) % b == 0 or o + n == full)
               for o, n, b, full in zip(r.offsets, r.sizes, block, shape))


def block_image(r: Box, block: Sequence[int]) -> Box:
    """The scale indices of the blocks of ``r`` (on the grid)."""
    return Box(tuple(o // b for o, b in zip(r.offsets, block)),
               tuple(-(-(o + n) // b) - o // b for o, n, b in zip(r.offsets, r.sizes, block)))


def _layout_problems(fqn: str, w: ArraySpec, s: ArraySpec, sch: QuantScheme) -> list[str]:
    """Destination chunks must be whole blocks (the last of a dim may be partial), and the scale
    chunks their block images on the same holders: a block is then quantized where it is stored."""
    blk = "x".join(map(str, sch.block))
    for c in w.chunks:
        if not on_grid(c.region, sch.block, w.shape):
            return [f"{fqn}: destination chunk {c.region} is not aligned to the {blk} quantization blocks "
                    "(only the last block of a dim may be partial); pick a layout whose shards are whole blocks"]
    images = sorted((c.holders, img.offsets, img.sizes)
                    for c in w.chunks for img in (block_image(c.region, sch.block),))
    scales = sorted((c.holders, c.region.offsets, c.region.sizes) for c in s.chunks)
    if images != scales:
        return [f"{fqn}: the chunks of its scale array are not the block images of its chunks on the same "
                "holders (a scale must be stored with the weight rows it scales)"]
    return []


def quant_targets(src: Manifest, dst: Manifest, *, block: tuple[int, int] = FP8_BLOCK,
                  ue8m0: bool = False) -> dict[str, QuantTarget]:
    """Every destination weight to quantize on write; ``PlanError`` (one line per array) when
    one is asked in a way that cannot be met."""
    targets: dict[str, QuantTarget] = {}
    problems: list[str] = []
    for fqn, w in dst.arrays.items():
        s_src = src.arrays.get(fqn)
        if w.data_type != "float8_e4m3fn" or s_src is None or s_src.data_type not in FLOATS:
            continue
        scale = next((fqn + x for x in SCALE_SUFFIXES if fqn + x in dst.arrays and fqn + x not in src.arrays), None)
        if scale is None:
            problems.append(f"{fqn}: float8_e4m3fn destination fed from {s_src.data_type} has no {fqn}_scale_inv "
                            "array to quantize with (describe the scales in the destination, e.g. layout --fp8)")
            continue
        sch = _scheme(fqn, w, dst.arrays[scale], block, ue8m0)
        if isinstance(sch, str):
            problems.append(sch)
            continue
        lay = _layout_problems(fqn, w, dst.arrays[scale], sch)
        problems.extend(lay)
        if not lay:
            targets[fqn] = QuantTarget(fqn, scale, s_src.data_type, sch)
    problems.extend(_mixed_tensors(dst, targets))
    if problems:
        raise PlanError(problems=problems)
    return targets


def _mixed_tensors(dst: Manifest, targets: Mapping[str, QuantTarget]) -> list[str]:
    """A local tensor holding quantized weights or their scales may hold nothing else: it is
    filled by the quantizer alone."""
    if not targets:  # nothing quantized: no chunk to look at (a compact manifest stays unexpanded)
        return []
    quantized = set(targets) | {t.scale for t in targets.values()}
    held = {(h, c.tensor(f)) for f in quantized for c in dst.arrays[f].chunks for h in c.holders}
    return sorted({f"{fqn}: stored in local tensor {c.tensor(fqn)!r} beside quantized weights or their scales; "
                   "such a local tensor may hold only those" for fqn, _, c in dst.iter_chunks()
                   if fqn not in quantized and any((h, c.tensor(fqn)) in held for h in c.holders)})


def planned_destination(dst: Manifest, targets: Mapping[str, QuantTarget], casts: Mapping[str, str]) -> Manifest:
    """The destination the plan moves: quantized weights (and ``casts``) in their source dtype,
    without the scale arrays (nothing in the source feeds them)."""
    m = with_dtypes(dst, {**casts, **{f: t.src_dtype for f, t in targets.items()}})
    scales = {t.scale for t in targets.values()}
    return m.with_arrays({f: a for f, a in m.arrays.items() if f not in scales}) if scales else m


def quant_report(dst: Manifest, targets: Mapping[str, QuantTarget], where: str) -> dict[str, Any]:
    """Which arrays are quantized, how, and the bytes saved against storing them unquantized
    (logical arrays, one copy each)."""
    arrays: dict[str, Any] = {}
    for f, t in targets.items():
        w, s = dst.arrays[f], dst.arrays[t.scale]
        n = int(np.prod(w.shape, dtype=np.int64))
        unquantized = n * by_name(t.src_dtype).itemsize
        stored = n + int(np.prod(s.shape, dtype=np.int64)) * by_name(s.data_type).itemsize
        arrays[f] = {"scheme": t.scheme.describe(), "scale": t.scale, "from": t.src_dtype, "where": where,
                     "bytes_unquantized": unquantized, "bytes_stored": stored, "bytes_saved": unquantized - stored}
    return {"arrays": arrays, "bytes_saved": sum(a["bytes_saved"] for a in arrays.values())}


# ------------------------------------------------------------------ blocks and steps

#: fills ``buf`` with the source bytes of a box of weight elements (whole blocks)
Read = Callable[[Box, U8], None]


def steps(box: Box, block: Sequence[int], shape: Sequence[int]) -> list[Box]:
    """``box`` (weight elements) grown to whole blocks, cut along dim 0 into steps of a bounded
    element count, each on the block grid."""
    lo = tuple(o // b * b for o, b in zip(box.offsets, block))
    hi = tuple(min(-(-s // b) * b, n) for s, b, n in zip(box.stops, block, shape))
    grown = Box(lo, tuple(h - o for o, h in zip(lo, hi)))
    row = max(1, grown.volume // max(grown.sizes[0], 1))
    rows = max(block[0], STEP_ELEMENTS // row // block[0] * block[0])
    return [Box((r,) + lo[1:], (min(rows, hi[0] - r),) + grown.sizes[1:]) for r in range(lo[0], hi[0], rows)]


def blocks_of(g: Box, block: Sequence[int], shape: Sequence[int]) -> Box:
    """The weight elements scaled by the scale indices ``g``."""
    lo = tuple(o * b for o, b in zip(g.offsets, block))
    return Box(lo, tuple(min(s * b, n) - o for s, b, n, o in zip(g.stops, block, shape, lo)))


def quantize_step(t: QuantTarget, step: Box, read: Read, buf: Buffer) -> tuple[np.ndarray[Any, Any],
                                                                               np.ndarray[Any, Any]]:
    """(FP8 bits, scales) of ``step`` (whole blocks), its source bytes read through ``read``."""
    raw = buf.take(step.volume * by_name(t.src_dtype).itemsize)
    read(step, raw)
    return quantize(to_float32(raw, t.src_dtype, step.sizes), t.scheme)


def quantized_box(t: QuantTarget, shape: Sequence[int], g: Box, read: Read, buf: Buffer, *,
                  scales: bool) -> np.ndarray[Any, Any]:
    """The stored values of box ``g`` of the weight (FP8 bits) or, with ``scales``, of its scale
    array (``g`` in scale indices), computed from whole blocks in bounded steps."""
    block = t.scheme.block
    rows = blocks_of(g, block, shape) if scales else g
    out: np.ndarray[Any, Any] | None = None
    for step in steps(rows, block, shape):
        q, s = quantize_step(t, step, read, buf)
        have, at = (s, block_image(step, block)) if scales else (q, step)
        if out is None:
            out = np.zeros(g.sizes, have.dtype)
        piece = at.intersect(g)
        if piece is not None and not piece.empty:
            out[piece.relative_to(g.offsets).slices] = have[piece.relative_to(at.offsets).slices]
    assert out is not None
    return out


# ------------------------------------------------------------------ filling slabs

@dataclass(frozen=True)
class _Part:
    """A quantized chunk (``scale`` False) or a scale chunk inside one local tensor on one rank."""

    target: QuantTarget
    chunk: Chunk
    scale: bool


class Quantizer:
    """Fills slabs of the FP8 and scale local tensors from the weights' source elements."""

    def __init__(self, stored: Manifest, targets: Mapping[str, QuantTarget],
                 transfers: Callable[[int, str], Sequence[Transfer]]) -> None:
        self.stored = stored
        self.transfers = transfers
        self.parts: dict[tuple[int, str], list[_Part]] = defaultdict(list)
        # (rank, weight) -> its chunks there: where a scale chunk's weight rows are read from
        self.weight_chunks: dict[tuple[int, str], list[Chunk]] = defaultdict(list)
        for t in targets.values():
            for c in stored.arrays[t.weight].chunks:
                for h in c.holders:
                    self.parts[(h, c.tensor(t.weight))].append(_Part(t, c, False))
                    self.weight_chunks[(h, t.weight)].append(c)
            for c in stored.arrays[t.scale].chunks:
                for h in c.holders:
                    self.parts[(h, c.tensor(t.scale))].append(_Part(t, c, True))
        self._src = Buffer()
        # (rank, weight, chunk offsets) -> (the chunk's scales, which scale rows are known): the
        # scales computed with the data, so the scale tensor needs no second read of the weight
        self._known: dict[tuple[int, str, tuple[int, ...]], tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = {}
        self._known_bytes = 0

    def holds(self, rank: int, name: str) -> bool:
        return (rank, name) in self.parts

    def forget(self) -> None:
        """Drop the scales kept from the data (a destination file is done)."""
        self._known.clear()
        self._known_bytes = 0

    def _remember(self, rank: int, t: QuantTarget, c: Chunk, step: Box, s: np.ndarray[Any, Any]) -> None:
        img, st = block_image(c.region, t.scheme.block), block_image(step, t.scheme.block)
        if st.sizes[1:] != img.sizes[1:]:
            return  # a step narrower than the chunk (a slab of part of a row): not worth tracking
        key = (rank, t.weight, c.region.offsets)
        known = self._known.get(key)
        if known is None:
            if self._known_bytes + img.volume * s.itemsize > SCALE_CACHE_BYTES:
                return
            known = (np.empty(img.sizes, s.dtype), np.zeros(img.sizes[0], bool))
            self._known[key] = known
            self._known_bytes += img.volume * s.itemsize
        r0 = st.offsets[0] - img.offsets[0]
        known[0][r0:r0 + st.sizes[0]] = s
        known[1][r0:r0 + st.sizes[0]] = True

    def _recall(self, rank: int, t: QuantTarget, c: Chunk, g: Box) -> np.ndarray[Any, Any] | None:
        known = self._known.get((rank, t.weight, c.region.offsets))
        if known is None:
            return None
        rel = g.relative_to(block_image(c.region, t.scheme.block).offsets)
        return known[0][rel.slices] if known[1][rel.slices[0]].all() else None

    def fill(self, rank: int, name: str, slab: Box, out: U8, filler: Filler) -> None:
        """``out``: the stored bytes of ``slab`` of local tensor ``name`` on ``rank``."""
        parts = self.parts[(rank, name)]
        isz = out.size // slab.volume
        out[:] = 0
        view = out.reshape(slab.sizes + (isz,))
        for p in parts:
            inter = slab.intersect(p.chunk.local_box)
            if inter is None or inter.empty:
                continue
            g = inter.shift(tuple(r - lo for r, lo in zip(p.chunk.region.offsets, p.chunk.local_offsets)))
            for piece, vals in (self._scales(rank, p.target, g, filler) if p.scale
                                else self._data(rank, p, g, filler)):
                rel = piece.shift(tuple(lo - r for r, lo in zip(p.chunk.region.offsets, p.chunk.local_offsets)))
                view[rel.relative_to(slab.offsets).slices] = vals.view(np.uint8).reshape(piece.sizes + (isz,))

    # ---- the weight's source elements, quantized block by block

    def _reader(self, rank: int, t: QuantTarget, c: Chunk, filler: Filler) -> Read:
        """Reads weight elements of chunk ``c`` from its local tensor on ``rank``, as planned."""
        isz = by_name(t.src_dtype).itemsize
        delta = tuple(lo - r for r, lo in zip(c.region.offsets, c.local_offsets))
        transfers = self.transfers(rank, c.tensor(t.weight))
        return lambda step, buf: filler.fill(step.shift(delta), transfers, isz, buf)

    def _data(self, rank: int, p: _Part, g: Box, filler: Filler) -> list[tuple[Box, np.ndarray[Any, Any]]]:
        t, shape = p.target, self.stored.arrays[p.target.weight].shape
        read = self._reader(rank, t, p.chunk, filler)
        out = []
        for step in steps(g, t.scheme.block, shape):
            q, s = quantize_step(t, step, read, self._src)
            self._remember(rank, t, p.chunk, step, s)
            piece = step.intersect(g)
            if piece is not None and not piece.empty:
                out.append((piece, np.ascontiguousarray(q[piece.relative_to(step.offsets).slices])))
        return out

    def _scales(self, rank: int, t: QuantTarget, g: Box, filler: Filler) -> list[tuple[Box, np.ndarray[Any, Any]]]:
        """The scales of the blocks ``g`` (scale indices), from the weight rows they scale."""
        shape = self.stored.arrays[t.weight].shape
        rows = blocks_of(g, t.scheme.block, shape)
        c = next(c for c in self.weight_chunks[(rank, t.weight)] if c.region.contains(rows))
        known = self._recall(rank, t, c, g)
        if known is None:
            known = quantized_box(t, shape, g, self._reader(rank, t, c, filler), self._src, scales=True)
        return [(g, np.ascontiguousarray(known))]
