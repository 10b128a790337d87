"""Pure planner: (source manifest, destination manifest, topology) -> Plan.

No I/O, no MPI, no torch: stdlib, numpy and ``formats`` only, so every rank can compute the same
plan from the same manifests and check it with a digest before any byte moves.

How a plan is built:

1. *Classes.* Arrays with the same shape, data type and chunk geometry on both sides (regions,
   holder counts, and which destination holders share a domain) are planned together: a DSv3
   trainer -> generator refit has 61k arrays but a few hundred classes. Holders differ between
   the arrays of a class (layer i lives on stage i // L, expert e on EP rank e // E); the class
   *template* refers to holders by slot (the j-th holder of a chunk) and is expanded over the
   arrays' holder tables with numpy. In a same-job reshard which bytes are already in place
   depends on the holders themselves, so there the holders are part of the class.
2. *Exact overlaps.* Source chunks are sorted along a sweep dim (the dim with the most distinct
   offsets); each destination chunk looks up only the source chunks whose interval along that
   dim can overlap it (bisect), then intersects boxes exactly: the *pieces*.
3. *Topology.* The destination holders of a piece are grouped by domain. A domain that needs a
   piece and holds none of it receives it once over the network: the piece is split evenly over
   the domain's ranks that need it (phase 1), and each of them forwards its part to the others
   inside the domain (phase 2).
4. *Replica balancing.* A phase-1 part of at least ``split_bytes`` is split evenly over the
   source holders (each replica sends one slice); a smaller one goes whole to one holder. Which
   holder takes which slice, and which domain rank lands a piece, rotates with the array's
   position in its class and with the piece, so equal loads spread round-robin. Rotation is
   deterministic and depends only on the manifests' content, never on their order.

The plan is kept compressed (templates + holder tables); ``Plan.transfers`` materialises every
transfer, ``Plan.sends(rank)`` / ``Plan.recvs(rank)`` / ``Plan.transfers_of(rank)`` only one
rank's. Ranks are numbered globally: the source job's ranks are ``0..S-1`` and the destination
job's are ``S..S+D-1`` (trainers first, as in NCCL M2N), unless ``same_job`` is set, in which case
rank r of both manifests is one process and bytes a rank already holds do not move.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import io
import pickle
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from formats.box import Box, slab, split_box, split_dim
from formats.errors import PlanError
from formats.manifest import ArraySpec, Chunk, Manifest

__all__ = [
    "DEFAULT_SPLIT_BYTES",
    "Plan",
    "Transfer",
    "match_arrays",
    "array_casts",
    "CASTABLE",
    "plan_transfers",
    "validate_plan",
]

#: parts at least this large are split across replicas / domain ranks; smaller ones move whole
DEFAULT_SPLIT_BYTES = 64 << 10

_I64 = np.int64


@dataclass(frozen=True, slots=True)
class Transfer:
    """Copy ``sizes`` elements of array ``fqn`` from a source rank's local tensor to a
    destination rank's local tensor (DCP ``ReadItem``-like). Ranks are global.

    ``phase`` 0: a local copy on one rank (same-job reshard, nothing moves);
    1: from a source holder; 2: forwarded inside a destination domain by a rank that received
    the region in phase 1 (``src_tensor``/``src_offsets`` are then in that rank's *destination*
    local tensor).
    """

    fqn: str
    region: Box  # in global array coordinates
    src_rank: int
    src_tensor: str
    src_offsets: tuple[int, ...]
    dst_rank: int
    dst_tensor: str
    dst_offsets: tuple[int, ...]
    itemsize: int
    phase: int = 1
    src_chunk: int = -1  # index into the source (phase 1/0) array's chunks
    dst_chunk: int = -1  # index into the destination array's chunks

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.region.sizes

    @property
    def nbytes(self) -> int:
        return self.region.volume * self.itemsize

    @property
    def src_box(self) -> Box:
        return Box(self.src_offsets, self.region.sizes)

    @property
    def dst_box(self) -> Box:
        return Box(self.dst_offsets, self.region.sizes)

    def key(self) -> str:
        return (f"{self.fqn}|{self.region.offsets}|{self.region.sizes}|{self.src_rank}|"
                f"{self.src_tensor}|{self.src_offsets}|{self.dst_rank}|{self.dst_tensor}|"
                f"{self.dst_offsets}|{self.itemsize}|{self.phase}")


# --------------------------------------------------------------------------- chunk layouts

def _chunk_order(c: Chunk) -> tuple[Any, ...]:
    return (c.region.offsets, c.region.sizes, c.holders, c.tensor(""), c.local_offsets)


@dataclass(frozen=True, eq=False)
class _Layout:
    """One array's chunks in canonical order (memoised per chunks tuple: layouts share them)."""

    perm: tuple[int, ...]  # canonical position -> index in the manifest's chunk list
    boxes: tuple[Box, ...]
    holders: tuple[tuple[int, ...], ...]
    tensors: tuple[str | None, ...]  # source.tensor (None: the array's own name)
    local: tuple[tuple[int, ...], ...]  # source.offsets (defaults filled in)
    geom: tuple[Any, ...]  # regions and holder counts: what a class shares

    @functools.cached_property
    def content(self) -> bytes:
        """Digest of everything above: equal content, equal plan. Pickled without its memo, so
        that equal values give equal bytes however their objects are shared (presets share
        tuples, parsed manifests do not)."""
        buf = io.BytesIO()
        p = pickle.Pickler(buf, protocol=4)
        p.fast = True
        p.dump((self.geom, self.holders, self.tensors, self.local))
        return hashlib.sha256(buf.getvalue()).digest()

    @staticmethod
    def of(chunks: Sequence[Chunk]) -> _Layout:
        # regions of one array are disjoint in any valid manifest: sort by region, and break
        # ties (a broken manifest the planner still reports on) by the whole chunk
        keys = [(c.region.offsets, c.region.sizes) for c in chunks]
        perm = tuple(sorted(range(len(chunks)), key=keys.__getitem__))
        if any(keys[a] == keys[b] for a, b in zip(perm, perm[1:])):
            perm = tuple(sorted(range(len(chunks)), key=lambda i: _chunk_order(chunks[i])))
        cs = [chunks[i] for i in perm]
        boxes = tuple(c.region for c in cs)
        holders = tuple(c.holders for c in cs)
        tensors = tuple(c.source.tensor if c.source is not None else None for c in cs)
        local = tuple(c.local_offsets for c in cs)
        geom = tuple((b.offsets, b.sizes, len(h)) for b, h in zip(boxes, holders))
        return _Layout(perm, boxes, holders, tensors, local, geom)


class _Memo:
    """Layouts by chunks-tuple identity (the tuples stay referenced, so ids stay unique)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Sequence[Chunk], _Layout]] = {}

    def layout(self, spec: ArraySpec) -> _Layout:
        hit = self._by_id.get(id(spec.chunks))
        if hit is None:
            hit = (spec.chunks, _Layout.of(spec.chunks))
            self._by_id[id(spec.chunks)] = hit
        return hit[1]


# --------------------------------------------------------------------------- compressed plan

@dataclass(eq=False)
class _Block:
    """A class of arrays planned by one template of T items, expanded over A arrays.

    Item t of array a moves ``size[t]`` elements at ``off[t]``. Its sender is a holder of the
    source chunk ``si[t]`` (``side[t] == 0``) or of the destination chunk ``di[t]`` (phase 2
    forwards, phase-0 local copies): slot ``cand[(k + rot + a) % n]`` of that chunk's holders,
    so rotating ``a`` spreads equal work round-robin over replicas and domain ranks.
    """

    fqns: tuple[str, ...]
    itemsize: int
    ndim: int
    off: np.ndarray  # [T, ndim]
    size: np.ndarray  # [T, ndim]
    phase: np.ndarray  # [T] int8
    si: np.ndarray  # [T] canonical source chunk position
    di: np.ndarray  # [T] canonical destination chunk position
    side: np.ndarray  # [T] 0: sender from source holders, 1: from destination holders
    scand: np.ndarray  # [T, c] slot candidates, padded
    sk: np.ndarray
    sn: np.ndarray
    dcand: np.ndarray
    dk: np.ndarray
    dn: np.ndarray
    rot: np.ndarray  # [T]
    hs: np.ndarray  # [Us, src chunks, max holders] source holders (global ranks)
    us: np.ndarray  # [A] row of hs for each array
    hd: np.ndarray  # [Ud, dst chunks, max holders] destination holders (global ranks)
    ud: np.ndarray  # [A]
    src_lay: tuple[_Layout, ...]  # per array, for tensors / offsets / manifest chunk indices
    dst_lay: tuple[_Layout, ...]
    grid: tuple[int, ...] | None = None  # FP8 weights: cuts only on the scale-block grid

    @property
    def items(self) -> int:
        return int(self.phase.shape[0])

    def ranks(self) -> tuple[np.ndarray, np.ndarray]:
        """Sender and receiver of every (array, item), shaped [A, T] (transposed views)."""
        src, dst = self.ranks_ta()
        return src.T, dst.T

    def ranks_ta(self) -> tuple[np.ndarray, np.ndarray]:
        """Sender and receiver of every (item, array), shaped [T, A], C-contiguous."""
        A, T = len(self.fqns), self.items
        if T == 0 or A == 0:
            z = np.zeros((T, A), dtype=_I64)
            return z, z
        dslot = _slots(self.dcand, self.dk, self.dn, self.rot, A)
        dst = _gather(self.hd, self.ud, self.di, dslot)
        sslot = _slots(self.scand, self.sk, self.sn, self.rot, A)
        from_src = self.side == 0
        if from_src.all():
            src = _gather(self.hs, self.us, self.si, sslot)
        else:
            src = np.empty_like(dst)
            m = np.nonzero(from_src)[0]
            if len(m):
                src[m] = _gather(self.hs, self.us, self.si[m], sslot[m])
            m = np.nonzero(~from_src)[0]
            src[m] = _gather(self.hd, self.ud, self.di[m], sslot[m])
        return src, dst

    def item_bytes(self) -> np.ndarray:
        out: np.ndarray = np.prod(self.size, axis=1, dtype=_I64) * self.itemsize
        return out

    def digest_into(self, h: Any) -> None:
        h.update(("\x00".join(self.fqns) + f"|{self.itemsize}|{self.ndim}\n").encode())
        for x in (self.off, self.size, self.phase, self.si, self.di, self.side, self.scand, self.sk,
                  self.sn, self.dcand, self.dk, self.dn, self.rot, self.hs, self.us, self.hd, self.ud):
            h.update(np.ascontiguousarray(x).tobytes())
            h.update(repr(x.shape).encode())
        for lay in self.src_lay + self.dst_lay:  # sources: tensors and offsets are part of the plan
            h.update(lay.content)

    def materialise(self, a: int, t: int, src_rank: int, dst_rank: int) -> Transfer:
        fqn = self.fqns[a]
        nd = self.ndim
        offs = tuple(int(v) for v in self.off[t, :nd])
        region = Box(offs, tuple(int(v) for v in self.size[t, :nd]))
        sl, dl = self.src_lay[a], self.dst_lay[a]
        si, di, phase = int(self.si[t]), int(self.di[t]), int(self.phase[t])
        dlo, dbase = dl.boxes[di].offsets, dl.local[di]
        do = tuple(b + o - lo for b, o, lo in zip(dbase, offs, dlo))
        dtensor = dl.tensors[di] or fqn
        if phase == 2:  # the forwarder reads its own copy of the destination chunk
            stensor, so = dtensor, do
        else:
            slo, sbase = sl.boxes[si].offsets, sl.local[si]
            so = tuple(b + o - lo for b, o, lo in zip(sbase, offs, slo))
            stensor = sl.tensors[si] or fqn
        return Transfer(fqn, region, src_rank, stensor, so, dst_rank, dtensor, do, self.itemsize, phase,
                        sl.perm[si], dl.perm[di])


def _slots(cand: np.ndarray, k: np.ndarray, n: np.ndarray, rot: np.ndarray, A: int) -> np.ndarray:
    """Holder slot of every (item, array): ``cand[(k + rot + a) % n]``; [T, A]."""
    T = len(n)
    out = np.empty((T, A), dtype=_I64)
    fixed = n == 1  # most items: one candidate, no rotation to compute
    if fixed.any():
        out[fixed] = cand[fixed, 0][:, None]
    m = np.nonzero(~fixed)[0]
    if len(m):
        r = (k[m] + rot[m])[:, None] + np.arange(A, dtype=_I64)[None, :]
        out[m] = cand[m[:, None], r % n[m][:, None]]
    return out


def _gather(table: np.ndarray, row: np.ndarray, chunk: np.ndarray, slot: np.ndarray) -> np.ndarray:
    """``table[row[a], chunk[t], slot[t, a]]`` for every (item t, array a); [T, A]."""
    u, nc, k = table.shape
    idx = slot.astype(np.int32) if table.size < 2**31 else slot.copy()
    idx += (chunk * k).astype(idx.dtype)[:, None]
    if u > 1:  # one holder table for the whole class is the common case: no per-array term
        idx += (row * (nc * k)).astype(idx.dtype)[None, :]
    out: np.ndarray = np.take(table.reshape(-1), idx)
    return out


class Plan:
    """Every transfer that makes the destination's chunks out of the source's.

    Built by :func:`plan_transfers` (compressed, see the module docstring) or from an explicit
    list of transfers (:meth:`from_transfers`).
    """

    def __init__(self, blocks: Sequence[_Block], src_world: int, dst_world: int, same_job: bool,
                 src_domain_size: int, dst_domain_size: int, stats: Mapping[str, Any] | None = None,
                 *, explicit: Sequence[Transfer] | None = None) -> None:
        self._blocks = tuple(blocks)
        self.src_world = src_world
        self.dst_world = dst_world
        self.same_job = same_job
        self.src_domain_size = src_domain_size
        self.dst_domain_size = dst_domain_size
        self._stats = dict(stats or {})
        #: arrays the sender casts while packing: fqn -> (source, destination data_type)
        self.casts: dict[str, tuple[str, str]] = {}
        self._explicit = tuple(explicit) if explicit is not None else None
        self._all: tuple[Transfer, ...] | None = self._explicit

    @classmethod
    def from_transfers(cls, transfers: Sequence[Transfer], src_world: int, dst_world: int, same_job: bool,
                       src_domain_size: int = 1, dst_domain_size: int = 1) -> Plan:
        return cls((), src_world, dst_world, same_job, src_domain_size, dst_domain_size, explicit=transfers)

    # -- rank numbering
    def dst_global(self, rank: int) -> int:
        return rank if self.same_job else self.src_world + rank

    def dst_local(self, global_rank: int) -> int:
        return global_rank if self.same_job else global_rank - self.src_world

    @property
    def world_size(self) -> int:
        return max(self.src_world, self.dst_world) if self.same_job else self.src_world + self.dst_world

    # -- transfers
    def _select(self, keep: Any, ranks: Sequence[tuple[np.ndarray, np.ndarray]] | None = None) -> Iterator[Transfer]:
        """Transfers whose (src ranks, dst ranks, phases) arrays pass ``keep`` (a mask maker);
        ``ranks``: each block's ``ranks()``, when the caller already has them."""
        for i, b in enumerate(self._blocks):
            src, dst = b.ranks() if ranks is None else ranks[i]
            mask = keep(src, dst, np.broadcast_to(b.phase[None, :], src.shape))
            for a, t in zip(*np.nonzero(mask)):
                yield b.materialise(int(a), int(t), int(src[a, t]), int(dst[a, t]))

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        if self._all is None:
            self._all = tuple(self._select(lambda s, d, p: np.ones(s.shape, dtype=bool)))
        return self._all

    def transfers_of(self, rank: int) -> list[Transfer]:
        """Every transfer ``rank`` (global) sends, receives or copies locally, in plan order."""
        if self._explicit is not None:
            return [t for t in self._explicit if rank in (t.src_rank, t.dst_rank)]
        return list(self._select(lambda s, d, p: (s == rank) | (d == rank)))

    def schedule_transfers(self, rank: int) -> list[Transfer]:
        """What ordering ``rank``'s messages needs, in plan order: its own transfers plus the
        phase-1 transfers into the ranks that forward bytes to it (a phase-2 message is ordered
        after the phase-1 messages that bring its bytes to the forwarder)."""
        if self._explicit is not None:
            ends = {t.src_rank for t in self._explicit if t.phase == 2 and t.dst_rank == rank}
            return [t for t in self._explicit
                    if rank in (t.src_rank, t.dst_rank) or (t.phase == 1 and t.dst_rank in ends)]
        fwd_set: set[int] = set()
        ranks = [b.ranks() for b in self._blocks]  # [A, T]; computed once for both passes
        for b, (src, dst) in zip(self._blocks, ranks):
            p2 = b.phase == 2
            if p2.any():
                fwd_set.update(np.unique(src[:, p2][dst[:, p2] == rank]).tolist())
        fwd = np.array(sorted(fwd_set), dtype=_I64)
        return list(self._select(lambda s, d, p: (s == rank) | (d == rank) | ((p == 1) & np.isin(d, fwd)), ranks))

    def sends(self, rank: int) -> list[Transfer]:
        if self._explicit is not None:
            return [t for t in self._explicit if t.src_rank == rank and t.phase != 0]
        return list(self._select(lambda s, d, p: (s == rank) & (p != 0)))

    def recvs(self, rank: int) -> list[Transfer]:
        if self._explicit is not None:
            return [t for t in self._explicit if t.dst_rank == rank and t.phase != 0]
        return list(self._select(lambda s, d, p: (d == rank) & (p != 0)))

    def pair_bytes(self) -> dict[tuple[int, int, int], int]:
        """Bytes per ``(phase, src global rank, dst global rank)`` (phase-0 local copies left out)."""
        out: dict[tuple[int, int, int], int] = defaultdict(int)
        if self._explicit is not None:
            for tr in self._explicit:
                if tr.phase:
                    out[(tr.phase, tr.src_rank, tr.dst_rank)] += tr.nbytes
            return dict(out)
        W = max(self.world_size, 1)
        for b in self._blocks:
            src, dst = b.ranks()
            ph = np.broadcast_to(b.phase[None, :].astype(_I64), src.shape)
            nb = np.broadcast_to(b.item_bytes()[None, :], src.shape)
            keep = ph != 0
            key = (ph[keep] * W + src[keep].astype(_I64)) * W + dst[keep].astype(_I64)
            u, inv = np.unique(key, return_inverse=True)
            sums = np.bincount(inv, weights=nb[keep].astype(np.float64), minlength=len(u))
            for k, v in zip(u.tolist(), sums.tolist()):
                out[(k // (W * W), (k // W) % W, k % W)] += int(v)
        return dict(out)

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    @property
    def num_transfers(self) -> int:
        """Transfers of every phase (local copies included), without materialising them."""
        if self._explicit is not None:
            return len(self._explicit)
        return int(self._stats["transfers"] + self._stats["local_copies"])

    def digest(self) -> str:
        h = hashlib.sha256()
        h.update(f"{self.src_world}|{self.dst_world}|{self.same_job}|{self.src_domain_size}|"
                 f"{self.dst_domain_size}\n".encode())
        if self._explicit is not None:
            for t in self._explicit:
                h.update(t.key().encode())
                h.update(b"\n")
        for b in self._blocks:
            b.digest_into(h)
        return h.hexdigest()


# --------------------------------------------------------------------------- matching

#: data types cast into one another on the way when source and destination differ (the sender
#: casts while it packs, so the wire carries destination-sized bytes). FP8 is not among them:
#: it needs scales, not a cast.
CASTABLE = ("float16", "bfloat16", "float32", "float64")


def array_casts(src: Manifest, dst: Manifest) -> dict[str, tuple[str, str]]:
    """``fqn -> (source data_type, destination data_type)`` for every array cast on the way."""
    return {f: (src.arrays[f].data_type, d.data_type) for f, d in dst.arrays.items()
            if f in src.arrays and src.arrays[f].data_type != d.data_type}


def match_arrays(src: Manifest, dst: Manifest, *, allow_extra: bool = False) -> list[str]:
    """Every problem matching ``dst`` arrays to ``src`` arrays (missing, extra, shape, dtype)."""
    problems = []
    for fqn, d in dst.arrays.items():
        s = src.arrays.get(fqn)
        if s is None:
            problems.append(f"{fqn}: missing in source (the destination needs it)")
            continue
        if s.shape != d.shape:
            problems.append(f"{fqn}: shape mismatch (source {list(s.shape)}, destination {list(d.shape)})")
        if s.data_type != d.data_type and not (s.data_type in CASTABLE and d.data_type in CASTABLE):
            problems.append(f"{fqn}: data_type mismatch (source {s.data_type}, destination {d.data_type}): only "
                            f"floating-point pairs ({', '.join(CASTABLE)}) are cast on the way")
    if not allow_extra:
        for fqn in src.arrays:
            if fqn not in dst.arrays:
                problems.append(f"{fqn}: in source but not in destination (pass --allow-extra to drop it)")
    return problems


# --------------------------------------------------------------------------- overlaps

class _Index:
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


def _overlaps(boxes: Sequence[Box], box: Box, index: _Index) -> list[tuple[int, Box]]:
    """(position, intersection) of every box of ``index`` that overlaps ``box``."""
    out = []
    for i in index.candidates(box):
        inter = boxes[i].intersect(box)
        if inter is not None and not inter.empty:
            out.append((i, inter))
    return out


# --------------------------------------------------------------------------- templates

_SRC, _DST = 0, 1


class _Template:
    """The items of one class, built from canonical chunk geometry (slots, not ranks)."""

    def __init__(self) -> None:
        self.off: list[tuple[int, ...]] = []
        self.size: list[tuple[int, ...]] = []
        self.cols: list[tuple[int, int, int, int, tuple[int, ...], int, tuple[int, ...], int, int]] = []
        self.total = self.lower = self.min_net = 0
        self.needed: dict[tuple[int, tuple[int, ...]], int] = defaultdict(int)  # (si, sender slots)
        self.uncovered: list[tuple[int, int, int]] = []  # (dst position, covered, volume)

    def add(self, box: Box, phase: int, si: int, di: int, side: int, scand: tuple[int, ...], sk: int,
            dcand: tuple[int, ...], dk: int, rot: int) -> None:
        self.off.append(box.offsets)
        self.size.append(box.sizes)
        self.cols.append((phase, si, di, side, scand, sk, dcand, dk, rot))


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


def _build_template(sl: _Layout, dl: _Layout, runs: Sequence[Sequence[tuple[int, int]]], isz: int,
                    split_bytes: int, same_job: bool, dom: Any, rot0: int,
                    shares: Shares | None = None, grid: Sequence[int] | None = None) -> tuple[_Template, int]:
    tp = _Template()
    given: dict[tuple[int, int], float] = defaultdict(float)  # bytes per (source chunk, slot), weighted sets
    index = _Index(sl.boxes)
    rot = rot0
    for di, dbox in enumerate(dl.boxes):
        pieces = _overlaps(sl.boxes, dbox, index)
        pieces.sort(key=lambda p: (p[1].offsets, p[1].sizes, p[0]))
        dvol = dbox.volume
        dh = dl.holders[di]
        tp.total += dvol * isz * len(dh)
        covered = sum(b.volume for _, b in pieces)
        if covered != dvol:
            tp.uncovered.append((di, covered, dvol))
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
                    psz = part.volume * isz
                    tp.needed[(si, senders)] += psz
                    fr = shares(si, senders) if shares is not None and len(senders) > 1 else None
                    if fr is not None:  # unequal shares: fixed slots, cut (or given) in proportion
                        if psz >= split_bytes and part.ndim:
                            for j, sub in enumerate(_split_weighted(part, fr, grid)):
                                if sub is not None:
                                    tp.add(sub, 1, si, di, _SRC, (senders[j],), 0, need, i, rot)
                                    given[(si, senders[j])] += sub.volume * isz
                        else:
                            j = min((j for j in range(len(senders)) if fr[j] > 0),
                                    key=lambda j: ((given[(si, senders[j])] + psz) / fr[j], j))
                            tp.add(part, 1, si, di, _SRC, (senders[j],), 0, need, i, rot)
                            given[(si, senders[j])] += psz
                    else:
                        subs = [part] if len(senders) == 1 or psz < split_bytes else split_box(part, len(senders), grid)
                        for j, sub in enumerate(subs):
                            tp.add(sub, 1, si, di, _SRC, senders, i + j, need, i, rot)
                    for m in range(1, len(need)):  # phase 2: forward inside the domain
                        tp.add(part, 2, si, di, _DST, need, i, need, i + m, rot)
    return tp, rot


def _pad(rows: Sequence[tuple[int, ...]], width: int) -> np.ndarray:
    w = max(width, 1)
    if rows and width and all(len(r) == width for r in rows):
        return np.array(rows, dtype=_I64).reshape(len(rows), w)
    out = np.zeros((len(rows), w), dtype=_I64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def _holder_table(lays: Sequence[_Layout], shift: int) -> tuple[np.ndarray, np.ndarray]:
    """Unique holder tables of the arrays' layouts, and each array's row."""
    rows: dict[tuple[tuple[int, ...], ...], int] = {}
    uniq: list[_Layout] = []
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


def _make_block(tp: _Template, fqns: Sequence[str], isz: int, ndim: int, src_lay: Sequence[_Layout],
                dst_lay: Sequence[_Layout], dst_shift: int, grid: tuple[int, ...] | None = None) -> _Block:
    T = len(tp.cols)
    cw = max((max(len(c[4]), len(c[6])) for c in tp.cols), default=1)
    cols = tp.cols
    hs, us = _holder_table(src_lay, 0)
    hd, ud = _holder_table(dst_lay, dst_shift)
    return _Block(
        fqns=tuple(fqns), itemsize=isz, ndim=ndim,
        off=_pad(tp.off, ndim), size=_pad(tp.size, ndim) if ndim else np.ones((T, 1), dtype=_I64),
        phase=np.array([c[0] for c in cols], dtype=np.int8),
        si=np.array([c[1] for c in cols], dtype=_I64), di=np.array([c[2] for c in cols], dtype=_I64),
        side=np.array([c[3] for c in cols], dtype=np.int8),
        scand=_pad([c[4] for c in cols], cw), sk=np.array([c[5] for c in cols], dtype=_I64),
        sn=np.array([len(c[4]) for c in cols], dtype=_I64),
        dcand=_pad([c[6] for c in cols], cw), dk=np.array([c[7] for c in cols], dtype=_I64),
        dn=np.array([len(c[6]) for c in cols], dtype=_I64),
        rot=np.array([c[8] for c in cols], dtype=_I64),
        hs=hs, us=us, hd=hd, ud=ud, src_lay=tuple(src_lay), dst_lay=tuple(dst_lay), grid=grid)


# --------------------------------------------------------------------------- FP8 pairs

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


def _follows(w: _Layout, sc: _Layout, block: Sequence[int], wshape: Sequence[int]) -> bool:
    """Whether the scale chunks are the weight chunks' block images, on the same holders."""
    if len(w.boxes) != len(sc.boxes) or w.holders != sc.holders:
        return False
    for b, c in zip(w.boxes, sc.boxes):
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


def _fp8_pairs(src: Manifest, dst: Manifest, lays: Mapping[str, tuple[_Layout, _Layout]]
               ) -> tuple[dict[str, tuple[str, tuple[int, ...]]], list[str]]:
    """``{weight: (scale, block)}`` for every FP8 weight whose ``…_scale_inv`` array follows it
    block for block in both manifests: such a pair is planned as one, so each scale block moves
    from the same sender to the same receivers in the same phase as the weight rows it scales.
    The second value names the scale arrays that do not follow their weights (planned alone)."""
    pairs: dict[str, tuple[str, tuple[int, ...]]] = {}
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
            pairs[wf] = (sf, block)
        else:
            alone.append(sf)
    return pairs, alone


def _derive_scales(block: _Block, pairs: Mapping[str, tuple[str, tuple[int, ...]]],
                   lays: Mapping[str, tuple[_Layout, _Layout]], itemsize: int) -> _Block:
    """The scale arrays' block of a block of paired FP8 weights: every item's region mapped to
    the scale blocks it covers (cuts are on the grid, so images never overlap); senders,
    receivers and phases are the weights' own."""
    grid = np.array(block.grid, dtype=_I64)
    off = block.off // grid
    stop = -(-(block.off + block.size) // grid)
    names = [pairs[f][0] for f in block.fqns]
    return replace(block, fqns=tuple(names), itemsize=itemsize, off=off, size=stop - off,
                   src_lay=tuple(lays[n][0] for n in names), dst_lay=tuple(lays[n][1] for n in names),
                   grid=None)


# --------------------------------------------------------------------------- planner

def plan_transfers(src: Manifest, dst: Manifest, *, src_domain_size: int | None = None,
                   dst_domain_size: int | None = None, same_job: bool = False,
                   allow_extra: bool = False, split_bytes: int = DEFAULT_SPLIT_BYTES) -> Plan:
    """Plan every transfer that makes ``dst``'s chunks out of ``src``'s.

    Raises ``PlanError`` listing every array that is missing, extra, or mismatched, and every
    destination region that no source chunk covers.
    """
    problems = match_arrays(src, dst, allow_extra=allow_extra)
    if problems:
        raise PlanError(problems=problems)
    S, D = src.world_size, dst.world_size
    sds = src_domain_size or src.domain_size or 1
    dds = dst_domain_size or dst.domain_size or 1
    if same_job:
        # one process per rank: one domain numbering for both sides
        sds = dds = (src_domain_size or dst_domain_size or src.domain_size or dst.domain_size or 1)
    shift = 0 if same_job else S

    def dom_local_dst(h: int) -> int:
        return h // (sds if same_job else dds)

    memo = _Memo()
    geom_ids: dict[Any, int] = {}
    runs_of: dict[int, tuple[int, tuple[tuple[tuple[int, int], ...], ...]]] = {}

    def gid(g: Any) -> int:
        return geom_ids.setdefault(g, len(geom_ids))

    lay_gid: dict[int, int] = {}

    def geom_id(lay: _Layout) -> int:  # hashing a geometry tuple is O(chunks): once per layout
        g = lay_gid.get(id(lay))
        if g is None:
            g = lay_gid[id(lay)] = gid(lay.geom)
        return g

    chunk_runs: dict[tuple[int, ...], tuple[tuple[int, int], ...]] = {}
    by_holders: dict[tuple[tuple[int, ...], ...], tuple[int, tuple[tuple[tuple[int, int], ...], ...]]] = {}

    def one_run(h: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        got = chunk_runs.get(h)
        if got is None:
            groups: list[tuple[int, int]] = []
            for j, r in enumerate(h):
                if groups and dom_local_dst(h[groups[-1][0]]) == dom_local_dst(r):
                    groups[-1] = (groups[-1][0], j + 1)
                else:
                    groups.append((j, j + 1))
            got = chunk_runs[h] = tuple(groups)
        return got

    def runs(lay: _Layout) -> tuple[int, tuple[tuple[tuple[int, int], ...], ...]]:
        # destination holder slots grouped by domain (holders are sorted: groups are runs);
        # memoised per layout and per holder tuple: parsed manifests share no objects
        hit = runs_of.get(id(lay))
        if hit is None:
            hit = by_holders.get(lay.holders)
            if hit is None:
                rt = tuple(one_run(h) for h in lay.holders)
                hit = by_holders[lay.holders] = (gid(("runs", rt)), rt)
            runs_of[id(lay)] = hit
        return hit

    # classes: arrays that one template serves
    classes: dict[Any, list[str]] = defaultdict(list)
    lays: dict[str, tuple[_Layout, _Layout]] = {}
    for fqn in sorted(dst.arrays):
        lays[fqn] = (memo.layout(src.arrays[fqn]), memo.layout(dst.arrays[fqn]))
    pairs, unpaired = _fp8_pairs(src, dst, lays)
    scales = {sf for sf, _ in pairs.values()}
    for fqn in sorted(dst.arrays):
        if fqn in scales:  # planned with its weight
            continue
        d = dst.arrays[fqn]
        sl, dl = lays[fqn]
        key: tuple[Any, ...] = (d.shape, d.data_type, geom_id(sl), geom_id(dl), runs(dl)[0])
        if fqn in pairs:
            key += (pairs[fqn][1],)
        if same_job:
            key += (sl.content, dl.content)
        classes[key].append(fqn)

    # canonical class order: the fewest source replicas first (the most constrained), larger first
    def class_order(item: tuple[Any, list[str]]) -> tuple[int, int, str]:
        fqns = item[1]
        a = src.arrays[fqns[0]]
        return (min((len(c.holders) for c in a.chunks), default=0), -a.nbytes, fqns[0])

    built: list[tuple[_Block, _Template, int]] = []  # (block, its template, rotation start)
    total = lower = min_net = 0
    needed_by_set: dict[tuple[int, ...], int] = defaultdict(int)
    uncovered: list[str] = []
    rot = 0

    def gdom(g: int) -> int:
        return g // sds

    for _key, fqns in sorted(classes.items(), key=class_order):
        d0 = dst.arrays[fqns[0]]
        sl0, dl0 = lays[fqns[0]]
        isz = d0.dtype.itemsize
        rot0 = rot
        grid = pairs[fqns[0]][1] if fqns[0] in pairs else None
        tp, rot = _build_template(sl0, dl0, runs(dl0)[1], isz, split_bytes, same_job, gdom, rot0, grid=grid)
        rot += len(fqns)  # the next class starts where this one's rotation ended
        A = len(fqns)
        for di, covered, dvol in tp.uncovered:
            what = "overlapping source chunks cover" if covered > dvol else "source chunks cover only"
            for fqn in fqns:
                dl = lays[fqn][1]
                uncovered.append(f"{fqn}: destination chunk {dl.perm[di]} region {dl.boxes[di]} ({what} "
                                 f"{covered} of {dvol} elements)")
        if tp.uncovered:
            continue
        total += tp.total * A
        lower += tp.lower * A
        min_net += tp.min_net * A
        block = _make_block(tp, fqns, isz, len(d0.shape), [lays[f][0] for f in fqns],
                            [lays[f][1] for f in fqns], shift, grid)
        counts = np.bincount(block.us, minlength=block.hs.shape[0])
        needs = [tp.needed]
        if grid is not None:  # the scales' own figures (same geometry in block units, same holders)
            ssl, sdl = lays[pairs[fqns[0]][0]]
            tps, _ = _build_template(ssl, sdl, runs(sdl)[1], dst.arrays[pairs[fqns[0]][0]].dtype.itemsize,
                                     split_bytes, same_job, gdom, 0)
            total += tps.total * A
            lower += tps.lower * A
            min_net += tps.min_net * A
            needs.append(tps.needed)
        for need in needs:
            for (si, senders), nbytes in need.items():
                for u in np.nonzero(counts)[0].tolist():
                    hs = tuple(int(block.hs[u, si, j]) for j in senders)
                    needed_by_set[hs] += nbytes * int(counts[u])
        if block.items:
            built.append((block, tp, rot0))
    if uncovered:
        raise PlanError(problems=uncovered)

    W = max(S, D) if same_job else S + D
    rk = {id(b): b.ranks_ta() for b, _, _ in built}
    shares = _replica_shares([(b, rk[id(b)]) for b, _, _ in built], needed_by_set, W)
    blocks: list[_Block] = []
    for block, tp, rot0 in built:
        for b in _reweight(block, tp, rot0, shares, runs, split_bytes, same_job, gdom, shift):
            blocks.append(b)
            if b.grid is not None:
                blocks.append(_derive_scales(b, pairs, lays, dst.arrays[pairs[b.fqns[0]][0]].dtype.itemsize))
    ranks = [rk[id(b)] if id(b) in rk else b.ranks_ta() for b in blocks]
    del rk

    W = max(S, D) if same_job else S + D
    stats: dict[str, Any] = {"arrays": len(dst.arrays), "total_bytes": total}
    stats.update(_transfer_stats(blocks, ranks, W=W, S=S, same_job=same_job, sds=sds, dds=dds))
    del ranks
    ideal = max((v / len(k) for k, v in needed_by_set.items()), default=0.0)
    stats.update({
        "lower_bound_bytes": lower,
        "min_network_bytes": min_net,
        "ideal_max_send_bytes": int(-(-ideal // 1)),
        "src_world": S,
        "dst_world": D,
        "src_domain_size": sds,
        "dst_domain_size": dds,
        "same_job": same_job,
        "fp8_pairs": len(pairs),
        "unpaired_scales": unpaired,
    })
    stats.update(_broadcast_baseline(src, dst, lays, same_job=same_job, S=S, sds=sds, dds=dds))
    plan = Plan(blocks, S, D, same_job, sds, dds, stats)
    plan.casts = array_casts(src, dst)
    return plan


def _replica_shares(blocks: Sequence[tuple[_Block, tuple[np.ndarray, np.ndarray]]],
                    needed: Mapping[tuple[int, ...], int], W: int) -> dict[tuple[int, ...], np.ndarray]:
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
    for b, (src, _) in blocks:  # ranks shaped [T, A]
        fixed = ~((b.phase == 1) & (b.sn > 1))
        if fixed.any():
            A = src.shape[1]
            w = np.repeat(b.item_bytes()[fixed].astype(np.float64), A)
            load += np.bincount(src[fixed].ravel(), weights=w, minlength=len(load))
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


def _reweight(block: _Block, tp: _Template, rot0: int, shares: Mapping[tuple[int, ...], np.ndarray],
              runs: Any, split_bytes: int, same_job: bool, gdom: Any, shift: int) -> list[_Block]:
    """``block`` as is when every holder set it sends from has equal shares; otherwise the arrays
    whose holder sets do not are re-planned with their sets' shares (one block per holder table)."""
    multi = [(si, sd) for (si, sd) in tp.needed if len(sd) > 1]
    if not multi or not shares:
        return [block]

    def fractions(u: int, si: int, senders: tuple[int, ...]) -> list[float] | None:
        fr = shares.get(tuple(int(block.hs[u, si, j]) for j in senders))
        return None if fr is None or _uniform(fr) else fr.tolist()

    uneven = [u for u in range(block.hs.shape[0]) if any(fractions(u, si, sd) is not None for si, sd in multi)]
    if not uneven:
        return [block]
    out = []
    keep = np.nonzero(~np.isin(block.us, uneven))[0]
    if len(keep):
        out.append(_subset(block, keep))
    for u in uneven:
        rows = np.nonzero(block.us == u)[0]
        a0 = int(rows[0])
        sl, dl = block.src_lay[a0], block.dst_lay[a0]
        tpu, _ = _build_template(sl, dl, runs(dl)[1], block.itemsize, split_bytes, same_job, gdom, rot0,
                                 shares=functools.partial(fractions, u), grid=block.grid)
        out.append(_make_block(tpu, [block.fqns[i] for i in rows], block.itemsize, block.ndim,
                               [block.src_lay[i] for i in rows], [block.dst_lay[i] for i in rows], shift,
                               block.grid))
    return out


def _subset(block: _Block, rows: np.ndarray) -> _Block:
    """The same template over some of the block's arrays."""
    if len(rows) == len(block.fqns):
        return block
    sel = rows.tolist()
    b = replace(block, fqns=tuple(block.fqns[i] for i in sel), us=block.us[rows], ud=block.ud[rows],
                src_lay=tuple(block.src_lay[i] for i in sel), dst_lay=tuple(block.dst_lay[i] for i in sel))
    return b


def _domains(g: np.ndarray, *, S: int, same_job: bool, sds: int, dds: int) -> np.ndarray:
    """Domain id of global ranks; the two jobs of a refit never share a domain."""
    if same_job:
        return g // sds
    big = (S + sds - 1) // sds + 1
    return np.where(g < S, g // sds, big + (g - S) // dds)


def _transfer_stats(blocks: Sequence[_Block], ranks: Sequence[tuple[np.ndarray, np.ndarray]], *, W: int,
                    S: int, same_job: bool, sds: int, dds: int) -> dict[str, Any]:
    send = np.zeros(max(W, 1), dtype=np.float64)
    recv = np.zeros(max(W, 1), dtype=np.float64)
    moved = net = n_moved = n_local = n_p2 = 0
    for b, (src, dst) in zip(blocks, ranks):  # [T, A]
        A = src.shape[1]
        nb = b.item_bytes()
        moving = b.phase != 0
        n_moved += int(moving.sum()) * A
        n_local += int((~moving).sum()) * A
        n_p2 += int((b.phase == 2).sum()) * A
        moved += int(nb[moving].sum()) * A
        if not moving.all():
            src, dst, nb = src[moving], dst[moving], nb[moving]
        sizes, which = np.unique(nb, return_inverse=True)
        for v, size in enumerate(sizes.tolist()):  # a few distinct item sizes: integer counts
            rows = src if len(sizes) == 1 else src[which == v]
            send += np.bincount(rows.ravel(), minlength=len(send)) * float(size)
            rows = dst if len(sizes) == 1 else dst[which == v]
            recv += np.bincount(rows.ravel(), minlength=len(recv)) * float(size)
        s, d = src.ravel(), dst.ravel()
        if same_job:
            cross = (s // sds) != (d // sds)
        else:  # the two jobs never share a domain; inside one job compare its domains
            on_src = s < S
            cross = on_src != (d < S)
            inside = np.nonzero(~cross)[0]
            if len(inside):
                si, di = s[inside], d[inside]
                cross[inside] = np.where(on_src[inside], si // sds != di // sds,
                                         (si - S) // dds != (di - S) // dds)
        net += int(cross.reshape(src.shape).sum(axis=1, dtype=_I64) @ nb)
    return {
        "moved_bytes": moved,
        "network_bytes": net,
        "local_bytes": moved - net,
        "max_send_bytes": round(float(send.max())) if W else 0,
        "max_recv_bytes": round(float(recv.max())) if W else 0,
        "transfers": n_moved,
        "local_copies": n_local,
        "phase2_transfers": n_p2,
    }


def _broadcast_baseline(src: Manifest, dst: Manifest, lays: Mapping[str, tuple[_Layout, _Layout]], *,
                        same_job: bool, S: int, sds: int, dds: int) -> dict[str, int]:
    """Gather-broadcast: source rank 0 gathers each whole array, then broadcasts it (ring, so
    the root sends each byte once) to every destination rank that needs any part of it."""
    root = 0
    gather = bcast = net = root_send = 0
    shift = 0 if same_job else S
    W = max(S, dst.world_size) if same_job else S + dst.world_size
    recv = np.zeros(max(W, 1), dtype=_I64)

    def dom(g: int) -> int:  # _domains for one rank
        if same_job or g < S:
            return g // sds
        return (S + sds - 1) // sds + 1 + (g - S) // dds

    root_dom = dom(root)
    src_memo: dict[int, tuple[int, int]] = {}  # layout id -> (volume held by root, volume gathered across domains)
    dst_memo: dict[int, tuple[np.ndarray, int]] = {}  # layout id -> (receiving ranks, how many off-domain)
    weight: dict[int, int] = defaultdict(int)
    for fqn, d in dst.arrays.items():
        isz = d.dtype.itemsize  # a cast happens before the gather: destination-sized bytes
        nbytes = d.nbytes
        sl, dl = lays[fqn]
        hit = src_memo.get(id(sl))
        if hit is None:
            held = sum(b.volume for b, h in zip(sl.boxes, sl.holders) if root in h)
            far = sum(b.volume for b, h in zip(sl.boxes, sl.holders) if root not in h and dom(h[0]) != root_dom)
            hit = src_memo[id(sl)] = (held, far)
        gather += nbytes - hit[0] * isz
        net += hit[1] * isz
        got = dst_memo.get(id(dl))
        if got is None:
            ranks = np.array(sorted(set().union(*dl.holders)), dtype=_I64) + shift
            if same_job:
                ranks = ranks[ranks != root]
            off = int((_domains(ranks, S=S, same_job=same_job, sds=sds, dds=dds) != root_dom).sum()) if len(ranks) else 0
            got = dst_memo[id(dl)] = (ranks, off)
        ranks, off = got
        bcast += nbytes * len(ranks)
        net += nbytes * off
        weight[id(dl)] += nbytes
        if dl.holders:
            root_send += nbytes
    for lid, w in weight.items():
        recv[dst_memo[lid][0]] += w
    return {
        "broadcast_moved_bytes": gather + bcast,
        "broadcast_gather_bytes": gather,
        "broadcast_bytes": bcast,
        "broadcast_network_bytes": net,
        "broadcast_max_recv_bytes": int(recv.max()) if len(recv) else 0,
        "broadcast_max_send_bytes": root_send,
    }


# --------------------------------------------------------------------------- checks

def validate_plan(plan: Plan, src: Manifest, dst: Manifest) -> list[str]:
    """Every problem with ``plan``: each destination (chunk, holder) must be written exactly
    once (volumes add up, no two writes overlap), and every box must fit its chunk."""
    problems = []
    by_target: dict[tuple[str, int, int], list[Box]] = defaultdict(list)
    for t in plan.transfers:
        d = dst.arrays.get(t.fqn)
        if d is None or not 0 <= t.dst_chunk < len(d.chunks):
            problems.append(f"{t.fqn}: transfer names destination chunk {t.dst_chunk} that does not exist")
            continue
        dc = d.chunks[t.dst_chunk]
        if not dc.region.contains(t.region):
            problems.append(f"{t.fqn}: transfer region {t.region} is outside destination chunk {dc.region}")
        by_target[(t.fqn, t.dst_chunk, plan.dst_local(t.dst_rank))].append(t.region)
    for fqn, d in dst.arrays.items():
        for ci, c in enumerate(d.chunks):
            for h in c.holders:
                boxes = by_target.get((fqn, ci, h), [])
                vol = sum(b.volume for b in boxes)
                if vol != c.region.volume:
                    problems.append(f"{fqn}: chunk {ci} on rank {h} receives {vol} of {c.region.volume} elements")
                    continue
                boxes = sorted(boxes, key=lambda b: b.offsets)
                for i in range(len(boxes)):
                    for j in range(i + 1, min(len(boxes), i + 64)):
                        if boxes[i].intersect(boxes[j]) is not None:
                            problems.append(f"{fqn}: chunk {ci} on rank {h} is written twice in {boxes[i].intersect(boxes[j])}")
    return problems
