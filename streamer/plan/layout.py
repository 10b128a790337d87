"""One array's chunks in canonical order (``ArrayLayout``), memoised per chunks tuple and, for
compact arrays, built from the compact layout without expanding its chunks (``LayoutMemo``).
Pure planning code.
"""

from __future__ import annotations

import functools
import hashlib
import io
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from formats.manifest.box import Box
from formats.manifest.compact_patterns import fill_pattern
from formats.manifest.wire import ArraySpec, Chunk

__all__ = ["ArrayLayout", "LayoutMemo", "Layouts"]

def _chunk_order(c: Chunk) -> tuple[Any, ...]:
    return (c.region.offsets, c.region.sizes, c.holders, c.tensor(""), c.local_offsets)


@dataclass(eq=False)  # not frozen: a frozen init costs 3x, and the planner makes one per array
class ArrayLayout:
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
    def of(chunks: Sequence[Chunk]) -> ArrayLayout:
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
        return ArrayLayout(perm, regions, holders, tensors, local, geometry)

    def placed(self, tensor: str | None, block: tuple[int, ...] | None) -> ArrayLayout:
        """This layout (of chunks without a source) with every chunk in local tensor ``tensor``
        at ``block``: the regions, holders and geometry tuples are shared, not copied."""
        n = len(self.regions)
        local = block if block is not None else (0,) * (self.regions[0].ndim if n else 0)
        out = ArrayLayout(self.chunk_index, self.regions, self.holders, (tensor,) * n, (local,) * n, self.geometry)
        out.__dict__["tensor_set"] = frozenset((tensor,)) if n else frozenset()  # known: no pass over them
        return out

    @functools.cached_property
    def tensor_set(self) -> frozenset[str | None]:
        return frozenset(self.tensors)


#: each array's (source, destination) layouts
Layouts = Mapping[str, tuple[ArrayLayout, ArrayLayout]]


class LayoutMemo:
    """Layouts by chunks-tuple identity (the tuples stay referenced, so ids stay unique); compact
    arrays by (layout, local tensor, block), without expanding their chunks."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Sequence[Chunk], ArrayLayout]] = {}
        self._bases: dict[int, tuple[Any, ArrayLayout | None]] = {}  # compact layout id -> (it, geometry)
        self._placed: dict[tuple[int, str | None, tuple[int, ...] | None], ArrayLayout] = {}

    def layout(self, spec: ArraySpec, fqn: str) -> ArrayLayout:
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
            hit = (spec.chunks, ArrayLayout.of(spec.chunks))
            self._by_id[id(spec.chunks)] = hit
        return hit[1]

    def _compact(self, ref: Any, fqn: str) -> ArrayLayout | None:
        """What ``ArrayLayout.of(ref.expand(fqn))`` gives, from the layout's regions (None: a layout
        with repeated regions, which the generic tie-break must order)."""
        lay = ref.layout
        base = self._bases.get(id(lay))
        if base is None:
            regions = lay.regions
            keys = sorted((b.offsets, b.sizes) for b, _ in regions)
            ok = all(a != b for a, b in zip(keys, keys[1:]))
            base = self._bases[id(lay)] = (lay, ArrayLayout.of([Chunk(b, hs) for b, hs in regions]) if ok else None)
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
