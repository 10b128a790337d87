"""The message order: a Plan's transfers packed into messages (buckets per pair of ranks, or
zero-copy messages for large contiguous regions) in the one global order every rank follows.

Pure: numpy, ``formats`` and the planner only; no transport. ``build_schedule(plan, rank=r)``
builds only rank ``r``'s messages, from its own transfers (or, for small plans, from the whole
plan's compressed form), so that every rank orders its own part without communication.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from formats.manifest.box import Box, contiguous_slabs, uniform_runs
from streamer.plan.forwards import forward_keys
from streamer.plan.model import Plan, Transfer

__all__ = ["INPLACE_MIN_BYTES", "SCHEDULE_VERSION", "WAVE_BYTES", "Message", "build_schedule", "is_contiguous"]


def is_contiguous(box: Box, shape: Sequence[int]) -> bool:
    return _contiguous(box.offsets, box.sizes, tuple(shape))


@functools.lru_cache(maxsize=1 << 16)
def _contiguous(offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    # cached: a full-size schedule asks about ~10^6 transfers, but the layers repeat a few boxes
    runs = list(uniform_runs(Box(offsets, sizes), shape))
    return len(runs) == 1 and (runs[0][1] == 1 or runs[0][2] == runs[0][3])


@dataclass(frozen=True)
class Message:
    phase: int
    src: int
    dst: int
    index: int  # bucket index within (phase, src, dst)
    transfers: tuple[Transfer, ...]
    nbytes: int
    uid: int = -1  # position in the global order
    deps: tuple[int, ...] = ()  # phase-2: uids of the phase-1 messages that bring its bytes


def _slabs(t: Transfer, bucket: int) -> list[tuple[Transfer, int]]:
    """``_split_transfer`` with each part's bytes."""
    nb = t.nbytes
    return [(t, nb)] if nb <= bucket else [(x, x.nbytes) for x in _split_transfer(t, bucket)]


def _split_transfer(t: Transfer, bucket: int) -> list[Transfer]:
    if t.nbytes <= bucket:
        return [t]
    out = []
    for slab in contiguous_slabs(t.region.sizes, t.itemsize, bucket):
        region = slab.shift(t.region.offsets)
        so = tuple(a + b for a, b in zip(t.src_offsets, slab.offsets))
        do = tuple(a + b for a, b in zip(t.dst_offsets, slab.offsets))
        out.append(Transfer(t.fqn, region, t.src_rank, t.src_tensor, so, t.dst_rank, t.dst_tensor, do,
                            t.itemsize, t.phase, t.src_chunk, t.dst_chunk))
    return out


#: transfers at least this large that are contiguous on one side at least travel as their own
#: message: zero-copy at each end where they are contiguous (a row-parallel weight's column slice,
#: strided at the sender, lands in place at the receiver: one copy instead of a pack and an unpack)
INPLACE_MIN_BYTES = 256 << 10
#: the order interleaves each rank's peers by this many bytes of a pair's phase-1 stream (a byte
#: round robin; A/B on bench refit, 3 x 9 pushes: 256 KiB 1.46-2.00x the floor, one 64 MiB bucket
#: 2.12-2.59x, ordering by message count as before 1.28-2.02x)
WAVE_BYTES = 256 << 10
#: the bucket layout's version: refit sessions compare it with the plan digest, so that jobs
#: that would lay out buckets differently (2: transfers grouped by local tensor; 3: messages
#: ordered by byte waves, forwards placed by ``forwards.forward_keys``; 4: the delta header
#: carries the base version; 5: transfers contiguous on one side only travel alone) are refused
SCHEDULE_VERSION = 5


def _by_tensor(ts: Sequence[Transfer]) -> tuple[Transfer, ...]:
    """A bucket's transfers grouped by local tensor (destination, then source; stable): a device
    packs each group of one tensor with one index op (``streamer.execute.staging``)."""
    return tuple(sorted(ts, key=lambda t: (t.dst_tensor, t.src_tensor)))


def _bucket(tagged: Sequence[tuple[Transfer, int, int]], phase: int, s: int, d: int, bucket_size: int,
            shape_of: Any) -> list[tuple[Message, int, int]]:
    """Pack one pair's transfers (each with an integer tag and its bytes) into messages, in
    order: each with the smallest and largest tag of its transfers."""
    msgs: list[tuple[Message, int, int]] = []
    cur: list[Transfer] = []
    tags: list[int] = []
    size = 0
    for t, tag, nb in tagged:
        if (shape_of is not None and nb >= INPLACE_MIN_BYTES
                and (_contiguous(t.src_offsets, t.region.sizes, tuple(shape_of(t.src_rank, t.src_tensor, phase == 2)))
                     or _contiguous(t.dst_offsets, t.region.sizes, tuple(shape_of(t.dst_rank, t.dst_tensor, True))))):
            msgs.append((Message(phase, s, d, len(msgs), (t,), nb), tag, tag))
            continue
        if cur and size + nb > bucket_size:
            msgs.append((Message(phase, s, d, len(msgs), _by_tensor(cur), size), min(tags), max(tags)))
            cur, tags, size = [], [], 0
        cur.append(t)
        tags.append(tag)
        size += nb
    if cur:
        msgs.append((Message(phase, s, d, len(msgs), _by_tensor(cur), size), min(tags), max(tags)))
    return msgs


def build_schedule(plan: Plan, bucket_size: int, shape_of: Any = None, *,
                   rank: int | None = None) -> list[Message]:
    """Every message of the plan, in the one global order all ranks use; with ``rank`` (global),
    only that rank's messages, built from its own transfers alone (they keep their relative order
    and their contents, so ranks that each build their own part agree message for message; uids
    are then local).

    ``shape_of(global_rank, local_tensor, on_dst) -> shape`` (optional) lets transfers of at
    least ``INPLACE_MIN_BYTES`` that are contiguous on one side at least go as their own messages,
    sent from or received into the local tensors without packing where contiguous; the rest
    share packed buckets.

    The order: phase-1 messages by *wave* (where their first byte lies in the stream of phase-1
    bytes between their two ranks, in units of ``WAVE_BYTES``), then by distance ``(dst - src) % world`` (a
    shifted exchange: at each step a rank sends to one peer and receives from another), then by
    ranks and index. Phase-2 forwards are pipelined with phase 1: a forward comes right after the
    wave and pair of the last phase-1 transfer that brings its part to the forwarder
    (``forwards.forward_keys``), a bound both ends compute from the compressed plan, so a receiver
    never expands its forwarders' phase-1 transfers. The forwarder records the phase-1 messages
    that carry the bytes in ``deps`` and posts the forward once they have arrived.
    """
    world = max(plan.world_size, 1)
    wave = max(min(bucket_size, WAVE_BYTES), 1)
    by_pair: dict[tuple[int, int, int], list[Transfer]] = defaultdict(list)
    for t in (plan.transfers if rank is None else plan.transfers_of(rank)):
        if t.phase:
            by_pair[(t.phase, t.src_rank, t.dst_rank)].append(t)
    fkeys = forward_keys(plan, None if rank is None else (rank,), wave)
    keyed: list[tuple[tuple[int, ...], Message]] = []
    for (phase, s, d), ts in by_pair.items():
        tagged: list[tuple[Transfer, int, int]] = []
        if phase == 1:  # tag: the stream position of the slab's first byte
            pos = 0
            for t in ts:
                for sl, nb in _slabs(t, bucket_size):
                    tagged.append((sl, pos, nb))
                    pos += nb
            for m, first, _ in _bucket(tagged, 1, s, d, bucket_size, shape_of):
                keyed.append(((first // wave, (d - s) % world, s, d, 0, 0, 0, 0, m.index), m))
            continue
        for t in ts:  # tag: when its bytes have reached the forwarder (-1: they never travel)
            k = fkeys.get((t.fqn, t.region.offsets, s, d), -1)
            tagged.extend((sl, k, nb) for sl, nb in _slabs(t, bucket_size))
        tagged.sort(key=lambda x: x[1])  # stable: plan order within a key
        for m, _, k in _bucket(tagged, 2, s, d, bucket_size, shape_of):
            w, dist = (k // world, k % world) if k >= 0 else (-1, 0)
            keyed.append(((w, dist, (s - dist) % world, s, 1, (d - s) % world, s, d, m.index), m))
    keyed.sort(key=lambda k: k[0])
    return _with_deps(keyed, rank)


def _with_deps(keyed: Sequence[tuple[tuple[int, ...], Message]], rank: int | None) -> list[Message]:
    """The messages in order with their uids, and the forwards ``rank`` sends (None: all) with
    the uids of the phase-1 messages that bring their bytes (always earlier: checked)."""
    # only the local tensors forwards read from: a receiver's own phase-1 messages are many
    read = {(t.src_rank, t.src_tensor) for _, m in keyed if m.phase == 2 and (rank is None or m.src == rank)
            for t in m.transfers}
    # (start, stop) per dim of each landed region: overlap tests without making boxes
    landed: dict[tuple[int, str], list[tuple[tuple[int, ...], tuple[int, ...], int]]] = defaultdict(list)
    for uid, (_, m) in enumerate(keyed):
        if m.phase == 1 and (rank is None or m.dst == rank):
            for t in m.transfers:
                if (t.dst_rank, t.dst_tensor) in read:
                    o = t.dst_offsets
                    landed[(t.dst_rank, t.dst_tensor)].append(
                        (o, tuple([a + z for a, z in zip(o, t.region.sizes)]), uid))
    out = []
    for uid, (_, m) in enumerate(keyed):
        deps: tuple[int, ...] = ()
        if m.phase == 2 and (rank is None or m.src == rank):
            got: set[int] = set()
            for t in m.transfers:
                o = t.src_offsets
                e = tuple([a + z for a, z in zip(o, t.region.sizes)])
                got.update(u for lo, hi, u in landed.get((t.src_rank, t.src_tensor), ())
                           if all(a < d and c < b for a, b, c, d in zip(lo, hi, o, e)))
            deps = tuple(sorted(got))
            if deps and deps[-1] > uid:
                raise RuntimeError(f"internal error: rank {m.src} would forward to rank {m.dst} bytes that arrive "
                                   "later in the schedule (please report this)")
        # a constructor call, not replace(): 3x faster per message
        out.append(Message(m.phase, m.src, m.dst, m.index, m.transfers, m.nbytes, uid, deps))
    return out
