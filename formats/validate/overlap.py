"""Overlap and coverage geometry of a set of boxes, for the manifest checks: every overlapping
pair, the exact union volume and the first uncovered cell, in O(n log n) per array.

Regions are snapped onto the grid of their distinct breakpoints and hashed (exact and linear for
grid-like layouts), or, when that grid would be too large, sorted along one dim and swept
(candidate pairs checked vectorised). Below a few dozen boxes a plain Python sweep is faster.
No I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from ..manifest.box import Box

__all__ = ["MAX_PAIRS", "BoxAnalysis", "analyze_boxes", "box_from"]

#: overlap enumeration stops after this many pairs per array (the summary then says "more than")
MAX_PAIRS = 10_000
#: the grid-snapping overlap finder is used while the snapped cells number at most this
_CELL_BUDGET_MIN = 1 << 18
#: candidate pairs checked per vectorised batch in the sweep
_SWEEP_BATCH = 1 << 19


def box_from(off: Sequence[int], stop: Sequence[int]) -> Box:
    return Box(tuple(int(o) for o in off), tuple(int(b) - int(a) for a, b in zip(off, stop)))


@dataclass
class BoxAnalysis:
    """Result of an overlap / coverage analysis of a set of non-empty boxes."""

    pairs: list[tuple[int, int]]  # overlapping (i, j), i < j, indices into the input
    truncated: bool  # more than MAX_PAIRS pairs exist
    union: int | None  # exact union volume when known
    gap: Box | None  # first uncovered cell (row-major) when known and the union is short


#: below this many boxes overlaps are found by a plain Python sweep (numpy call overhead dominates)
_SMALL = 48


def analyze_boxes(offs: list[tuple[int, ...]], stops: list[tuple[int, ...]], nd: int, *,
                  shape: Sequence[int] | None = None, max_pairs: int = MAX_PAIRS,
                  cell_budget: int | None = None, small: int | None = None) -> BoxAnalysis:
    """Every overlapping pair among ``n`` non-empty ``nd``-d boxes (``offs[i]``, ``stops[i]``).

    With ``shape`` (boxes already clipped to it), also the exact union volume when it can be had
    cheaply, and the first uncovered cell of the breakpoint grid when the union falls short.
    ``cell_budget`` / ``small`` override the method thresholds (tests use them to force a path).
    """
    n = len(offs)
    if n == 0:
        gap: Box | None = None
        if shape is not None and all(x > 0 for x in shape):
            gap = Box.whole(shape)
        return BoxAnalysis([], False, 0, gap)
    if n <= (_SMALL if small is None else small):
        pairs, truncated = _pairs_python(offs, stops, nd, max_pairs)
        if shape is None:
            return BoxAnalysis(pairs, truncated, None, None)
        vol = sum(prod(b - a for a, b in zip(o, e)) for o, e in zip(offs, stops))
        if not pairs and vol >= prod(shape):
            return BoxAnalysis([], False, vol, None)  # disjoint and full: an exact tiling
        # something is wrong: spend a little more for the exact union and a gap location
        cells = _analyze_cells(_int64_rows(offs, nd), _int64_rows(stops, nd), shape, max_pairs,
                               max(_CELL_BUDGET_MIN, 4 * n) if cell_budget is None else cell_budget)
        if cells is not None:
            return BoxAnalysis(pairs, truncated, cells.union, cells.gap)
        return BoxAnalysis(pairs, truncated, None if pairs else vol, None)
    off = _int64_rows(offs, nd)
    stop = _int64_rows(stops, nd)
    budget = cell_budget if cell_budget is not None else max(_CELL_BUDGET_MIN, 4 * n)
    geo = _analyze_cells(off, stop, shape, max_pairs, budget)
    if geo is None:
        geo = _analyze_sweep(off, stop, max_pairs)
        if shape is not None and not geo.pairs:
            geo.union = sum(prod(b - a for a, b in zip(o, e)) for o, e in zip(offs, stops))
    return geo


def _pairs_python(offs: list[tuple[int, ...]], stops: list[tuple[int, ...]], nd: int,
                  max_pairs: int) -> tuple[list[tuple[int, int]], bool]:
    """Sort along the dim with the most distinct offsets; compare each box with those starting
    before it ends in that dim."""
    n = len(offs)
    if nd == 0:  # 0-d boxes always intersect
        allp = [(i, j) for i in range(n) for j in range(i + 1, n)]
        return allp[:max_pairs], len(allp) > max_pairs
    d = max(range(nd), key=lambda k: len({o[k] for o in offs}))
    order = sorted(range(n), key=lambda i: offs[i][d])
    pairs: list[tuple[int, int]] = []
    dims = range(nd)
    for x in range(n):
        i = order[x]
        oi, si = offs[i], stops[i]
        end = si[d]
        for y in range(x + 1, n):
            j = order[y]
            oj = offs[j]
            if oj[d] >= end:
                break
            sj = stops[j]
            if all(oj[k] < si[k] and oi[k] < sj[k] for k in dims):
                pairs.append((i, j) if i < j else (j, i))
                if len(pairs) > max_pairs:
                    return sorted(pairs)[:max_pairs], True
    return sorted(pairs), False


def _analyze_cells(off: np.ndarray[Any, Any], stop: np.ndarray[Any, Any], shape: Sequence[int] | None,
                   max_pairs: int, budget: int) -> BoxAnalysis | None:
    """Snap boxes onto the grid of distinct breakpoints; hash the cells. None when too many cells."""
    n, nd = off.shape
    breaks: list[np.ndarray[Any, Any]] = []
    for d in range(nd):
        parts = [off[:, d], stop[:, d]]
        if shape is not None:
            parts.append(np.array([0, shape[d]], dtype=np.int64))
        breaks.append(np.unique(np.concatenate(parts)))
    radix = [len(b) - 1 for b in breaks]
    total_grid = prod(radix)
    if total_grid > (1 << 62):
        return None
    lo = np.empty((n, nd), dtype=np.int64)
    span = np.empty((n, nd), dtype=np.int64)
    for d in range(nd):
        lo[:, d] = np.searchsorted(breaks[d], off[:, d])
        span[:, d] = np.searchsorted(breaks[d], stop[:, d]) - lo[:, d]
    ncells = float(np.prod(span.astype(np.float64), axis=1).sum())
    if ncells > budget:
        return None
    kstride = [1] * nd
    for d in range(nd - 2, -1, -1):
        kstride[d] = kstride[d + 1] * radix[d + 1]
    key, owner = _cell_keys(lo, span, kstride)
    order = np.argsort(key, kind="stable")
    ks = key[order]
    ow = owner[order]
    same = ks[1:] == ks[:-1]
    pairs, truncated = _shared_cells(ks, ow, same, max_pairs)
    union: int | None = None
    gap: Box | None = None
    if shape is not None:
        union, gap = _union_and_gap(ks, same, breaks, radix, kstride, shape)
    return BoxAnalysis(sorted(pairs)[:max_pairs], truncated, union, gap)


def _cell_keys(lo: np.ndarray[Any, Any], span: np.ndarray[Any, Any],
               kstride: list[int]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Every grid cell each box covers, as (row-major cell key, box index), one entry per cell."""
    n, nd = lo.shape
    owner = np.arange(n, dtype=np.int64)
    key = np.zeros(n, dtype=np.int64)
    for d in range(nd):
        r = span[owner, d]
        if bool((r == 1).all()):
            key = key + lo[owner, d] * kstride[d]
            continue
        rep_owner = np.repeat(owner, r)
        rep_key = np.repeat(key, r)
        starts = np.cumsum(r) - r
        within = np.arange(len(rep_owner), dtype=np.int64) - np.repeat(starts, r)
        key = rep_key + (lo[rep_owner, d] + within) * kstride[d]
        owner = rep_owner
    return key, owner


def _shared_cells(ks: np.ndarray[Any, Any], ow: np.ndarray[Any, Any], same: np.ndarray[Any, Any],
                  max_pairs: int) -> tuple[set[tuple[int, int]], bool]:
    """Pairs of boxes that share a cell (sorted keys ``ks``, their boxes ``ow``), at most
    ``max_pairs`` + 1 of them; True when there were more."""
    pairs: set[tuple[int, int]] = set()
    if not bool(same.any()):
        return pairs, False
    # runs of equal keys: positions [a, b) with b - a >= 2
    boundary = np.flatnonzero(~same) + 1
    starts_ = np.concatenate([[0], boundary])
    ends_ = np.concatenate([boundary, [len(ks)]])
    multi = np.flatnonzero(ends_ - starts_ >= 2)
    for k in multi.tolist():
        owners = sorted(set(ow[starts_[k]:ends_[k]].tolist()))
        for x in range(len(owners)):
            for y in range(x + 1, len(owners)):
                pairs.add((owners[x], owners[y]))
                if len(pairs) > max_pairs:
                    return pairs, True
    return pairs, False


def _union_and_gap(ks: np.ndarray[Any, Any], same: np.ndarray[Any, Any], breaks: list[np.ndarray[Any, Any]],
                   radix: list[int], kstride: list[int], shape: Sequence[int]) -> tuple[int, Box | None]:
    """Elements the covered cells hold, and the first uncovered cell (None: all covered)."""
    nd = len(radix)
    uniq = ks[np.concatenate([[True], ~same])] if len(ks) else ks
    vol = np.ones(len(uniq), dtype=np.int64)
    for d in range(nd):
        idx = (uniq // kstride[d]) % radix[d]
        vol *= np.diff(breaks[d])[idx]
    union = int(vol.sum(dtype=np.int64)) if len(uniq) else 0
    gap: Box | None = None
    if union < prod(shape) and len(uniq) < prod(radix):
        miss = np.flatnonzero(uniq != np.arange(len(uniq), dtype=np.int64))
        first = int(miss[0]) if len(miss) else len(uniq)
        g_off, g_stop = [], []
        for d in range(nd):
            i = (first // kstride[d]) % radix[d]
            g_off.append(int(breaks[d][i]))
            g_stop.append(int(breaks[d][i + 1]))
        gap = box_from(g_off, g_stop)
    return union, gap


def _analyze_sweep(off: np.ndarray[Any, Any], stop: np.ndarray[Any, Any], max_pairs: int) -> BoxAnalysis:
    """Sort along the dim with the fewest candidate pairs (boxes starting before another ends in
    that dim) and check the candidates vectorised, in bounded batches, one dim at a time."""
    n, nd = off.shape
    best: tuple[int, np.ndarray[Any, Any], np.ndarray[Any, Any]] | None = None
    best_k = -1
    for d in range(nd):
        order = np.argsort(off[:, d], kind="stable")
        o = off[order, d]
        end = np.searchsorted(o, stop[order, d], side="left")
        c = np.maximum(end - np.arange(n) - 1, 0)
        k = int(c.sum())
        if best is None or k < best_k:
            best, best_k = (d, order, c), k
    assert best is not None
    sd, order, c = best
    others = [d for d in range(nd) if d != sd]
    cols = [(np.ascontiguousarray(off[order, d]), np.ascontiguousarray(stop[order, d])) for d in others]
    csum = np.cumsum(c)
    cstart = csum - c
    found: list[tuple[int, int]] = []

    def check(pa: np.ndarray[Any, Any], pb: np.ndarray[Any, Any]) -> bool:
        for co, cs in cols:
            keep = (co[pb] < cs[pa]) & (co[pa] < cs[pb])
            pa, pb = pa[keep], pb[keep]
            if not len(pa):
                return False
        x, y = order[pa], order[pb]
        found.extend(zip(np.minimum(x, y).tolist(), np.maximum(x, y).tolist()))
        return len(found) > max_pairs

    p = 0
    batch = _SWEEP_BATCH
    while p < n:
        cp = int(c[p])
        if cp > batch:  # one box with many candidates: in slices
            for s0 in range(0, cp, batch):
                pb = np.arange(p + 1 + s0, p + 1 + min(cp, s0 + batch), dtype=np.int64)
                if check(np.full(len(pb), p, dtype=np.int64), pb):
                    return BoxAnalysis(sorted(found)[:max_pairs], True, None, None)
            p += 1
            continue
        q = int(np.searchsorted(csum, int(cstart[p]) + batch, side="right"))
        reps = c[p:q]
        total = int(reps.sum())
        if total:
            pa = np.repeat(np.arange(p, q, dtype=np.int64), reps)
            within = np.arange(total, dtype=np.int64) - np.repeat(cstart[p:q] - cstart[p], reps)
            if check(pa, pa + 1 + within):
                return BoxAnalysis(sorted(found)[:max_pairs], True, None, None)
        p = q
    return BoxAnalysis(sorted(found), False, None, None)


def _int64_rows(rows: list[tuple[int, ...]], nd: int) -> np.ndarray[Any, Any]:
    if not rows:
        return np.zeros((0, nd), dtype=np.int64)
    return np.array(rows, dtype=np.int64).reshape(len(rows), nd)
