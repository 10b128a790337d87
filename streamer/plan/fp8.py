"""FP8 weights planned with their scales: a ``…_scale_inv`` array that follows its weight block
for block is planned with it, and the scales' block is derived from the weights'. Pure
planning code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from formats.manifest.wire import Manifest
from streamer.plan.layout import ArrayLayout, Layouts
from streamer.plan.model import Block

__all__ = ["SCALE_SUFFIX", "Fp8Pair", "derive_scales", "find_fp8_pairs"]

_I64 = np.int64

#: ``X.weight_scale_inv`` / ``w13_weight_scale_inv`` scale the FP8 weight named without the suffix
SCALE_SUFFIX = "_scale_inv"


def _infer_block(wshape: Sequence[int], sshape: Sequence[int]) -> tuple[int, ...] | None:
    """The scale block of a ``wshape`` weight whose scales are ``sshape`` (ceil division)."""
    if len(wshape) != len(sshape) or not wshape:
        return None
    out = []
    for w, n in zip(wshape, sshape):
        if n < 1 or w < 1:
            return None
        b = -(-w // n)
        if -(-w // b) != n:
            return None
        out.append(b)
    return tuple(out)


def _follows(w: ArrayLayout, sc: ArrayLayout, block: Sequence[int], wshape: Sequence[int]) -> bool:
    """Whether the scale chunks are the weight chunks' block images, on the same holders."""
    if len(w.regions) != len(sc.regions) or w.holders != sc.holders:
        return False
    for b, c in zip(w.regions, sc.regions):
        offs, sizes = [], []
        for o, n, g, full in zip(b.offsets, b.sizes, block, wshape):
            stop = o + n
            if o % g or (stop % g and stop != full):
                return False
            offs.append(o // g)
            sizes.append(-(-stop // g) - o // g)
        if (tuple(offs), tuple(sizes)) != (c.offsets, c.sizes):
            return False
    return True


class Fp8Pair(NamedTuple):
    scale: str  # the scale array's name
    block: tuple[int, ...]  # elements of the weight per scale


def find_fp8_pairs(src: Manifest, dst: Manifest, lays: Layouts) -> tuple[dict[str, Fp8Pair], list[str]]:
    """``{weight: (scale, block)}`` for every FP8 weight whose ``…_scale_inv`` array follows it
    block for block in both manifests: such a pair is planned as one, so each scale block moves
    from the same sender to the same receivers in the same phase as the weight rows it scales.
    The second value names the scale arrays that do not follow their weights (planned alone)."""
    pairs: dict[str, Fp8Pair] = {}
    alone: list[str] = []
    for sf in sorted(dst.arrays):
        if not sf.endswith(SCALE_SUFFIX):
            continue
        wf = sf[: -len(SCALE_SUFFIX)]
        w = dst.arrays.get(wf)
        if w is None or not w.data_type.startswith("float8"):
            continue
        block = _infer_block(w.shape, dst.arrays[sf].shape)
        if block is not None and all(_follows(lays[wf][i], lays[sf][i], block, w.shape) for i in (0, 1)):
            pairs[wf] = Fp8Pair(sf, block)
        else:
            alone.append(sf)
    return pairs, alone


def derive_scales(block: Block, pairs: Mapping[str, Fp8Pair], lays: Layouts, itemsize: int) -> Block:
    """The scale arrays' block of a block of paired FP8 weights: every item's region mapped to
    the scale blocks it covers (cuts are on the grid, so images never overlap); senders,
    receivers and phases are the weights' own."""
    grid = np.array(block.grid, dtype=_I64)
    off = block.offsets // grid
    stop = -(-(block.offsets + block.sizes) // grid)
    names = [pairs[f].scale for f in block.fqns]
    return replace(block, fqns=tuple(names), itemsize=itemsize, offsets=off, sizes=stop - off,
                   src_layouts=tuple(lays[n][0] for n in names), dst_layouts=tuple(lays[n][1] for n in names),
                   grid=None)
