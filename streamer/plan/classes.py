"""Classes: arrays with the same shape, data type and chunk geometry on both sides, planned by
one template (see :mod:`streamer.plan.planner`). Pure planning code.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from formats.manifest.wire import Manifest
from streamer.plan.fp8 import Fp8Pair
from streamer.plan.layout import ArrayLayout, Layouts
from streamer.plan.topology import Runs, Topology

__all__ = ["ClassKeys", "classify"]

class ClassKeys:
    """What arrays of one class share, interned: chunk geometries and destination holder runs.

    Hashing a geometry or a holder tuple is O(chunks): each is done once per layout (and, for
    runs, once per holder tuple too: parsed manifests share no objects)."""

    def __init__(self, topo: Topology) -> None:
        self._topo = topo
        self._ids: dict[Any, int] = {}
        self._geometry: dict[int, int] = {}  # geometry tuple id -> geometry id
        self._runs: dict[int, tuple[int, Runs]] = {}  # holders tuple id -> (runs id, runs)
        self._runs_by_holders: dict[tuple[tuple[int, ...], ...], tuple[int, Runs]] = {}
        self._chunk_runs: dict[tuple[int, ...], tuple[tuple[int, int], ...]] = {}

    def _intern(self, key: Any) -> int:
        return self._ids.setdefault(key, len(self._ids))

    def geometry(self, lay: ArrayLayout) -> int:
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

    def runs_id(self, lay: ArrayLayout) -> int:
        return self._runs_entry(lay)[0]

    def runs(self, lay: ArrayLayout) -> Runs:
        """Destination holder slots grouped by domain (holders are sorted: groups are runs)."""
        return self._runs_entry(lay)[1]

    def _runs_entry(self, lay: ArrayLayout) -> tuple[int, Runs]:
        hit = self._runs.get(id(lay.holders))
        if hit is None:
            hit = self._runs_by_holders.get(lay.holders)
            if hit is None:
                rt = tuple(self._runs_of_chunk(h) for h in lay.holders)
                hit = self._runs_by_holders[lay.holders] = (self._intern(("runs", rt)), rt)
            self._runs[id(lay.holders)] = hit
        return hit


def classify(src: Manifest, dst: Manifest, lays: Layouts, pairs: Mapping[str, Fp8Pair],
             keys: ClassKeys, same_job: bool) -> list[list[str]]:
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
