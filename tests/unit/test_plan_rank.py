"""Per-rank planning (issue 14 item 3): what one rank selects from the compressed plan, put
together over all ranks, is exactly the whole plan.

Oracle: the whole plan's materialised transfers (``Plan.transfers``). For every rank, its
transfers, sends and receives are the whole plan's, filtered, in plan order, and what it
knows of its forwards (``forward_keys``, ``forward_sources``) equals a box-intersection oracle;
the sends of all ranks plus the local copies are the whole plan as a multiset; ``rank_figures``
sums to the plan's figures. Checked on random layouts (uneven, nested, replicated, domains,
same-job), Qwen-like MoE layouts with uneven expert blocks, FP8 weight + scale pairs and the
framework presets (fused QKV / gate-up, stacked experts, pipeline stages), compact and v1.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from helpers import LayoutPair, lay_out, n_examples, random_layout_pair
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan import BALANCE_CASES, qwen_like, tp_layout
from test_presets import DSV3, DSV3_FP8, MOE, QWEN3

from formats.errors import UsageError
from formats.layouts import Mesh, Replicate, Shard, parse_mesh
from formats.layouts.presets import preset_manifest
from formats.manifest.wire import COMPACT_FORMAT_VERSION, Manifest, dumps_manifest, loads_manifest
from streamer.plan.forwards import forward_keys, forward_sources
from streamer.plan.local_shapes import LocalShapes, plan_shapes
from streamer.plan.model import Plan, Transfer
from streamer.plan.planner import plan_transfers
from streamer.plan.rankplan import rank_figures, rank_role
from streamer.refit.rankstart import input_digests, input_problems

#: the byte wave ``forward_keys`` is checked with: small, so that streams span several waves
WAVE = 48


def forward_oracle(full: tuple[Transfer, ...], world: int) -> tuple[dict[Any, int], dict[Any, set[int]]]:
    """From the materialised plan, by box intersection: each forward's latest phase-1 bytes (the
    wave of the last byte of the phase-1 transfers into the forwarder's tensor that overlap what
    it forwards, in their sender->forwarder stream), and each forward's senders."""
    pos: dict[tuple[int, int], int] = Counter()
    end: list[tuple[Transfer, int]] = []
    for t in full:
        if t.phase == 1:
            pos[(t.src_rank, t.dst_rank)] += t.nbytes
            end.append((t, pos[(t.src_rank, t.dst_rank)]))
    keys: dict[Any, int] = {}
    sources: dict[Any, set[int]] = {}
    for t in full:
        if t.phase != 2:
            continue
        f, d = t.src_rank, t.dst_rank
        deps = [(t1, e) for t1, e in end if t1.dst_rank == f and t1.dst_tensor == t.src_tensor
                and t1.dst_box.intersect(t.src_box) is not None]
        assert deps, t
        keys[(t.fqn, t.region.offsets, f, d)] = max((e - 1) // WAVE * world + (f - t1.src_rank) % world
                                                    for t1, e in deps)
        sources[(t.fqn, t.region.offsets, f, d)] = {t1.src_rank for t1, _ in deps}
    return keys, sources


def check_per_rank(plan: Plan) -> None:
    """Every rank's selections against the whole plan, and the figures' sums."""
    full = plan.transfers
    st_ = plan.stats()
    want_keys, want_sources = forward_oracle(full, plan.world_size)
    assert forward_keys(plan, None, WAVE) == want_keys
    for b in plan._blocks:  # the balancer's per-rank send counts, without the [T, A] grid
        items = np.arange(b.num_items)
        src, _ = b.ranks_ta(items)
        want = np.bincount(src.ravel(), weights=np.repeat(b.item_bytes().astype(float), src.shape[1]),
                           minlength=plan.world_size)
        assert np.array_equal(b.sender_bytes(items, plan.world_size), want)
    moving: Counter[Transfer] = Counter()
    copies: Counter[Transfer] = Counter()
    figs = []
    for r in range(plan.world_size):
        mine = [t for t in full if r in (t.src_rank, t.dst_rank)]
        assert plan.transfers_of(r) == mine, r
        sends = [t for t in full if t.src_rank == r and t.phase != 0]
        recvs = [t for t in full if t.dst_rank == r and t.phase != 0]
        assert plan.sends(r) == sends and plan.recvs(r) == recvs, r
        keys = forward_keys(plan, (r,), WAVE)
        assert keys == {k: v for k, v in want_keys.items() if r in k[2:]}, r
        got = {(fqn, f, box.offsets): s for (fqn, f), v in forward_sources(plan, r).items() for box, s in v}
        assert got == {(fqn, f, o): s for (fqn, o, f, d), s in want_sources.items() if d == r}, r
        moving.update(sends)
        copies.update(t for t in mine if t.phase == 0 and t.dst_rank == r)
        f = rank_figures(plan, r)
        assert (f.bytes_sent, f.bytes_received) == (sum(t.nbytes for t in sends), sum(t.nbytes for t in recvs)), r
        assert f.send_peers == tuple(sorted({t.dst_rank for t in sends}))
        assert f.recv_peers == tuple(sorted({t.src_rank for t in recvs}))
        figs.append(f)
    assert moving + copies == Counter(full)
    assert sum(f.bytes_sent for f in figs) == sum(f.bytes_received for f in figs) == st_.moved_bytes
    assert sum(f.sends for f in figs) == sum(f.receives for f in figs) == st_.transfers
    assert sum(f.transfers for f in figs) == 2 * st_.transfers
    assert sum(f.local_copies for f in figs) == st_.local_copies
    assert sum(f.forwards for f in figs) == st_.phase2_transfers
    assert sum(f.network_bytes_sent for f in figs) == st_.network_bytes
    assert max(f.bytes_sent for f in figs) == st_.max_send_bytes
    assert max(f.bytes_received for f in figs) == st_.max_recv_bytes


def check_shapes(plan: Plan, src: Manifest, dst: Manifest) -> None:
    """Peers' local tensor shapes, per tensor, equal ``Manifest.local_tensors`` on every rank."""
    shape_of = plan_shapes(plan, src, dst)
    for m, on_dst in ((src, False), (dst, True)):
        plain = LocalShapes(m)
        undeclared = replace(m, tensors={})  # shapes from the chunks alone (presets declare theirs)
        bare = LocalShapes(undeclared)
        for r in range(m.world_size):
            for name, spec in undeclared.local_tensors(r).items():
                assert bare(r, name) == spec.shape, (r, name)
            g = plan.dst_global(r) if on_dst else r
            moved = {t.src_tensor for t in plan.sends(g)} | {t.dst_tensor for t in plan.recvs(g)}
            for name, spec in m.local_tensors(r).items():
                assert plain(r, name) == spec.shape, (r, name)
                if name in moved:  # the planner's names index only the arrays it moves
                    assert shape_of(g, name, on_dst) == spec.shape, (r, name)


@given(random_layout_pair(), st.booleans(), st.sampled_from([1, 64, 1 << 16]))
@settings(max_examples=n_examples(40), deadline=None)
def test_per_rank_plans_make_the_whole_plan(pair: LayoutPair, same_job: bool, split: int) -> None:
    plan = plan_transfers(pair.src, pair.dst, src_domain_size=pair.src_domain_size,
                          dst_domain_size=pair.dst_domain_size, same_job=same_job, split_bytes=split)
    check_per_rank(plan)
    check_shapes(plan, pair.src, pair.dst)


@pytest.mark.parametrize("dds", [None, 4])
@pytest.mark.parametrize("name,sm,dm,experts", BALANCE_CASES, ids=[c[0] for c in BALANCE_CASES])
def test_per_rank_on_balanced_moe_layouts(name: str, sm: str, dm: str, experts: int, dds: int | None) -> None:
    """Replica balancing (water-filled shares for uneven expert blocks) stays whole-plan work;
    each rank's selection still matches it."""
    arrays = qwen_like(experts=experts, hidden=256)
    src, dst = tp_layout(arrays, sm), tp_layout(arrays, dm)
    check_per_rank(plan_transfers(src, dst, dst_domain_size=dds, split_bytes=1024))


FP8 = {"l.w.weight": ((512, 256), "float8_e4m3fn"), "l.w.weight_scale_inv": ((4, 2), "float32"),
       "l.b.weight": ((512, 128), "float8_e4m3fn"), "l.b.weight_scale_inv": ((4, 1), "float32")}


@pytest.mark.parametrize("same_job", [False, True])
def test_per_rank_with_fp8_pairs(same_job: bool) -> None:
    src = lay_out(FP8, Mesh(("dp", "tp"), (2, 2)), {n: (Replicate(), Shard(0)) for n in FP8})
    dst = lay_out(FP8, Mesh(("dp", "tp"), (2, 4)), {n: (Replicate(), Shard(0)) for n in FP8})
    plan = plan_transfers(src, dst, split_bytes=1, same_job=same_job, dst_domain_size=2)
    assert plan.stats().fp8_pairs == 2
    check_per_rank(plan)


PRESET_CASES = [
    ("qwen3 megatron pp2tp2 -> vllm dp2tp2", QWEN3, "megatron", "pp=2,tp=2", "vllm", "dp=2,tp=2", None),
    ("moe megatron ep2tp2 -> vllm tp4, domain 2", MOE, "megatron", "ep=2,tp=2", "vllm", "tp=4", 2),
    ("moe fsdp2 -> sglang tp4", MOE, "fsdp2", "fsdp=3", "sglang", "tp=4", None),
    ("dsv3 megatron pp2ep2 -> vllm tp4", DSV3, "megatron", "pp=2,ep=2,tp=1", "vllm", "tp=4", None),
    ("dsv3 fp8 megatron tp2 -> vllm dp2tp2", DSV3_FP8, "megatron", "tp=2", "vllm", "dp=2,tp=2", 2),
]


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "v1"])
@pytest.mark.parametrize("name,cfg,sp,sm,dp,dm,dds", PRESET_CASES, ids=[c[0] for c in PRESET_CASES])
def test_per_rank_on_presets(name: str, cfg: dict[str, Any], sp: str, sm: str, dp: str, dm: str,
                             dds: int | None, compact: bool) -> None:
    fp8 = cfg is DSV3_FP8
    src = preset_manifest(cfg, sp, parse_mesh(sm), compact=compact, fp8=fp8)
    dst = preset_manifest(cfg, dp, parse_mesh(dm), compact=compact, fp8=fp8)
    if compact:  # as a refit rank gets them: parsed from the compact text, nothing expanded
        src, dst = (loads_manifest(dumps_manifest(m, format_version=COMPACT_FORMAT_VERSION)) for m in (src, dst))
    plan = plan_transfers(src, dst, dst_domain_size=dds)
    check_shapes(plan, src, dst)
    if compact:
        assert not any(a.expanded for m in (src, dst) for a in m.arrays.values() if a.ref is not None), \
            "planning (or a local tensor shape) expanded a compact array"
        v1 = plan_transfers(*(loads_manifest(dumps_manifest(m)) for m in (src, dst)), dst_domain_size=dds)
        assert plan.digest() == v1.digest() and plan.stats() == v1.stats()
    check_per_rank(plan)


def test_same_job_reshard_per_rank() -> None:
    src = preset_manifest(MOE, "megatron", parse_mesh("ep=2,tp=2"))
    dst = preset_manifest(MOE, "vllm", parse_mesh("tp=4"))
    check_per_rank(plan_transfers(src, dst, same_job=True, src_domain_size=2))


def test_lazy_figures_equal_the_eager_ones() -> None:
    src = preset_manifest(MOE, "megatron", parse_mesh("ep=2,tp=2"))
    dst = preset_manifest(MOE, "vllm", parse_mesh("dp=2,tp=2"))
    lazy = plan_transfers(src, dst, dst_domain_size=2, stats=False)
    eager = plan_transfers(src, dst, dst_domain_size=2)
    assert lazy.stats() == eager.stats() and lazy.digest() == eager.digest()


def test_rank_outside_the_plan_is_a_usage_error() -> None:
    src, dst = (lay_out({"w": ((4, 4), "float32")}, Mesh(("tp",), (n,)), {"w": (Shard(0),)}) for n in (2, 3))
    plan = plan_transfers(src, dst)
    assert rank_role(plan, 1) == ("send", 1) and rank_role(plan, 2) == ("recv", 0)
    with pytest.raises(UsageError, match=r"--rank 5 is outside the plan's ranks 0\.\.4"):
        rank_figures(plan, 5)
    same = plan_transfers(src, src, same_job=True)
    assert rank_role(same, 1) == ("send+recv", 1)


def test_input_digests_name_what_differs() -> None:
    opts = {"bucket_size": 1 << 20, "strategy": "reshard", "allow_extra": False}
    a = input_digests(b"src", b"dst", opts)
    assert input_problems([a, a, a]) == []
    b = input_digests(b"src!", b"dst", opts)
    c = input_digests(b"src", b"dst", {**opts, "bucket_size": 2 << 20})
    got = input_problems([a, b, c, b])
    assert len(got) == 2
    assert got[0].startswith("bucket_size differs on ranks [2] (2: 2097152, 0: 1048576)")
    assert got[1].startswith("source manifest digest differs on ranks [1, 3]")
    d = dict(a, planner="shardstream 9.9, plan algorithm 1")
    assert input_problems([a, d])[0].startswith("planner differs on ranks [1]")


@pytest.mark.parametrize("same_job", [False, True])
def test_cli_rank_figures_sum_to_the_whole_plan(tmp_path: Any, capsys: Any, same_job: bool) -> None:
    """``plan --rank R --json`` over every rank, through the CLI: bytes sent and received each sum
    to the whole plan's ``moved_bytes``; a rank outside the plan is one line, exit 2."""
    import json

    from formats.manifest.wire import save_manifest
    from streamer.cli.app import main

    src, dst = tmp_path / "src.json", tmp_path / "dst.json"
    save_manifest(preset_manifest(MOE, "megatron", parse_mesh("ep=2,tp=2")), src, format_version=COMPACT_FORMAT_VERSION)
    save_manifest(preset_manifest(MOE, "vllm", parse_mesh("dp=2,tp=2")), dst, format_version=COMPACT_FORMAT_VERSION)
    flags = ["--src-domain-size", "2", "--dst-domain-size", "2", *(["--same-job"] if same_job else [])]
    assert main(["plan", str(src), str(dst), "--json", *flags]) == 0
    whole = json.loads(capsys.readouterr().out)
    ranks = 4 if same_job else 8
    got = []
    for r in range(ranks):
        assert main(["plan", str(src), str(dst), "--rank", str(r), "--json", *flags]) == 0
        out = capsys.readouterr()
        got.append(json.loads(out.out))
        assert f"rank {r} (" in out.err  # the human lines go to stderr with --json
    assert {"rank", "role", "bytes_sent", "bytes_received", "transfers", "messages"} <= set(got[0])
    assert [g["rank"] for g in got] == list(range(ranks))
    assert sum(g["bytes_sent"] for g in got) == sum(g["bytes_received"] for g in got) == whole["moved_bytes"] > 0
    assert sum(g["sends"] for g in got) == whole["transfers"]
    assert max(g["bytes_sent"] for g in got) == whole["max_send_bytes"]
    assert {g["role"] for g in got} == ({"send+recv"} if same_job else {"send", "recv"})
    assert all(g["messages"] > 0 for g in got if g["transfers"])
    assert main(["plan", str(src), str(dst), "--rank", str(ranks), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--rank {ranks} is outside the plan's ranks 0..{ranks - 1}" in err[0], err


def test_bench_rank_start_and_whole_plan_on_a_small_model(tmp_path: Any) -> None:
    """The scale benchmark's two workers on small compact manifests: a rank's start schedules
    exactly its share of the bytes, and the whole plan's figures are the plan's."""
    from formats.manifest.wire import save_manifest
    from streamer.tools.bench_rank import rank_start, scale_case, whole_plan

    src, dst = tmp_path / "src.json", tmp_path / "dst.json"
    save_manifest(preset_manifest(MOE, "megatron", parse_mesh("ep=2,tp=2")), src, format_version=COMPACT_FORMAT_VERSION)
    save_manifest(preset_manifest(MOE, "vllm", parse_mesh("dp=2,tp=2")), dst, format_version=COMPACT_FORMAT_VERSION)
    plan = plan_transfers(loads_manifest(src.read_text()), loads_manifest(dst.read_text()),
                          src_domain_size=2, dst_domain_size=2)
    for r in range(plan.world_size):
        got = rank_start(str(src), str(dst), r, 2)
        f = rank_figures(plan, r)
        assert got["bytes"] == f.bytes_sent + f.bytes_received > 0, r
        assert 0 < got["peak_rss_bytes"] and got["local_tensors"] > 0  # type: ignore[operator]
    whole = whole_plan(str(src), str(dst), 2)
    assert (whole["transfers"], whole["moved_bytes"]) == (plan.stats().transfers, plan.stats().moved_bytes)
    assert whole["digest"] == plan.digest()
    assert scale_case("/x/deepseek-v3.config.json") == "deepseek-v3" and scale_case("qwen3-32b.config.json") is None
