"""Device tensors over a host transport, staged through pinned buckets, under mpiexec:
``mpiexec -n N python tests/mpi/staged_worker.py mpi|gloo fake|cuda``. Prints OK on rank 0.
With N > 4 it runs again on the first 4 ranks (another split of senders and receivers).

``fake``: CPU torch tensors stand in for device tensors (``FakeDeviceOps``, its stream a thread
running each copy late); ``cuda``: CUDA tensors (ranks may share one GPU), staged by ``CudaOps``.
Half the ranks send (dp x tp), half receive (tp, one domain: phase-2 forwards); the same
executor runs three pushes of changing weights. Checked on every rank, collect-then-assert:
each push byte exact, receivers written in place (data pointers unchanged), no allocation after
the first push (the device ops' count, the same slots; on CUDA also the caching allocator's count
of allocations around each push), then one more push with verify.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np
from mpi4py import MPI

from formats.layouts import Replicate, Shard, build_manifest, parse_mesh
from formats.manifest.box import Box
from formats.manifest.dtypes import DTYPES, np_storage
from formats.manifest.wire import Chunk, Source
from streamer.execute import staging
from streamer.execute.executor import Executor
from streamer.execute.schedule import build_schedule
from streamer.ops.buffers import byte_view
from streamer.ops.device_ops import FakeDeviceOps
from streamer.plan.planner import plan_transfers

EXPERTS = 8
ARRAYS: dict[str, tuple[tuple[int, ...], str]] = {
    "w": ((37, 256), "bfloat16"), "v": ((24, 13), "float32"), "s": ((), "int64"), "b": ((6, 5, 4), "bool"),
    **{f"x.{e}": ((16, 48), "bfloat16") for e in range(EXPERTS)}}


def oracle(shape: tuple[int, ...], dt: str, step: int) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt].itemsize
    b = ((np.arange(n, dtype=np.uint64) * 7 + step * 31) % 256).astype(np.uint8)
    if dt == "bool":
        b &= 1
    return b.view(np_storage(DTYPES[dt])).reshape(shape)


def _fused(name: str, rows: int) -> Any:
    """Expert ``x.e`` at rows ``e * rows`` of one local tensor ``name`` (vLLM's ``w13``, Megatron's
    grouped experts): a message then carries many regions of one tensor."""
    def make(fqn: str, region: Box, holders: tuple[int, ...]) -> Iterable[Chunk]:
        if fqn.startswith("x."):
            e = int(fqn[2:])
            return (Chunk(region, holders, Source(tensor=name, offsets=(e * rows, 0))),)
        return (Chunk(region, holders),)
    return make


def layouts(W: int, S: int) -> tuple[Any, Any]:
    """Senders dp x tp (experts' rows split, fused); receivers dp x tp or tp (experts' columns
    split, fused), in one domain (phase-2 forwards)."""
    ms = parse_mesh(f"dp={2 if S % 2 == 0 else 1},tp={S // (2 if S % 2 == 0 else 1)}")
    md = parse_mesh(f"dp=2,tp={(W - S) // 2}") if (W - S) % 2 == 0 else parse_mesh(f"tp={W - S}")

    def pl(mesh: Any, rules: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
        rest = (Replicate(),) * (mesh.ndim - 1)
        return {f: rest + (rules[f],) if f in rules else rest + (Replicate(),) for f in ARRAYS}

    src_rules: dict[str, Any] = {"w": Shard(0), "v": Shard(1), **{f"x.{e}": Shard(0) for e in range(EXPERTS)}}
    dst_rules: dict[str, Any] = {"w": Shard(1), "b": Shard(2), **{f"x.{e}": Shard(1) for e in range(EXPERTS)}}
    src = build_manifest(ARRAYS, ms, pl(ms, src_rules), make_chunks=_fused("experts", -(-16 // ms.shape[-1])))
    dst = build_manifest(ARRAYS, md, pl(md, dst_rules), make_chunks=_fused("w13", 16))
    return src, dst


def local_tensors(src: Any, dst: Any, r: int, S: int, step: int) -> dict[str, np.ndarray]:
    """Rank ``r``'s local tensors at push ``step`` (receivers: zeros) as host arrays."""
    if r >= S:
        return {n: np.zeros(ts.shape, np_storage(DTYPES[ts.data_type])) for n, ts in dst.local_tensors(r - S).items()}
    out = {n: np.zeros(ts.shape, np_storage(DTYPES[ts.data_type])) for n, ts in src.local_tensors(r).items()}
    for fqn, a in src.arrays.items():
        full = oracle(a.shape, a.data_type, step)
        for c in a.chunks:
            if r in c.holders:
                out[c.tensor(fqn)][c.local_box.slices] = full[c.region.slices]
    return out


def expected(dst: Any, r: int, step: int) -> dict[str, list[tuple[Any, np.ndarray]]]:
    out: dict[str, list[tuple[Any, np.ndarray]]] = {}
    for fqn, a in dst.arrays.items():
        full = oracle(a.shape, a.data_type, step)
        for c in a.chunks:
            if r in c.holders:
                out.setdefault(c.tensor(fqn), []).append((c.local_box.slices, full[c.region.slices]))
    return out


def make_transport(kind: str, world: Any) -> Any:
    from streamer.transport.mpi import MPITransport

    if kind == "mpi":
        return MPITransport(world)
    from streamer.transport.torch_dist import TorchDistTransport

    return TorchDistTransport(MPITransport(world), "gloo", timeout=60)


def main(kind: str, device: str) -> int:
    """The pushes on every rank, then (more than 4 ranks) again on the first 4: another split of
    senders and receivers, in the same launch, so each rank starts Python and torch once."""
    world = MPI.COMM_WORLD
    fails = suite(kind, device, world)
    if world.Get_size() > 4:
        sub = world.Split(0 if world.Get_rank() < 4 else MPI.UNDEFINED, world.Get_rank())
        if sub != MPI.COMM_NULL:
            fails += [f"[4 of {world.Get_size()} ranks] {f}" for f in suite(kind, device, sub)]
            sub.Free()
    verdicts = [f for fs in world.allgather(fails) for f in fs]
    if world.Get_rank() == 0:
        print("\n".join(verdicts) if verdicts else "OK")
    return 1 if verdicts else 0


def suite(kind: str, device: str, world: Any) -> list[str]:
    """Three pushes and a verified one on the ranks of ``world``; this rank's failures."""
    import torch

    W = world.Get_size()
    S = W // 2
    t = make_transport(kind, world)
    r = t.rank
    staging.MIN_ROW_BYTES = 1  # small test arrays: index ops for every run of one tensor's transfers
    src, dst = layouts(W, S)
    plan = plan_transfers(src, dst, dst_domain_size=W - S, split_bytes=64)
    sched = build_schedule(plan, 4096)
    dev = torch.device("cuda", r % torch.cuda.device_count()) if device == "cuda" else torch.device("cpu")
    types = {c.tensor(f): a.data_type for f, a in (src if r < S else dst).arrays.items() for c in a.chunks}

    def to_torch(a: np.ndarray, name: str) -> Any:
        flat = torch.from_numpy(byte_view(a).reshape(-1).copy())
        return flat.view(getattr(torch, types[name])).reshape(a.shape).to(dev)

    tensors = {n: to_torch(a, n) for n, a in local_tensors(src, dst, r, S, 1).items()}
    ptrs = {n: v.data_ptr() for n, v in tensors.items()}
    ops = FakeDeviceOps(1e-4) if device == "fake" else None
    ex = Executor(t, plan, sched, tensors, timeout=60, device_ops=ops)
    try:
        fails = push_three_times(ex, tensors, src, dst, r, S, dev)
        if {n: v.data_ptr() for n, v in tensors.items()} != ptrs:
            fails.append(f"rank {r}: a local tensor was reallocated")
        ex.verify = True
        ex.run()  # verify: every region's checksum compared on the receiver
        fails += check(tensors, dst, r, S, 3, "verify push")
    except Exception as e:  # noqa: BLE001 - every rank reports, then all exit together
        fails = [f"rank {r}: {type(e).__name__}: {e}"]
    if ops is not None:
        ops.close()
    # index ops on both sides: fused experts put many regions of one tensor in a message
    gathers = [sum(isinstance(step, staging._Gather) for (_, on_send), p in ex._programs.items() if on_send == send
                   for step in p.steps) for send in (True, False)]
    every = world.allgather(gathers)
    if r == 0 and not (sum(g[0] for g in every) and sum(g[1] for g in every)):
        fails.append(f"no index ops on some side (senders', receivers' per rank: {every})")
    t.close()
    return fails


def push_three_times(ex: Executor, tensors: dict[str, Any], src: Any, dst: Any, r: int, S: int, dev: Any) -> list[str]:
    import torch

    fails: list[str] = []
    stager = ex._stager
    if stager is None:
        return [f"rank {r}: the executor does not stage {dev} tensors"]
    slots = [b.data_ptr() for b in stager.host + stager.device]
    counts = []
    for step in (1, 2, 3):
        for n, v in local_tensors(src, dst, r, S, step).items():  # new weights in the same storage
            tensors[n].view(-1).view(torch.uint8).copy_(torch.from_numpy(byte_view(v).reshape(-1)))
        cuda_allocs = _cuda_allocs(dev)
        st = ex.run()
        counts.append((stager.ops.allocations, _cuda_allocs(dev) - cuda_allocs))
        if st.staged_bytes != st.bytes_sent + st.bytes_received:
            fails.append(f"rank {r}: push {step} staged {st.staged_bytes} B, moved {st.bytes_sent + st.bytes_received}")
        fails += check(tensors, dst, r, S, step, f"push {step}")
    if counts[1:] != [(counts[0][0], 0)] * 2:
        fails.append(f"rank {r}: allocations after each push (device ops, CUDA allocator during the push): {counts}")
    if [b.data_ptr() for b in stager.host + stager.device] != slots:
        fails.append(f"rank {r}: the bucket slots moved")
    return fails


def _cuda_allocs(dev: Any) -> int:
    import torch

    return int(torch.cuda.memory_stats(dev).get("allocation.all.allocated", 0)) if dev.type == "cuda" else 0


def check(tensors: dict[str, Any], dst: Any, r: int, S: int, step: int, what: str) -> list[str]:
    if r < S:
        return []
    fails = []
    for name, regions in expected(dst, r - S, step).items():
        host = byte_view(tensors[name].cpu())  # whole tensor: no device temporary
        for sl, want in regions:
            if not np.array_equal(host[sl].reshape(-1), byte_view(np.ascontiguousarray(want)).reshape(-1)):
                fails.append(f"rank {r}: {what}: {name}{sl} differs from the oracle")
    return fails


if __name__ == "__main__":
    rc = main(sys.argv[1], sys.argv[2])
    gc.freeze()  # exit without a last collection over the heap (torch's: 0.3 CPU-s a rank)
    sys.exit(rc)
