"""One class's template: the exact overlaps of its destination chunks with its source chunks
(a sorted sweep), the pieces split over domain ranks (phase 1) and forwarded inside domains
(phase 2), with holder slots in place of ranks; and the ``Block`` that expands a template over
the class's arrays. Pure planning code.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from formats.manifest.box import Box, slab, split_box, split_dim
from streamer.plan.layout import ArrayLayout
from streamer.plan.model import Block
from streamer.plan.topology import Runs, Topology

__all__ = ["Shares", "SweepIndex", "Template", "build_template", "make_block", "overlaps"]

_I64 = np.int64

class SweepIndex:
    """Boxes sorted along a sweep dim (the one with the most distinct offsets) for interval lookups."""

    def __init__(self, boxes: Sequence[Box]) -> None:
        nd = boxes[0].ndim if boxes else 0
        self.dim = -1
        if nd:
            self.dim = max(range(nd), key=lambda d: (len({b.offsets[d] for b in boxes}), -d))
        if self.dim < 0:
            self.order = list(range(len(boxes)))
            self.starts: list[int] = [0] * len(boxes)
            self.maxlen = 1
        else:
            d = self.dim
            self.order = sorted(range(len(boxes)), key=lambda i: (boxes[i].offsets[d], i))
            self.starts = [boxes[i].offsets[d] for i in self.order]
            self.maxlen = max((b.sizes[d] for b in boxes), default=1)

    def candidates(self, box: Box) -> Iterable[int]:
        if self.dim < 0:
            return self.order
        a = box.offsets[self.dim]
        b = a + box.sizes[self.dim]
        lo = bisect.bisect_right(self.starts, a - self.maxlen)
        hi = bisect.bisect_left(self.starts, b)
        return self.order[lo:hi]


def overlaps(boxes: Sequence[Box], box: Box, index: SweepIndex) -> list[tuple[int, Box]]:
    """(position, intersection) of every box of ``index`` that overlaps ``box``."""
    out = []
    for i in index.candidates(box):
        inter = boxes[i].intersect(box)
        if inter is not None and not inter.empty:
            out.append((i, inter))
    return out


#: which chunk's holders a sender is picked from: the source chunk's or the destination chunk's
_SRC, _DST = 0, 1


class _Item(NamedTuple):
    """One transfer of a template, with holder slots in place of ranks (see :class:`Block`)."""

    phase: int
    src_chunk: int
    dst_chunk: int
    sender_side: int
    sender_slots: tuple[int, ...]
    sender_first: int
    receiver_slots: tuple[int, ...]
    receiver_first: int
    rotation: int
    part: int  # the part it brings into (phase 1) or forwards inside (phase 2) a domain; -1: phase 0


class _Gap(NamedTuple):
    """A destination chunk the source chunks do not cover exactly."""

    dst_chunk: int  # canonical position
    covered: int  # elements the overlapping source chunks cover
    volume: int  # elements of the destination chunk


class Template:
    """The items of one class, built from canonical chunk geometry (slots, not ranks), and the
    class's lower-bound figures for one array."""

    def __init__(self) -> None:
        self.offsets: list[tuple[int, ...]] = []
        self.sizes: list[tuple[int, ...]] = []
        self.items: list[_Item] = []
        self.total = self.lower = self.min_net = 0
        #: bytes needed per (source chunk, sender slots)
        self.needed: dict[tuple[int, tuple[int, ...]], int] = defaultdict(int)
        self.uncovered: list[_Gap] = []

    def add(self, region: Box, phase: int, src_chunk: int, dst_chunk: int, sender_side: int,
            sender_slots: tuple[int, ...], sender_first: int, receiver_slots: tuple[int, ...],
            receiver_first: int, rotation: int, part: int = -1) -> None:
        self.offsets.append(region.offsets)
        self.sizes.append(region.sizes)
        self.items.append(_Item(phase, src_chunk, dst_chunk, sender_side, sender_slots, sender_first,
                                receiver_slots, receiver_first, rotation, part))


#: ``(source chunk position, sender slots) -> each slot's share of the bytes``, or None for
#: equal shares (round-robin rotation then balances)
Shares = Callable[[int, tuple[int, ...]], Sequence[float] | None]


def _split_weighted(box: Box, shares: Sequence[float], grid: Sequence[int] | None = None) -> list[Box | None]:
    """Cut ``box`` along split_box's dim into consecutive slabs proportional to ``shares``."""
    k = len(shares)
    dim, pts = split_dim(box, k, grid)
    n = box.sizes[dim]
    total = sum(shares) or 1.0
    out: list[Box | None] = []
    acc, prev = 0.0, 0
    for j, f in enumerate(shares):
        acc += f
        want = n * acc / total
        if j == k - 1:
            cut = n
        elif pts is None:
            cut = max(prev, min(n, round(want)))
        else:  # the nearest grid point
            i = bisect.bisect_left(pts, want)
            cut = max(prev, min(pts[max(0, i - 1):i + 1], key=lambda x: (abs(x - want), x)))
        out.append(slab(box, dim, prev, cut) if cut > prev else None)
        prev = cut
    return out


def build_template(sl: ArrayLayout, dl: ArrayLayout, runs: Runs, isz: int, topo: Topology, rot0: int,
                   shares: Shares | None = None, grid: Sequence[int] | None = None) -> tuple[Template, int]:
    """The items of one array (``sl`` -> ``dl``, canonical chunk order), and the rotation after them."""
    split_bytes, same_job, dom = topo.split_bytes, topo.same_job, topo.domain
    tp = Template()
    given: dict[tuple[int, int], float] = defaultdict(float)  # bytes per (source chunk, slot), weighted sets
    index = SweepIndex(sl.regions)
    rot = rot0
    pid = -1
    for di, dbox in enumerate(dl.regions):
        pieces = overlaps(sl.regions, dbox, index)
        pieces.sort(key=lambda p: (p[1].offsets, p[1].sizes, p[0]))
        dvol = dbox.volume
        dh = dl.holders[di]
        tp.total += dvol * isz * len(dh)
        covered = sum(b.volume for _, b in pieces)
        if covered != dvol:
            tp.uncovered.append(_Gap(di, covered, dvol))
            continue
        for si, inter in pieces:
            sh = sl.holders[si]
            pbytes = inter.volume * isz
            for c0, c1 in runs[di]:
                slots = tuple(range(c0, c1))
                if same_job:
                    for j in slots:
                        if dh[j] in sh:  # already held: a copy on the rank, nothing moves
                            tp.add(inter, 0, si, di, _DST, (j,), 0, (j,), 0, 0)
                    need = tuple(j for j in slots if dh[j] not in sh)
                    if not need:
                        continue
                    gdom = dom(dh[c0])
                    in_dom = tuple(j for j, h in enumerate(sh) if dom(h) == gdom)
                    if not in_dom:
                        tp.min_net += pbytes
                    senders = in_dom or tuple(range(len(sh)))
                else:
                    need = slots
                    tp.min_net += pbytes
                    senders = tuple(range(len(sh)))
                tp.lower += pbytes * len(need)
                rot += 1
                # phase 1: the piece lands once in the domain, spread over `need`
                parts = [inter] if len(need) == 1 or pbytes < split_bytes else split_box(inter, len(need), grid)
                for i, part in enumerate(parts):
                    pid += 1  # the phase-1 items bringing `part` and the phase-2 items forwarding it
                    psz = part.volume * isz
                    tp.needed[(si, senders)] += psz
                    fr = shares(si, senders) if shares is not None and len(senders) > 1 else None
                    if fr is not None:  # unequal shares: fixed slots, cut (or given) in proportion
                        if psz >= split_bytes and part.ndim:
                            for j, sub in enumerate(_split_weighted(part, fr, grid)):
                                if sub is not None:
                                    tp.add(sub, 1, si, di, _SRC, (senders[j],), 0, need, i, rot, pid)
                                    given[(si, senders[j])] += sub.volume * isz
                        else:
                            j = min((j for j in range(len(senders)) if fr[j] > 0),
                                    key=lambda j: ((given[(si, senders[j])] + psz) / fr[j], j))
                            tp.add(part, 1, si, di, _SRC, (senders[j],), 0, need, i, rot, pid)
                            given[(si, senders[j])] += psz
                    else:
                        subs = [part] if len(senders) == 1 or psz < split_bytes else split_box(part, len(senders), grid)
                        for j, sub in enumerate(subs):
                            tp.add(sub, 1, si, di, _SRC, senders, i + j, need, i, rot, pid)
                    for m in range(1, len(need)):  # phase 2: forward inside the domain
                        tp.add(part, 2, si, di, _DST, need, i, need, i + m, rot, pid)
    return tp, rot


def _pad(rows: Sequence[tuple[int, ...]], width: int) -> np.ndarray:
    w = max(width, 1)
    if rows and width and all(len(r) == width for r in rows):
        return np.array(rows, dtype=_I64).reshape(len(rows), w)
    out = np.zeros((len(rows), w), dtype=_I64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def _holder_table(lays: Sequence[ArrayLayout], shift: int) -> tuple[np.ndarray, np.ndarray]:
    """Unique holder tables of the arrays' layouts, and each array's row."""
    rows: dict[tuple[tuple[int, ...], ...], int] = {}
    uniq: list[ArrayLayout] = []
    idx = np.empty(len(lays), dtype=_I64)
    for a, lay in enumerate(lays):
        key = lay.holders
        if key not in rows:
            rows[key] = len(uniq)
            uniq.append(lay)
        idx[a] = rows[key]
    n = len(uniq[0].holders) if uniq else 0
    k = max((len(h) for lay in uniq for h in lay.holders), default=1)
    tab = np.zeros((len(uniq), max(n, 1), max(k, 1)), dtype=np.int32)  # ranks fit: half the traffic
    for u, lay in enumerate(uniq):
        for c, h in enumerate(lay.holders):
            tab[u, c, :len(h)] = h
    tab += shift
    return tab, idx


def make_block(tp: Template, fqns: Sequence[str], isz: int, ndim: int, src_lay: Sequence[ArrayLayout],
               dst_lay: Sequence[ArrayLayout], dst_shift: int, grid: tuple[int, ...] | None = None) -> Block:
    T = len(tp.items)
    items = tp.items
    cw = max((max(len(c.sender_slots), len(c.receiver_slots)) for c in items), default=1)
    src_holders, src_row = _holder_table(src_lay, 0)
    dst_holders, dst_row = _holder_table(dst_lay, dst_shift)

    def column(name: str, dtype: Any = _I64) -> np.ndarray:
        return np.array([getattr(c, name) for c in items], dtype=dtype)

    return Block(
        fqns=tuple(fqns), itemsize=isz, ndim=ndim,
        offsets=_pad(tp.offsets, ndim), sizes=_pad(tp.sizes, ndim) if ndim else np.ones((T, 1), dtype=_I64),
        phase=column("phase", np.int8), src_chunk=column("src_chunk"), dst_chunk=column("dst_chunk"),
        sender_side=column("sender_side", np.int8),
        sender_slots=_pad([c.sender_slots for c in items], cw), sender_first=column("sender_first"),
        sender_count=np.array([len(c.sender_slots) for c in items], dtype=_I64),
        receiver_slots=_pad([c.receiver_slots for c in items], cw), receiver_first=column("receiver_first"),
        receiver_count=np.array([len(c.receiver_slots) for c in items], dtype=_I64),
        rotation=column("rotation"), part=column("part"), src_holders=src_holders, src_row=src_row, dst_holders=dst_holders,
        dst_row=dst_row, src_layouts=tuple(src_lay), dst_layouts=tuple(dst_lay), grid=grid)
