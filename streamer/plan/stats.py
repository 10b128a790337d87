"""A plan's figures (``PlanStats`` fields): the lower bounds summed per class, the moved bytes,
busiest ranks and transfer counts, and the same figures for the gather-broadcast baseline.
Pure planning code.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from formats.manifest.wire import Manifest
from streamer.plan.layout import Layouts
from streamer.plan.model import Block
from streamer.plan.template import Template
from streamer.plan.topology import Topology, rank_domains

__all__ = ["Figures", "broadcast_baseline", "transfer_stats"]

_I64 = np.int64

@dataclass
class Figures:
    """The lower-bound figures, summed over the classes as they are planned."""

    total: int = 0
    lower: int = 0
    min_net: int = 0
    #: bytes needed from each distinct set of source holders (global ranks)
    needed_by_set: dict[tuple[int, ...], int] = field(default_factory=lambda: defaultdict(int))

    def add(self, tp: Template, arrays: int) -> None:
        self.total += tp.total * arrays
        self.lower += tp.lower * arrays
        self.min_net += tp.min_net * arrays

    def add_needed(self, block: Block, needed: Mapping[tuple[int, tuple[int, ...]], int]) -> None:
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


def transfer_stats(blocks: Sequence[Block], ranks: Sequence[tuple[np.ndarray, np.ndarray]],
                   topo: Topology) -> dict[str, int]:
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


def broadcast_baseline(src: Manifest, dst: Manifest, lays: Layouts, topo: Topology) -> dict[str, int]:
    """Gather-broadcast: source rank 0 gathers each whole array, then broadcasts it (ring, so
    the root sends each byte once) to every destination rank that needs any part of it."""
    S, same_job, sds, dds = topo.src_world, topo.same_job, topo.src_domain_size, topo.dst_domain_size
    root = 0
    gather = bcast = net = root_send = 0
    shift = topo.dst_shift
    W = topo.world_size
    recv = np.zeros(max(W, 1), dtype=_I64)

    def dom(g: int) -> int:  # rank_domains for one rank
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
            off = int((rank_domains(ranks, S=S, same_job=same_job, sds=sds, dds=dds) != root_dom).sum()) if len(ranks) else 0
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
