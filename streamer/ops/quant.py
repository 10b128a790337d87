"""Quantization targets and block geometry (pure numpy): which destination weights are quantized
while they are written or refit, with the scale array beside them, and the blocks a region meets.
Shared by quantize on convert (``streamer.convert.quantize``) and on refit (``streamer.execute.quant``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from formats.errors import PlanError
from formats.manifest.box import Box
from formats.manifest.dtypes import by_name
from formats.manifest.wire import ArraySpec, Manifest
from formats.quant import MX_BLOCK, QuantScheme
from streamer.ops.cast import FLOATS, with_dtypes

__all__ = ["FP8_BLOCK", "SCALE_SUFFIXES", "STEP_ELEMENTS", "QuantTarget", "block_image", "blocks_of", "on_grid",
           "planned_destination", "quant_report", "quant_targets", "steps"]

#: DeepSeek-V3 / vLLM block of block-FP8 weights (one float32 scale per 128×128 elements)
FP8_BLOCK = (128, 128)
#: scale siblings of weight ``W``: ``W_scale_inv`` (DeepSeek, vLLM) or ``W_scale`` (MX checkpoints)
SCALE_SUFFIXES = ("_scale_inv", "_scale")
#: float32 elements one quantization step may hold (a few temporaries of this size are live)
STEP_ELEMENTS = 1 << 22


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
