"""The plan model: ``Transfer``, ``PlanStats`` and the compressed ``Plan``.

A plan is kept compressed: one ``Block`` per class of arrays (a template of items with holder
slots in place of ranks, expanded over the arrays' holder tables with numpy). ``Plan.transfers``
materialises every transfer, ``Plan.sends(rank)`` / ``Plan.recvs(rank)`` / ``Plan.transfers_of(rank)``
only one rank's. Ranks are numbered globally: the source job's ranks are ``0..S-1`` and the
destination job's are ``S..S+D-1``, unless ``same_job`` is set. Built by
:func:`streamer.plan.planner.plan_transfers`. Pure planning code: numpy and ``formats`` only.
"""

from __future__ import annotations

import functools
import hashlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import numpy as np

from formats.manifest.box import Box
from streamer.plan.layout import ArrayLayout
from streamer.plan.topology import rank_domains

__all__ = ["DEFAULT_SPLIT_BYTES", "PLAN_ALGORITHM", "Block", "Plan", "PlanStats", "RankGrid", "Transfer"]

#: parts at least this large are split across replicas / domain ranks; smaller ones move whole
DEFAULT_SPLIT_BYTES = 64 << 10

#: the planner's algorithm: bump it when a change makes the same inputs plan differently (the two
#: jobs of a refit compare it, with the inputs, instead of comparing whole plans)
PLAN_ALGORITHM = 1

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


@dataclass(frozen=True, slots=True)
class PlanStats:
    """The figures of a plan (design §5), in bytes unless named otherwise. ``to_dict()`` is the
    JSON object ``plan --json`` prints, keys in this order."""

    arrays: int
    #: what lands on destination ranks: destination chunk bytes x their holders
    total_bytes: int
    #: what crosses from one rank to another
    moved_bytes: int
    #: moved bytes that cross a domain boundary / stay inside one
    network_bytes: int
    local_bytes: int
    #: the busiest rank's send and receive
    max_send_bytes: int
    max_recv_bytes: int
    #: transfers that move bytes (phases 1 and 2), local copies (phase 0), phase-2 forwards
    transfers: int
    local_copies: int
    phase2_transfers: int
    #: what destinations need and do not already hold
    lower_bound_bytes: int
    #: per destination domain, the bytes it needs that no rank inside it holds
    min_network_bytes: int
    #: a lower bound on ``max_send_bytes`` (the busiest holder set's bytes over its size)
    ideal_max_send_bytes: int
    src_world: int
    dst_world: int
    src_domain_size: int
    dst_domain_size: int
    same_job: bool
    #: FP8 weights planned with their scales; scale arrays planned alone
    fp8_pairs: int
    unpaired_scales: tuple[str, ...]
    #: the same figures for the gather-broadcast baseline
    broadcast_moved_bytes: int
    broadcast_gather_bytes: int
    broadcast_bytes: int
    broadcast_network_bytes: int
    broadcast_max_recv_bytes: int
    broadcast_max_send_bytes: int

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["unpaired_scales"] = list(self.unpaired_scales)
        return out



@dataclass(eq=False)
class Block:
    """A class of arrays planned by one template of T transfers (*items*), expanded over A arrays.

    Item t of array a moves the region ``sizes[t]`` at ``offsets[t]``. Its sender is a holder of
    the source chunk ``src_chunk[t]`` (``sender_side[t] == 0``) or of the destination chunk
    ``dst_chunk[t]`` (phase-2 forwards, phase-0 local copies): holder slot
    ``sender_slots[t][(sender_first[t] + rotation[t] + a) % sender_count[t]]`` of that chunk, so
    rotating ``a`` spreads equal work round-robin over replicas and domain ranks. Its receiver is
    the holder of ``dst_chunk[t]`` picked the same way from ``receiver_slots``.
    """

    fqns: tuple[str, ...]
    itemsize: int
    ndim: int
    offsets: np.ndarray  # [T, ndim] the regions, in global array coordinates
    sizes: np.ndarray  # [T, ndim]
    phase: np.ndarray  # [T] int8
    src_chunk: np.ndarray  # [T] canonical source chunk position
    dst_chunk: np.ndarray  # [T] canonical destination chunk position
    sender_side: np.ndarray  # [T] int8, 0: the sender holds the source chunk, 1: the destination chunk
    sender_slots: np.ndarray  # [T, c] holder slots the sender rotates over, padded
    sender_first: np.ndarray  # [T] position in sender_slots before rotation
    sender_count: np.ndarray  # [T] valid entries of sender_slots
    receiver_slots: np.ndarray  # [T, c] the same for the receiver (destination chunk holders)
    receiver_first: np.ndarray
    receiver_count: np.ndarray
    rotation: np.ndarray  # [T]
    part: np.ndarray  # [T] phase 1 and 2: which part of the template the item moves (phase 2
    # forwards bytes the phase-1 items of the same part bring to the forwarder); -1: phase 0
    src_holders: np.ndarray  # [Us, src chunks, max holders] source holders (global ranks)
    src_row: np.ndarray  # [A] each array's row of src_holders
    dst_holders: np.ndarray  # [Ud, dst chunks, max holders] destination holders (global ranks)
    dst_row: np.ndarray  # [A]
    src_layouts: tuple[ArrayLayout, ...]  # per array, for tensors / offsets / manifest chunk indices
    dst_layouts: tuple[ArrayLayout, ...]
    grid: tuple[int, ...] | None = None  # FP8 weights: cuts only on the scale-block grid

    @property
    def num_items(self) -> int:
        return int(self.phase.shape[0])

    def ranks(self) -> tuple[np.ndarray, np.ndarray]:
        """Sender and receiver of every (array, item), shaped [A, T] (transposed views)."""
        src, dst = self.ranks_ta()
        return src.T, dst.T

    def ranks_ta(self, items: np.ndarray | None = None, arrays: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
        """Sender and receiver of every (item, array), shaped [T, A], C-contiguous; with ``items`` /
        ``arrays`` (increasing positions), of those only."""
        it: Any = slice(None) if items is None else items
        aidx = np.arange(len(self.fqns), dtype=_I64) if arrays is None else arrays
        T, A = (self.num_items if items is None else len(items)), len(aidx)
        if T == 0 or A == 0:
            z = np.zeros((T, A), dtype=_I64)
            return z, z
        rot = self.rotation[it]
        dslot = _slots(self.receiver_slots[it], self.receiver_first[it], self.receiver_count[it], rot, aidx)
        dst_chunk, src_chunk = self.dst_chunk[it], self.src_chunk[it]
        dst = _gather(self.dst_holders, self.dst_row[aidx], dst_chunk, dslot)
        sslot = _slots(self.sender_slots[it], self.sender_first[it], self.sender_count[it], rot, aidx)
        from_src = self.sender_side[it] == 0
        if from_src.all():
            src = _gather(self.src_holders, self.src_row[aidx], src_chunk, sslot)
        else:
            src = np.empty_like(dst)
            m = np.nonzero(from_src)[0]
            if len(m):
                src[m] = _gather(self.src_holders, self.src_row[aidx], src_chunk[m], sslot[m])
            m = np.nonzero(~from_src)[0]
            src[m] = _gather(self.dst_holders, self.dst_row[aidx], dst_chunk[m], sslot[m])
        return src, dst

    def touching(self, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The items and the arrays whose chunks one of ``ranks`` (global) holds, on either side:
        a superset of the (item, array) pairs that such a rank sends or receives, found from the
        holder tables alone (O(items + arrays + holder table), not O(items x arrays))."""
        hs = np.asarray(np.isin(self.src_holders, ranks).any(axis=2))  # [source tables, chunks]
        hd = np.asarray(np.isin(self.dst_holders, ranks).any(axis=2))
        items = np.nonzero(hs[:, self.src_chunk].any(axis=0) | hd[:, self.dst_chunk].any(axis=0))[0]
        arrays = np.nonzero(np.asarray(hs.any(axis=1))[self.src_row] | np.asarray(hd.any(axis=1))[self.dst_row])[0]
        return items, arrays

    def item_bytes(self) -> np.ndarray:
        out: np.ndarray = np.prod(self.sizes, axis=1, dtype=_I64) * self.itemsize
        return out

    def sender_bytes(self, items: np.ndarray, world: int) -> np.ndarray:
        """Bytes each rank sends for ``items`` (positions) over every array: what a bincount of
        ``ranks_ta(items)[0]`` weighted by the items' bytes gives, without the [T, A] grid. An
        item's sender depends on the array only through its holder table and ``a % count``, so
        arrays are counted per (table, residue) and each item is expanded over those alone."""
        out = np.zeros(world, dtype=np.float64)
        A = len(self.fqns)
        nbytes = self.item_bytes()[items].astype(np.float64)
        count = self.sender_count[items]
        from_src = self.sender_side[items] == 0
        for side in (True, False):
            for n in np.unique(count).tolist():
                sel = np.nonzero((from_src == side) & (count == n))[0]
                if not len(sel):
                    continue
                table, row = (self.src_holders, self.src_row) if side else (self.dst_holders, self.dst_row)
                chunk = (self.src_chunk if side else self.dst_chunk)[items[sel]]
                U = table.shape[0]
                if U * n >= A:  # as many (table, residue) classes as arrays: the grid is no larger
                    src, _ = self.ranks_ta(items[sel])
                    out += np.bincount(src.ravel(), weights=np.repeat(nbytes[sel], src.shape[1]), minlength=world)
                    continue
                arrays_per = np.bincount(row * n + np.arange(A) % n, minlength=U * n).reshape(U, n).astype(np.float64)
                it = items[sel]
                base = (self.sender_first[it] + self.rotation[it])[:, None] + np.arange(n)[None, :]  # [T, residue]
                slot = np.take_along_axis(self.sender_slots[it], base % n, axis=1)
                ranks = table[:, chunk[:, None], slot]  # [U, T, residue]
                w = nbytes[sel][None, :, None] * arrays_per[:, None, :]
                out += np.bincount(ranks.ravel(), weights=w.ravel(), minlength=world)
        return out

    def digest_into(self, h: Any) -> None:
        h.update(("\x00".join(self.fqns) + f"|{self.itemsize}|{self.ndim}\n").encode())
        for x in (self.offsets, self.sizes, self.phase, self.src_chunk, self.dst_chunk, self.sender_side,
                  self.sender_slots, self.sender_first, self.sender_count, self.receiver_slots,
                  self.receiver_first, self.receiver_count, self.rotation, self.src_holders, self.src_row,
                  self.dst_holders, self.dst_row):
            h.update(np.ascontiguousarray(x).tobytes())
            h.update(repr(x.shape).encode())
        for lay in self.src_layouts + self.dst_layouts:  # sources: tensors and offsets are part of the plan
            h.update(lay.content)

    @functools.cached_property
    def item_values(self) -> tuple[list[tuple[int, ...]], list[Box], list[int], list[int], list[int]]:
        """The items as Python values (offsets, regions, chunks, phases), converted once per block
        rather than element by element for every transfer materialised (which share the regions)."""
        nd = self.ndim
        offsets = [tuple(r[:nd]) for r in self.offsets.tolist()]
        return (offsets, [Box(o, tuple(z[:nd])) for o, z in zip(offsets, self.sizes.tolist())],
                self.src_chunk.tolist(), self.dst_chunk.tolist(), self.phase.tolist())

    def materialise(self, a: int, t: int, src_rank: int, dst_rank: int) -> Transfer:
        fqn = self.fqns[a]
        offsets, regions, src_chunk, dst_chunk, phases = self.item_values
        offs = offsets[t]
        region = regions[t]
        sl, dl = self.src_layouts[a], self.dst_layouts[a]
        si, di, phase = src_chunk[t], dst_chunk[t], phases[t]
        dlo, dbase = dl.regions[di].offsets, dl.local_offsets[di]
        do = tuple(b + o - lo for b, o, lo in zip(dbase, offs, dlo))
        dtensor = dl.tensors[di] or fqn
        if phase == 2:  # the forwarder reads its own copy of the destination chunk
            stensor, so = dtensor, do
        else:
            slo, sbase = sl.regions[si].offsets, sl.local_offsets[si]
            so = tuple(b + o - lo for b, o, lo in zip(sbase, offs, slo))
            stensor = sl.tensors[si] or fqn
        return Transfer(fqn, region, src_rank, stensor, so, dst_rank, dtensor, do, self.itemsize, phase,
                        sl.chunk_index[si], dl.chunk_index[di])


def _slots(cand: np.ndarray, k: np.ndarray, n: np.ndarray, rot: np.ndarray, arrays: np.ndarray) -> np.ndarray:
    """Holder slot of every (item, array a of ``arrays``): ``cand[(k + rot + a) % n]``; [T, A]."""
    T, A = len(n), len(arrays)
    out = np.empty((T, A), dtype=_I64)
    fixed = n == 1  # most items: one candidate, no rotation to compute
    if fixed.any():
        out[fixed] = cand[fixed, 0][:, None]
    m = np.nonzero(~fixed)[0]
    if len(m):
        r = (k[m] + rot[m])[:, None] + arrays[None, :]
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


class RankGrid(NamedTuple):
    """A block's (item, array) grid, or the part of it some ranks touch (see ``Plan.grids``)."""

    block: Block
    items: np.ndarray  # [T] item positions in the block
    arrays: np.ndarray  # [A] array positions in the block
    src: np.ndarray  # [T, A] sender (global rank)
    dst: np.ndarray  # [T, A] receiver (global rank)


class Plan:
    """Every transfer that makes the destination's chunks out of the source's.

    Built by :func:`streamer.plan.planner.plan_transfers`, compressed (see the module docstring).
    """

    def __init__(self, blocks: Sequence[Block], src_world: int, dst_world: int, same_job: bool,
                 src_domain_size: int, dst_domain_size: int, stats: PlanStats | Callable[[], PlanStats]) -> None:
        self._blocks = tuple(blocks)
        self.src_world = src_world
        self.dst_world = dst_world
        self.same_job = same_job
        self.src_domain_size = src_domain_size
        self.dst_domain_size = dst_domain_size
        #: the figures, or how to compute them on first use (a refit rank never needs them)
        self._stats = stats
        self._all: tuple[Transfer, ...] | None = None
        #: arrays the sender casts while packing: fqn -> (source, destination data_type)
        self.casts: dict[str, tuple[str, str]] = {}

    # -- rank numbering
    def dst_global(self, rank: int) -> int:
        return rank if self.same_job else self.src_world + rank

    def dst_local(self, global_rank: int) -> int:
        return global_rank if self.same_job else global_rank - self.src_world

    @property
    def world_size(self) -> int:
        return max(self.src_world, self.dst_world) if self.same_job else self.src_world + self.dst_world

    def domains(self, ranks: np.ndarray) -> np.ndarray:
        """Domain of each global rank (the two jobs of a refit never share one)."""
        return rank_domains(ranks, S=self.src_world, same_job=self.same_job, sds=self.src_domain_size,
                            dds=self.dst_domain_size)

    # -- transfers
    def grids(self, ranks: Iterable[int] | None = None) -> Iterator[RankGrid]:
        """Per block, the (item, array) grid with its senders and receivers; with ``ranks``
        (global), only the items and arrays whose chunks one of them holds (a superset of what
        they send and receive: the caller masks), so that no other rank's part is expanded."""
        want = None if ranks is None else np.array(sorted(set(ranks)), dtype=_I64)
        for b in self._blocks:
            if want is None:
                items, arrays = np.arange(b.num_items, dtype=_I64), np.arange(len(b.fqns), dtype=_I64)
                src, dst = b.ranks_ta()
            else:
                items, arrays = b.touching(want)
                if not len(items) or not len(arrays):
                    continue
                src, dst = b.ranks_ta(items, arrays)
            yield RankGrid(b, items, arrays, src, dst)

    def _select(self, keep: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
                ranks: Iterable[int] | None = None) -> Iterator[Transfer]:
        """Transfers, in plan order, whose (src ranks, dst ranks, phases) pass ``keep`` (a mask
        maker over [T, A] grids); ``ranks``: only those that can involve these ranks are looked at."""
        for g in self.grids(ranks):
            b = g.block
            mask = keep(g.src, g.dst, np.broadcast_to(b.phase[g.items][:, None], g.src.shape))
            ai, ti = np.nonzero(mask.T)  # array-major, as the plan's order
            for a, t, s, d in zip(g.arrays[ai].tolist(), g.items[ti].tolist(), g.src[ti, ai].tolist(),
                                  g.dst[ti, ai].tolist()):
                yield b.materialise(a, t, s, d)

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        if self._all is None:
            self._all = tuple(self._select(lambda s, d, p: np.ones(s.shape, dtype=bool)))
        return self._all

    def transfers_of(self, rank: int) -> list[Transfer]:
        """Every transfer ``rank`` (global) sends, receives or copies locally, in plan order."""
        return list(self._select(lambda s, d, p: (s == rank) | (d == rank), (rank,)))

    @property
    def blocks(self) -> tuple[Block, ...]:
        """The compressed plan: one block per class of arrays (see ``Block``)."""
        return self._blocks

    def sends(self, rank: int) -> list[Transfer]:
        return list(self._select(lambda s, d, p: (s == rank) & (p != 0), (rank,)))

    def recvs(self, rank: int) -> list[Transfer]:
        return list(self._select(lambda s, d, p: (d == rank) & (p != 0), (rank,)))

    def tensor_names(self, on_dst: bool) -> dict[str, set[str]]:
        """fqn -> the local tensor names its source (``on_dst``: destination) chunks use, for
        every array the plan moves (the planner's layouts already have them)."""
        out: dict[str, set[str]] = {}
        for b in self._blocks:
            for fqn, lay in zip(b.fqns, b.dst_layouts if on_dst else b.src_layouts):
                out[fqn] = {t or fqn for t in lay.tensor_set}
        return out

    def pair_bytes(self) -> dict[tuple[int, int, int], int]:
        """Bytes per ``(phase, src global rank, dst global rank)`` (phase-0 local copies left out)."""
        out: dict[tuple[int, int, int], int] = defaultdict(int)
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

    def stats(self) -> PlanStats:
        if not isinstance(self._stats, PlanStats):
            self._stats = self._stats()
        return self._stats

    def moved_bytes_by_array(self) -> dict[str, int]:
        """Bytes each array moves from rank to rank (phases 1 and 2), without materialising
        transfers: every array of a block moves its template's items."""
        out: dict[str, int] = defaultdict(int)
        for b in self._blocks:
            per = int(b.item_bytes()[b.phase != 0].sum())
            for f in b.fqns:
                out[f] += per
        return dict(out)

    @property
    def num_transfers(self) -> int:
        """Transfers of every phase (local copies included), without materialising them."""
        st = self.stats()
        return st.transfers + st.local_copies

    def digest(self) -> str:
        h = hashlib.sha256()
        h.update(f"{self.src_world}|{self.dst_world}|{self.same_job}|{self.src_domain_size}|"
                 f"{self.dst_domain_size}\n".encode())
        for b in self._blocks:
            b.digest_into(h)
        return h.hexdigest()
