"""The gather-broadcast baseline refit, over any transport (MPI, gloo, NCCL).

This is what refit did before resharding (NeMo RL's packed broadcast): sender rank 0 gathers
every whole array, then broadcasts whole arrays in packed buckets to every receiver, which
keeps the regions it holds. It runs over the ``Transport`` protocol only (point-to-point for
the gather, ``bcast_buffer`` for the broadcast) so the comparison is fair on every transport.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from formats.manifest.wire import Manifest
from streamer.execute.executor import ExecStats
from streamer.ops.buffers import _copy
from streamer.ops.cast_view import cast_view
from streamer.transport.base import Transport, wait_all

__all__ = ["Baseline", "gather_broadcast"]


@dataclass(frozen=True)
class Baseline:
    """What the baseline needs of a refit session: the transport over both jobs (senders first),
    the two manifests, the planned casts and the session's bounds."""

    t: Transport
    src: Manifest
    dst: Manifest
    casts: Mapping[str, tuple[str, str]]
    n_send: int
    names: Callable[[int], str]  # the group's rank names, for timeout messages
    timeout: float
    bucket: int

_GATHER_TAG = 11


def _pack_groups(names: list[str], sizes: Mapping[str, int], bucket: int) -> list[list[str]]:
    """Consecutive arrays packed into buckets of at most ``bucket`` bytes (an array larger than
    a bucket travels alone)."""
    groups: list[list[str]] = []
    size = 0
    for n in names:
        if not groups or (groups[-1] and size + sizes[n] > bucket):
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += sizes[n]
    return groups


def _gather(s: Baseline, views: Mapping[str, Any]) -> tuple[dict[str, Any], int, int]:
    """Every array whole on global rank 0: (arrays as byte views, bytes sent, bytes received)."""
    t = s.t
    rank = t.rank
    full: dict[str, Any] = {}
    reqs: list[tuple[Any, str, tuple[slice, ...], Any]] = []
    sent = recvd = 0
    for fqn, a in s.src.arrays.items():
        if fqn not in s.dst.arrays:
            continue
        d = s.dst.arrays[fqn]
        isz = d.dtype.itemsize  # senders cast before the gather, as a trainer would
        cast = s.casts.get(fqn)

        def held(c: Any, fqn: str = fqn, cast: Any = cast) -> Any:
            v = views[c.tensor(fqn)][c.local_box.slices]
            return cast_view(v, *cast) if cast else v

        if rank == 0:
            full[fqn] = t.alloc(d.nbytes).reshape(tuple(a.shape) + (isz,))
        for c in a.chunks:
            owner = c.holders[0]
            sl = c.region.slices
            if rank == 0 and 0 in c.holders:
                _copy(full[fqn][sl], held(c))
            elif rank == 0:
                tmp = t.alloc(c.region.volume * isz).reshape(tuple(c.region.sizes) + (isz,))
                reqs.append((t.irecv(tmp, owner, _GATHER_TAG), fqn, sl, tmp))
                recvd += c.region.volume * isz
            elif rank == owner and 0 not in c.holders:
                data = t.alloc(c.region.volume * isz).reshape(tuple(c.region.sizes) + (isz,))
                _copy(data, held(c))
                reqs.append((t.isend(data, 0, _GATHER_TAG), fqn, sl, data))
                sent += c.region.volume * isz
    wait_all([r for r, *_ in reqs], s.timeout, "gather", names=s.names, transport=t)
    if rank == 0:
        for r, fqn, sl, tmp in reqs:
            _copy(full[fqn][sl], tmp)
    return full, sent, recvd


def gather_broadcast(s: Baseline, tensors: Mapping[str, Any]) -> ExecStats:
    t = s.t
    rank = t.rank
    S = s.n_send
    views = {n: t.byte_view(v) for n, v in tensors.items()}
    t0 = time.perf_counter()
    full, sent, recvd = _gather(s, views)
    msgs = peak = 0
    members = [0] + list(range(S, t.size))
    if rank in members:
        sizes = {f: a.nbytes for f, a in s.dst.arrays.items()}
        for group in _pack_groups(list(s.dst.arrays), sizes, s.bucket):
            size = sum(sizes[f] for f in group)
            buf = t.alloc(size)
            peak = max(peak, size)
            off = 0
            for f in group:
                if rank == 0:
                    _copy(buf[off:off + sizes[f]], full[f].reshape(-1))
                off += sizes[f]
            t.bcast_buffer(buf, 0, members, s.timeout)
            msgs += 1
            if rank == 0:
                sent += size * (len(members) - 1)
            if rank >= S:
                recvd += size
                _keep_held(s, buf, group, sizes, rank - S, views)
    if rank == 0:
        peak += sum(int(v.nbytes) for v in full.values())
    return ExecStats(bytes_sent=sent, bytes_received=recvd, messages=msgs, seconds=time.perf_counter() - t0,
                     peak_buffer_bytes=peak)


def _keep_held(s: Baseline, buf: Any, group: list[str], sizes: Mapping[str, int], local: int,
               views: Mapping[str, Any]) -> None:
    """Copy the regions this receiver holds out of a broadcast bucket."""
    off = 0
    for f in group:
        a = s.dst.arrays[f]
        whole = buf[off:off + sizes[f]].reshape(tuple(a.shape) + (a.dtype.itemsize,))
        for c in a.chunks:
            if local in c.holders:
                _copy(views[c.tensor(f)][c.local_box.slices], whole[c.region.slices])
        off += sizes[f]
