"""Device tensors on host transports, staged through pinned buckets (streamer/staging.py), with
the fake device: CPU torch tensors stand in for device tensors and a worker thread, running
every queued copy late, is the stream. Every rank of a plan runs in its own thread over the
loopback transport; the same executors serve several pushes of changing weights.

Checked: bytes equal the oracle after every push; receivers are written in place (same data
pointers, the caller's tensor objects hold the new bytes); nothing is allocated after the first
push; staged and host ranks interoperate; a long region list becomes few device ops.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    LayoutPair,
    check_dest_tensors,
    empty_dest_tensors,
    lay_out,
    make_source_tensors,
    n_examples,
    oracle_arrays,
    random_layout_pair,
    rank_tensors,
    run_sessions,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from formats.errors import UsageError, ValidationError
from formats.layouts import Mesh, Replicate, Shard
from formats.manifest.box import Box
from formats.manifest.wire import ArraySpec, Chunk, Manifest, Source
from streamer.execute import staging
from streamer.execute.executor import ExecStats, Executor
from streamer.execute.schedule import build_schedule
from streamer.execute.staging import Part, build_program
from streamer.ops.buffers import byte_view, torch_byte_view
from streamer.ops.cast import cast_bytes
from streamer.ops.device_ops import FakeDeviceOps
from streamer.plan.model import Plan
from streamer.plan.planner import plan_transfers
from streamer.transport.loopback import LoopbackHub

DELAY = 2e-4  # each fake device op runs this late: a bucket used before its copy completed is stale


def as_torch(a: np.ndarray, data_type: str) -> Any:
    """A torch tensor sharing ``a``'s memory (numpy storage dtype: bf16 as uint16)."""
    flat = torch.from_numpy(byte_view(a).reshape(-1))
    return flat.view(getattr(torch, data_type)).reshape(a.shape)


def step_arrays(full: Mapping[str, np.ndarray], arrays: Mapping[str, Any], step: int) -> dict[str, np.ndarray]:
    """The oracle of push ``step``: every byte shifted by ``step`` (bools keep their low bit)."""
    out = {}
    for fqn, a in full.items():
        b = byte_view(a) + np.uint8(step)
        if arrays[fqn][1] == "bool":
            b &= 1
        out[fqn] = b.reshape(-1).view(a.dtype).reshape(a.shape)
    return out


class Ranks:
    """Every global rank of ``plan`` with a persistent executor; ``staged(g)`` says which ranks
    hand torch tensors on the fake device (the others hand numpy arrays to the host path)."""

    def __init__(self, plan: Plan, pair: LayoutPair, *, bucket: int, staged: Any = lambda g: True,
                 zero_copy: bool = True, verify: bool = True, window: int = 2) -> None:
        self.plan, self.pair = plan, pair
        src, dst = pair.src, pair.dst
        self.full = oracle_arrays(pair.arrays)
        self.src_np = make_source_tensors(src, self.full)
        self.dst_np = empty_dest_tensors(dst)
        types = {**{(r, n): s.data_type for r in range(src.world_size) for n, s in src.local_tensors(r).items()},
                 **{(plan.dst_global(r), n): s.data_type for r in range(dst.world_size)
                    for n, s in dst.local_tensors(r).items()}}
        np_tensors = rank_tensors(plan, self.src_np, self.dst_np)
        self.ops = {g: FakeDeviceOps(DELAY) for g in np_tensors if staged(g)}
        self.tensors = {g: {n: as_torch(a, types[(g, n)]) if g in self.ops else a for n, a in ts.items()}
                        for g, ts in np_tensors.items()}
        shapes: dict[tuple[int, bool], Any] = {}

        def shape_of(g: int, tensor: str, on_dst: bool) -> tuple[int, ...]:
            if (g, on_dst) not in shapes:
                shapes[(g, on_dst)] = dst.local_tensors(plan.dst_local(g)) if on_dst else src.local_tensors(g)
            return tuple(shapes[(g, on_dst)][tensor].shape)

        self.schedule = build_schedule(plan, bucket, shape_of if zero_copy else None)
        self.hub = LoopbackHub(plan.world_size)
        eps = self.hub.endpoints()
        self.ex = {g: Executor(eps[g], plan, self.schedule, self.tensors[g], timeout=10, verify=verify,
                               window=window, device_ops=self.ops.get(g)) for g in self.tensors}

    def push(self, step: int) -> dict[int, ExecStats]:
        """Set the sources to push ``step``'s oracle, zero the destinations, run every rank."""
        want = step_arrays(self.full, self.pair.arrays, step)
        for r, ts in make_source_tensors(self.pair.src, want).items():
            for n, a in ts.items():
                byte_view(self.src_np[r][n])[...] = byte_view(a)
        for ts in self.dst_np.values():
            for a in ts.values():
                a[...] = 0
        stats: dict[int, ExecStats] = {}
        errors: dict[int, BaseException] = {}

        def body(g: int) -> None:
            try:
                stats[g] = self.ex[g].run()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors[g] = e

        threads = [threading.Thread(target=body, args=(g,), daemon=True) for g in self.ex]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a rank hung"
        for g, e in sorted(errors.items()):
            raise AssertionError(f"rank {g} failed: {e!r}") from e
        assert check_dest_tensors(self.pair.dst, self.dst_np, want) == []
        return stats

    def close(self) -> None:
        for ops in self.ops.values():
            ops.close()


def _pair(arrays: dict[str, tuple[tuple[int, ...], str]], src_mesh: Mesh, src_pl: dict[str, Any],
          dst_mesh: Mesh, dst_pl: dict[str, Any], dst_domain: int | None = None) -> tuple[Plan, LayoutPair]:
    src = lay_out(arrays, src_mesh, {f: src_pl.get(f, (Replicate(),) * src_mesh.ndim) for f in arrays})
    dst = lay_out(arrays, dst_mesh, {f: dst_pl.get(f, (Replicate(),) * dst_mesh.ndim) for f in arrays})
    plan = plan_transfers(src, dst, dst_domain_size=dst_domain, split_bytes=64)
    return plan, LayoutPair(arrays, src, dst, None, dst_domain)


def _tp2_to_dp2tp2() -> tuple[Plan, LayoutPair]:
    """TP2 senders (column and row shards) -> DP2 x TP2 receivers in one domain (phase-2 forwards)."""
    arrays = {"w": ((64, 48), "bfloat16"), "v": ((40, 24), "float32"), "s": ((), "int64"), "b": ((6, 5, 4), "bool")}
    m2, m4 = Mesh(("tp",), (2,)), Mesh(("dp", "tp"), (2, 2))
    return _pair(arrays, m2, {"w": (Shard(0),), "v": (Shard(1),)}, m4,
                 {"w": (Replicate(), Shard(1)), "v": (Replicate(), Shard(0)), "b": (Replicate(), Shard(2))},
                 dst_domain=4)


# --------------------------------------------------------------------------- pushes


@pytest.mark.parametrize(("bucket", "row"), [(96, 256), (1 << 20, 256), (1 << 20, 1)])
def test_staged_pushes_land_in_place_without_new_allocations(bucket: int, row: int) -> None:
    """Three pushes of changing weights: byte exact each time, the receivers' storage the same
    (pointers and tensor objects), the same slots, and no allocation after the first push."""
    plan, pair = _tp2_to_dp2tp2()
    with min_row(row):
        ranks = Ranks(plan, pair, bucket=bucket)
        _three_pushes(plan, ranks)
    gathers = sum(isinstance(step, staging._Gather) for ex in ranks.ex.values()
                  for prog in ex._programs.values() for step in prog.steps)
    assert gathers > 0 or row > 1 or bucket == 96  # small buckets hold a region or two each


def _three_pushes(plan: Plan, ranks: Ranks) -> None:
    try:
        ptrs = {g: {n: t.data_ptr() for n, t in ts.items()} for g, ts in ranks.tensors.items()}
        slots = {g: [h.data_ptr() for h in ex._stager.host + ex._stager.device]  # type: ignore[union-attr]
                 for g, ex in ranks.ex.items()}
        ranks.push(1)
        after_first = {g: ops.allocations for g, ops in ranks.ops.items()}
        submitted = {g: ops.submitted for g, ops in ranks.ops.items()}
        for step in (2, 3):
            stats = ranks.push(step)
            assert {g: ops.allocations for g, ops in ranks.ops.items()} == after_first
            assert sum(s.staged_bytes for s in stats.values()) == 2 * plan.stats().moved_bytes
            for g in range(ranks.pair.src.world_size):  # double buffering: two slots in use at once
                mine = ranks.ex[g].mine
                assert len(mine) < 2 or stats[g].peak_buffer_bytes >= mine[0].nbytes + mine[1].nbytes
        assert all(ops.submitted > submitted[g] for g, ops in ranks.ops.items())  # the device did the work
        assert {g: {n: t.data_ptr() for n, t in ts.items()} for g, ts in ranks.tensors.items()} == ptrs
        assert {g: [h.data_ptr() for h in ex._stager.host + ex._stager.device]  # type: ignore[union-attr]
                for g, ex in ranks.ex.items()} == slots
        # the caller's torch tensors hold push 3's bytes (the numpy oracle shares their memory)
        g = plan.dst_global(0)
        assert torch.equal(torch_byte_view(ranks.tensors[g]["w"]).reshape(-1),
                           torch.from_numpy(byte_view(ranks.dst_np[0]["w"]).reshape(-1)))
    finally:
        ranks.close()


@contextlib.contextmanager
def min_row(n: int) -> Iterator[None]:
    """Index ops for rows from ``n`` bytes: 1 makes every run of consecutive transfers of one
    tensor an index op, so that small test arrays exercise them (and every word width)."""
    old = staging.MIN_ROW_BYTES
    staging.MIN_ROW_BYTES = n
    try:
        yield
    finally:
        staging.MIN_ROW_BYTES = old


def _prefixed(m: Manifest, prefix: str) -> Manifest:
    """``m`` with its local tensors renamed: a same-job rank holds both layouts' tensors."""
    return m.with_arrays({fqn: ArraySpec(a.shape, a.data_type, tuple(
        Chunk(c.region, c.holders, Source(tensor=prefix + c.tensor(fqn), offsets=(c.source or Source()).offsets))
        for c in a.chunks)) for fqn, a in m.arrays.items()})


@settings(max_examples=n_examples(16))
@given(pair=random_layout_pair(max_ranks=5, max_dim=6), bucket=st.sampled_from([64, 1 << 20]),
       mix=st.sampled_from(["all", "senders", "receivers", "odd"]), zero_copy=st.booleans(),
       row=st.sampled_from([1, 256]), same_job=st.booleans())
def test_random_layouts_staged_and_host_ranks_interoperate(pair: LayoutPair, bucket: int, mix: str,
                                                           zero_copy: bool, row: int, same_job: bool) -> None:
    """Random meshes, placements, dtypes (bf16, fp32, int64, uint8, bool; 0-d..4-d), phase-2
    forwards, same-job reshards (local copies); all ranks staged, or only senders, only
    receivers, or every other rank: the bucket layout is the same on both paths, so a staged rank
    talks to a host rank."""
    if same_job:
        pair = LayoutPair(pair.arrays, pair.src, _prefixed(pair.dst, "dst:"), pair.src_domain_size,
                          pair.dst_domain_size)
    with min_row(row):
        _random_layouts(pair, bucket, mix, zero_copy, same_job)


def _random_layouts(pair: LayoutPair, bucket: int, mix: str, zero_copy: bool, same_job: bool) -> None:
    plan = plan_transfers(pair.src, pair.dst, src_domain_size=pair.src_domain_size,
                          dst_domain_size=pair.dst_domain_size, split_bytes=64, same_job=same_job)
    S = pair.src.world_size
    staged = {"all": lambda g: True, "senders": lambda g: g < S, "receivers": lambda g: g >= S,
              "odd": lambda g: g % 2 == 1}[mix]
    ranks = Ranks(plan, pair, bucket=bucket, staged=staged, zero_copy=zero_copy)
    try:
        for step in (1, 2):
            ranks.push(step)
    finally:
        ranks.close()


def test_sender_casts_on_the_device() -> None:
    """fp32 sources, bf16 destinations: the staged sender casts while it packs (round to nearest
    even, as ``convert`` does)."""
    arrays = {"w": ((24, 40), "float32"), "n": ((40,), "float32")}
    m2 = Mesh(("tp",), (2,))
    src = lay_out(arrays, m2, {"w": (Shard(1),), "n": (Replicate(),)})
    dst = lay_out({k: (s, "bfloat16") for k, (s, _) in arrays.items()}, m2, {"w": (Shard(0),), "n": (Replicate(),)})
    plan = plan_transfers(src, dst)
    assert set(plan.casts) == {"w", "n"}
    ranks = Ranks(plan, LayoutPair(arrays, src, dst, None, None), bucket=1 << 20, verify=False)
    rng = np.random.default_rng(0)
    try:
        full = {k: rng.standard_normal(s).astype(np.float32) for k, (s, _) in arrays.items()}
        for r, ts in make_source_tensors(src, full).items():
            for n, a in ts.items():
                ranks.src_np[r][n][...] = a
        hub_threads = [threading.Thread(target=ex.run) for ex in ranks.ex.values()]
        for t in hub_threads:
            t.start()
        for t in hub_threads:
            t.join(30)
        want = {k: cast_bytes(v.reshape(-1).view(np.uint8), "float32", "bfloat16").view("<u2").reshape(v.shape)
                for k, v in full.items()}
        assert check_dest_tensors(dst, ranks.dst_np, want) == []
    finally:
        ranks.close()


# --------------------------------------------------------------------------- the fake device is honest


class _NoWait(FakeDeviceOps):
    """A broken executor's view of the device: every copy looks complete at once."""

    def ready(self, event: Any) -> bool:
        return True


def test_a_send_that_does_not_wait_for_its_copy_is_caught() -> None:
    """The fake device really runs late: skipping the event wait sends stale bucket bytes, and
    the oracle check sees it (so the passing tests above do exercise the ordering)."""
    plan, pair = _tp2_to_dp2tp2()
    ranks = Ranks(plan, pair, bucket=96, verify=False)
    for g, ex in ranks.ex.items():
        ops = _NoWait(0.01)
        ranks.ops[g] = ops
        ex._stager.ops = ops  # type: ignore[union-attr]
    try:
        with pytest.raises(AssertionError):
            ranks.push(1)
    finally:
        ranks.close()


def test_a_hung_device_copy_times_out_by_name() -> None:
    """A device copy that does not complete ends the push after the timeout, saying so instead
    of blaming a peer."""
    plan, pair = _tp2_to_dp2tp2()
    ranks = Ranks(plan, pair, bucket=96, verify=False)
    slow = FakeDeviceOps(2.0)
    ranks.ops[0] = slow
    ranks.ex[0]._stager.ops = slow  # type: ignore[union-attr]
    for ex in ranks.ex.values():
        ex.timeout = 0.5
    try:
        with pytest.raises(AssertionError) as e:
            ranks.push(1)
        assert "rank 0: timed out after 0.5 s waiting for the device copies of" in str(e.value.__cause__)
    finally:
        ranks.close()


# --------------------------------------------------------------------------- device programs


def test_a_long_region_list_is_one_index_op() -> None:
    """64 expert blocks landing in one stacked tensor: one ``index_copy_`` / ``index_select`` with
    an index built once, not 64 copies; the bytes equal the per-region copy."""
    ops = FakeDeviceOps()
    w = torch.zeros(64, 16, 32, dtype=torch.bfloat16)
    v = torch_byte_view(w)
    parts, off = [], 0
    for e in range(64):  # rows 4..11 of every expert: 8 runs of 64 bytes... merged into 512-byte rows
        box = Box((e, 4, 0), (1, 8, 32))
        parts.append(Part(v, box, off, 8 * 32 * 2))
        off += 8 * 32 * 2
    prog = build_program(parts, ops)
    assert prog.ops == 1 and ops.allocations == 1  # one step, one index tensor
    bucket = torch.arange(off, dtype=torch.int64).to(torch.uint8)
    prog.steps[0].unpack(bucket)
    want = torch.zeros_like(v)
    for p in parts:
        want[p.box.slices].copy_(bucket[p.off:p.off + p.nbytes].view(want[p.box.slices].shape))
    assert torch.equal(v, want)
    out = torch.zeros_like(bucket)
    prog.steps[0].pack(out)
    assert torch.equal(out, bucket)


def test_short_rows_and_lone_regions_are_strided_copies() -> None:
    """Rows shorter than MIN_ROW_BYTES are not indexed (the index would outweigh them); a lone
    contiguous region goes straight to the pinned bucket."""
    ops = FakeDeviceOps()
    v = torch_byte_view(torch.zeros(8, 6, dtype=torch.float32))
    parts = [Part(v, Box((0, 0), (8, 1)), 0, 32), Part(v, Box((0, 3), (8, 2)), 32, 64)]
    prog = build_program(parts, ops)
    assert prog.ops == 2 and prog.direct is None and ops.allocations == 0
    lone = build_program([Part(v, Box((2, 0), (3, 6)), 0, 72)], ops)
    assert lone.ops == 0 and lone.direct is not None and lone.direct.data_ptr() == v[2].data_ptr()


# --------------------------------------------------------------------------- refusals


def test_mixed_host_and_device_tensors_are_refused_by_name() -> None:
    plan, pair = _tp2_to_dp2tp2()
    hub = LoopbackHub(plan.world_size)
    tensors = {n: torch.from_numpy(a) for n, a in make_source_tensors(pair.src, oracle_arrays(pair.arrays))[0].items()}
    tensors["s"] = np.zeros((), np.int64)  # type: ignore[assignment]
    with pytest.raises(ValidationError) as e:
        Executor(hub.endpoints()[0], plan, build_schedule(plan, 96), tensors, device_ops=FakeDeviceOps())
    assert "local tensor 's' is not on the fake device" in str(e.value)


def test_delta_with_device_tensors_is_refused() -> None:
    from streamer.execute.delta import DeltaPush, DeltaState

    plan, pair = _tp2_to_dp2tp2()
    hub = LoopbackHub(plan.world_size)
    tensors = {n: torch.from_numpy(a) for n, a in make_source_tensors(pair.src, oracle_arrays(pair.arrays))[0].items()}
    ex = Executor(hub.endpoints()[0], plan, build_schedule(plan, 96), tensors, device_ops=FakeDeviceOps())
    with pytest.raises(UsageError, match="device tensors are not supported"):
        ex.run(DeltaPush(DeltaState(), 1, frozenset()))



# --------------------------------------------------------------------------- through RefitSession


def test_session_pulls_in_place_on_the_fake_device() -> None:
    """``RefitSession.push``/``pull`` of fake-device tensors, three pushes of changing weights:
    each lands byte exact in the receivers' own storage (same data pointers, same tensor
    objects), and no rank allocates after its first push."""
    arrays = {"w": ((48, 64), "bfloat16"), "b": ((48,), "float32"), "s": ((), "float32")}
    src = lay_out(arrays, Mesh(("dp", "tp"), (2, 2)),
                  {"w": (Replicate(), Shard(0)), "b": (Replicate(), Shard(0)), "s": (Replicate(), Replicate())})
    dst = lay_out(arrays, Mesh(("tp",), (3,)), {"w": (Shard(1),), "b": (Shard(0),), "s": (Replicate(),)})
    full = oracle_arrays(arrays)
    steps = {k: step_arrays(full, arrays, k) for k in (1, 2, 3)}
    src_np = {k: make_source_tensors(src, steps[k]) for k in steps}
    types = {f: t for f, (_, t) in arrays.items()}
    mine = {r: {n: as_torch(a.copy(), types[n]) for n, a in ts.items()} for r, ts in src_np[1].items()}
    dst_np = empty_dest_tensors(dst)
    theirs = {r: {n: as_torch(a, types[n]) for n, a in ts.items()} for r, ts in dst_np.items()}
    got: dict[int, dict[int, dict[str, np.ndarray]]] = {k: {} for k in steps}

    def act(s: Any, r: int) -> Any:
        seen = []
        try:
            for k in steps:
                if s.role == "send":
                    for n, t in mine[r].items():
                        torch_byte_view(t).copy_(torch.from_numpy(byte_view(src_np[k][r][n])))
                    st = s.push(mine[r])
                else:
                    st = s.pull(theirs[r])
                    got[k][r] = {n: byte_view(a).copy() for n, a in dst_np[r].items()}
                # the push's stats say what went through the pinned buckets: every byte moved
                assert st.staged_bytes == st.bytes_sent + st.bytes_received > 0, st
                seen.append((s.device_ops.allocations, {n: t.data_ptr() for n, t in (mine if s.role == "send"
                                                                                      else theirs)[r].items()}))
        finally:
            s.device_ops.close()
        return seen

    ptrs = {r: {n: t.data_ptr() for n, t in ts.items()} for r, ts in theirs.items()}
    results, errors = run_sessions(src, dst, act, options_of=lambda role: {"device_ops": FakeDeviceOps(DELAY)})
    assert not errors, errors
    for k in steps:
        assert check_dest_tensors(dst, {r: {n: a.reshape(-1).view(dst_np[r][n].dtype).reshape(dst_np[r][n].shape)
                                            for n, a in ts.items()} for r, ts in got[k].items()}, steps[k]) == []
    for g, seen in results.items():
        assert seen[0][0] > 0 and seen[0][0] == seen[1][0] == seen[2][0], (g, seen)
        assert seen[0][1] == seen[1][1] == seen[2][1]
    assert {r: {n: t.data_ptr() for n, t in ts.items()} for r, ts in theirs.items()} == ptrs


@pytest.mark.parametrize(("option", "said"), [({"delta": True}, "with --delta"),
                                              ({"strategy": "broadcast"}, "with --strategy broadcast")])
def test_session_refuses_delta_and_broadcast_with_device_tensors_on_every_rank(option: dict[str, Any],
                                                                               said: str) -> None:
    arrays = {"w": ((8, 4), "float32")}
    src = lay_out(arrays, Mesh(("tp",), (2,)), {"w": (Shard(0),)})
    dst = lay_out(arrays, Mesh(("tp",), (1,)), {"w": (Replicate(),)})
    srcs = make_source_tensors(src, oracle_arrays(arrays))
    dsts = empty_dest_tensors(dst)

    def act(s: Any, r: int) -> Any:
        return s.push(srcs[r]) if s.role == "send" else s.pull({n: torch.from_numpy(a) for n, a in dsts[r].items()})

    _, errors = run_sessions(src, dst, act, **option,
                             options_of=lambda role: {"device_ops": FakeDeviceOps()} if role == "recv" else {})
    assert sorted(errors) == [0, 1, 2]
    assert all(f"device tensors (fake) {said}" in str(e) for e in errors.values()), errors
    assert not any(a.any() for ts in dsts.values() for a in ts.values())  # refused before any byte moved


def test_a_device_other_than_cuda_is_refused_by_name() -> None:
    plan, pair = _tp2_to_dp2tp2()
    hub = LoopbackHub(plan.world_size)
    tensors = {n: torch.empty(a.shape, dtype=torch.uint8, device="meta")
               for n, a in make_source_tensors(pair.src, oracle_arrays(pair.arrays))[0].items()}
    with pytest.raises(ValidationError) as e:
        Executor(hub.endpoints()[0], plan, build_schedule(plan, 96), tensors)
    assert "local tensor 'w' is on meta: host transports stage CUDA tensors only" in str(e.value)


def test_session_refuses_a_host_tensor_among_device_tensors_on_every_rank() -> None:
    """One receiver hands a numpy array among its fake-device tensors: every rank of both jobs
    is refused with that rank's line, before any byte moves (no rank waits for a failed one)."""
    arrays = {"w": ((8, 4), "float32"), "b": ((4,), "float32")}
    src = lay_out(arrays, Mesh(("tp",), (2,)), {"w": (Shard(0),), "b": (Replicate(),)})
    dst = lay_out(arrays, Mesh(("tp",), (2,)), {"w": (Shard(1),), "b": (Replicate(),)})
    srcs = make_source_tensors(src, oracle_arrays(arrays))
    dsts = empty_dest_tensors(dst)

    def act(s: Any, r: int) -> Any:
        if s.role == "send":
            return s.push(srcs[r])
        return s.pull({"w": torch.from_numpy(dsts[r]["w"]), "b": dsts[r]["b"]} if r == 1 else
                      {n: torch.from_numpy(a) for n, a in dsts[r].items()})

    _, errors = run_sessions(src, dst, act,
                             options_of=lambda role: {"device_ops": FakeDeviceOps()} if role == "recv" else {})
    assert sorted(errors) == [0, 1, 2, 3]
    assert all("receiver rank 1 (global 3): local tensor 'b' is not on the fake device" in str(e) for e in errors.values()), errors
    assert not any(a.any() for ts in dsts.values() for a in ts.values())
