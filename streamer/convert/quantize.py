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

from formats.manifest.box import Box
from formats.manifest.dtypes import by_name
from formats.manifest.wire import Chunk, Manifest
from formats.quant import quantize, to_float32
from streamer.convert.fill import U8, Buffer, Filler
from streamer.ops.quant import QuantTarget, block_image, blocks_of, steps
from streamer.plan.model import Transfer

__all__ = ["Quantizer", "quantize_step", "quantized_box"]


#: scales kept from filling the FP8 data for filling the scale tensor (per destination file)
SCALE_CACHE_BYTES = 64 << 20

Read = Callable[[Box, U8], None]


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
