"""Quantize on refit: a ``float8_e4m3fn`` destination array with a scale sibling, fed from a
bf16/fp16/fp32/fp64 trainer array, is quantized while the refit moves it (the schemes and the
checks of ``convert.quantize``: block FP8 per DeepGEMM, its UE8M0 variant, MXFP8).

Where, per array, decided from the manifests alone (every rank decides the same):

* **sender** — every source chunk of the weight is whole blocks of the destination's grid, so
  every sender holds the whole blocks around anything it sends: it quantizes them and sends FP8
  bytes plus the blocks' scales (the wire carries about half the bytes of bf16). The plan moves
  the weight as FP8 from a *virtual* source scale array (the block images of the weight's source
  chunks, on the same holders), so each scale element goes from a rank that holds its block.
* **receiver** — otherwise (a trainer shard boundary cuts a block). The weight moves in its
  source type into a staging buffer per destination local tensor (allocated once per session);
  after the push every holder quantizes its chunks (whole blocks: destination chunks are
  block-aligned, ``quant_targets`` refuses others) into the FP8 tensor and the scale tensor in
  place.

Both give the bytes of the definition for every block: a block is always quantized whole, from
the same elements.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from formats.errors import PlanError
from formats.manifest.box import Box
from formats.manifest.dtypes import by_name, np_storage
from formats.manifest.wire import ArraySpec, Chunk, Manifest, Source
from formats.quant import quantize, to_float32
from streamer.ops.buffers import byte_view, host_bytes
from streamer.ops.quant import (
    FP8_BLOCK,
    QuantTarget,
    block_image,
    blocks_of,
    on_grid,
    quant_report,
    quant_targets,
    steps,
)
from streamer.plan.model import Plan, Transfer

__all__ = ["RECEIVER", "SENDER", "STAGE_PREFIX", "ReceiverQuant", "RefitQuant", "SenderQuant", "refit_quant",
           "refit_quant_report"]

SENDER, RECEIVER = "sender", "receiver"
#: staging local tensors of receiver-quantized weights are named this + the FP8 local tensor
STAGE_PREFIX = "quantize-on-refit:staging:"
#: the virtual source local tensor of a sender-quantized weight's scales (never read)
_VIRTUAL_PREFIX = "quantize-on-refit:scales:"


@dataclass(frozen=True)
class RefitQuant:
    """What a refit quantizes, where, and the manifests the plan moves between."""

    targets: Mapping[str, QuantTarget]
    #: weights quantized by the senders (the others: by the receivers)
    sender: frozenset[str]
    #: the source the plan moves from: sender-quantized weights typed FP8, with virtual scales
    src: Manifest
    #: the destination the plan moves to: receiver-quantized weights in their source type, in
    #: staging local tensors, without their scales
    dst: Manifest

    def where(self, fqn: str) -> str:
        return SENDER if fqn in self.sender else RECEIVER


def refit_quant(src: Manifest, dst: Manifest, *, block: tuple[int, int] = FP8_BLOCK,
                ue8m0: bool = False) -> RefitQuant | None:
    """How ``src`` -> ``dst`` quantizes, or None when nothing is quantized. ``PlanError`` (one
    line per array) for a destination that cannot be quantized (``quant_targets``)."""
    targets = quant_targets(src, dst, block=block, ue8m0=ue8m0)
    if not targets:
        return None
    sender = frozenset(f for f, t in targets.items()
                       if all(on_grid(c.region, t.scheme.block, src.arrays[f].shape) for c in src.arrays[f].chunks))
    return RefitQuant(targets, sender, _planned_source(src, dst, targets, sender),
                      _planned_destination(dst, targets, sender))


def _planned_source(src: Manifest, dst: Manifest, targets: Mapping[str, QuantTarget],
                    sender: frozenset[str]) -> Manifest:
    arrays = dict(src.arrays)
    for f in sorted(sender):
        t, a = targets[f], src.arrays[f]
        arrays[f] = ArraySpec(a.shape, "float8_e4m3fn", a.chunks)
        s = dst.arrays[t.scale]
        images = [block_image(c.region, t.scheme.block) for c in a.chunks]
        arrays[t.scale] = ArraySpec(s.shape, s.data_type, tuple(
            Chunk(img, c.holders, Source(tensor=_VIRTUAL_PREFIX + t.scale, offsets=img.offsets))
            for img, c in zip(images, a.chunks)))
    return src.with_arrays(arrays)


def _planned_destination(dst: Manifest, targets: Mapping[str, QuantTarget], sender: frozenset[str]) -> Manifest:
    staged = {f: t for f, t in targets.items() if f not in sender}
    scales = {t.scale for t in staged.values()}
    arrays: dict[str, ArraySpec] = {}
    for f, a in dst.arrays.items():
        if f in scales:
            continue  # computed by the receivers, nothing moves
        t = staged.get(f)
        arrays[f] = a if t is None else ArraySpec(a.shape, t.src_dtype, tuple(
            Chunk(c.region, c.holders, Source(tensor=STAGE_PREFIX + c.tensor(f), offsets=c.local_offsets))
            for c in a.chunks))
    return dst.with_arrays(arrays)


def refit_quant_report(q: RefitQuant, dst: Manifest, plan: Plan) -> dict[str, Any]:
    """``quant_report`` with, per array, where it is quantized and the bytes it puts on the wire
    against moving it unquantized; totals ``wire_bytes_saved``, ``on_sender``, ``on_receiver``."""
    rep = quant_report(dst, q.targets, "")
    moved = plan.moved_bytes_by_array()
    for f, a in rep["arrays"].items():
        t = q.targets[f]
        a["where"] = q.where(f)
        if f in q.sender:  # the plan moves FP8 bytes (1 per element) and the scales
            wire, unquantized = moved.get(f, 0) + moved.get(t.scale, 0), moved.get(f, 0) * by_name(t.src_dtype).itemsize
        else:
            wire = unquantized = moved.get(f, 0)
        a.update(wire_bytes=wire, wire_bytes_unquantized=unquantized, wire_bytes_saved=unquantized - wire)
    arrays = rep["arrays"].values()
    rep.update(on_sender=sum(a["where"] == SENDER for a in arrays), on_receiver=sum(a["where"] == RECEIVER for a in arrays),
               wire_bytes_saved=sum(a["wire_bytes_saved"] for a in arrays))
    return rep


# ------------------------------------------------------------------ quantizing local bytes

def _quantized_steps(t: QuantTarget, shape: tuple[int, ...], rows: Box, view: Any,
                     delta: tuple[int, ...]) -> Iterator[tuple[Box, np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
    """(step, FP8 bits, scales) over the whole blocks around ``rows`` (array coordinates), read
    from the byte ``view`` of the local tensor that holds them at ``rows.shift(delta)``."""
    for step in steps(rows, t.scheme.block, shape):
        raw = host_bytes(view[step.shift(delta).slices])
        q, s = quantize(to_float32(raw, t.src_dtype, step.sizes), t.scheme)
        yield step, q, s


def _put(out: Any, values: np.ndarray[Any, Any]) -> None:
    """Write ``values`` (their bytes) into the byte view ``out`` (numpy or torch), in place."""
    b = np.ascontiguousarray(values).view(np.uint8).reshape(out.shape)
    if isinstance(out, np.ndarray):
        out[...] = b
    else:
        import torch

        out.copy_(torch.from_numpy(b))


def _delta(c: Chunk) -> tuple[int, ...]:
    """From array coordinates to chunk ``c``'s local tensor coordinates."""
    return tuple(lo - r for r, lo in zip(c.region.offsets, c.local_offsets))


class SenderQuant:
    """The executor's hook on a sending rank: packs FP8 bytes and scales of sender-quantized
    weights from the rank's high-precision local tensors."""

    def __init__(self, q: RefitQuant, src: Manifest) -> None:
        self.src = src
        self.weights = {f: q.targets[f] for f in q.sender}
        self.scales = {q.targets[f].scale: q.targets[f] for f in q.sender}
        #: seconds spent quantizing in this push
        self.seconds = 0.0
        #: (scale array, scale region) -> the scales computed with their weight rows in this push
        self._known: dict[tuple[str, Box], np.ndarray[Any, Any]] = {}

    def handles(self, tr: Transfer) -> bool:
        """Phase-1 (and local) transfers of these arrays; forwards copy the receiver's FP8 bytes."""
        return tr.phase != 2 and (tr.fqn in self.weights or tr.fqn in self.scales)

    def _rows(self, tr: Transfer) -> tuple[QuantTarget, Chunk, Box]:
        """The target, the weight's source chunk and the weight elements ``tr`` needs (whole blocks)."""
        scale = tr.fqn in self.scales
        t = self.scales[tr.fqn] if scale else self.weights[tr.fqn]
        shape = self.src.arrays[t.weight].shape
        # a virtual scale chunk is the image of the weight chunk with the same index
        c = self.src.arrays[t.weight].chunks[tr.src_chunk]
        rows = _grown(blocks_of(tr.region, t.scheme.block, shape) if scale else tr.region, t, shape)
        if not c.region.contains(rows):  # sender-side weights have source chunks of whole blocks
            raise PlanError(f"{t.weight}: rank {tr.src_rank} sends {tr.fqn} region {tr.region} but does not hold "
                            f"the whole blocks {rows} (a bug: please report)")
        return t, c, rows

    def source(self, tr: Transfer) -> tuple[str, Box, int]:
        """(local tensor, box in it, itemsize) this rank reads to pack ``tr``."""
        t, c, rows = self._rows(tr)
        return c.tensor(t.weight), rows.shift(_delta(c)), by_name(t.src_dtype).itemsize

    def new_push(self) -> None:
        """Forget the last push's scales and time."""
        self.seconds = 0.0
        self._known.clear()

    def pack(self, tr: Transfer, out: Any, views: Mapping[str, Any]) -> None:
        """Write ``tr``'s wire bytes (FP8 bits, or scales) into the byte view ``out``."""
        t0 = time.perf_counter()
        t, c, rows = self._rows(tr)
        scale = tr.fqn in self.scales
        known = self._known.get((tr.fqn, tr.region)) if scale else None
        if known is not None:  # computed with the weight rows they scale, earlier in this push
            _put(out, known)
        else:
            self._quantize(tr, out, views, t, c, rows)
        self.seconds += time.perf_counter() - t0

    def _quantize(self, tr: Transfer, out: Any, views: Mapping[str, Any], t: QuantTarget, c: Chunk,
                  rows: Box) -> None:
        scale = tr.fqn in self.scales
        img = block_image(rows, t.scheme.block)
        # the scales of a weight region of whole blocks are kept for its scale transfer(s)
        keep = None if scale or rows != tr.region else np.empty(img.sizes, np.uint8 if t.scheme.kind == "mx"
                                                                 else np.float32)
        shape = self.src.arrays[t.weight].shape
        for step, q, s in _quantized_steps(t, shape, rows, views[c.tensor(t.weight)], _delta(c)):
            have, at = (s, block_image(step, t.scheme.block)) if scale else (q, step)
            piece = at.intersect(tr.region)
            if piece is not None and not piece.empty:
                _put(out[piece.relative_to(tr.region.offsets).slices], have[piece.relative_to(at.offsets).slices])
            if keep is not None:
                keep[block_image(step, t.scheme.block).relative_to(img.offsets).slices] = s
        if keep is not None:
            self._known[(t.scale, img)] = keep

    def wire(self, tr: Transfer, views: Mapping[str, Any]) -> np.ndarray[Any, Any]:
        """``tr``'s wire bytes in a new host array (verify checksums them)."""
        out = np.empty(tr.region.sizes + (tr.itemsize,), dtype=np.uint8)
        self.pack(tr, out, views)
        return out


def _grown(rows: Box, t: QuantTarget, shape: tuple[int, ...]) -> Box:
    """``rows`` grown to whole blocks (clipped at the array's end)."""
    block = t.scheme.block
    lo = tuple(o // b * b for o, b in zip(rows.offsets, block))
    hi = tuple(min(-(-s // b) * b, n) for s, b, n in zip(rows.stops, block, shape))
    return Box(lo, tuple(h - o for o, h in zip(lo, hi)))


@dataclass(frozen=True)
class _Part:
    """One destination chunk of a receiver-quantized weight on this rank, and its scale chunk."""

    target: QuantTarget
    weight: Chunk
    scale: Chunk


class ReceiverQuant:
    """A receiving rank's staging buffers, and the quantization of what landed in them."""

    def __init__(self, q: RefitQuant, dst: Manifest, rank: int) -> None:
        self.dst = dst
        self.parts: list[_Part] = []
        for f, t in q.targets.items():
            if f in q.sender:
                continue
            scales = {c.region: c for c in dst.arrays[t.scale].chunks if rank in c.holders}
            for c in dst.arrays[f].chunks:
                if rank in c.holders:  # quant_targets checked that the scale chunk is its image
                    self.parts.append(_Part(t, c, scales[block_image(c.region, t.scheme.block)]))
        specs = q.dst.local_tensors(rank)
        #: allocated once per session and reused by every push (delta pushes XOR into them)
        self.staging: dict[str, np.ndarray[Any, Any]] = {
            n: np.zeros(s.shape, dtype=np_storage(by_name(s.data_type))) for n, s in specs.items()
            if n.startswith(STAGE_PREFIX)}

    @property
    def staging_bytes(self) -> int:
        return sum(a.nbytes for a in self.staging.values())

    def finish(self, tensors: Mapping[str, Any]) -> float:
        """Quantize every staged chunk into its FP8 and scale local tensors (in place); seconds."""
        t0 = time.perf_counter()
        for p in self.parts:
            t, w, s = p.target, p.weight, p.scale
            name = w.tensor(t.weight)
            fp8, scales = byte_view(tensors[name]), byte_view(tensors[s.tensor(t.scale)])
            d, ds = _delta(w), _delta(s)
            shape = self.dst.arrays[t.weight].shape
            for step, q, sc in _quantized_steps(t, shape, w.region, byte_view(self.staging[STAGE_PREFIX + name]), d):
                _put(fp8[step.shift(d).slices], q)
                _put(scales[block_image(step, t.scheme.block).shift(ds).slices], sc)
        return time.perf_counter() - t0
