"""Replica balancing: each source replica's share of the bytes needed from its holder set,
water-filled over the ranks' fixed loads, and the arrays whose replicas carry unequal loads
re-planned with those shares. Pure planning code.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from formats.manifest.wire import Manifest
from streamer.plan.classes import ClassKeys
from streamer.plan.fp8 import Fp8Pair, derive_scales
from streamer.plan.layout import Layouts
from streamer.plan.model import Block
from streamer.plan.stats import Figures
from streamer.plan.template import Template, build_template, make_block
from streamer.plan.topology import Topology

__all__ = ["PlannedClass", "rebalance", "replica_shares", "reweight"]

@dataclass
class PlannedClass:
    """A class's block as first planned (equal replica shares), before rebalancing."""

    block: Block
    template: Template
    rotation: int  # where the class's rotation starts



def rebalance(built: Sequence[PlannedClass], fig: Figures, dst: Manifest, lays: Layouts,
              pairs: Mapping[str, Fp8Pair], keys: ClassKeys, topo: Topology, *, with_ranks: bool = True
               ) -> tuple[list[Block], list[tuple[np.ndarray, np.ndarray]]]:
    """Re-plan the arrays whose replicas carry unequal fixed loads with their replica shares, and
    add the FP8 scales' blocks; with ``with_ranks``, each final block's (sender, receiver) ranks
    [T, A] too (the figures need them; a refit rank does not)."""
    rk = {id(p.block): p.block.ranks_ta() for p in built} if with_ranks else {}
    shares = replica_shares([p.block for p in built], fig.needed_by_set, topo.world_size)
    blocks: list[Block] = []
    for p in built:
        for b in reweight(p.block, p.template, p.rotation, shares, keys, topo):
            blocks.append(b)
            if b.grid is not None:
                scale = pairs[b.fqns[0]].scale
                blocks.append(derive_scales(b, pairs, lays, dst.arrays[scale].dtype.itemsize))
    if not with_ranks:
        return blocks, []
    return blocks, [rk[id(b)] if id(b) in rk else b.ranks_ta() for b in blocks]


def replica_shares(blocks: Sequence[Block], needed: Mapping[tuple[int, ...], int], W: int) -> dict[tuple[int, ...], np.ndarray]:
    """Each replica's share of the bytes needed from each holder set of two or more ranks.

    Fixed loads (single-holder sends, phase-2 forwards) come first; the sets' bytes are then
    water-filled over their ranks, set by set, a few rounds (block coordinate descent on the
    sum of squared loads, whose optimum also has the smallest largest load). Equal fixed loads
    give equal shares, and the even split with rotation is then already optimal.
    """
    sets = sorted(k for k in needed if len(k) > 1)
    if not sets:
        return {}
    load = np.zeros(max(W, 1), dtype=np.float64)
    for b in blocks:  # byte counts are integers: exact in float64 (< 2**53), in any order
        fixed = ~((b.phase == 1) & (b.sender_count > 1))
        if fixed.any():
            load += b.sender_bytes(np.nonzero(fixed)[0], len(load))
    alloc = {k: np.full(len(k), needed[k] / len(k)) for k in sets}
    for k in sets:
        load[list(k)] += alloc[k]
    for _ in range(8):
        moved = 0.0
        for k in sets:
            idx = np.array(k)
            base = load[idx] - alloc[k]
            new = _water_level(base, float(needed[k]))
            moved = max(moved, float(np.abs(new - alloc[k]).max()))
            load[idx] = base + new
            alloc[k] = new
        if moved <= 1e-6 * max(1.0, float(load.max())):
            break
    return {k: a / max(float(needed[k]), 1.0) for k, a in alloc.items()}


def _water_level(base: np.ndarray, amount: float) -> np.ndarray:
    """Split ``amount`` over ranks with loads ``base`` so the filled ones end level."""
    order = np.argsort(base, kind="stable")
    b = base[order]
    csum = np.cumsum(b)
    level = b[-1]
    for j in range(1, len(b) + 1):
        lv = (amount + csum[j - 1]) / j
        if j == len(b) or lv <= b[j]:
            level = lv
            break
    out = np.zeros_like(base)
    out[order] = np.maximum(0.0, level - b)
    return out


def _uniform(fr: np.ndarray) -> bool:
    return bool(fr.max() - fr.min() <= 1e-6 * max(float(fr.max()), 1e-12))


def reweight(block: Block, tp: Template, rot0: int, shares: Mapping[tuple[int, ...], np.ndarray],
             keys: ClassKeys, topo: Topology) -> list[Block]:
    """``block`` as is when every holder set it sends from has equal shares; otherwise the arrays
    whose holder sets do not are re-planned with their sets' shares (one block per holder table)."""
    multi = [(si, sd) for (si, sd) in tp.needed if len(sd) > 1]
    if not multi or not shares:
        return [block]

    def fractions(u: int, si: int, senders: tuple[int, ...]) -> list[float] | None:
        fr = shares.get(tuple(int(block.src_holders[u, si, j]) for j in senders))
        return None if fr is None or _uniform(fr) else fr.tolist()

    uneven = [u for u in range(block.src_holders.shape[0])
              if any(fractions(u, si, sd) is not None for si, sd in multi)]
    if not uneven:
        return [block]
    out = []
    keep = np.nonzero(~np.isin(block.src_row, uneven))[0]
    if len(keep):
        out.append(_subset(block, keep))
    for u in uneven:
        rows = np.nonzero(block.src_row == u)[0]
        a0 = int(rows[0])
        sl, dl = block.src_layouts[a0], block.dst_layouts[a0]
        tpu, _ = build_template(sl, dl, keys.runs(dl), block.itemsize, topo, rot0,
                                shares=functools.partial(fractions, u), grid=block.grid)
        out.append(make_block(tpu, [block.fqns[i] for i in rows], block.itemsize, block.ndim,
                              [block.src_layouts[i] for i in rows], [block.dst_layouts[i] for i in rows],
                              topo.dst_shift, block.grid))
    return out


def _subset(block: Block, rows: np.ndarray) -> Block:
    """The same template over some of the block's arrays."""
    if len(rows) == len(block.fqns):
        return block
    sel = rows.tolist()
    b = replace(block, fqns=tuple(block.fqns[i] for i in sel), src_row=block.src_row[rows],
                dst_row=block.dst_row[rows], src_layouts=tuple(block.src_layouts[i] for i in sel),
                dst_layouts=tuple(block.dst_layouts[i] for i in sel))
    return b
