"""Shapes of other ranks' local tensors, one (rank, local tensor) at a time.

A rank's schedule sends a large contiguous region straight from (and into) the framework's
tensors only when both ends agree it is contiguous in its local tensor, so each rank needs the
shape of its peers' local tensors. ``Manifest.local_tensors(rank)`` answers for one rank from
every array (O(arrays)); over hundreds of peers that is O(ranks x arrays). Here the arrays are
indexed by the local tensors they live in once, and each question reads only the arrays of that
tensor. Answers equal ``Manifest.local_tensors(rank)[tensor].shape``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from formats.manifest.compact_patterns import fill_pattern
from formats.manifest.wire import ArraySpec, Manifest
from streamer.plan.model import Plan

__all__ = ["LocalShapes", "plan_shapes"]


class LocalShapes:
    """``shapes(rank, tensor)``: the shape of local tensor ``tensor`` on ``rank`` of ``m``.

    ``names`` (optional): fqn -> the local tensor names its chunks use, where the caller already
    has them (the planner's layouts); arrays it leaves out are looked at here.
    """

    def __init__(self, m: Manifest, names: Mapping[str, Collection[str]] | None = None) -> None:
        self._m = m
        self._by_tensor: dict[str, list[str]] = {}
        given = names or {}
        for fqn, spec in m.arrays.items():  # manifest order: the order local_tensors reads them in
            got = given.get(fqn)
            for t in (got if got is not None else _names(fqn, spec)):
                self._by_tensor.setdefault(t, []).append(fqn)
        self._cache: dict[str, dict[int, tuple[int, ...]]] = {}  # local tensor -> holder -> shape
        self._sizes: dict[int, dict[int, tuple[int, ...]]] = {}  # compact layout id -> holder -> sizes

    def __call__(self, rank: int, tensor: str) -> tuple[int, ...]:
        declared = self._m.tensors.get(rank, {}).get(tensor)
        if declared is not None:
            return declared.shape
        by_rank = self._cache.get(tensor)
        if by_rank is None:
            by_rank = self._cache[tensor] = self._stops(tensor)
        got = by_rank.get(rank)
        if got is None:
            raise KeyError(f"rank {rank} holds no local tensor {tensor!r}")
        return got

    def _stops(self, tensor: str) -> dict[int, tuple[int, ...]]:
        """Every holder's shape of ``tensor``: the per-dim maximum of the stops of the local
        boxes inside it (``Manifest.local_tensors``). Compact arrays are taken by layout: the
        stop of a box is its block plus its size, so per dim the maximum over the arrays of one
        layout is the largest block plus the largest size the rank holds."""
        fqns = self._by_tensor.get(tensor, ())
        specs = [self._m.arrays[f] for f in fqns]
        if len({len(sp.shape) for sp in specs}) > 1:  # arrays of several ranks: manifest order decides
            return _in_order(fqns, specs, tensor)
        out: dict[int, list[int]] = {}
        by_layout: dict[int, tuple[Any, list[int]]] = {}  # layout id -> (layout, largest block per dim)
        for fqn, spec in zip(fqns, specs):
            if spec.ref is not None and not spec.expanded:
                off = spec.ref.block or (0,) * len(spec.shape)
                got = by_layout.get(id(spec.ref.layout))
                if got is None:
                    by_layout[id(spec.ref.layout)] = (spec.ref.layout, list(off))
                else:
                    got[1][:] = [max(a, b) for a, b in zip(got[1], off)]
                continue
            for c in spec.chunks:
                if c.tensor(fqn) == tensor:
                    for h in c.holders:
                        _widen(out, h, c.local_box.stops)
        for lay, top in by_layout.values():
            for rank, size in self._largest(lay).items():
                _widen(out, rank, tuple([o + z for o, z in zip(top, size)]))
        return {r: tuple(v) for r, v in out.items()}

    def _largest(self, lay: Any) -> dict[int, tuple[int, ...]]:
        """Per holder of a compact layout, the largest size per dim of the regions it holds."""
        got = self._sizes.get(id(lay))
        if got is None:
            got = self._sizes[id(lay)] = {r: tuple(max(col) for col in zip(*sizes))
                                          for r, sizes in lay.sizes_by_rank.items() if sizes}
        return got


def _widen(out: dict[int, list[int]], rank: int, st: tuple[int, ...]) -> None:
    cur = out.get(rank)
    if cur is None:
        out[rank] = list(st)
    elif len(cur) == len(st):
        out[rank] = [max(a, b) for a, b in zip(cur, st)]


def _in_order(fqns: Sequence[str], specs: Sequence[ArraySpec], tensor: str) -> dict[int, tuple[int, ...]]:
    """``_stops`` array by array, in manifest order (the first box's rank of dims wins)."""
    out: dict[int, list[int]] = {}
    for fqn, spec in zip(fqns, specs):
        if spec.ref is not None and not spec.expanded:
            off = spec.ref.block or (0,) * len(spec.shape)
            for rank, sizes in spec.ref.layout.sizes_by_rank.items():
                for sz in sizes:
                    _widen(out, rank, tuple([o + z for o, z in zip(off, sz)]))
            continue
        for c in spec.chunks:
            if c.tensor(fqn) == tensor:
                for h in c.holders:
                    _widen(out, h, c.local_box.stops)
    return {r: tuple(v) for r, v in out.items()}


def _names(fqn: str, spec: ArraySpec) -> set[str]:
    ref = spec.ref
    if ref is not None and not spec.expanded:
        lay = ref.layout
        return {fqn if lay.tensor is None else fill_pattern(lay.tensor, fqn)} if lay.regions else set()
    return {c.tensor(fqn) for c in spec.chunks}


def plan_shapes(plan: Plan, src: Manifest, dst: Manifest) -> Callable[[int, str, bool], tuple[int, ...]]:
    """``shape_of(global rank, local tensor, on_dst)`` for ``build_schedule`` over ``plan``."""
    sides = (LocalShapes(src, plan.tensor_names(False)), LocalShapes(dst, plan.tensor_names(True)))

    def shape_of(g: int, tensor: str, on_dst: bool) -> tuple[int, ...]:
        return sides[1](plan.dst_local(g), tensor) if on_dst else sides[0](g, tensor)

    return shape_of
