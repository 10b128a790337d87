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
from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple

import numpy as np

from formats.box import Box, slab, split_box, split_dim
from formats.compact import fill_pattern
from formats.errors import PlanError
from formats.manifest import ArraySpec, Chunk, Manifest

__all__ = [
    "DEFAULT_SPLIT_BYTES",
    "PLAN_ALGORITHM",
    "Plan",
    "PlanStats",
    "RankGrid",
    "Transfer",
    "match_arrays",
    "array_casts",
    "CASTABLE",
    "plan_transfers",
    "validate_plan",
]

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


# --------------------------------------------------------------------------- chunk layouts

def _chunk_order(c: Chunk) -> tuple[Any, ...]:
    return (c.region.offsets, c.region.sizes, c.holders, c.tensor(""), c.local_offsets)


@dataclass(eq=False)  # not frozen: a frozen init costs 3x, and the planner makes one per array
class _Layout:
    """One array's chunks in canonical order (memoised per chunks tuple: layouts share them).
    Treated as immutable."""

    chunk_index: tuple[int, ...]  # canonical position -> index in the manifest's chunk list
    regions: tuple[Box, ...]
    holders: tuple[tuple[int, ...], ...]
    tensors: tuple[str | None, ...]  # source.tensor (None: the array's own name)
    local_offsets: tuple[tuple[int, ...], ...]  # source.offsets (defaults filled in)
    geometry: tuple[Any, ...]  # regions and holder counts: what a class shares

    @functools.cached_property
    def content(self) -> bytes:
        """Digest of everything above: equal content, equal plan. Pickled without its memo, so
        that equal values give equal bytes however their objects are shared (presets share
        tuples, parsed manifests do not)."""
        buf = io.BytesIO()
        p = pickle.Pickler(buf, protocol=4)
        p.fast = True
        p.dump((self.geometry, self.holders, self.tensors, self.local_offsets))
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
        regions = tuple(c.region for c in cs)
        holders = tuple(c.holders for c in cs)
        tensors = tuple(c.source.tensor if c.source is not None else None for c in cs)
        local = tuple(c.local_offsets for c in cs)
        geometry = tuple((b.offsets, b.sizes, len(h)) for b, h in zip(regions, holders))
        return _Layout(perm, regions, holders, tensors, local, geometry)

    def placed(self, tensor: str | None, block: tuple[int, ...] | None) -> _Layout:
        """This layout (of chunks without a source) with every chunk in local tensor ``tensor``
        at ``block``: the regions, holders and geometry tuples are shared, not copied."""
        n = len(self.regions)
        local = block if block is not None else (0,) * (self.regions[0].ndim if n else 0)
        out = _Layout(self.chunk_index, self.regions, self.holders, (tensor,) * n, (local,) * n, self.geometry)
        out.__dict__["tensor_set"] = frozenset((tensor,)) if n else frozenset()  # known: no pass over them
        return out

    @functools.cached_property
    def tensor_set(self) -> frozenset[str | None]:
        return frozenset(self.tensors)


#: each array's (source, destination) layouts
Layouts = Mapping[str, tuple[_Layout, _Layout]]


class _Memo:
    """Layouts by chunks-tuple identity (the tuples stay referenced, so ids stay unique); compact
    arrays by (layout, local tensor, block), without expanding their chunks."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Sequence[Chunk], _Layout]] = {}
        self._bases: dict[int, tuple[Any, _Layout | None]] = {}  # compact layout id -> (it, geometry)
        self._placed: dict[tuple[int, str | None, tuple[int, ...] | None], _Layout] = {}

    def layout(self, spec: ArraySpec, fqn: str) -> _Layout:
        ref = spec.ref
        if ref is not None and not spec.expanded:
            try:
                got = self._compact(ref, fqn)
            except ValueError:  # a bad layout or pattern: expanding names the array
                got = None
            if got is not None:
                return got
        hit = self._by_id.get(id(spec.chunks))
        if hit is None:
            hit = (spec.chunks, _Layout.of(spec.chunks))
            self._by_id[id(spec.chunks)] = hit
        return hit[1]

    def _compact(self, ref: Any, fqn: str) -> _Layout | None:
        """What ``_Layout.of(ref.expand(fqn))`` gives, from the layout's regions (None: a layout
        with repeated regions, which the generic tie-break must order)."""
        lay = ref.layout
        base = self._bases.get(id(lay))
        if base is None:
            regions = lay.regions
            keys = sorted((b.offsets, b.sizes) for b, _ in regions)
            ok = all(a != b for a, b in zip(keys, keys[1:]))
            base = self._bases[id(lay)] = (lay, _Layout.of([Chunk(b, hs) for b, hs in regions]) if ok else None)
        if base[1] is None:
            return None
        # as Layout.chunks names it: no pattern, or the array's own name, is the default (None)
        tensor = None if lay.tensor is None else fill_pattern(lay.tensor, fqn)
        if tensor == fqn:
            tensor = None
        key = (id(lay), tensor, ref.block)
        got = self._placed.get(key)
        if got is None:
            got = self._placed[key] = base[1].placed(tensor, ref.block)
        return got


# --------------------------------------------------------------------------- compressed plan

@dataclass(eq=False)
class _Block:
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
    sender_side: np.ndarray  # [T] int8, _SRC: the sender holds the source chunk, _DST: the destination chunk
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
    src_layouts: tuple[_Layout, ...]  # per array, for tensors / offsets / manifest chunk indices
    dst_layouts: tuple[_Layout, ...]
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
    def _items(self) -> tuple[list[tuple[int, ...]], list[Box], list[int], list[int], list[int]]:
        """The items as Python values (offsets, regions, chunks, phases), converted once per block
        rather than element by element for every transfer materialised (which share the regions)."""
        nd = self.ndim
        offsets = [tuple(r[:nd]) for r in self.offsets.tolist()]
        return (offsets, [Box(o, tuple(z[:nd])) for o, z in zip(offsets, self.sizes.tolist())],
                self.src_chunk.tolist(), self.dst_chunk.tolist(), self.phase.tolist())

    def materialise(self, a: int, t: int, src_rank: int, dst_rank: int) -> Transfer:
        fqn = self.fqns[a]
        offsets, regions, src_chunk, dst_chunk, phases = self._items
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

    block: _Block
    items: np.ndarray  # [T] item positions in the block
    arrays: np.ndarray  # [A] array positions in the block
    src: np.ndarray  # [T, A] sender (global rank)
    dst: np.ndarray  # [T, A] receiver (global rank)


class Plan:
    """Every transfer that makes the destination's chunks out of the source's.

    Built by :func:`plan_transfers`, compressed (see the module docstring).
    """

    def __init__(self, blocks: Sequence[_Block], src_world: int, dst_world: int, same_job: bool,
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
        return _domains(ranks, S=self.src_world, same_job=self.same_job, sds=self.src_domain_size,
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

    def forward_keys(self, ranks: Iterable[int] | None, wave_bytes: int) -> dict[tuple[str, tuple[int, ...], int, int], int]:
        """See :func:`streamer.plan.forwards.forward_keys`."""
        from streamer.plan.forwards import forward_keys

        return forward_keys(self, ranks, wave_bytes)

    def forward_sources(self, rank: int) -> dict[tuple[str, int], list[tuple[Box, set[int]]]]:
        """See :func:`streamer.plan.forwards.forward_sources`."""
        from streamer.plan.forwards import forward_sources

        return forward_sources(self, rank)

    @property
    def blocks(self) -> tuple[_Block, ...]:
        """The compressed plan: one block per class of arrays (see ``_Block``)."""
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

#: which chunk's holders a sender is picked from: the source chunk's or the destination chunk's
_SRC, _DST = 0, 1


class _Item(NamedTuple):
    """One transfer of a template, with holder slots in place of ranks (see :class:`_Block`)."""

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


class _Template:
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


def _build_template(sl: _Layout, dl: _Layout, runs: Runs, isz: int, topo: _Topology, rot0: int,
                    shares: Shares | None = None, grid: Sequence[int] | None = None) -> tuple[_Template, int]:
    """The items of one array (``sl`` -> ``dl``, canonical chunk order), and the rotation after them."""
    split_bytes, same_job, dom = topo.split_bytes, topo.same_job, topo.domain
    tp = _Template()
    given: dict[tuple[int, int], float] = defaultdict(float)  # bytes per (source chunk, slot), weighted sets
    index = _Index(sl.regions)
    rot = rot0
    pid = -1
    for di, dbox in enumerate(dl.regions):
        pieces = _overlaps(sl.regions, dbox, index)
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
    T = len(tp.items)
    items = tp.items
    cw = max((max(len(c.sender_slots), len(c.receiver_slots)) for c in items), default=1)
    src_holders, src_row = _holder_table(src_lay, 0)
    dst_holders, dst_row = _holder_table(dst_lay, dst_shift)

    def column(name: str, dtype: Any = _I64) -> np.ndarray:
        return np.array([getattr(c, name) for c in items], dtype=dtype)

    return _Block(
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


class _Fp8Pair(NamedTuple):
    scale: str  # the scale array's name
    block: tuple[int, ...]  # elements of the weight per scale


def _fp8_pairs(src: Manifest, dst: Manifest, lays: Layouts) -> tuple[dict[str, _Fp8Pair], list[str]]:
    """``{weight: (scale, block)}`` for every FP8 weight whose ``…_scale_inv`` array follows it
    block for block in both manifests: such a pair is planned as one, so each scale block moves
    from the same sender to the same receivers in the same phase as the weight rows it scales.
    The second value names the scale arrays that do not follow their weights (planned alone)."""
    pairs: dict[str, _Fp8Pair] = {}
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
            pairs[wf] = _Fp8Pair(sf, block)
        else:
            alone.append(sf)
    return pairs, alone


def _derive_scales(block: _Block, pairs: Mapping[str, _Fp8Pair], lays: Layouts, itemsize: int) -> _Block:
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


# --------------------------------------------------------------------------- planner

#: destination holder slots of each chunk of a layout, grouped by domain: ``(start, stop)`` runs
Runs = tuple[tuple[tuple[int, int], ...], ...]


@dataclass(frozen=True)
class _Topology:
    """Rank numbering and domains of one plan."""

    src_world: int
    dst_world: int
    src_domain_size: int
    dst_domain_size: int
    same_job: bool
    split_bytes: int

    @staticmethod
    def of(src: Manifest, dst: Manifest, src_domain_size: int | None, dst_domain_size: int | None,
           same_job: bool, split_bytes: int) -> _Topology:
        sds = src_domain_size or src.domain_size or 1
        dds = dst_domain_size or dst.domain_size or 1
        if same_job:  # one process per rank: one domain numbering for both sides
            sds = dds = (src_domain_size or dst_domain_size or src.domain_size or dst.domain_size or 1)
        return _Topology(src.world_size, dst.world_size, sds, dds, same_job, split_bytes)

    @property
    def dst_shift(self) -> int:
        """Global rank of the destination job's rank 0."""
        return 0 if self.same_job else self.src_world

    @property
    def world_size(self) -> int:
        return max(self.src_world, self.dst_world) if self.same_job else self.src_world + self.dst_world

    def domain(self, rank: int) -> int:
        """Domain of a rank of a same-job reshard (both sides share the numbering)."""
        return rank // self.src_domain_size

    def dst_domain(self, rank: int) -> int:
        """Domain of a destination job rank."""
        return rank // (self.src_domain_size if self.same_job else self.dst_domain_size)


class _ClassKeys:
    """What arrays of one class share, interned: chunk geometries and destination holder runs.

    Hashing a geometry or a holder tuple is O(chunks): each is done once per layout (and, for
    runs, once per holder tuple too: parsed manifests share no objects)."""

    def __init__(self, topo: _Topology) -> None:
        self._topo = topo
        self._ids: dict[Any, int] = {}
        self._geometry: dict[int, int] = {}  # geometry tuple id -> geometry id
        self._runs: dict[int, tuple[int, Runs]] = {}  # holders tuple id -> (runs id, runs)
        self._runs_by_holders: dict[tuple[tuple[int, ...], ...], tuple[int, Runs]] = {}
        self._chunk_runs: dict[tuple[int, ...], tuple[tuple[int, int], ...]] = {}

    def _intern(self, key: Any) -> int:
        return self._ids.setdefault(key, len(self._ids))

    def geometry(self, lay: _Layout) -> int:
        # by the tuple's identity first: compact arrays' layouts share one geometry tuple
        g = self._geometry.get(id(lay.geometry))
        if g is None:
            g = self._geometry[id(lay.geometry)] = self._intern(lay.geometry)
        return g

    def _runs_of_chunk(self, holders: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        got = self._chunk_runs.get(holders)
        if got is None:
            dom = self._topo.dst_domain
            groups: list[tuple[int, int]] = []
            for j, r in enumerate(holders):
                if groups and dom(holders[groups[-1][0]]) == dom(r):
                    groups[-1] = (groups[-1][0], j + 1)
                else:
                    groups.append((j, j + 1))
            got = self._chunk_runs[holders] = tuple(groups)
        return got

    def runs_id(self, lay: _Layout) -> int:
        return self._runs_entry(lay)[0]

    def runs(self, lay: _Layout) -> Runs:
        """Destination holder slots grouped by domain (holders are sorted: groups are runs)."""
        return self._runs_entry(lay)[1]

    def _runs_entry(self, lay: _Layout) -> tuple[int, Runs]:
        hit = self._runs.get(id(lay.holders))
        if hit is None:
            hit = self._runs_by_holders.get(lay.holders)
            if hit is None:
                rt = tuple(self._runs_of_chunk(h) for h in lay.holders)
                hit = self._runs_by_holders[lay.holders] = (self._intern(("runs", rt)), rt)
            self._runs[id(lay.holders)] = hit
        return hit


def _classify(src: Manifest, dst: Manifest, lays: Layouts, pairs: Mapping[str, _Fp8Pair],
              keys: _ClassKeys, same_job: bool) -> list[list[str]]:
    """The classes (arrays one template serves), in canonical order: the fewest source replicas
    first (the most constrained), larger first. An FP8 pair's scale is planned with its weight."""
    scales = {p.scale for p in pairs.values()}
    classes: dict[Any, list[str]] = defaultdict(list)
    for fqn in sorted(dst.arrays):
        if fqn in scales:
            continue
        d = dst.arrays[fqn]
        sl, dl = lays[fqn]
        key: tuple[Any, ...] = (d.shape, d.data_type, keys.geometry(sl), keys.geometry(dl), keys.runs_id(dl))
        if fqn in pairs:
            key += (pairs[fqn].block,)
        if same_job:  # which bytes are in place depends on the holders themselves
            key += (sl.content, dl.content)
        classes[key].append(fqn)

    def class_order(fqns: list[str]) -> tuple[int, int, str]:
        holders = lays[fqns[0]][0].holders  # the source chunks' (a compact array stays unexpanded)
        return (min((len(h) for h in holders), default=0), -src.arrays[fqns[0]].nbytes, fqns[0])

    return sorted(classes.values(), key=class_order)


@dataclass
class _Figures:
    """The lower-bound figures, summed over the classes as they are planned."""

    total: int = 0
    lower: int = 0
    min_net: int = 0
    #: bytes needed from each distinct set of source holders (global ranks)
    needed_by_set: dict[tuple[int, ...], int] = field(default_factory=lambda: defaultdict(int))

    def add(self, tp: _Template, arrays: int) -> None:
        self.total += tp.total * arrays
        self.lower += tp.lower * arrays
        self.min_net += tp.min_net * arrays

    def add_needed(self, block: _Block, needed: Mapping[tuple[int, tuple[int, ...]], int]) -> None:
        """``needed`` (bytes per source chunk and sender slots, one array) for every array of ``block``."""
        counts = np.bincount(block.src_row, minlength=block.src_holders.shape[0])
        for (si, senders), nbytes in needed.items():
            for u in np.nonzero(counts)[0].tolist():
                hs = tuple(int(block.src_holders[u, si, j]) for j in senders)
                self.needed_by_set[hs] += nbytes * int(counts[u])

    @property
    def ideal_max_send(self) -> int:
        ideal = max((v / len(k) for k, v in self.needed_by_set.items()), default=0.0)
        return int(-(-ideal // 1))


@dataclass
class _Planned:
    """A class's block as first planned (equal replica shares), before rebalancing."""

    block: _Block
    template: _Template
    rotation: int  # where the class's rotation starts


def _gaps(tp: _Template, fqns: Sequence[str], lays: Layouts) -> list[str]:
    out = []
    for gap in tp.uncovered:
        what = "overlapping source chunks cover" if gap.covered > gap.volume else "source chunks cover only"
        for fqn in fqns:
            dl = lays[fqn][1]
            out.append(f"{fqn}: destination chunk {dl.chunk_index[gap.dst_chunk]} region "
                       f"{dl.regions[gap.dst_chunk]} ({what} {gap.covered} of {gap.volume} elements)")
    return out


def _plan_classes(classes: Sequence[Sequence[str]], dst: Manifest, lays: Layouts,
                  pairs: Mapping[str, _Fp8Pair], keys: _ClassKeys, topo: _Topology) -> tuple[list[_Planned], _Figures]:
    """One template per class, expanded into a block over the class's arrays; raises
    ``PlanError`` naming every destination region the source chunks do not cover exactly."""
    built: list[_Planned] = []
    fig = _Figures()
    uncovered: list[str] = []
    rot = 0
    for fqns in classes:
        d0 = dst.arrays[fqns[0]]
        sl0, dl0 = lays[fqns[0]]
        pair = pairs.get(fqns[0])
        grid = pair.block if pair is not None else None
        rot0 = rot
        tp, rot = _build_template(sl0, dl0, keys.runs(dl0), d0.dtype.itemsize, topo, rot0, grid=grid)
        rot += len(fqns)  # the next class starts where this one's rotation ended
        uncovered += _gaps(tp, fqns, lays)
        if tp.uncovered:
            continue
        fig.add(tp, len(fqns))
        block = _make_block(tp, fqns, d0.dtype.itemsize, len(d0.shape), [lays[f][0] for f in fqns],
                            [lays[f][1] for f in fqns], topo.dst_shift, grid)
        fig.add_needed(block, tp.needed)
        if pair is not None:  # the scales' own figures (same geometry in block units, same holders)
            ssl, sdl = lays[pair.scale]
            tps, _ = _build_template(ssl, sdl, keys.runs(sdl), dst.arrays[pair.scale].dtype.itemsize, topo, 0)
            fig.add(tps, len(fqns))
            fig.add_needed(block, tps.needed)
        if block.num_items:
            built.append(_Planned(block, tp, rot0))
    if uncovered:
        raise PlanError(problems=uncovered)
    return built, fig


def _rebalance(built: Sequence[_Planned], fig: _Figures, dst: Manifest, lays: Layouts,
               pairs: Mapping[str, _Fp8Pair], keys: _ClassKeys, topo: _Topology, *, with_ranks: bool = True
               ) -> tuple[list[_Block], list[tuple[np.ndarray, np.ndarray]]]:
    """Re-plan the arrays whose replicas carry unequal fixed loads with their replica shares, and
    add the FP8 scales' blocks; with ``with_ranks``, each final block's (sender, receiver) ranks
    [T, A] too (the figures need them; a refit rank does not)."""
    rk = {id(p.block): p.block.ranks_ta() for p in built} if with_ranks else {}
    shares = _replica_shares([p.block for p in built], fig.needed_by_set, topo.world_size)
    blocks: list[_Block] = []
    for p in built:
        for b in _reweight(p.block, p.template, p.rotation, shares, keys, topo):
            blocks.append(b)
            if b.grid is not None:
                scale = pairs[b.fqns[0]].scale
                blocks.append(_derive_scales(b, pairs, lays, dst.arrays[scale].dtype.itemsize))
    if not with_ranks:
        return blocks, []
    return blocks, [rk[id(b)] if id(b) in rk else b.ranks_ta() for b in blocks]


def plan_transfers(src: Manifest, dst: Manifest, *, src_domain_size: int | None = None,
                   dst_domain_size: int | None = None, same_job: bool = False,
                   allow_extra: bool = False, split_bytes: int = DEFAULT_SPLIT_BYTES,
                   stats: bool = True) -> Plan:
    """Plan every transfer that makes ``dst``'s chunks out of ``src``'s.

    Raises ``PlanError`` listing every array that is missing, extra, or mismatched, and every
    destination region that no source chunk covers. ``stats=False`` leaves the whole-plan figures
    (``Plan.stats()``) to be computed on first use: a refit rank plans for its own transfers only.
    """
    problems = match_arrays(src, dst, allow_extra=allow_extra)
    if problems:
        raise PlanError(problems=problems)
    topo = _Topology.of(src, dst, src_domain_size, dst_domain_size, same_job, split_bytes)
    memo = _Memo()
    lays = {fqn: (memo.layout(src.arrays[fqn], fqn), memo.layout(dst.arrays[fqn], fqn)) for fqn in sorted(dst.arrays)}
    pairs, unpaired = _fp8_pairs(src, dst, lays)
    keys = _ClassKeys(topo)
    built, fig = _plan_classes(_classify(src, dst, lays, pairs, keys, same_job), dst, lays, pairs, keys, topo)
    blocks, ranks = _rebalance(built, fig, dst, lays, pairs, keys, topo, with_ranks=stats)
    del built

    def figures(ranks: Sequence[tuple[np.ndarray, np.ndarray]]) -> PlanStats:
        return PlanStats(
            arrays=len(dst.arrays), total_bytes=fig.total, **_transfer_stats(blocks, ranks, topo),
            lower_bound_bytes=fig.lower, min_network_bytes=fig.min_net, ideal_max_send_bytes=fig.ideal_max_send,
            src_world=topo.src_world, dst_world=topo.dst_world, src_domain_size=topo.src_domain_size,
            dst_domain_size=topo.dst_domain_size, same_job=same_job, fp8_pairs=len(pairs),
            unpaired_scales=tuple(unpaired), **_broadcast_baseline(src, dst, lays, topo))

    got: PlanStats | Callable[[], PlanStats]
    got = figures(ranks) if stats else (lambda: figures([b.ranks_ta() for b in blocks]))
    del ranks
    plan = Plan(blocks, topo.src_world, topo.dst_world, same_job, topo.src_domain_size, topo.dst_domain_size, got)
    plan.casts = array_casts(src, dst)
    return plan


def _replica_shares(blocks: Sequence[_Block], needed: Mapping[tuple[int, ...], int], W: int) -> dict[tuple[int, ...], np.ndarray]:
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


def _reweight(block: _Block, tp: _Template, rot0: int, shares: Mapping[tuple[int, ...], np.ndarray],
              keys: _ClassKeys, topo: _Topology) -> list[_Block]:
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
        tpu, _ = _build_template(sl, dl, keys.runs(dl), block.itemsize, topo, rot0,
                                 shares=functools.partial(fractions, u), grid=block.grid)
        out.append(_make_block(tpu, [block.fqns[i] for i in rows], block.itemsize, block.ndim,
                               [block.src_layouts[i] for i in rows], [block.dst_layouts[i] for i in rows],
                               topo.dst_shift, block.grid))
    return out


def _subset(block: _Block, rows: np.ndarray) -> _Block:
    """The same template over some of the block's arrays."""
    if len(rows) == len(block.fqns):
        return block
    sel = rows.tolist()
    b = replace(block, fqns=tuple(block.fqns[i] for i in sel), src_row=block.src_row[rows],
                dst_row=block.dst_row[rows], src_layouts=tuple(block.src_layouts[i] for i in sel),
                dst_layouts=tuple(block.dst_layouts[i] for i in sel))
    return b


def _domains(g: np.ndarray, *, S: int, same_job: bool, sds: int, dds: int) -> np.ndarray:
    """Domain id of global ranks; the two jobs of a refit never share a domain."""
    if same_job:
        return g // sds
    big = (S + sds - 1) // sds + 1
    return np.where(g < S, g // sds, big + (g - S) // dds)


def _transfer_stats(blocks: Sequence[_Block], ranks: Sequence[tuple[np.ndarray, np.ndarray]],
                    topo: _Topology) -> dict[str, int]:
    """The plan's moved bytes, busiest ranks and transfer counts (``PlanStats`` fields)."""
    W, S, same_job = topo.world_size, topo.src_world, topo.same_job
    sds, dds = topo.src_domain_size, topo.dst_domain_size
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


def _broadcast_baseline(src: Manifest, dst: Manifest, lays: Layouts, topo: _Topology) -> dict[str, int]:
    """Gather-broadcast: source rank 0 gathers each whole array, then broadcasts it (ring, so
    the root sends each byte once) to every destination rank that needs any part of it."""
    S, same_job, sds, dds = topo.src_world, topo.same_job, topo.src_domain_size, topo.dst_domain_size
    root = 0
    gather = bcast = net = root_send = 0
    shift = topo.dst_shift
    W = topo.world_size
    recv = np.zeros(max(W, 1), dtype=_I64)

    def dom(g: int) -> int:  # _domains for one rank
        if same_job or g < S:
            return g // sds
        return (S + sds - 1) // sds + 1 + (g - S) // dds

    root_dom = dom(root)
    # by holders tuple id (compact arrays' layouts share it; the regions go with it)
    src_memo: dict[int, tuple[int, int]] = {}  # -> (volume held by root, volume gathered across domains)
    dst_memo: dict[int, tuple[np.ndarray, int]] = {}  # -> (receiving ranks, how many off-domain)
    weight: dict[int, int] = defaultdict(int)
    for fqn, d in dst.arrays.items():
        isz = d.dtype.itemsize  # a cast happens before the gather: destination-sized bytes
        nbytes = d.nbytes
        sl, dl = lays[fqn]
        hit = src_memo.get(id(sl.holders))
        if hit is None:
            held = sum(b.volume for b, h in zip(sl.regions, sl.holders) if root in h)
            far = sum(b.volume for b, h in zip(sl.regions, sl.holders) if root not in h and dom(h[0]) != root_dom)
            hit = src_memo[id(sl.holders)] = (held, far)
        gather += nbytes - hit[0] * isz
        net += hit[1] * isz
        got = dst_memo.get(id(dl.holders))
        if got is None:
            ranks = np.array(sorted(set().union(*dl.holders)), dtype=_I64) + shift
            if same_job:
                ranks = ranks[ranks != root]
            off = int((_domains(ranks, S=S, same_job=same_job, sds=sds, dds=dds) != root_dom).sum()) if len(ranks) else 0
            got = dst_memo[id(dl.holders)] = (ranks, off)
        ranks, off = got
        bcast += nbytes * len(ranks)
        net += nbytes * off
        weight[id(dl.holders)] += nbytes
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
