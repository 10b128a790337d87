"""The plan checker: every problem with a plan against its two manifests (``shardstream plan
--check``). Independent of how the planner builds a plan: it reads the materialised transfers
and the manifests' chunks only. Pure planning code.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from formats.manifest.box import Box
from formats.manifest.wire import Manifest
from streamer.plan.model import Plan

__all__ = ["validate_plan"]

_I64 = np.int64

@dataclass(frozen=True)
class _ChunkRows:
    """Every chunk of a manifest as a numpy row: region (padded to ``ndim`` dims), holders
    (padded with -1), offsets in the local tensor; the rows of an array start at ``start[fqn]``."""

    offsets: np.ndarray  # [chunks, ndim]
    sizes: np.ndarray
    local: np.ndarray
    holders: np.ndarray  # [chunks, max holders]
    tensors: list[str] = field(default_factory=list)
    start: dict[str, int] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def of(m: Manifest, ndim: int) -> _ChunkRows:
        start: dict[str, int] = {}
        count: dict[str, int] = {}
        offs: list[tuple[int, ...]] = []
        sizes: list[tuple[int, ...]] = []
        local: list[tuple[int, ...]] = []
        holders: list[tuple[int, ...]] = []
        tensors: list[str] = []
        for fqn, a in m.arrays.items():
            start[fqn], count[fqn] = len(offs), len(a.chunks)
            for c in a.chunks:
                offs.append(_padded(c.region.offsets, ndim, 0))
                sizes.append(_padded(c.region.sizes, ndim, 1))
                local.append(_padded(c.local_offsets, ndim, 0))
                holders.append(c.holders)
                tensors.append(c.tensor(fqn))
        n = len(offs)
        tab = np.full((n, max((len(h) for h in holders), default=1)), -1, dtype=_I64)
        for i, h in enumerate(holders):
            tab[i, :len(h)] = h
        return _ChunkRows(np.array(offs, dtype=_I64).reshape(n, ndim), np.array(sizes, dtype=_I64).reshape(n, ndim),
                          np.array(local, dtype=_I64).reshape(n, ndim), tab, tensors, start, count)

    def then(self, other: _ChunkRows) -> _ChunkRows:
        """These rows followed by ``other``'s (geometry and holders only)."""
        w = max(self.holders.shape[1], other.holders.shape[1])
        tab = np.full((len(self.holders) + len(other.holders), w), -1, dtype=_I64)
        tab[:len(self.holders), :self.holders.shape[1]] = self.holders
        tab[len(self.holders):, :other.holders.shape[1]] = other.holders
        return _ChunkRows(np.concatenate([self.offsets, other.offsets]), np.concatenate([self.sizes, other.sizes]),
                          np.concatenate([self.local, other.local]), tab)

    def row(self, fqn: str, chunk: int) -> int:
        """The row of ``fqn``'s chunk ``chunk``; -1 when there is none."""
        n = self.count.get(fqn, 0)
        return self.start[fqn] + chunk if 0 <= chunk < n else -1


def _padded(t: tuple[int, ...], ndim: int, fill: int) -> tuple[int, ...]:
    return t + (fill,) * (ndim - len(t))


def _placed(rows: _ChunkRows, r: np.ndarray, rank: np.ndarray, off: np.ndarray, size: np.ndarray,
            local: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per transfer: whether chunk row ``r`` holds the region (``off``, ``size``), whether ``rank``
    is one of its holders, and whether ``local`` is the region's place in the local tensor."""
    lo = rows.offsets[r]
    inside = ((off >= lo) & (off + size <= lo + rows.sizes[r])).all(axis=1)
    held = (rows.holders[r] == rank[:, None]).any(axis=1)
    at = (local == rows.local[r] + off - lo).all(axis=1)
    return inside, held, at


class _Sides(NamedTuple):
    """The materialised transfers of a plan, one numpy row each (``ndim`` dims, padded)."""

    position: np.ndarray  # in plan.transfers
    phase: np.ndarray
    dst_row: np.ndarray  # destination chunk row
    sender_row: np.ndarray  # row of the chunk the sender reads: source chunk, or (phase 2) destination chunk
    sender: np.ndarray  # sender's rank in its job
    receiver: np.ndarray  # receiver's rank in the destination job
    offsets: np.ndarray
    sizes: np.ndarray
    src_offsets: np.ndarray
    dst_offsets: np.ndarray


def _tabulate(plan: Plan, src: Manifest, dst: Manifest, srows: _ChunkRows, drows: _ChunkRows,
              ndim: int, problems: list[str]) -> _Sides:
    """One row per transfer, chunk rows looked up; what cannot be looked up, or names the wrong
    local tensor or item size, goes to ``problems``."""
    cols: list[tuple[int, int, int, int, int, int]] = []
    geo: list[tuple[int, ...]] = []
    nsrc = len(srows.tensors)
    for i, t in enumerate(plan.transfers):
        d = dst.arrays.get(t.fqn)
        dr = drows.row(t.fqn, t.dst_chunk)
        sr = dr if t.phase == 2 else srows.row(t.fqn, t.src_chunk)
        if d is None or dr < 0 or sr < 0:
            problems.append(f"{t.fqn}: transfer {i} names a {'destination' if dr < 0 else 'source'} chunk that "
                            f"does not exist (source {t.src_chunk}, destination {t.dst_chunk})")
            continue
        stensor = (drows if t.phase == 2 else srows).tensors[sr]
        if t.dst_tensor != drows.tensors[dr] or t.src_tensor != stensor:
            problems.append(f"{t.fqn}: transfer {i} reads {t.src_tensor!r} / writes {t.dst_tensor!r}, "
                            f"not the chunks' local tensors {stensor!r} / {drows.tensors[dr]!r}")
        if t.itemsize != d.dtype.itemsize:
            problems.append(f"{t.fqn}: transfer {i} has item size {t.itemsize}, not {d.dtype.itemsize}")
        sender = plan.dst_local(t.src_rank) if t.phase == 2 else t.src_rank
        cols.append((i, t.phase, dr, sr + nsrc if t.phase == 2 else sr, sender, plan.dst_local(t.dst_rank)))
        geo.append(_padded(t.region.offsets, ndim, 0) + _padded(t.region.sizes, ndim, 1)
                   + _padded(t.src_offsets, ndim, 0) + _padded(t.dst_offsets, ndim, 0))
    c = np.array(cols, dtype=_I64).reshape(len(cols), 6)
    g = np.array(geo, dtype=_I64).reshape(len(cols), 4, ndim)
    return _Sides(c[:, 0], c[:, 1], c[:, 2], c[:, 3], c[:, 4], c[:, 5], g[:, 0], g[:, 1], g[:, 2], g[:, 3])


def _check_sides(plan: Plan, src: Manifest, sides: _Sides, srows: _ChunkRows, drows: _ChunkRows) -> list[str]:
    """Each transfer reads a region of a chunk its sender holds (the source chunk; for a phase-2
    forward, the forwarder's copy of the destination chunk) and writes a region of a chunk its
    receiver holds, at the chunks' places in their local tensors; phases connect the right jobs."""
    both = srows.then(drows)  # sender rows: source chunks, then destination chunks (phase-2 forwarders)
    s_in, s_held, s_at = _placed(both, sides.sender_row, sides.sender, sides.offsets, sides.sizes, sides.src_offsets)
    d_in, d_held, d_at = _placed(drows, sides.dst_row, sides.receiver, sides.offsets, sides.sizes, sides.dst_offsets)
    S, ph = src.world_size, sides.phase
    g_src = np.where(ph == 2, sides.sender + (0 if plan.same_job else S), sides.sender)
    g_dst = sides.receiver + (0 if plan.same_job else S)
    wrong_jobs = (ph == 0) & ((g_src != g_dst) | (not plan.same_job))
    wrong_jobs |= (ph != 0) & (g_src == g_dst)
    if not plan.same_job:
        wrong_jobs |= (ph == 1) & ((sides.sender < 0) | (sides.sender >= S))
        wrong_jobs |= (ph == 2) & (sides.sender < 0)
    wrong_jobs |= (ph < 0) | (ph > 2)
    checks = [(s_in, "reads outside its source chunk"), (s_held, "is sent by a rank that does not hold its source chunk"),
              (s_at, "reads at the wrong source offsets"), (d_in, "writes outside its destination chunk"),
              (d_held, "goes to a rank that does not hold its destination chunk"),
              (d_at, "writes at the wrong destination offsets"), (~wrong_jobs, "connects the wrong ranks for its phase")]
    problems = []
    ts = plan.transfers
    for ok, what in checks:
        for k in np.nonzero(~ok)[0].tolist():
            t = ts[int(sides.position[k])]
            problems.append(f"{t.fqn}: phase-{t.phase} transfer of {t.region} from rank {t.src_rank} to rank "
                            f"{t.dst_rank} {what}")
    return problems


def _check_coverage(sides: _Sides, drows: _ChunkRows) -> list[str]:
    """Every (destination chunk, holder) is written exactly once: the regions written into it
    add up to its volume and no two overlap (they lie inside it: :func:`_check_sides`)."""
    width = int(max(drows.holders.max(initial=0), sides.receiver.max(initial=0))) + 1
    want_keys = (np.arange(len(drows.holders))[:, None] * width + drows.holders)[drows.holders >= 0]
    want_vol = np.repeat(np.prod(drows.sizes, axis=1), (drows.holders >= 0).sum(axis=1))
    keys = sides.dst_row * width + np.clip(sides.receiver, 0, None)
    got_keys, inv, n_boxes = np.unique(keys, return_inverse=True, return_counts=True)
    got_vol = np.zeros(len(got_keys), dtype=_I64)
    np.add.at(got_vol, inv, np.prod(sides.sizes, axis=1))
    pos = np.minimum(np.searchsorted(got_keys, want_keys), max(len(got_keys) - 1, 0))
    found = (got_keys[pos] == want_keys) if len(got_keys) else np.zeros(len(want_keys), dtype=bool)
    vol = np.where(found, got_vol[pos] if len(got_keys) else 0, 0)
    names = {start + i: (fqn, i) for fqn, start in drows.start.items() for i in range(drows.count[fqn])}
    problems = []
    for k in np.nonzero(vol != want_vol)[0].tolist():
        row, h = divmod(int(want_keys[k]), width)
        fqn, ci = names[row]
        problems.append(f"{fqn}: chunk {ci} on rank {h} receives {int(vol[k])} of {int(want_vol[k])} elements")
    several = np.nonzero(found & (vol == want_vol))[0]
    several = several[n_boxes[pos[several]] > 1]
    if len(several):
        order = np.argsort(inv, kind="stable")
        first = np.concatenate([[0], np.cumsum(n_boxes)])
        for k in several.tolist():
            u = int(pos[k])
            idx = order[first[u]:first[u + 1]]
            hit = _overlap_in(sides.offsets[idx], sides.sizes[idx])
            if hit is not None:
                row, h = divmod(int(want_keys[k]), width)
                fqn, ci = names[row]
                problems.append(f"{fqn}: chunk {ci} on rank {h} is written twice in {hit}")
    return problems


def _overlap_in(offs: np.ndarray, sizes: np.ndarray) -> Box | None:
    """The intersection of two of the boxes, if any two overlap (sweep along the dim with the
    most distinct offsets: only boxes still open along it can overlap the next one)."""
    d = max(range(offs.shape[1]), key=lambda j: len(np.unique(offs[:, j])))
    order = np.argsort(offs[:, d], kind="stable")
    open_: list[Box] = []
    for i in order.tolist():
        box = Box(tuple(offs[i].tolist()), tuple(sizes[i].tolist()))
        start = box.offsets[d]
        open_ = [b for b in open_ if b.offsets[d] + b.sizes[d] > start]
        for b in open_:
            inter = b.intersect(box)
            if inter is not None and not inter.empty:
                return inter
        open_.append(box)
    return None


def _check_forwards(plan: Plan, sides: _Sides) -> list[str]:
    """A phase-2 forwarder has received the region it forwards in phase 1."""
    ts = plan.transfers
    p2 = np.nonzero(sides.phase == 2)[0]
    if not len(p2):
        return []
    wanted = set(zip(sides.dst_row[p2].tolist(), sides.sender[p2].tolist()))
    got: dict[tuple[int, int], list[Box]] = defaultdict(list)
    p1 = np.nonzero(sides.phase == 1)[0]
    for k, key in zip(sides.position[p1].tolist(), zip(sides.dst_row[p1].tolist(), sides.receiver[p1].tolist())):
        if key in wanted:
            got[key].append(ts[k].region)
    problems = []
    for k, key in zip(sides.position[p2].tolist(), zip(sides.dst_row[p2].tolist(), sides.sender[p2].tolist())):
        t = ts[k]
        inters = (b.intersect(t.region) for b in got.get(key, ()))
        vol = sum(i.volume for i in inters if i is not None)
        if vol != t.region.volume:
            problems.append(f"{t.fqn}: rank {t.src_rank} forwards {t.region} but received only {vol} of its "
                            f"{t.region.volume} elements in phase 1")
    return problems


def validate_plan(plan: Plan, src: Manifest, dst: Manifest) -> list[str]:
    """Every problem with ``plan`` against its manifests: each transfer reads a region of a chunk
    its sender holds and writes a region of a chunk its receiver holds (at the chunks' places in
    their local tensors), each phase-2 forward sends what its forwarder received in phase 1, and
    each destination (chunk, holder) is written exactly once (volumes add up, no two writes overlap)."""
    ndim = max([1] + [len(a.shape) for m in (src, dst) for a in m.arrays.values()])
    srows, drows = _ChunkRows.of(src, ndim), _ChunkRows.of(dst, ndim)
    problems: list[str] = []
    sides = _tabulate(plan, src, dst, srows, drows, ndim, problems)
    problems += _check_sides(plan, src, sides, srows, drows)
    problems += _check_forwards(plan, sides)
    problems += _check_coverage(sides, drows)
    return problems
