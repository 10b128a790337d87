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

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from formats.errors import PlanError
from formats.manifest.wire import Manifest
from streamer.plan.balance import PlannedClass, rebalance
from streamer.plan.check import validate_plan
from streamer.plan.classes import ClassKeys, classify
from streamer.plan.fp8 import Fp8Pair, find_fp8_pairs
from streamer.plan.layout import LayoutMemo, Layouts
from streamer.plan.match import CASTABLE, array_casts, match_arrays
from streamer.plan.model import DEFAULT_SPLIT_BYTES, PLAN_ALGORITHM, Plan, PlanStats, RankGrid, Transfer
from streamer.plan.stats import Figures, broadcast_baseline, transfer_stats
from streamer.plan.template import Template, build_template, make_block
from streamer.plan.topology import Topology

# the plan's model, matching and checker are re-exported: ``from streamer.plan.planner import Plan``
# keeps working (new code imports them from ``streamer.plan`` or their own modules)
__all__ = ["CASTABLE", "DEFAULT_SPLIT_BYTES", "PLAN_ALGORITHM", "Plan", "PlanStats", "RankGrid", "Transfer",
           "array_casts", "match_arrays", "plan_transfers", "validate_plan"]


def _gaps(tp: Template, fqns: Sequence[str], lays: Layouts) -> list[str]:
    out = []
    for gap in tp.uncovered:
        what = "overlapping source chunks cover" if gap.covered > gap.volume else "source chunks cover only"
        for fqn in fqns:
            dl = lays[fqn][1]
            out.append(f"{fqn}: destination chunk {dl.chunk_index[gap.dst_chunk]} region "
                       f"{dl.regions[gap.dst_chunk]} ({what} {gap.covered} of {gap.volume} elements)")
    return out


def _plan_classes(classes: Sequence[Sequence[str]], dst: Manifest, lays: Layouts,
                  pairs: Mapping[str, Fp8Pair], keys: ClassKeys, topo: Topology) -> tuple[list[PlannedClass], Figures]:
    """One template per class, expanded into a block over the class's arrays; raises
    ``PlanError`` naming every destination region the source chunks do not cover exactly."""
    built: list[PlannedClass] = []
    fig = Figures()
    uncovered: list[str] = []
    rot = 0
    for fqns in classes:
        d0 = dst.arrays[fqns[0]]
        sl0, dl0 = lays[fqns[0]]
        pair = pairs.get(fqns[0])
        grid = pair.block if pair is not None else None
        rot0 = rot
        tp, rot = build_template(sl0, dl0, keys.runs(dl0), d0.dtype.itemsize, topo, rot0, grid=grid)
        rot += len(fqns)  # the next class starts where this one's rotation ended
        uncovered += _gaps(tp, fqns, lays)
        if tp.uncovered:
            continue
        fig.add(tp, len(fqns))
        block = make_block(tp, fqns, d0.dtype.itemsize, len(d0.shape), [lays[f][0] for f in fqns],
                           [lays[f][1] for f in fqns], topo.dst_shift, grid)
        fig.add_needed(block, tp.needed)
        if pair is not None:  # the scales' own figures (same geometry in block units, same holders)
            ssl, sdl = lays[pair.scale]
            tps, _ = build_template(ssl, sdl, keys.runs(sdl), dst.arrays[pair.scale].dtype.itemsize, topo, 0)
            fig.add(tps, len(fqns))
            fig.add_needed(block, tps.needed)
        if block.num_items:
            built.append(PlannedClass(block, tp, rot0))
    if uncovered:
        raise PlanError(problems=uncovered)
    return built, fig


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
    topo = Topology.of(src, dst, src_domain_size, dst_domain_size, same_job, split_bytes)
    memo = LayoutMemo()
    lays = {fqn: (memo.layout(src.arrays[fqn], fqn), memo.layout(dst.arrays[fqn], fqn)) for fqn in sorted(dst.arrays)}
    pairs, unpaired = find_fp8_pairs(src, dst, lays)
    keys = ClassKeys(topo)
    built, fig = _plan_classes(classify(src, dst, lays, pairs, keys, same_job), dst, lays, pairs, keys, topo)
    blocks, ranks = rebalance(built, fig, dst, lays, pairs, keys, topo, with_ranks=stats)
    del built

    def figures(ranks: Sequence[tuple[np.ndarray, np.ndarray]]) -> PlanStats:
        return PlanStats(
            arrays=len(dst.arrays), total_bytes=fig.total, **transfer_stats(blocks, ranks, topo),
            lower_bound_bytes=fig.lower, min_network_bytes=fig.min_net, ideal_max_send_bytes=fig.ideal_max_send,
            src_world=topo.src_world, dst_world=topo.dst_world, src_domain_size=topo.src_domain_size,
            dst_domain_size=topo.dst_domain_size, same_job=same_job, fp8_pairs=len(pairs),
            unpaired_scales=tuple(unpaired), **broadcast_baseline(src, dst, lays, topo))

    got: PlanStats | Callable[[], PlanStats]
    got = figures(ranks) if stats else (lambda: figures([b.ranks_ta() for b in blocks]))
    del ranks
    plan = Plan(blocks, topo.src_world, topo.dst_world, same_job, topo.src_domain_size, topo.dst_domain_size, got)
    plan.casts = array_casts(src, dst)
    return plan
