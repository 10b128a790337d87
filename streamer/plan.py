"""Pure planner: (source manifest, destination manifest, topology) -> Plan.

No I/O, no MPI, no torch: stdlib plus ``formats`` only, so every rank can compute the same
plan from the same manifests and check it with a digest before any byte moves.

How a plan is built, per array:

1. *Exact overlaps.* Source chunks are sorted along a sweep dim (the dim with the most distinct
   offsets); each destination chunk looks up only the source chunks whose interval along that
   dim can overlap it (bisect), then intersects boxes exactly. The result is a list of
   *pieces*: (destination chunk, source chunk, region).
2. *Topology.* The destination holders of a piece are grouped by domain. A domain that needs a
   piece and holds none of it receives it once over the network: the piece is split evenly over
   the domain's ranks that need it (phase 1), and each of them forwards its part to the others
   inside the domain (phase 2).
3. *Replica balancing.* Every phase-1 part picks its sender among the source chunk's holders:
   large parts are water-filled over the holders (split so their send loads even out), small
   ones go to the least-loaded holder. Deterministic order and tie-breaking (lowest rank).

Ranks are numbered globally: the source job's ranks are ``0..S-1`` and the destination job's are
``S..S+D-1`` (trainers first, as in NCCL M2N), unless ``same_job`` is set, in which case rank r of
both manifests is one process and bytes a rank already holds do not move.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from formats.box import Box, split_box
from formats.errors import PlanError
from formats.manifest import ArraySpec, Chunk, Manifest

__all__ = ["Transfer", "Plan", "plan_transfers", "match_arrays", "validate_plan",
           "DEFAULT_SPLIT_BYTES"]

#: parts at least this large are split across replicas / domain ranks; smaller ones move whole
DEFAULT_SPLIT_BYTES = 64 << 10


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


@dataclass(frozen=True)
class Plan:
    transfers: tuple[Transfer, ...]
    src_world: int
    dst_world: int
    same_job: bool
    src_domain_size: int
    dst_domain_size: int
    _stats: Mapping[str, Any] = field(default_factory=dict, repr=False)

    # -- rank numbering
    def dst_global(self, rank: int) -> int:
        return rank if self.same_job else self.src_world + rank

    def dst_local(self, global_rank: int) -> int:
        return global_rank if self.same_job else global_rank - self.src_world

    @property
    def world_size(self) -> int:
        return max(self.src_world, self.dst_world) if self.same_job else self.src_world + self.dst_world

    def sends(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src_rank == rank and t.phase != 0]

    def recvs(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.dst_rank == rank and t.phase != 0]

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def digest(self) -> str:
        h = hashlib.sha256()
        h.update(f"{self.src_world}|{self.dst_world}|{self.same_job}|{self.src_domain_size}|"
                 f"{self.dst_domain_size}\n".encode())
        for t in self.transfers:
            h.update(t.key().encode())
            h.update(b"\n")
        return h.hexdigest()


# --------------------------------------------------------------------------- matching

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
        if s.data_type != d.data_type:
            problems.append(f"{fqn}: data_type mismatch (source {s.data_type}, destination {d.data_type})")
    if not allow_extra:
        for fqn in src.arrays:
            if fqn not in dst.arrays:
                problems.append(f"{fqn}: in source but not in destination (pass --allow-extra to drop it)")
    return problems


# --------------------------------------------------------------------------- overlaps

def _sweep_dim(chunks: Sequence[Chunk]) -> int:
    nd = chunks[0].region.ndim if chunks else 0
    if nd == 0:
        return -1
    best, best_n = 0, -1
    for d in range(nd):
        n = len({c.region.offsets[d] for c in chunks})
        if n > best_n:
            best, best_n = d, n
    return best


class _Index:
    """Source chunks of one array, sorted along a sweep dim for interval lookups."""

    def __init__(self, chunks: Sequence[Chunk]) -> None:
        self.dim = _sweep_dim(chunks)
        if self.dim < 0:
            self.order = list(range(len(chunks)))
            self.starts: list[int] = [0] * len(chunks)
            self.maxlen = 1
        else:
            d = self.dim
            self.order = sorted(range(len(chunks)), key=lambda i: (chunks[i].region.offsets[d], i))
            self.starts = [chunks[i].region.offsets[d] for i in self.order]
            self.maxlen = max((c.region.sizes[d] for c in chunks), default=1)
        self.chunks = chunks

    def candidates(self, box: Box) -> Iterable[int]:
        if self.dim < 0:
            return self.order
        a = box.offsets[self.dim]
        b = a + box.sizes[self.dim]
        lo = bisect.bisect_right(self.starts, a - self.maxlen)
        hi = bisect.bisect_left(self.starts, b)
        return self.order[lo:hi]


def _overlaps(fqn: str, s: ArraySpec, dchunk: Chunk, index: _Index) -> list[tuple[int, Box]]:
    out = []
    for i in index.candidates(dchunk.region):
        inter = s.chunks[i].region.intersect(dchunk.region)
        if inter is not None and not inter.empty:
            out.append((i, inter))
    return out


# --------------------------------------------------------------------------- balancing

class _Loads:
    def __init__(self) -> None:
        self.send: dict[int, int] = defaultdict(int)
        self.recv: dict[int, int] = defaultdict(int)

    def least(self, ranks: Sequence[int], table: dict[int, int]) -> int:
        return min(ranks, key=lambda r: (table[r], r))


def _water_fill(box: Box, holders: Sequence[int], loads: dict[int, int], itemsize: int,
                split_bytes: int) -> list[tuple[int, Box]]:
    """Split ``box`` across ``holders`` so their loads even out (small boxes go whole)."""
    nbytes = box.volume * itemsize
    if len(holders) == 1:
        return [(holders[0], box)]
    if nbytes < split_bytes or box.ndim == 0:
        r = min(holders, key=lambda h: (loads[h], h))
        return [(r, box)]
    # water level L with sum(max(0, L - load)) == nbytes
    hs = sorted(holders, key=lambda h: (loads[h], h))
    total = nbytes
    level = 0.0
    k = len(hs)
    for j in range(1, len(hs) + 1):
        lv = (total + sum(loads[h] for h in hs[:j])) / j
        if j == len(hs) or lv <= loads[hs[j]]:
            level, k = lv, j
            break
    shares = [max(0.0, level - loads[h]) for h in hs[:k]]
    # split along the first dim with enough rows, proportionally to the shares
    dim = next((d for d, n in enumerate(box.sizes) if n >= k), None)
    if dim is None:
        r = hs[0]
        return [(r, box)]
    n = box.sizes[dim]
    ssum = sum(shares) or 1.0
    out = []
    acc = 0.0
    prev = 0
    for j, h in enumerate(hs[:k]):
        acc += shares[j]
        cut = n if j == k - 1 else int(round(n * acc / ssum))
        cut = max(prev, min(n, cut))
        if cut > prev:
            offs = list(box.offsets)
            sizes = list(box.sizes)
            offs[dim] += prev
            sizes[dim] = cut - prev
            out.append((h, Box(tuple(offs), tuple(sizes))))
        prev = cut
    return out


# --------------------------------------------------------------------------- planner

def _chunk_order(c: Chunk) -> tuple[Any, ...]:
    return (c.region.offsets, c.region.sizes, c.holders, c.tensor(""), c.local_offsets)


def _domain_of(rank: int, size: int) -> int:
    return rank // size


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

    def src_dom(r: int) -> tuple[int, int]:
        return (0, r // sds)

    def dst_g(r: int) -> int:
        return r if same_job else S + r

    def dom(g: int) -> tuple[int, int]:
        # domains of the global rank g; separate jobs never share a domain
        if same_job:
            return (0, g // sds)
        return (0, g // sds) if g < S else (1, (g - S) // dds)

    loads = _Loads()
    transfers: list[Transfer] = []
    total = lower = min_net = 0
    needed_by_set: dict[tuple[int, ...], int] = defaultdict(int)
    uncovered: list[str] = []

    # Canonical order, so that the greedy balancing and hence the plan do not depend on the order
    # of arrays or chunks in either manifest: arrays with the fewest source replicas first (the
    # most constrained: EP expert blocks before EP-replicated dense arrays), larger ones first,
    # then by name; chunks and pieces by region.
    def array_order(f: str) -> tuple[int, int, str]:
        a = src.arrays[f]
        return (min((len(c.holders) for c in a.chunks), default=0), -a.nbytes, f)

    for fqn in sorted(dst.arrays, key=array_order):
        d = dst.arrays[fqn]
        s = src.arrays[fqn]
        isz = d.dtype.itemsize
        index = _Index(s.chunks)
        for di in sorted(range(len(d.chunks)), key=lambda i: _chunk_order(d.chunks[i])):
            dchunk = d.chunks[di]
            pieces = sorted(_overlaps(fqn, s, dchunk, index),
                            key=lambda p: (p[1].offsets, p[1].sizes, _chunk_order(s.chunks[p[0]])))
            covered = sum(b.volume for _, b in pieces)
            dvol = dchunk.region.volume
            total += dvol * isz * len(dchunk.holders)
            if covered != dvol:
                what = "overlapping source chunks cover" if covered > dvol else "source chunks cover only"
                uncovered.append(f"{fqn}: destination chunk {di} region {dchunk.region} ({what} "
                                 f"{covered} of {dvol} elements)")
                continue
            # destination holders grouped by domain
            groups: dict[tuple[int, int], list[int]] = defaultdict(list)
            for h in dchunk.holders:
                groups[dom(dst_g(h))].append(dst_g(h))
            dlo = dchunk.region.offsets
            dtensor = dchunk.tensor(fqn)
            dbase = dchunk.local_offsets
            for si, inter in pieces:
                schunk = s.chunks[si]
                sh = schunk.holders
                stensor = schunk.tensor(fqn)
                sbase = schunk.local_offsets
                slo = schunk.region.offsets

                def mk(region: Box, sr: int, dr: int, phase: int) -> Transfer:
                    so = tuple(b + o - lo for b, o, lo in zip(sbase, region.offsets, slo))
                    do = tuple(b + o - lo for b, o, lo in zip(dbase, region.offsets, dlo))
                    return Transfer(fqn, region, sr, stensor, so, dr, dtensor, do, isz, phase, si, di)

                pbytes = inter.volume * isz
                holder_doms = {dom(h) for h in sh} if same_job else set()
                for gkey in sorted(groups):
                    members = groups[gkey]
                    if same_job:
                        local = [m for m in members if m in sh]
                        for m in local:  # already held: a copy on the rank, nothing moves
                            transfers.append(mk(inter, m, m, 0))
                        need = [m for m in members if m not in sh]
                        if not need:
                            continue
                        lower += pbytes * len(need)
                        in_dom = [h for h in sh if dom(h) == gkey]
                        if gkey not in holder_doms:
                            min_net += pbytes
                        senders = in_dom or list(sh)
                    else:
                        need = members
                        lower += pbytes * len(need)
                        min_net += pbytes
                        senders = list(sh)
                    # phase 1: the piece lands once in the domain, spread over `need`
                    if len(need) == 1 or pbytes < split_bytes:
                        land = [(loads.least(need, loads.recv), inter)]
                    else:
                        parts = split_box(inter, len(need))
                        order = sorted(need, key=lambda r: (loads.recv[r], r))
                        land = list(zip(order, parts))
                    for lr, part in land:
                        psz = part.volume * isz
                        loads.recv[lr] += psz
                        needed_by_set[tuple(senders)] += psz
                        for sr, sub in _water_fill(part, senders, loads.send, isz, split_bytes):
                            loads.send[sr] += sub.volume * isz
                            transfers.append(mk(sub, sr, lr, 1))
                        # phase 2: forward inside the domain
                        for other in need:
                            if other == lr:
                                continue
                            do_l = tuple(b + o - lo for b, o, lo in zip(dbase, part.offsets, dlo))
                            do_o = do_l
                            transfers.append(Transfer(fqn, part, lr, dtensor, do_l, other, dtensor, do_o,
                                                      isz, 2, si, di))
                            loads.send[lr] += psz
                            loads.recv[other] += psz
    if uncovered:
        raise PlanError(problems=uncovered)

    moved = net = 0
    send: dict[int, int] = defaultdict(int)
    recv: dict[int, int] = defaultdict(int)
    for t in transfers:
        if t.phase == 0:
            continue
        b = t.nbytes
        moved += b
        send[t.src_rank] += b
        recv[t.dst_rank] += b
        if dom(t.src_rank) != dom(t.dst_rank):
            net += b
    ideal = max((v / len(k) for k, v in needed_by_set.items()), default=0.0)
    stats: dict[str, Any] = {
        "arrays": len(dst.arrays),
        "total_bytes": total,
        "moved_bytes": moved,
        "lower_bound_bytes": lower,
        "network_bytes": net,
        "local_bytes": moved - net,
        "min_network_bytes": min_net,
        "max_send_bytes": max(send.values(), default=0),
        "max_recv_bytes": max(recv.values(), default=0),
        "ideal_max_send_bytes": int(-(-ideal // 1)),
        "transfers": sum(1 for t in transfers if t.phase != 0),
        "local_copies": sum(1 for t in transfers if t.phase == 0),
        "phase2_transfers": sum(1 for t in transfers if t.phase == 2),
        "src_world": S,
        "dst_world": D,
        "src_domain_size": sds,
        "dst_domain_size": dds,
        "same_job": same_job,
    }
    stats.update(_broadcast_baseline(src, dst, same_job=same_job, dom=dom, dst_g=dst_g))
    return Plan(tuple(transfers), S, D, same_job, sds, dds, stats)


def _broadcast_baseline(src: Manifest, dst: Manifest, *, same_job: bool, dom: Any, dst_g: Any) -> dict[str, int]:
    """Gather-broadcast: source rank 0 gathers each whole array, then broadcasts it (ring, so
    the root sends each byte once) to every destination rank that needs any part of it."""
    root = 0
    gather = bcast = net = 0
    recv: dict[int, int] = defaultdict(int)
    root_send = 0
    for fqn, d in dst.arrays.items():
        s = src.arrays[fqn]
        isz = s.dtype.itemsize
        nbytes = s.nbytes
        held = sum(c.region.volume for c in s.chunks if root in c.holders) * isz
        g = nbytes - held
        gather += g
        # gathered bytes come from holders; count network when the holder's domain differs
        for c in s.chunks:
            if root not in c.holders:
                if dom(c.holders[0]) != dom(root):
                    net += c.region.volume * isz
        ranks = sorted({dst_g(h) for c in d.chunks for h in c.holders})
        for r in ranks:
            if same_job and r == root:
                continue
            bcast += nbytes
            recv[r] += nbytes
            if dom(r) != dom(root):
                net += nbytes
        if ranks:
            root_send += nbytes
    return {
        "broadcast_moved_bytes": gather + bcast,
        "broadcast_gather_bytes": gather,
        "broadcast_bytes": bcast,
        "broadcast_network_bytes": net,
        "broadcast_max_recv_bytes": max(recv.values(), default=0),
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
