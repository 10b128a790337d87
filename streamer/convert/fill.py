"""Filling one box of a destination (a slab of a local tensor, a zarr chunk or shard) from the
plan's transfers, with ranged reads of only the source bytes needed. Both sinks fill through it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from formats.manifest.box import Box, uniform_runs
from formats.manifest.wire import Manifest
from formats.store import ResolvedTensor, SourceStore
from streamer.plan.model import Transfer

__all__ = ["Buffer", "Filler", "contiguous_span"]

U8 = np.ndarray[Any, np.dtype[np.uint8]]


class Buffer:
    """A reused byte buffer that grows on demand: a fresh allocation per use costs a page fault
    per 4 KiB."""

    def __init__(self) -> None:
        self._buf: U8 = np.empty(0, dtype=np.uint8)

    def take(self, n: int) -> U8:
        if self._buf.size < n:
            self._buf = np.empty(n, dtype=np.uint8)
        return self._buf[:n]


def contiguous_span(rel: Box, sizes: tuple[int, ...]) -> tuple[int, int] | None:
    """``(first element, element count)`` when ``rel`` is one contiguous run of a row-major buffer
    of ``sizes``, else None."""
    runs = list(itertools.islice(uniform_runs(rel, sizes), 2))
    if len(runs) == 1 and runs[0][1] == 1:
        return runs[0][0], runs[0][3]
    return None


class Filler:
    """Fills boxes of destination tensors from source reads; source tensors are resolved once."""

    def __init__(self, src: Manifest, store: SourceStore) -> None:
        self.src = src
        self.store = store
        self._scratch = Buffer()
        self._resolved: dict[tuple[str, int, int], ResolvedTensor] = {}

    def resolve(self, t: Transfer) -> ResolvedTensor:
        key = (t.fqn, t.src_chunk, t.src_rank)
        rt = self._resolved.get(key)
        if rt is None:
            rt = self.store.resolve(t.fqn, self.src.arrays[t.fqn].chunks[t.src_chunk], t.src_rank)
            self._resolved[key] = rt
        return rt

    def fill(self, box: Box, transfers: Sequence[Transfer], isz: int, buf: U8) -> None:
        """Fill ``buf`` (``box``'s row-major bytes, ``isz`` per element) with every transfer
        whose destination meets ``box``; what none covers is zero (padding rows, a partial
        destination)."""
        parts = [(t, sub) for t in transfers if (sub := box.intersect(t.dst_box)) is not None and not sub.empty]
        if sum(sub.volume for _, sub in parts) < box.volume:
            buf[:] = 0
        for t, sub in parts:
            rt = self.resolve(t)
            sbox = sub.shift(tuple(so - do for so, do in zip(t.src_offsets, t.dst_offsets)))
            if sub == box:
                self.store.read(rt, sbox, buf)
                continue
            rel = sub.relative_to(box.offsets)
            span = contiguous_span(rel, box.sizes)
            if span is not None:
                # One contiguous byte range of the box (the common case: a row block of an S(0)
                # shard, ~70% of the bytes of a TP4 -> TP3 convert): read straight into place.
                # Through scratch it cost one more full memcpy of those bytes.
                lo = span[0] * isz
                self.store.read(rt, sbox, buf[lo:lo + span[1] * isz])
            else:
                tmp = self.store.read(rt, sbox, self._scratch.take(sbox.volume * isz))
                buf.reshape(box.sizes + (isz,))[rel.slices] = tmp.reshape(sub.sizes + (isz,))
