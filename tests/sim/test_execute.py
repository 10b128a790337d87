"""streamer.execute.executor over the loopback transport: every rank of a plan in its own thread, in one
process. Destination tensors must equal the oracle byte for byte; faults must surface as
TransportError / PeerTimeoutError on the right ranks, never as a hang.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
from helpers import (
    LayoutPair,
    check_dest_tensors,
    empty_dest_tensors,
    lay_out,
    make_source_tensors,
    n_examples,
    oracle_arrays,
    random_layout_pair,
    run_plan_loopback,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from formats.errors import PeerTimeoutError, TransportError
from formats.layouts import Mesh, Replicate, Shard, chunk_regions
from formats.manifest.box import Box
from formats.manifest.wire import Chunk, Manifest, Source
from streamer.execute.schedule import INPLACE_MIN_BYTES, Message, build_schedule
from streamer.plan.check import validate_plan
from streamer.plan.model import Plan
from streamer.plan.planner import plan_transfers
from streamer.transport.loopback import LoopbackHub


def execute(
    plan: Plan,
    src: Manifest,
    dst: Manifest,
    arrays: dict[str, Any],
    *,
    bucket: int,
    verify: bool = True,
    timeout: float = 10.0,
    zero_copy: bool = False,
    dst_tensors: dict[int, dict[str, Any]] | None = None,
) -> tuple[Any, dict[int, dict[str, Any]]]:
    full = oracle_arrays(arrays)
    s = make_source_tensors(src, full)
    d = empty_dest_tensors(dst) if dst_tensors is None else dst_tensors
    res = run_plan_loopback(
        plan, src, dst, s, d, bucket=bucket, verify=verify, timeout=timeout, zero_copy=zero_copy
    )
    res.raise_first()
    assert check_dest_tensors(dst, d, full) == []
    st_ = plan.stats()
    assert sum(x.bytes_received for x in res.stats.values()) == st_.moved_bytes
    assert sum(x.bytes_sent for x in res.stats.values()) == st_.moved_bytes
    for g, x in res.stats.items():
        assert x.peak_buffer_bytes <= 2 * bucket, (g, x.peak_buffer_bytes, bucket)
        if verify:
            assert x.verified_regions == sum(len(m.transfers) for m in res.schedule if m.dst == g)
    return res, d


# --------------------------------------------------------------------------- random layouts


@settings(max_examples=n_examples(25))
@given(
    pair=random_layout_pair(max_ranks=6, max_dim=6),
    bucket=st.sampled_from([64, 1 << 20]),
    same_job=st.booleans(),
)
def test_random_layouts_land_byte_exact(pair: LayoutPair, bucket: int, same_job: bool) -> None:
    """Random meshes/placements/dtypes (bf16, fp32, int64, uint8, bool; 0-d..4-d), tiny buckets
    (split transfers, many messages) and large ones, with and without domains (phase 2)."""
    dst = pair.dst
    if same_job:  # one process per rank: destination tensors need names of their own
        dst = _prefixed(dst, "dst:")
    plan = plan_transfers(
        pair.src,
        dst,
        src_domain_size=pair.src_domain_size,
        dst_domain_size=pair.dst_domain_size,
        same_job=same_job,
        split_bytes=16,
    )
    assert validate_plan(plan, pair.src, dst) == []
    execute(plan, pair.src, dst, pair.arrays, bucket=bucket)


def test_tiny_bucket_splits_transfers_into_many_messages() -> None:
    arrays = {
        "a": ((37, 20), "bfloat16"),
        "b": ((20, 37), "float32"),
        "c": ((), "int64"),
        "d": ((5, 4, 3, 2, 3), "uint8"),
        "e": ((9, 7), "bool"),
    }
    sm, dm = Mesh(("dp", "tp"), (2, 2)), Mesh(("tp",), (3,))
    src = lay_out(
        arrays,
        sm,
        {
            "a": (Replicate(), Shard(0)),
            "b": (Shard(1), Shard(1)),
            "c": (Replicate(),) * 2,
            "d": (Shard(2), Shard(0)),
            "e": (Shard(0), Shard(0)),
        },
    )
    dst = lay_out(
        arrays,
        dm,
        {"a": (Shard(1),), "b": (Shard(0),), "c": (Replicate(),), "d": (Shard(4),), "e": (Shard(1),)},
    )
    for dds in (None, 3):
        plan = plan_transfers(src, dst, dst_domain_size=dds, split_bytes=16)
        res, _ = execute(plan, src, dst, arrays, bucket=64)
        n_data = sum(1 for (_s, _d, tag, _n) in res.hub.log if tag in (1, 2))
        assert n_data == len(res.schedule) > len(plan.transfers) - plan.stats().local_copies
        assert all(n <= 64 for (_s, _d, tag, n) in res.hub.log if tag in (1, 2))
        assert max(x.peak_buffer_bytes for x in res.stats.values()) > 0
        if dds:
            assert any(m.phase == 2 for m in res.schedule)


@pytest.mark.parametrize("window", [1, 2, 4])
def test_window_sizes(window: int) -> None:
    arrays = {"w": ((24, 16), "float32")}
    src = lay_out(arrays, Mesh(("dp", "tp"), (2, 2)), {"w": (Replicate(), Shard(1))})
    dst = lay_out(arrays, Mesh(("dp", "tp"), (2, 3)), {"w": (Replicate(), Shard(0))})
    plan = plan_transfers(src, dst, dst_domain_size=6, split_bytes=1)
    full = oracle_arrays(arrays)
    d = empty_dest_tensors(dst)
    res = run_plan_loopback(plan, src, dst, make_source_tensors(src, full), d, bucket=128, window=window)
    res.raise_first()
    assert check_dest_tensors(dst, d, full) == []
    assert all(x.peak_buffer_bytes <= window * 128 for x in res.stats.values())


def test_zero_copy_messages_for_large_contiguous_transfers() -> None:
    """With local tensor shapes (as RefitSession passes them), contiguous transfers of at least
    INPLACE_MIN_BYTES travel alone, straight from and into the local tensors: no bucket used."""
    rows = 4 * INPLACE_MIN_BYTES // (256 * 4)
    arrays = {"w1": ((rows, 256), "float32"), "w2": ((rows, 256), "float32")}
    src = lay_out(arrays, Mesh(("tp",), (2,)), {"w1": (Shard(0),), "w2": (Shard(0),)})
    dst = lay_out(arrays, Mesh(("tp",), (4,)), {"w1": (Shard(0),), "w2": (Shard(0),)})
    plan = plan_transfers(src, dst)
    res, _ = execute(plan, src, dst, arrays, bucket=1 << 20, zero_copy=True)
    assert len(res.schedule) == 8 and all(len(m.transfers) == 1 for m in res.schedule)
    assert all(x.peak_buffer_bytes == 0 for x in res.stats.values())
    # without the shapes, the two transfers of each pair share one packed bucket
    res2, _ = execute(plan, src, dst, arrays, bucket=1 << 20)
    assert len(res2.schedule) == 4
    assert max(x.peak_buffer_bytes for x in res2.stats.values()) >= 2 * INPLACE_MIN_BYTES


def test_one_sided_messages_land_in_place() -> None:
    """Row-parallel weights (column slices: strided at each sender, whole at each receiver) travel
    one transfer per message: the senders pack them, the receivers take them in place (no bucket)."""
    rows = INPLACE_MIN_BYTES // (64 * 4)  # a receiver's slice: 64 columns x rows = 256 KiB
    arrays = {"a": ((rows, 256), "float32"), "b": ((rows, 256), "float32")}
    src = lay_out(arrays, Mesh(("tp",), (2,)), {n: (Shard(1),) for n in arrays})
    dst = lay_out(arrays, Mesh(("tp",), (4,)), {n: (Shard(1),) for n in arrays})
    plan = plan_transfers(src, dst)
    res, _ = execute(plan, src, dst, arrays, bucket=8 << 20, zero_copy=True)
    assert len(res.schedule) == 8 and all(len(m.transfers) == 1 for m in res.schedule)
    assert all(res.stats[g].peak_buffer_bytes == 0 for g in (2, 3, 4, 5))  # received in place
    assert all(res.stats[g].peak_buffer_bytes == 2 * INPLACE_MIN_BYTES for g in (0, 1))  # packed


def test_packed_messages_share_a_bucket_slot() -> None:
    """Two slots sized for the largest message: smaller packed messages share the current slot
    (64-byte aligned); the next slot is taken only once empty; a slot empties when its last
    message completes."""
    from streamer.execute.executor import Executor

    arrays = {"v": ((64, 100), "float32"), "w": ((64, 100), "float32")}
    src = lay_out(arrays, Mesh(("tp",), (1,)), {n: (Replicate(),) for n in arrays})
    dst = lay_out(arrays, Mesh(("tp",), (1,)), {n: (Replicate(),) for n in arrays})
    plan = plan_transfers(src, dst)
    sched = build_schedule(plan, 25600)  # one message per array
    ex = Executor(LoopbackHub(2).endpoints()[0], plan, sched, make_source_tensors(src, oracle_arrays(arrays))[0])
    size = max(m.nbytes for m in ex.mine)  # 25600: each slot's bytes
    taken = [ex._take(n) for n in (1000, 1000, 20000)]
    assert [s for s, _ in taken] == [0, 0, 0] and [b.nbytes for _, b in taken] == [1000, 1000, 20000]
    assert [b.ctypes.data - taken[0][1].ctypes.data for _, b in taken] == [0, 1024, 2048]
    s4, b4 = ex._take(size)  # no room left in slot 0: slot 1
    assert s4 == 1 and b4.nbytes == size
    assert ex._take(10)[0] == -1  # slot 1 is full, slot 0 still holds three messages
    for _ in range(3):
        ex._release(0)
    assert ex._take(size)[0] == 0  # slot 0 emptied: taken from its start


def test_torch_destination_tensors() -> None:
    torch = pytest.importorskip("torch")
    arrays = {"w": ((6, 10), "bfloat16"), "f": ((3, 5), "float32"), "m": ((7,), "bool")}
    src = lay_out(arrays, Mesh(("tp",), (2,)), {"w": (Shard(1),), "f": (Shard(0),), "m": (Shard(0),)})
    dst = lay_out(arrays, Mesh(("tp",), (3,)), {"w": (Shard(0),), "f": (Shard(1),), "m": (Replicate(),)})
    plan = plan_transfers(src, dst)
    tdt = {"bfloat16": torch.bfloat16, "float32": torch.float32, "bool": torch.bool}
    d_torch = {
        r: {n: torch.zeros(spec.shape, dtype=tdt[spec.data_type]) for n, spec in dst.local_tensors(r).items()}
        for r in range(dst.world_size)
    }
    full = oracle_arrays(arrays)
    res = run_plan_loopback(plan, src, dst, make_source_tensors(src, full), d_torch, bucket=32)
    res.raise_first()
    as_np = {
        r: {n: (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy() for n, t in ts.items()}
        for r, ts in d_torch.items()
    }
    assert check_dest_tensors(dst, as_np, full) == []


# --------------------------------------------------------------------------- fused local tensors


def _fused(
    arrays: dict[str, Any],
    mesh: Mesh,
    tp_axis: int,
    parts: list[str],
    fused: str,
    extra: dict[str, tuple[Any, ...]],
) -> Manifest:
    """q/k/v sharded S(0) over ``tp_axis`` and stacked per rank into one local tensor ``fused``:
    ``[q_shard; k_shard; v_shard]``, each part starting at ``ceil(rows/tp)`` rows after the
    previous one (uneven shards leave a gap, as padded frameworks do)."""
    tp = mesh.shape[tp_axis]
    base: dict[str, int] = {}
    acc = 0
    for p in parts:
        base[p] = acc
        acc += -(-arrays[p][0][0] // tp)
    pl = {p: tuple(Shard(0) if a == tp_axis else Replicate() for a in range(mesh.ndim)) for p in parts}
    pl.update(extra)

    def make(fqn: str, region: Box, holders: tuple[int, ...]) -> Iterable[Chunk]:
        if fqn in base:
            return (
                Chunk(region, holders, Source(tensor=fused, offsets=(base[fqn],) + (0,) * (region.ndim - 1))),
            )
        return (Chunk(region, holders),)

    return lay_out(arrays, mesh, pl, make_chunks=make)


QKV = {
    "attn.q.weight": ((12, 8), "bfloat16"),
    "attn.k.weight": ((5, 8), "bfloat16"),
    "attn.v.weight": ((5, 8), "bfloat16"),
    "attn.o.weight": ((8, 12), "bfloat16"),
}
PARTS = ["attn.q.weight", "attn.k.weight", "attn.v.weight"]


@pytest.mark.parametrize("dds", [None, 6])
@pytest.mark.parametrize("bucket", [64, 1 << 20])
def test_fused_qkv_lands_at_its_offsets(bucket: int, dds: int | None) -> None:
    """Megatron-like fused ``linear_qkv`` (DP2xTP2) -> vLLM-like fused ``qkv_proj`` (DP2xTP3,
    uneven k/v shards): each array's region lands at its own offset inside the fused tensor."""
    sm, dm = Mesh(("dp", "tp"), (2, 2)), Mesh(("dp", "tp"), (2, 3))
    src = _fused(QKV, sm, 1, PARTS, "linear_qkv", {"attn.o.weight": (Replicate(), Shard(1))})
    dst = _fused(QKV, dm, 1, PARTS, "qkv_proj", {"attn.o.weight": (Replicate(), Shard(1))})
    assert set(dst.local_tensors(0)) == {"qkv_proj", "attn.o.weight"}
    assert dst.local_tensors(0)["qkv_proj"].shape == (4 + 2 + 2, 8)
    plan = plan_transfers(src, dst, dst_domain_size=dds, split_bytes=16)
    _, d = execute(plan, src, dst, QKV, bucket=bucket)
    full = oracle_arrays(QKV)
    for r in range(dst.world_size):
        tp = r % 3
        t = d[r]["qkv_proj"]
        for p, off in zip(PARTS, (0, 4, 6)):
            ((lo, hi),) = [
                (b.offsets[0], b.offsets[0] + b.sizes[0])
                for b, h in chunk_regions(QKV[p][0], dm, (Replicate(), Shard(0)))
                if r in h
            ]
            assert t[off : off + hi - lo].tobytes() == full[p][lo:hi].tobytes(), (r, tp, p)


# --------------------------------------------------------------------------- same job


def _prefixed(m: Manifest, prefix: str) -> Manifest:
    from formats.manifest.wire import ArraySpec

    out = {}
    for fqn, a in m.arrays.items():
        chunks = []
        for c in a.chunks:
            src = c.source or Source()
            chunks.append(
                Chunk(
                    c.region,
                    c.holders,
                    Source(tensor=prefix + c.tensor(fqn), offsets=src.offsets, file=src.file),
                )
            )
        out[fqn] = ArraySpec(a.shape, a.data_type, tuple(chunks))
    return m.with_arrays(out)


@pytest.mark.parametrize("dds", [None, 2, 4])
def test_same_job_reshard(dds: int | None) -> None:
    """Rank r is both a source and a destination: bytes it holds are copied locally (phase 0),
    the rest move. Destination local tensors are named apart from the sources (``dst:`` prefix):
    one rank's tensor dict holds both."""
    arrays = {"w": ((8, 8), "float32"), "b": ((10,), "bfloat16"), "s": ((), "int64")}
    src = lay_out(
        arrays,
        Mesh(("dp", "tp"), (2, 2)),
        {"w": (Replicate(), Shard(0)), "b": (Shard(0), Replicate()), "s": (Replicate(), Replicate())},
    )
    dst = _prefixed(
        lay_out(arrays, Mesh(("tp",), (4,)), {"w": (Shard(0),), "b": (Shard(0),), "s": (Replicate(),)}),
        "dst:",
    )
    plan = plan_transfers(src, dst, same_job=True, dst_domain_size=dds, split_bytes=8)
    st_ = plan.stats()
    assert st_.local_copies > 0 and st_.moved_bytes == st_.lower_bound_bytes < st_.total_bytes
    res, _ = execute(plan, src, dst, arrays, bucket=48)
    assert sum(x.local_copies for x in res.stats.values()) == st_.local_copies


def test_same_job_needs_distinct_tensor_names() -> None:
    """In same-job mode the executor takes one tensor dict per rank, so a source and a destination
    local tensor with the same name cannot both be given; the helper refuses the clash instead of
    letting received bytes overwrite source bytes."""
    arrays = {"w": ((8, 8), "float32")}
    src = lay_out(arrays, Mesh(("tp",), (2,)), {"w": (Shard(0),)})
    dst = lay_out(arrays, Mesh(("tp",), (4,)), {"w": (Shard(0),)})
    plan = plan_transfers(src, dst, same_job=True)
    full = oracle_arrays(arrays)
    with pytest.raises(ValueError, match="share names"):
        run_plan_loopback(plan, src, dst, make_source_tensors(src, full), empty_dest_tensors(dst), bucket=64)


# --------------------------------------------------------------------------- faults

FAULT_ARRAYS = {"w": ((16, 12), "float32"), "e": ((6, 5), "bfloat16")}


def _fault_layout() -> tuple[Manifest, Manifest]:
    src = lay_out(
        FAULT_ARRAYS, Mesh(("dp", "tp"), (2, 2)), {"w": (Replicate(), Shard(0)), "e": (Shard(1), Replicate())}
    )
    dst = lay_out(
        FAULT_ARRAYS, Mesh(("dp", "tp"), (2, 3)), {"w": (Replicate(), Shard(1)), "e": (Replicate(), Shard(0))}
    )
    return src, dst


@pytest.mark.parametrize("dds", [None, 6])
def test_corrupted_message_is_caught_by_verify(dds: int | None) -> None:
    src, dst = _fault_layout()
    plan = plan_transfers(src, dst, dst_domain_size=dds, split_bytes=16)
    bucket = 64
    from streamer.execute.schedule import build_schedule

    sched = build_schedule(plan, bucket)
    # the first phase-1 message of sender 0 to its first receiver: byte 0 is the first transfer's
    victim: Message = next(m for m in sched if m.phase == 1 and m.src == 0)
    tr = victim.transfers[0]
    done: list[int] = []

    def corrupt(s: int, d: int, tag: int, data: bytearray) -> None:
        if not done and (s, d, tag) == (victim.src, victim.dst, 1):
            data[0] ^= 0xFF
            done.append(1)

    full = oracle_arrays(FAULT_ARRAYS)
    d = empty_dest_tensors(dst)
    res = run_plan_loopback(
        plan,
        src,
        dst,
        make_source_tensors(src, full),
        d,
        bucket=bucket,
        verify=True,
        timeout=5,
        corrupt=corrupt,
        join_timeout=15,
    )
    assert done and not res.hung
    assert set(res.errors) == {victim.dst}, {g: repr(e) for g, e in res.errors.items()}
    err = res.errors[victim.dst]
    assert isinstance(err, TransportError) and not isinstance(err, PeerTimeoutError)
    assert err.exit_code == 3
    want = f"{tr.fqn}: region {tr.region} received by rank {victim.dst} from rank {victim.src} is corrupt"
    assert any(p.startswith(want) for p in err.problems), err.problems
    assert len(res.stats) == plan.world_size - 1  # every other rank finished
    # the damage is in that array only (on the victim, and on the ranks it forwarded it to)
    bad = check_dest_tensors(dst, d, full)
    assert bad and all(b.startswith(f"{tr.fqn}: ") for b in bad)
    assert any(f"on destination rank {plan.dst_local(victim.dst)} " in b for b in bad)


def test_corruption_goes_unnoticed_without_verify() -> None:
    src, dst = _fault_layout()
    plan = plan_transfers(src, dst)

    def corrupt(s: int, d: int, tag: int, data: bytearray) -> None:
        if (s, d, tag) == (0, src.world_size, 1):
            data[-1] ^= 0x01

    full = oracle_arrays(FAULT_ARRAYS)
    d = empty_dest_tensors(dst)
    res = run_plan_loopback(
        plan, src, dst, make_source_tensors(src, full), d, bucket=64, verify=False, corrupt=corrupt
    )
    res.raise_first()
    assert check_dest_tensors(dst, d, full)


def _run_without(plan: Plan, src: Manifest, dst: Manifest, dead: int, timeout: float) -> Any:
    """Run the plan on loopback with rank ``dead`` never started, verify on, every wait ``timeout``."""
    full = oracle_arrays(FAULT_ARRAYS)
    return run_plan_loopback(plan, src, dst, make_source_tensors(src, full), empty_dest_tensors(dst), bucket=64,
                             verify=True, timeout=timeout, skip_ranks=[dead], join_timeout=timeout + 10)


def _receivers_of(plan: Plan, rank: int, sched: list[Message]) -> set[int]:
    return {m.dst for m in sched if m.src == rank}


@pytest.mark.parametrize("dds", [None, 6])
def test_dead_source_peer_times_out_naming_it(dds: int | None) -> None:
    """Source rank 1 never starts. Every rank that waits on it raises PeerTimeoutError naming
    rank 1 within the timeout plus a little; the others finish or fail the same clean way."""
    src, dst = _fault_layout()
    plan = plan_transfers(src, dst, dst_domain_size=dds, split_bytes=16)
    dead, timeout = 1, 1.0
    res = _run_without(plan, src, dst, dead, timeout)
    assert not res.hung
    direct = _receivers_of(plan, dead, res.schedule)
    assert direct
    for g in direct:
        e = res.errors.get(g)
        assert isinstance(e, PeerTimeoutError), (g, e)
        assert re.search(rf"\brank {dead}\b", str(e)), str(e)
        assert f"timed out after {timeout:g} s" in str(e)
        assert res.finished_at[g] <= 2 * timeout + 3.0  # at most one timeout per wait, plus slack
    for g, e in res.errors.items():
        assert isinstance(e, PeerTimeoutError), (g, repr(e))
    assert set(res.stats) | set(res.errors) == set(range(plan.world_size)) - {dead}
    assert res.elapsed <= 3 * timeout + 5.0
    # a receiver waiting for a forward names the forwarder and whom it waits for (worked out from
    # the plan: a receiver does not know its forwarders' messages)
    named = [g for g, e in res.errors.items() if "which forwards bytes from" in str(e)]
    assert bool(named) == bool(dds), {g: str(e) for g, e in res.errors.items()}
    for g in named:  # the senders of the bytes in the forwards it still waits for
        assert re.search(rf"\(which forwards bytes from [^)]*\brank {dead}\b", str(res.errors[g])), str(res.errors[g])


def test_dead_destination_peer_does_not_hang_anyone() -> None:
    src, dst = _fault_layout()
    plan = plan_transfers(src, dst, dst_domain_size=6, split_bytes=16)
    dead = plan.dst_global(0)  # a phase-1 landing rank that also forwards in phase 2
    timeout = 1.0
    res = _run_without(plan, src, dst, dead, timeout)
    assert not res.hung
    assert set(res.stats) | set(res.errors) == set(range(plan.world_size)) - {dead}
    for g, e in res.errors.items():
        assert isinstance(e, PeerTimeoutError) and re.search(rf"\brank {dead}\b", str(e)), (g, repr(e))
    # whoever waited on phase-2 forwards from the dead rank gave up naming it
    fwd = {m.dst for m in res.schedule if m.src == dead}
    assert fwd and fwd <= set(res.errors)


# --------------------------------------------------------------------------- loopback semantics


def test_loopback_matches_receives_in_posting_order() -> None:
    """Like MPI: two receives posted from one peer with one tag take the messages in the order
    the receives were posted, whatever order they are tested in (regression: a receive tested
    first took the first message, so threads racing the sender could swap buckets)."""
    hub = LoopbackHub(2)
    a, b = hub.endpoints()
    first, second = np.zeros(4, np.uint8), np.zeros(8, np.uint8)
    r1 = b.irecv(first, 0, 1)
    r2 = b.irecv(second, 0, 1)
    assert not r1.test() and not r2.test()
    a.isend(np.arange(4, dtype=np.uint8), 1, 1)
    a.isend(np.arange(10, 18, dtype=np.uint8), 1, 1)
    assert not r2.test()  # the first message belongs to r1
    assert r1.test() and r2.test()
    assert first.tolist() == [0, 1, 2, 3] and second.tolist() == list(range(10, 18))
    # a cancelled receive gives up its place in the line
    r3 = b.irecv(np.zeros(2, np.uint8), 0, 1)
    r4 = b.irecv(got := np.zeros(2, np.uint8), 0, 1)
    r3.cancel()
    a.isend(np.array([7, 9], np.uint8), 1, 1)
    assert r4.test() and got.tolist() == [7, 9]


@settings(max_examples=n_examples(25))
@given(pair=random_layout_pair(max_arrays=3), bucket=st.sampled_from([16, 64, 1 << 20]))
def test_per_rank_schedule_matches_global_order(pair: LayoutPair, bucket: int) -> None:
    """``build_schedule(rank=r)`` (what RefitSession uses: a full-size plan is too big to order
    whole on every rank) gives rank r exactly the messages of the global schedule that involve
    it, with the same contents, in the same order; the forwards it sends depend on the same
    messages (a receiver is never told, nor needs, which phase-1 messages its forwarder waits for)."""
    from streamer.execute.schedule import build_schedule

    plan = plan_transfers(pair.src, pair.dst, dst_domain_size=pair.dst_domain_size, split_bytes=16)
    glob = build_schedule(plan, bucket)
    by_uid = {m.uid: m for m in glob}

    def sig(m: Message, lookup: dict[int, Message], g: int) -> tuple[Any, ...]:
        deps = tuple(sorted((lookup[d].src, lookup[d].dst, lookup[d].index, lookup[d].phase) for d in m.deps))
        return (m.phase, m.src, m.dst, m.index, m.nbytes, tuple(t.key() for t in m.transfers),
                deps if m.src == g else ())

    for m in glob:  # the global order is one the executors can follow: bytes arrive before they are forwarded
        assert all(d < m.uid for d in m.deps) and (m.phase == 1) == (not m.deps), m
    for g in range(plan.world_size):
        local = build_schedule(plan, bucket, rank=g)
        loc_uid = {m.uid: m for m in local}
        want = [sig(m, by_uid, g) for m in glob if g in (m.src, m.dst)]
        got = [sig(m, loc_uid, g) for m in local]
        assert got == want, g
        assert all(not m.deps for m in local if m.src != g)


def test_poll_sleep_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from formats.errors import UsageError
    from streamer.execute.executor import MAX_POLL_SLEEP, _poll_sleep

    monkeypatch.delenv("SHARDSTREAM_POLL_SLEEP", raising=False)
    assert _poll_sleep() == MAX_POLL_SLEEP
    monkeypatch.setenv("SHARDSTREAM_POLL_SLEEP", "5e-5")
    assert _poll_sleep() == 5e-5
    for bad in ("abc", "-1", "2", "nan"):
        monkeypatch.setenv("SHARDSTREAM_POLL_SLEEP", bad)
        with pytest.raises(UsageError, match="SHARDSTREAM_POLL_SLEEP"):
            _poll_sleep()
