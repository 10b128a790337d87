"""streamer.plan.planner: overlaps, coverage, byte counts, replica balance, determinism, errors.

Oracles written here, independent of the planner:

* ``brute_pieces``: the quadratic all-pairs intersection of destination and source chunks (the
  planner sweeps sorted chunks instead);
* ``oracle_lower_bound`` / ``oracle_min_network``: what destinations need and do not hold, and
  what each destination domain needs that no rank inside it holds, straight from design §5;
* ``tight_send_bound``: the exact optimum of fractional replica balancing (max over unions U of
  source holder sets of the bytes that only U can send, divided by |U|). It equals the
  documented ``ideal_max_send_bytes`` when the holder sets are disjoint and is larger when they
  overlap (EP expert blocks inside EP-replicated dense arrays).
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter, defaultdict
from collections.abc import Sequence
from itertools import combinations
from typing import Any, cast

import pytest
from helpers import LayoutPair, lay_out, n_examples, random_layout_pair
from hypothesis import example, given, settings
from hypothesis import strategies as st

from formats.errors import PlanError
from formats.layouts import (
    Mesh,
    Replicate,
    Shard,
    apply_layout,
    manifest_from_arrays,
    parse_mesh,
    parse_rule,
)
from formats.manifest.box import Box
from formats.manifest.wire import ArraySpec, Chunk, Manifest
from streamer.plan.check import validate_plan
from streamer.plan.match import match_arrays
from streamer.plan.model import DEFAULT_SPLIT_BYTES, Plan, PlanStats, Transfer
from streamer.plan.planner import plan_transfers
from streamer.plan.template import SweepIndex, overlaps

# --------------------------------------------------------------------------- oracles


def brute_pieces(src: Manifest, dst: Manifest) -> set[tuple[str, int, int, Box]]:
    """(array, destination chunk, source chunk, region) for every non-empty intersection."""
    out = set()
    for fqn, d in dst.arrays.items():
        s = src.arrays[fqn]
        for di, dc in enumerate(d.chunks):
            for si, sc in enumerate(s.chunks):
                inter = dc.region.intersect(sc.region)
                if inter is not None and not inter.empty:
                    out.add((fqn, di, si, inter))
    return out


def _held_volume(src: Manifest, fqn: str, region: Box, ranks: set[int]) -> int:
    """Elements of ``region`` held by a source chunk with a holder in ``ranks`` (chunks tile)."""
    n = 0
    for c in src.arrays[fqn].chunks:
        if ranks.intersection(c.holders):
            inter = c.region.intersect(region)
            if inter is not None:
                n += inter.volume
    return n


def oracle_total(dst: Manifest) -> int:
    return sum(c.region.volume * a.dtype.itemsize * len(c.holders) for _, a, c in dst.iter_chunks())


def oracle_lower_bound(src: Manifest, dst: Manifest, same_job: bool) -> int:
    if not same_job:
        return oracle_total(dst)
    n = 0
    for fqn, a, c in dst.iter_chunks():
        for h in c.holders:
            n += (c.region.volume - _held_volume(src, fqn, c.region, {h})) * a.dtype.itemsize
    return n


def oracle_min_network(src: Manifest, dst: Manifest, same_job: bool, domain_size: int) -> int:
    n = 0
    for fqn, a, c in dst.iter_chunks():
        for dom in sorted({h // domain_size for h in c.holders}):
            if same_job:
                ranks = set(range(dom * domain_size, (dom + 1) * domain_size))
                missing = c.region.volume - _held_volume(src, fqn, c.region, ranks)
            else:
                missing = c.region.volume
            n += missing * a.dtype.itemsize
    return n


def tight_send_bound(plan: Plan, src: Manifest) -> float:
    """Optimal fractional max send over the source ranks for the bytes the plan takes from each
    source holder set (phase 1)."""
    need: dict[frozenset[int], int] = defaultdict(int)
    for t in plan.transfers:
        if t.phase == 1 and t.src_rank < src.world_size:
            hs = src.arrays[t.fqn].chunks[t.src_chunk].holders
            need[frozenset(hs)] += t.nbytes
    sets = list(need)
    assert len(sets) <= 16, "too many distinct holder sets for the subset bound"
    best = 0.0
    for k in range(1, len(sets) + 1):
        for combo in combinations(sets, k):
            u = frozenset().union(*combo)
            best = max(best, sum(v for s, v in need.items() if s <= u) / len(u))
    return best


def phase1_send(plan: Plan) -> dict[int, int]:
    out: dict[int, int] = defaultdict(int)
    for t in plan.transfers:
        if t.phase == 1:
            out[t.src_rank] += t.nbytes
    return out


def check_transfer_sources(plan: Plan, src: Manifest, dst: Manifest) -> list[str]:
    """Every transfer reads bytes its sender really has, at the right place."""
    bad = []
    S = src.world_size
    p1_boxes: dict[tuple[str, int, int], list[Box]] = defaultdict(list)
    for t in plan.transfers:
        if t.phase == 1:
            p1_boxes[(t.fqn, t.dst_chunk, t.dst_rank)].append(t.region)
    for t in plan.transfers:
        dc = dst.arrays[t.fqn].chunks[t.dst_chunk]
        if plan.dst_local(t.dst_rank) not in dc.holders:
            bad.append(f"{t}: destination rank does not hold destination chunk")
        want_do = tuple(b + o - lo for b, o, lo in zip(dc.local_offsets, t.region.offsets, dc.region.offsets))
        if t.dst_tensor != dc.tensor(t.fqn) or t.dst_offsets != want_do:
            bad.append(f"{t}: wrong destination tensor/offsets (want {dc.tensor(t.fqn)} {want_do})")
        if t.itemsize != dst.arrays[t.fqn].dtype.itemsize:
            bad.append(f"{t}: wrong itemsize")
        if t.phase in (0, 1):
            sc = src.arrays[t.fqn].chunks[t.src_chunk]
            if t.src_rank not in sc.holders or not sc.region.contains(t.region):
                bad.append(f"{t}: sender does not hold the region in source chunk {t.src_chunk}")
            want_so = tuple(
                b + o - lo for b, o, lo in zip(sc.local_offsets, t.region.offsets, sc.region.offsets)
            )
            if t.src_tensor != sc.tensor(t.fqn) or t.src_offsets != want_so:
                bad.append(f"{t}: wrong source tensor/offsets (want {sc.tensor(t.fqn)} {want_so})")
            if t.phase == 0 and (not plan.same_job or t.src_rank != t.dst_rank):
                bad.append(f"{t}: phase-0 copy between two ranks")
            if t.phase == 1:
                if t.src_rank == t.dst_rank:
                    bad.append(f"{t}: phase-1 transfer to itself")
                if not plan.same_job and not (t.src_rank < S <= t.dst_rank):
                    bad.append(f"{t}: phase-1 transfer not from the source job to the destination job")
        elif t.phase == 2:
            if plan.dst_local(t.src_rank) not in dc.holders or t.src_rank == t.dst_rank:
                bad.append(f"{t}: forwarder does not hold the destination chunk")
            if t.src_tensor != t.dst_tensor or t.src_offsets != t.dst_offsets:
                bad.append(f"{t}: forward reads another place than the one it writes")
            inters = [b.intersect(t.region) for b in p1_boxes[(t.fqn, t.dst_chunk, t.src_rank)]]
            got = sum(i.volume for i in inters if i is not None)
            if got != t.region.volume:
                bad.append(f"{t}: forwarder received only {got} of {t.region.volume} elements in phase 1")
        else:
            bad.append(f"{t}: unknown phase")
    return bad


def assert_plan_exact(plan: Plan, src: Manifest, dst: Manifest, same_job: bool) -> PlanStats:
    assert validate_plan(plan, src, dst) == []
    assert check_transfer_sources(plan, src, dst) == []
    st_ = plan.stats()
    ds = plan.dst_domain_size
    moved = sum(t.nbytes for t in plan.transfers if t.phase != 0)
    assert st_.total_bytes == oracle_total(dst)
    assert st_.moved_bytes == moved
    assert st_.lower_bound_bytes == oracle_lower_bound(src, dst, same_job)
    assert st_.moved_bytes == st_.lower_bound_bytes
    assert st_.min_network_bytes == oracle_min_network(src, dst, same_job, ds)
    assert st_.network_bytes == st_.min_network_bytes
    assert st_.local_bytes == moved - st_.network_bytes
    assert st_.transfers == sum(1 for t in plan.transfers if t.phase != 0)
    assert st_.phase2_transfers == sum(1 for t in plan.transfers if t.phase == 2)
    # ideal_max_send_bytes is a lower bound on the busiest sender
    assert st_.max_send_bytes >= st_.ideal_max_send_bytes
    if moved:
        assert st_.ideal_max_send_bytes > 0
    return st_


# --------------------------------------------------------------------------- properties

SPLITS = st.sampled_from([1, 16, 256, DEFAULT_SPLIT_BYTES])


@settings(max_examples=n_examples(50))
@given(pair=random_layout_pair(), same_job=st.booleans(), split=SPLITS)
@example(  # nested: two axes shard dim 0 of an uneven array; replicas on both sides
    pair=LayoutPair(
        {"w": ((7, 5), "bfloat16")},
        lay_out({"w": ((7, 5), "bfloat16")}, Mesh(("dp", "tp"), (2, 2)), {"w": (Shard(0), Shard(0))}),
        lay_out({"w": ((7, 5), "bfloat16")}, Mesh(("dp", "tp"), (2, 3)), {"w": (Replicate(), Shard(1))}),
        None,
        3,
    ),
    same_job=False,
    split=1,
)
def test_plan_is_exact(pair: LayoutPair, same_job: bool, split: int) -> None:
    plan = plan_transfers(
        pair.src,
        pair.dst,
        src_domain_size=pair.src_domain_size,
        dst_domain_size=pair.dst_domain_size,
        same_job=same_job,
        split_bytes=split,
    )
    st_ = assert_plan_exact(plan, pair.src, pair.dst, same_job)
    if same_job:
        want = pair.src_domain_size or pair.dst_domain_size or 1
        assert st_.src_domain_size == st_.dst_domain_size == want
    else:
        assert st_.src_domain_size == (pair.src_domain_size or 1)
        assert st_.dst_domain_size == (pair.dst_domain_size or 1)


@settings(max_examples=n_examples(30))
@given(pair=random_layout_pair(domains=False), same_job=st.booleans())
def test_domain_sizes_do_not_change_what_lands(pair: LayoutPair, same_job: bool) -> None:
    """With and without domains (phase 2): every byte lands exactly once on every holder, moved
    bytes stay at the lower bound, and network bytes at the per-domain minimum."""
    world = pair.dst.world_size
    for dds in (None, 1, 2, world):
        plan = plan_transfers(pair.src, pair.dst, dst_domain_size=dds, same_job=same_job, split_bytes=8)
        assert_plan_exact(plan, pair.src, pair.dst, same_job)
    plan = plan_transfers(pair.src, pair.dst, src_domain_size=pair.src.world_size, same_job=same_job)
    assert_plan_exact(plan, pair.src, pair.dst, same_job)


@settings(max_examples=n_examples(40))
@given(pair=random_layout_pair(max_ranks=6))
def test_sweep_matches_all_pairs_oracle(pair: LayoutPair) -> None:
    """The planner's sorted sweep finds exactly the intersections the quadratic oracle finds, and
    every (destination chunk, source chunk) piece reaches every destination holder in full."""
    src, dst = pair.src, pair.dst
    swept: set[tuple[str, int, int, Box]] = set()
    for fqn, d in dst.arrays.items():
        boxes = [c.region for c in src.arrays[fqn].chunks]
        index = SweepIndex(boxes)
        for di, dc in enumerate(d.chunks):
            for si, box in overlaps(boxes, dc.region, index):
                swept.add((fqn, di, si, box))
    oracle = brute_pieces(src, dst)
    assert swept == oracle
    for same_job in (False, True):
        plan = plan_transfers(
            src, dst, same_job=same_job, dst_domain_size=pair.dst_domain_size, split_bytes=4
        )
        got: dict[tuple[str, int, int, int], list[Box]] = defaultdict(list)
        for t in plan.transfers:
            got[(t.fqn, t.dst_chunk, t.src_chunk, plan.dst_local(t.dst_rank))].append(t.region)
        want = {}
        for fqn, di, si, box in oracle:
            for h in dst.arrays[fqn].chunks[di].holders:
                want[(fqn, di, si, h)] = box
        assert set(got) == set(want)
        for k, boxes in got.items():
            assert all(want[k].contains(b) for b in boxes), k
            assert sum(b.volume for b in boxes) == want[k].volume, k


def test_sweep_with_many_chunks_matches_oracle() -> None:
    """Grid-sharded uneven arrays with many chunks on both sides (the sweep's bisect window)."""
    arrays = {"g": ((37, 23), "float32"), "h": ((11, 3, 29), "bfloat16")}
    sm = Mesh(("a", "b", "c"), (3, 2, 4))
    dm = Mesh(("x", "y"), (5, 3))
    src = lay_out(arrays, sm, {"g": (Shard(0), Shard(1), Shard(0)), "h": (Shard(2), Shard(0), Shard(2))})
    dst = lay_out(arrays, dm, {"g": (Shard(1), Shard(0)), "h": (Shard(2), Shard(1))})
    swept: set[tuple[str, int, int, Box]] = set()
    for fqn, d in dst.arrays.items():
        boxes = [c.region for c in src.arrays[fqn].chunks]
        index = SweepIndex(boxes)
        for di, dc in enumerate(d.chunks):
            swept.update((fqn, di, si, b) for si, b in overlaps(boxes, dc.region, index))
    assert swept == brute_pieces(src, dst)
    assert_plan_exact(plan_transfers(src, dst, split_bytes=1), src, dst, False)
    assert_plan_exact(plan_transfers(src, dst, same_job=True, split_bytes=1), src, dst, True)


def test_validate_plan_catches_broken_plans() -> None:
    arrays = {"w": ((8, 6), "float32")}
    src = lay_out(arrays, Mesh(("tp",), (2,)), {"w": (Shard(0),)})
    dst = lay_out(arrays, Mesh(("dp", "tp"), (2, 3)), {"w": (Replicate(), Shard(1))})
    plan = plan_transfers(src, dst)
    assert validate_plan(plan, src, dst) == []
    ts = list(plan.transfers)
    dropped = _edited(plan, ts[1:])
    assert any("receives" in p for p in validate_plan(dropped, src, dst))
    doubled = _edited(plan, ts + ts[:1])
    assert any("receives" in p for p in validate_plan(doubled, src, dst))
    t = ts[0]
    # a sender that does not hold the source chunk (rank 1 holds the other half)
    other = 1 - t.src_rank
    wrong_src = _edited(plan, [dataclasses.replace(t, src_rank=other)] + ts[1:])
    assert any("does not hold its source chunk" in p for p in validate_plan(wrong_src, src, dst))
    # a receiver that does not hold the destination chunk, and so leaves the real holder short
    dc = dst.arrays["w"].chunks[t.dst_chunk]
    stranger = next(r for r in range(dst.world_size) if r not in dc.holders)
    wrong_dst = _edited(plan, [dataclasses.replace(t, dst_rank=plan.dst_global(stranger))] + ts[1:])
    got = validate_plan(wrong_dst, src, dst)
    assert any("does not hold its destination chunk" in p for p in got) and any("receives" in p for p in got)
    # the right bytes written at the wrong place in the local tensor
    shifted = tuple(o + 1 for o in t.dst_offsets)
    assert any("wrong destination offsets" in p
               for p in validate_plan(_edited(plan, [dataclasses.replace(t, dst_offsets=shifted)] + ts[1:]), src, dst))
    assert validate_plan(_edited(plan, ts), src, dst) == []


def test_validate_plan_catches_overlapping_writes_with_exact_volume() -> None:
    arrays = {"w": ((8, 4), "float32")}
    src = lay_out(arrays, Mesh(("tp",), (2,)), {"w": (Shard(0),)})
    dst = lay_out(arrays, Mesh(("tp",), (1,)), {"w": (Replicate(),)})
    plan = plan_transfers(src, dst)
    ts = list(plan.transfers)
    assert len(ts) == 2 and validate_plan(plan, src, dst) == []
    # the second half written from rows 3.. instead of 4..: one row twice, one row never
    t = ts[1]
    moved = dataclasses.replace(t, region=Box((3, 0), (4, 4)), src_offsets=(0, 0), dst_offsets=(3, 0))
    got = validate_plan(_edited(plan, [ts[0], moved]), src, dst)
    assert any("written twice" in p for p in got), got


def test_validate_plan_checks_forwards() -> None:
    arrays = {"w": ((8, 4), "float32")}
    src = lay_out(arrays, Mesh(("tp",), (1,)), {"w": (Replicate(),)})
    dst = lay_out(arrays, Mesh(("dp",), (2,)), {"w": (Replicate(),)})
    plan = plan_transfers(src, dst, dst_domain_size=2, split_bytes=1)
    ts = list(plan.transfers)
    assert any(t.phase == 2 for t in ts) and validate_plan(plan, src, dst) == []
    # a forward whose phase-1 delivery is gone: the forwarder has nothing to send
    fwd = next(t for t in ts if t.phase == 2)
    lost = [t for t in ts if not (t.phase == 1 and t.dst_rank == fwd.src_rank)]
    got = validate_plan(_edited(plan, lost), src, dst)
    assert any("received only 0" in p for p in got), got


class _Edited:
    """A real plan whose transfers were edited (``validate_plan`` reads its transfers and numbering)."""

    def __init__(self, plan: Plan, transfers: Sequence[Transfer]) -> None:
        self._plan = plan
        self.transfers = tuple(transfers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._plan, name)


def _edited(plan: Plan, transfers: Sequence[Transfer]) -> Plan:
    return cast(Plan, _Edited(plan, transfers))


# --------------------------------------------------------------------------- hand-computed stats


def _tp(n: int, shape: tuple[int, ...] = (8, 8), dt: str = "float32") -> Manifest:
    return lay_out({"w": (shape, dt)}, Mesh(("tp",), (n,)), {"w": (Shard(0),)})


def test_stats_tp2_to_tp4_separate_jobs() -> None:
    src, dst = _tp(2), _tp(4)
    plan = plan_transfers(src, dst)
    s = plan.stats()
    assert {
        k: getattr(s, k)
        for k in (
            "total_bytes",
            "moved_bytes",
            "lower_bound_bytes",
            "network_bytes",
            "local_bytes",
            "min_network_bytes",
            "max_send_bytes",
            "max_recv_bytes",
            "ideal_max_send_bytes",
            "transfers",
            "local_copies",
            "phase2_transfers",
            "src_world",
            "dst_world",
        )
    } == {
        "total_bytes": 256,
        "moved_bytes": 256,
        "lower_bound_bytes": 256,
        "network_bytes": 256,
        "local_bytes": 0,
        "min_network_bytes": 256,
        "max_send_bytes": 128,
        "max_recv_bytes": 64,
        "ideal_max_send_bytes": 128,
        "transfers": 4,
        "local_copies": 0,
        "phase2_transfers": 0,
        "src_world": 2,
        "dst_world": 4,
    }
    assert plan.world_size == 6
    assert sorted((t.src_rank, t.dst_rank, str(t.region)) for t in plan.transfers) == [
        (0, 2, "[0:2, 0:8]"),
        (0, 3, "[2:4, 0:8]"),
        (1, 4, "[4:6, 0:8]"),
        (1, 5, "[6:8, 0:8]"),
    ]
    # gather-broadcast baseline: rank 0 gathers the 128 bytes it lacks from rank 1 (another
    # domain), then sends the whole 256-byte array to each of the 4 destination ranks
    assert {k: v for k, v in s.to_dict().items() if k.startswith("broadcast")} == {
        "broadcast_moved_bytes": 128 + 4 * 256,
        "broadcast_gather_bytes": 128,
        "broadcast_bytes": 1024,
        "broadcast_network_bytes": 128 + 1024,
        "broadcast_max_recv_bytes": 256,
        "broadcast_max_send_bytes": 256,
    }
    # a source domain holding both source ranks: the gather stays local
    s2 = plan_transfers(src, dst, src_domain_size=2).stats()
    assert s2.broadcast_network_bytes == 1024
    assert s2.network_bytes == s2.min_network_bytes == 256  # separate jobs never share a domain


def test_stats_tp2_to_tp4_same_job() -> None:
    src, dst = _tp(2), _tp(4)
    plan = plan_transfers(src, dst, same_job=True)
    s = plan.stats()
    # rank 0 keeps rows 0:2; rank 1 needs 2:4 from rank 0; ranks 2, 3 need 4:6, 6:8 from rank 1
    assert (s.total_bytes, s.moved_bytes, s.lower_bound_bytes) == (256, 192, 192)
    assert (s.local_copies, s.transfers, s.max_send_bytes, s.ideal_max_send_bytes) == (
        1,
        3,
        128,
        128,
    )
    assert (s.network_bytes, s.min_network_bytes) == (192, 192)
    assert plan.world_size == 4
    assert sorted((t.phase, t.src_rank, t.dst_rank, str(t.region)) for t in plan.transfers) == [
        (0, 0, 0, "[0:2, 0:8]"),
        (1, 0, 1, "[2:4, 0:8]"),
        (1, 1, 2, "[4:6, 0:8]"),
        (1, 1, 3, "[6:8, 0:8]"),
    ]
    assert s.broadcast_gather_bytes == 128 and s.broadcast_bytes == 3 * 256
    one = plan_transfers(src, dst, same_job=True, dst_domain_size=4).stats()
    assert (one.network_bytes, one.min_network_bytes, one.local_bytes) == (0, 0, 192)


def test_stats_replicated_destination_domain_phase2() -> None:
    """TP2 -> DP2xTP2 in one destination domain: each byte crosses the network once, then is
    forwarded inside the domain (phase 2)."""
    arrays = {"w": ((8, 8), "float32")}
    src = lay_out(arrays, Mesh(("tp",), (2,)), {"w": (Shard(0),)})
    dst = lay_out(arrays, Mesh(("dp", "tp"), (2, 2)), {"w": (Replicate(), Shard(0))})
    s = plan_transfers(src, dst, split_bytes=1).stats()
    assert (s.moved_bytes, s.network_bytes, s.min_network_bytes, s.phase2_transfers) == (
        512,
        512,
        512,
        0,
    )
    s = plan_transfers(src, dst, dst_domain_size=4, split_bytes=1).stats()
    assert (s.moved_bytes, s.network_bytes, s.min_network_bytes) == (512, 256, 256)
    assert s.local_bytes == 256 and s.phase2_transfers > 0


# --------------------------------------------------------------------------- balance on realistic sizes

H = 4096  # Qwen-like hidden size, bf16: a 4096x4096 projection is 32 MiB


def qwen_like(layers: int = 2, experts: int = 0, hidden: int = H) -> dict[str, tuple[tuple[int, ...], str]]:
    bf = "bfloat16"
    a: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((32000, hidden), bf)}
    for i in range(layers):
        p = f"model.layers.{i}."
        a[p + "input_layernorm.weight"] = ((hidden,), bf)
        a[p + "self_attn.q_proj.weight"] = ((hidden, hidden), bf)
        a[p + "self_attn.k_proj.weight"] = ((hidden // 4, hidden), bf)
        a[p + "self_attn.v_proj.weight"] = ((hidden // 4, hidden), bf)
        a[p + "self_attn.o_proj.weight"] = ((hidden, hidden), bf)
        a[p + "self_attn.q_norm.weight"] = ((128,), bf)
        if experts:
            for e in range(experts):
                a[p + f"mlp.experts.{e}.up_proj.weight"] = ((hidden // 4, hidden), bf)
                a[p + f"mlp.experts.{e}.down_proj.weight"] = ((hidden, hidden // 4), bf)
        else:
            a[p + "mlp.up_proj.weight"] = ((3 * hidden, hidden), bf)
            a[p + "mlp.down_proj.weight"] = ((hidden, 3 * hidden), bf)
    a["model.norm.weight"] = ((hidden,), bf)
    a["lm_head.weight"] = ((32000, hidden), bf)
    return a


def tp_layout(arrays: dict[str, tuple[tuple[int, ...], str]], mesh_text: str) -> Manifest:
    """Megatron-style TP rules (column-parallel S(0), row-parallel S(1)) on ``mesh_text``; every
    other axis replicates (``pp`` / ``ep`` place arrays by name)."""
    mesh = parse_mesh(mesh_text)
    rules = []
    for glob, pl in [
        ("*embed_tokens.weight", "S(0)"),
        ("*lm_head.weight", "S(0)"),
        ("*_proj.weight", "S(0)"),
        ("*o_proj.weight", "S(1)"),
        ("*down_proj.weight", "S(1)"),
    ][::-1]:
        pls = ["R"] * mesh.ndim
        if "tp" in mesh.axes:
            pls[mesh.axis_index("tp")] = pl
        rules.append(parse_rule(f"{glob}={','.join(pls)}", mesh))
    return apply_layout(manifest_from_arrays(arrays), mesh, rules, file_pattern=None)


BALANCE_CASES = [
    # (name, source mesh, destination mesh, experts)
    ("dp2tp2->tp4", "dp=2,tp=2", "tp=4", 0),
    ("tp2pp2dp2->tp4dp2", "pp=2,dp=2,tp=2", "dp=2,tp=4", 0),
    ("dp4tp2->tp8", "dp=4,tp=2", "tp=8", 0),
    ("dp2tp4->tp2", "dp=2,tp=4", "tp=2", 0),
    ("fsdp-like dp8->tp4", "dp=8", "tp=4", 0),
    ("ep-replicas ep2dp2tp2->dp2tp4", "ep=2,dp=2,tp=2", "dp=2,tp=4", 0),
    ("ep2dp2tp2 experts->dp2tp4", "ep=2,dp=2,tp=2", "dp=2,tp=4", 4),
    ("ep4tp2 uneven experts->tp4", "ep=4,tp=2", "tp=4", 5),
    ("dp2ep4 uneven experts->tp2", "dp=2,ep=4", "tp=2", 5),
]

#: tiny arrays (norms) move whole to the least-loaded replica: allow one split_bytes per rank
SLACK = DEFAULT_SPLIT_BYTES


@pytest.mark.parametrize("dds", [None, 4, 8])
@pytest.mark.parametrize("name,sm,dm,experts", BALANCE_CASES, ids=[c[0] for c in BALANCE_CASES])
def test_replica_balance_realistic(name: str, sm: str, dm: str, experts: int, dds: int | None) -> None:
    arrays = qwen_like(experts=experts)
    src, dst = tp_layout(arrays, sm), tp_layout(arrays, dm)
    plan = plan_transfers(src, dst, dst_domain_size=dds)
    s = assert_plan_exact(plan, src, dst, False)
    ideal = s.ideal_max_send_bytes
    src_max = max(phase1_send(plan).values())
    # the source side is balanced to the exact optimum (within 5 %) ...
    tight = tight_send_bound(plan, src)
    assert ideal <= tight + 1
    assert src_max <= 1.05 * tight + SLACK, (name, src_max / tight)
    if not experts:  # ... which is the documented ideal when holder sets do not overlap
        assert src_max <= 1.05 * ideal + SLACK, (name, src_max / ideal)
        if dds is None or s.phase2_transfers == 0:  # no forwards: the busiest rank is a source
            assert s.max_send_bytes <= 1.05 * ideal + SLACK, (name, s.max_send_bytes / ideal)


def test_uneven_expert_blocks_balance_against_the_exact_optimum() -> None:
    """5 experts over ep=4 give expert blocks of 2, 2, 1, 0: the dense arrays (replicated over ep)
    must go mostly to the ranks with fewer experts. The greedy water-filling only finds that when
    the most constrained arrays (fewest replicas) are placed first (regression: in name order
    it reached 1.0675 x the optimum here)."""
    h, bf = 2048, "bfloat16"
    arrays: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((32000, h), bf)}
    for i in range(2):
        p = f"model.layers.{i}."
        arrays[p + "self_attn.q_proj.weight"] = ((h, h), bf)
        arrays[p + "self_attn.o_proj.weight"] = ((h, h), bf)
        arrays[p + "input_layernorm.weight"] = ((h,), bf)
        for e in range(5):
            arrays[p + f"mlp.experts.{e}.up_proj.weight"] = ((1024, h), bf)
            arrays[p + f"mlp.experts.{e}.down_proj.weight"] = ((h, 1024), bf)
    src, dst = tp_layout(arrays, "ep=4,tp=2"), tp_layout(arrays, "tp=4")
    plan = plan_transfers(src, dst)
    tight = tight_send_bound(plan, src)
    s = plan.stats()
    assert s.max_send_bytes <= 1.01 * tight + SLACK, s.max_send_bytes / tight
    # the documented ideal is a (loose) lower bound here: the holder sets overlap
    assert s.ideal_max_send_bytes < tight <= s.max_send_bytes


# --------------------------------------------------------------------------- determinism


def _shuffled(m: Manifest, rng: random.Random) -> Manifest:
    names = list(m.arrays)
    rng.shuffle(names)
    out = {}
    for n in names:
        a = m.arrays[n]
        ch = list(a.chunks)
        rng.shuffle(ch)
        out[n] = ArraySpec(a.shape, a.data_type, tuple(ch))
    return m.with_arrays(out)


def _multiset(plan: Plan) -> Counter[str]:
    return Counter(t.key() for t in plan.transfers)


@settings(max_examples=n_examples(30))
@given(
    pair=random_layout_pair(max_arrays=4),
    same_job=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    split=SPLITS,
)
def test_plan_independent_of_array_and_chunk_order(
    pair: LayoutPair, same_job: bool, seed: int, split: int
) -> None:
    kw: dict[str, Any] = {
        "src_domain_size": pair.src_domain_size,
        "dst_domain_size": pair.dst_domain_size,
        "same_job": same_job,
        "split_bytes": split,
    }
    p0 = plan_transfers(pair.src, pair.dst, **kw)
    again = plan_transfers(pair.src, pair.dst, **kw)
    assert again.digest() == p0.digest() and again.transfers == p0.transfers
    rng = random.Random(seed)
    src2, dst2 = _shuffled(pair.src, rng), _shuffled(pair.dst, rng)
    p1 = plan_transfers(src2, dst2, **kw)
    assert validate_plan(p1, src2, dst2) == []
    assert p1.stats() == p0.stats()
    assert _multiset(p1) == _multiset(p0)
    assert p1.digest() == p0.digest()


def test_order_independence_with_replica_balancing() -> None:
    """Several arrays share replica senders: the greedy balancing must not depend on the order
    in which the manifests list them (regression: it followed the destination's dict order)."""
    arrays = {f"w{i}": ((64, 512), "float32") for i in range(6)}
    src = lay_out(arrays, Mesh(("dp", "tp"), (3, 2)), {n: (Replicate(), Shard(0)) for n in arrays})
    dst = lay_out(arrays, Mesh(("tp",), (4,)), {n: (Shard(1),) for n in arrays})
    p0 = plan_transfers(src, dst, split_bytes=1 << 30)  # whole parts: each goes to one replica
    for seed in range(5):
        rng = random.Random(seed)
        p = plan_transfers(_shuffled(src, rng), _shuffled(dst, rng), split_bytes=1 << 30)
        assert _multiset(p) == _multiset(p0)
        assert p.digest() == p0.digest()


# --------------------------------------------------------------------------- errors

A = {"w": ((8, 4), "float32"), "b": ((4,), "bfloat16")}


def _one(arrays: dict[str, tuple[tuple[int, ...], str]]) -> Manifest:
    return lay_out(arrays, Mesh(("tp",), (2,)), {n: (Shard(0),) for n in arrays})


def test_missing_destination_array_is_named() -> None:
    src = _one({"w": A["w"]})
    dst = _one(A)
    with pytest.raises(PlanError) as ei:
        plan_transfers(src, dst)
    assert any(p.startswith("b:") and "missing in source" in p for p in ei.value.problems)
    assert "b" in str(ei.value)


def test_shape_and_dtype_mismatch() -> None:
    src = _one(A)
    with pytest.raises(PlanError, match=r"w: shape mismatch \(source \[8, 4\], destination \[8, 6\]\)"):
        plan_transfers(src, _one({"w": ((8, 6), "float32"), "b": A["b"]}))
    assert plan_transfers(src, _one({"w": A["w"], "b": (A["b"][0], "float16")})).casts == {"b": ("bfloat16", "float16")}
    with pytest.raises(PlanError, match=r"b: data_type mismatch \(source bfloat16, destination int16\)"):
        plan_transfers(src, _one({"w": A["w"], "b": (A["b"][0], "int16")}))


def test_every_matching_problem_reported_at_once() -> None:
    src = _one({"w": ((8, 4), "float32"), "x": ((2,), "int64")})
    dst = _one({"w": ((8, 4), "int32"), "b": A["b"]})
    with pytest.raises(PlanError) as ei:
        plan_transfers(src, dst)
    probs = ei.value.problems
    assert len(probs) == 3
    assert any(p.startswith("w: data_type mismatch") for p in probs)
    assert any(p.startswith("b: missing in source") for p in probs)
    assert any(p.startswith("x: in source but not in destination") for p in probs)
    assert probs == match_arrays(src, dst)


def test_extra_source_array_needs_allow_extra() -> None:
    src = _one({**A, "extra": ((3, 3), "int64")})
    dst = _one(A)
    with pytest.raises(PlanError, match="extra: in source but not in destination"):
        plan_transfers(src, dst)
    plan = plan_transfers(src, dst, allow_extra=True)
    assert validate_plan(plan, src, dst) == []
    assert all(t.fqn != "extra" for t in plan.transfers)
    assert match_arrays(src, dst, allow_extra=True) == []


def test_partial_source_not_covering_a_needed_region() -> None:
    """A partial source (e.g. one pipeline stage) that lacks rows 4:8 of ``w``: the error names
    the array and the destination region it cannot fill."""
    full = _one(A)
    w = full.arrays["w"]
    partial = Manifest(
        world_size=2,
        partial=True,
        arrays={"w": ArraySpec(w.shape, w.data_type, (w.chunks[0],)), "b": full.arrays["b"]},
    )
    dst = lay_out(A, Mesh(("tp",), (4,)), {"w": (Shard(0),), "b": (Replicate(),)})
    with pytest.raises(PlanError) as ei:
        plan_transfers(partial, dst)
    probs = ei.value.problems
    assert len(probs) == 2  # rows 4:6 and 6:8
    assert all(p.startswith("w: ") for p in probs)
    assert any("[4:6, 0:4]" in p for p in probs) and any("[6:8, 0:4]" in p for p in probs)
    assert all("cover only 0 of 8 elements" in p for p in probs)
    # a region half covered says how much is covered
    dst2 = lay_out(A, Mesh(("tp",), (1,)), {"w": (Replicate(),), "b": (Replicate(),)})
    with pytest.raises(PlanError, match=r"w: destination chunk 0 region \[0:8, 0:4\].*16 of 32 elements"):
        plan_transfers(partial, dst2)
    # a destination that needs only what the partial source has is fine
    dst3 = Manifest(
        world_size=1,
        partial=True,
        arrays={
            "w": ArraySpec(w.shape, w.data_type, (Chunk(Box((1, 0), (3, 4)), (0,)),)),
            "b": ArraySpec((4,), "bfloat16", (Chunk(Box.whole((4,)), (0,)),)),
        },
    )
    plan = plan_transfers(partial, dst3)
    assert validate_plan(plan, partial, dst3) == []


def test_zero_size_and_scalar_arrays() -> None:
    arrays = {"s": ((), "int64"), "z": ((0, 4), "float32"), "v": ((3,), "bool")}
    src = lay_out(
        arrays,
        Mesh(("dp", "tp"), (2, 2)),
        {"s": (Replicate(), Replicate()), "z": (Shard(0), Shard(1)), "v": (Shard(0), Replicate())},
    )
    dst = lay_out(arrays, Mesh(("tp",), (3,)), {"s": (Replicate(),), "z": (Shard(1),), "v": (Shard(0),)})
    for same_job in (False, True):
        plan = plan_transfers(src, dst, same_job=same_job, split_bytes=1)
        s = assert_plan_exact(plan, src, dst, same_job)
        assert s.total_bytes == 3 * 8 + 3
    assert not any(t.fqn == "z" for t in plan.transfers)


def test_transfer_geometry_helpers() -> None:
    t = Transfer("w", Box((2, 1), (3, 4)), 0, "a", (0, 1), 5, "b", (1, 0), 2)
    assert t.sizes == (3, 4) and t.nbytes == 24
    assert t.src_box == Box((0, 1), (3, 4)) and t.dst_box == Box((1, 0), (3, 4))
    assert "w|" in t.key()


# --------------------------------------------------------------------------- FP8 weight + scale pairs

FP8 = {
    "l.w.weight": ((512, 384), "float8_e4m3fn"),
    "l.w.weight_scale_inv": ((4, 3), "float32"),
    "l.b.weight": ((511, 256), "float8_e4m3fn"),  # last block short: 511 = 3·128 + 127
    "l.b.weight_scale_inv": ((4, 2), "float32"),
}


def _block_image(b: Box, block: tuple[int, ...]) -> Box:
    offs = tuple(o // g for o, g in zip(b.offsets, block))
    stops = tuple(-(-(o + n) // g) for o, n, g in zip(b.offsets, b.sizes, block))
    return Box(offs, tuple(e - o for o, e in zip(offs, stops)))


def _fp8_layout(mesh: str, weight: tuple[Any, ...], scale: tuple[Any, ...] | None = None) -> Manifest:
    m = Mesh(tuple(p.split("=")[0] for p in mesh.split(",")), tuple(int(p.split("=")[1]) for p in mesh.split(",")))
    return lay_out(FP8, m, {n: (weight if n.endswith(".weight") else (scale or weight)) for n in FP8})


@pytest.mark.parametrize("same_job", [False, True])
@pytest.mark.parametrize("dds", [None, 2])
def test_fp8_scales_move_with_their_weight_rows(same_job: bool, dds: int | None) -> None:
    """Each scale block goes from the sender of the weight rows it scales to the same receiver
    in the same phase, and replica splits of the weights cut only on the 128-row block grid."""
    src = _fp8_layout("dp=2,tp=2", (Replicate(), Shard(0)))  # two replicas to balance over
    dst = _fp8_layout("dp=2,tp=4", (Replicate(), Shard(0)))  # 512 rows / 4 = 128: whole blocks
    plan = plan_transfers(src, dst, split_bytes=1, same_job=same_job, dst_domain_size=dds)
    assert_plan_exact(plan, src, dst, same_job)
    s = plan.stats()
    assert s.fp8_pairs == 2 and s.unpaired_scales == ()
    weights: Counter[tuple[Any, ...]] = Counter()
    scales: Counter[tuple[Any, ...]] = Counter()
    senders: set[int] = set()
    for t in plan.transfers:
        if t.fqn.endswith(".weight"):
            for o, n, full in zip(t.region.offsets[:1], t.region.sizes[:1], src.arrays[t.fqn].shape[:1]):
                assert o % 128 == 0 and ((o + n) % 128 == 0 or o + n == full), t  # cut on the grid
            weights[(t.fqn + "_scale_inv", t.phase, t.src_rank, t.dst_rank, _block_image(t.region, (128, 128)))] += 1
            if t.phase == 1:
                senders.add(t.src_rank)
        else:
            scales[(t.fqn, t.phase, t.src_rank, t.dst_rank, t.region)] += 1
    assert weights == scales
    if not same_job:
        assert senders == {0, 1, 2, 3}  # both replicas of both shards send


def test_fp8_pairs_balance_uneven_replicas_on_the_grid() -> None:
    """Unequal fixed loads make the water-filled shares unequal; the proportional cuts still
    fall on the block grid and the scales still follow."""
    # 32 block rows, so the cuts can follow the shares; 128 KiB more on rank 0 only
    arrays = {"l.w.weight": ((4096, 128), "float8_e4m3fn"), "l.w.weight_scale_inv": ((32, 1), "float32"),
              "l.x": ((512, 64), "float32")}
    m_src = Mesh(("dp",), (2,))
    src = lay_out(arrays, m_src, {n: (Replicate(),) for n in arrays})
    src = Manifest(world_size=2, arrays={**src.arrays, "l.x": ArraySpec((512, 64), "float32", (
        Chunk(Box((0, 0), (512, 64)), (0,)),))})
    dst = lay_out(arrays, Mesh(("tp",), (1,)), {n: (Replicate(),) for n in arrays})
    plan = plan_transfers(src, dst, split_bytes=1)
    assert_plan_exact(plan, src, dst, False)
    fp8 = Counter()
    for t in plan.transfers:
        if t.fqn != "l.x":
            fp8[t.src_rank] += t.nbytes
    assert fp8[1] > fp8[0] > 0  # the idle replica takes more of the weights, both send
    sent = phase1_send(plan)
    assert max(sent.values()) <= sum(sent.values()) / 2 + 128 * 128  # level to within one block row
    w = [t for t in plan.transfers if t.fqn == "l.w.weight"]
    assert len({t.src_rank for t in w}) == 2
    for t in w:
        assert t.region.offsets[0] % 128 == 0
    want = Counter((t.src_rank, _block_image(t.region, (128, 128))) for t in w)
    got = Counter((t.src_rank, t.region) for t in plan.transfers if t.fqn == "l.w.weight_scale_inv")
    assert want == got


def test_fp8_scales_that_do_not_follow_their_weights_are_planned_alone() -> None:
    """torch.chunk over 3 cuts 512 rows at 171: not whole blocks, so the pair cannot move as one;
    both still arrive exactly, and the plan says which scale arrays were planned alone."""
    src = _fp8_layout("tp=2", (Shard(0),))
    dst = _fp8_layout("fsdp=3", (Shard(0),))
    plan = plan_transfers(src, dst, split_bytes=1)
    assert_plan_exact(plan, src, dst, False)
    assert plan.stats().unpaired_scales == ("l.b.weight_scale_inv", "l.w.weight_scale_inv")
    assert plan.stats().fp8_pairs == 0


def test_digest_does_not_depend_on_object_sharing() -> None:
    """Layouts share chunk tuples between arrays; a parsed manifest shares nothing. Both jobs of a
    refit must still compute the same digest from the same content."""
    from formats.manifest.wire import dumps_manifest, loads_manifest

    arrays = {f"l.{i}.w": ((64, 32), "bfloat16") for i in range(4)}
    from formats.layouts import build_manifest

    src = build_manifest(arrays, Mesh(("dp", "tp"), (2, 2)), {n: (Replicate(), Shard(0)) for n in arrays},
                         file_pattern=None)
    dst = build_manifest(arrays, Mesh(("tp",), (4,)), {n: (Shard(1),) for n in arrays}, file_pattern=None)
    assert src.arrays["l.0.w"].chunks is src.arrays["l.1.w"].chunks  # shared by build_manifest
    a = plan_transfers(src, dst, dst_domain_size=2)
    b = plan_transfers(loads_manifest(dumps_manifest(src)), loads_manifest(dumps_manifest(dst)), dst_domain_size=2)
    assert a.digest() == b.digest() and a.transfers == b.transfers
