"""Where a phase-2 forward goes in the message order, computed from the compressed plan.

A forward (phase 2) sends on bytes its forwarder received in phase 1. The schedule places it
after the phase-1 transfers that bring its part to the forwarder (``execute.build_schedule``).
Both ends of the forward must compute that place alike, and a receiver must not expand its
forwarders' phase-1 transfers (at DeepSeek-V3 scale, 406k transfers into the 7 other ranks of a
domain). So the place is a bound computed here with numpy over the template items: the phase-1
items of one *part* (``Block.part``) and prefix sums of each sender->forwarder byte stream.
Pure planning code: numpy only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from formats.manifest.box import Box
from streamer.plan.model import Plan

__all__ = ["forward_keys", "forward_sources"]

_I64 = np.int64


def _row_ids(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Ids of the rows of two sets of integer columns (``a[i][j]`` is column i of row j), equal
    where the rows are: mixed radix, or ``np.unique`` over the rows when that would overflow."""
    base = [max([int(x.max()) + 2 for x in (ca, cb) if len(x)], default=1) for ca, cb in zip(a, b)]
    if float(np.prod([float(x) for x in base])) < 2.0**62:
        def ids(cols: Sequence[np.ndarray]) -> np.ndarray:
            out = np.zeros(len(cols[0]), dtype=_I64)
            for c, n in zip(cols, base):
                out = out * n + (c + 1)  # +1: parts of phase-0 items are -1
            return out
        return ids(a), ids(b)
    rows = np.concatenate([np.stack(a, axis=1), np.stack(b, axis=1)])
    _, inv = np.unique(rows, axis=0, return_inverse=True)
    inv = inv.reshape(-1).astype(_I64)
    return inv[:len(a[0])], inv[len(a[0]):]


class _ForwardGroups(NamedTuple):
    """Phase-1 transfers into forwarders grouped by the part they bring (``_forward_groups``)."""

    uniq: np.ndarray  # sorted group ids (block, array, part, forwarder)
    inverse: np.ndarray  # each phase-1 transfer's group, as a position in uniq
    senders: np.ndarray  # each phase-1 transfer's sender, in plan order
    forwarders: np.ndarray  # its receiver (the forwarder)
    nbytes: np.ndarray
    forwards: tuple[np.ndarray, ...]  # the phase-2 transfers asked about: block, array, item, forwarder, receiver, group id

    def keys(self, wave_bytes: int, world: int) -> np.ndarray:
        """Each phase-1 transfer's ``wave * world + (forwarder - sender) % world``."""
        s, f = self.senders, self.forwarders
        pair = s * world + f
        order = np.argsort(pair, kind="stable")
        cs = np.cumsum(self.nbytes[order])
        ps = pair[order]
        start = np.ones(len(ps), dtype=bool)
        start[1:] = ps[1:] != ps[:-1]
        first = np.maximum.accumulate(np.where(start, np.arange(len(ps)), 0))
        before = np.where(first > 0, cs[first - 1], 0)
        end = np.empty_like(cs)
        end[order] = cs - before  # the stream position after each transfer's last byte
        key: np.ndarray = ((end - 1) // max(wave_bytes, 1)) * world + (f - s) % world
        return key


def forward_keys(plan: Plan, ranks: Iterable[int] | None, wave_bytes: int) -> dict[tuple[str, tuple[int, ...], int, int], int]:
    """When the bytes of each phase-2 transfer that one of ``ranks`` (global; None: every rank)
    sends or receives have reached the forwarder, as a number both ends compute alike.

    Keyed by ``(fqn, region offsets, forwarder, receiver)``; the value is the largest
    ``wave * world + (forwarder - sender) % world`` over the phase-1 transfers that bring its
    part to the forwarder, where a phase-1 transfer's wave is the position of its last byte
    in the stream of phase-1 bytes from its sender to the forwarder (plan order), in units of
    ``wave_bytes``. The receiver computes this from the compressed plan, without expanding
    the forwarder's phase-1 transfers (``build_schedule`` orders forwards by it).
    """
    groups = _forward_groups(plan, ranks)
    out: dict[tuple[str, tuple[int, ...], int, int], int] = {}
    if groups is None:
        return out
    world = max(plan.world_size, 1)
    key, (blk, arr, item, fwd, dst, gid) = groups.keys(wave_bytes, world), groups.forwards
    best = np.full(len(groups.uniq), -1, dtype=_I64)
    np.maximum.at(best, groups.inverse, key)
    pos = np.searchsorted(groups.uniq, gid)
    found = (pos < len(groups.uniq)) & (groups.uniq[np.minimum(pos, len(groups.uniq) - 1)] == gid)
    val = np.where(found, best[np.minimum(pos, len(groups.uniq) - 1)], -1).tolist()
    for j, (b, a, t, f, d) in enumerate(zip(blk.tolist(), arr.tolist(), item.tolist(), fwd.tolist(),
                                            dst.tolist())):
        block = plan.blocks[b]
        out[(block.fqns[a], block.item_values[0][t], f, d)] = val[j]
    return out

def forward_sources(plan: Plan, rank: int) -> dict[tuple[str, int], list[tuple[Box, set[int]]]]:
    """For the phase-2 transfers ``rank`` receives, by (fqn, forwarder): each one's region
    and the senders whose phase-1 bytes it forwards (to name them when a forward is late)."""
    groups = _forward_groups(plan, (rank,))
    out: dict[tuple[str, int], list[tuple[Box, set[int]]]] = defaultdict(list)
    if groups is None:
        return out
    senders: dict[int, set[int]] = defaultdict(set)
    for g, s in zip(groups.inverse.tolist(), groups.senders.tolist()):
        senders[g].add(s)
    blk, arr, item, fwd, dst, gid = (x.tolist() for x in groups.forwards)
    pos = np.searchsorted(groups.uniq, groups.forwards[5]).tolist()
    for b, a, t, f, d, g, p in zip(blk, arr, item, fwd, dst, gid, pos):
        if d == rank:
            block = plan.blocks[b]
            ok = p < len(groups.uniq) and int(groups.uniq[p]) == g
            out[(block.fqns[a], f)].append((block.item_values[1][t], senders[p] if ok else set()))
    return out

def _forward_groups(plan: Plan, ranks: Iterable[int] | None) -> _ForwardGroups | None:
    """The phase-2 transfers ``ranks`` send or receive, and every phase-1 transfer into
    their forwarders, as columns (see ``forward_keys``); None when there are no forwards."""
    want = None if ranks is None else np.array(sorted(set(ranks)), dtype=_I64)
    b_of = {id(b): i for i, b in enumerate(plan.blocks)}
    fw_cols: list[list[np.ndarray]] = [[] for _ in range(6)]
    fwd_set: set[int] = set()
    for g in plan.grids(want):
        m = np.broadcast_to((g.block.phase[g.items] == 2)[:, None], g.src.shape)
        if want is not None:
            m = m & (np.isin(g.src, want) | np.isin(g.dst, want))
        ai, ti = np.nonzero(m.T)
        if not len(ai):
            continue
        f, d = g.src[ti, ai], g.dst[ti, ai]
        fwd_set.update(np.unique(f).tolist())
        for c, x in zip(fw_cols, (np.full(len(ai), b_of[id(g.block)], dtype=_I64), g.arrays[ai],
                                  g.items[ti], f, d, g.block.part[g.items[ti]])):
            c.append(x)
    if not fwd_set:
        return None
    fwd = np.array(sorted(fwd_set), dtype=_I64)
    p1_cols: list[list[np.ndarray]] = [[] for _ in range(6)]
    for g in plan.grids(fwd):
        m = (g.block.phase[g.items] == 1)[:, None] & np.isin(g.dst, fwd)
        ai, ti = np.nonzero(m.T)  # array-major: the plan's order
        items = g.items[ti]
        for c, x in zip(p1_cols, (np.full(len(ai), b_of[id(g.block)], dtype=_I64), g.arrays[ai],
                                  g.block.part[items], g.src[ti, ai], g.dst[ti, ai],
                                  g.block.item_bytes()[items])):
            c.append(x)
    blk, arr, part, src, dst, nbytes = (np.concatenate(c) if c else np.zeros(0, dtype=_I64) for c in p1_cols)
    fblk, farr, fitem, ffwd, fdst, fpart = (np.concatenate(c) for c in fw_cols)
    ids, fids = _row_ids((blk, arr, part, dst), (fblk, farr, fpart, ffwd))
    uniq, inverse = np.unique(ids, return_inverse=True)
    return _ForwardGroups(uniq, inverse.reshape(-1), src, dst, nbytes, (fblk, farr, fitem, ffwd, fdst, fids))
