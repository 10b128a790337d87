"""One size-agnostic transport test body, run under mpiexec for each transport:
``mpiexec -n N python tests/mpi/transport_worker.py mpi|gloo|nccl|shm|cuda-ipc``. Prints OK on rank 0.
With N > 4 the suite runs twice: on all N ranks, then on the first 4 (another sender/receiver split).

Checks, collect-then-assert style (every rank reaches the same verdict):
control collectives, a real plan executed byte-exact (with phase-2 forwarding and verify), and a
receive that no one answers failing with PeerTimeoutError within its timeout.
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from formats.errors import PeerTimeoutError
from formats.layouts import apply_layout, manifest_from_arrays, parse_mesh, parse_rule
from formats.manifest.dtypes import DTYPES, np_storage
from streamer.execute.executor import Executor
from streamer.execute.schedule import build_schedule
from streamer.plan.planner import plan_transfers


def oracle(shape: tuple[int, ...], dt: str) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    return (np.arange(n, dtype=np.uint64) % 256).astype(np_storage(DTYPES[dt])).reshape(shape)


def main(kind: str) -> int:
    """The suite on every rank, then (more than 4 ranks) again on the first 4: another split of
    senders and receivers, in the same launch, so each rank starts Python (and torch) once."""
    world = MPI.COMM_WORLD
    if kind == "gloo":  # like a trainer: the default group exists and stays the trainer's
        import torch.distributed as dist

        from streamer.transport.torch_dist import free_port

        port = world.bcast(free_port() if world.Get_rank() == 0 else None, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.Get_rank(),
                                world_size=world.Get_size())
    fails = suite(kind, world)
    if world.Get_size() > 4:
        sub = world.Split(0 if world.Get_rank() < 4 else MPI.UNDEFINED, world.Get_rank())
        if sub != MPI.COMM_NULL:
            fails += [f"[4 of {world.Get_size()} ranks] {f}" for f in suite(kind, sub)]
            sub.Free()
    # the bulk groups are shardstream's own: the default group still works, unchanged
    if kind in ("gloo", "nccl") and torch_dist_default_ok() is False:  # shm ranks never import torch
        fails.append(f"rank {world.Get_rank()}: the default process group no longer works after the pushes")
    verdicts = [f for fs in world.allgather(fails) for f in fs]
    if world.Get_rank() == 0:
        print("\n".join(verdicts) if verdicts else "OK")
    return 1 if verdicts else 0


def suite(kind: str, world: Any) -> list[str]:
    """Every check on the ranks of ``world``, on a transport of its own; this rank's failures."""
    W = world.Get_size()
    S = W // 2
    if kind == "mpi":
        from streamer.transport.mpi import MPITransport

        t = MPITransport(world)
    elif kind in ("shm", "cuda-ipc"):  # one-sided copies between the ranks of this node
        from streamer.transport.handles import HandleTransport
        from streamer.transport.mpi import MPITransport

        if kind == "shm":
            from streamer.transport.shm import ShmBackend

            backend: Any = ShmBackend()
        else:
            from streamer.transport.cuda_ipc import CudaIpcBackend

            backend = CudaIpcBackend.for_rank(world.Get_rank())
        t = HandleTransport(backend, MPITransport(world))
    else:
        from streamer.transport.mpi import MPITransport
        from streamer.transport.torch_dist import TorchDistTransport

        t = TorchDistTransport(MPITransport(world), kind, timeout=60)
    r = t.rank
    fails: list[str] = []
    # control plane
    got = t.allgather_bytes(f"r{r}".encode() * (r + 1), 20)
    if got != [f"r{i}".encode() * (i + 1) for i in range(W)]:
        fails.append(f"rank {r}: allgather_bytes wrong")
    # payloads around the MPI transport's one-collective slot (512 bytes): some ranks' spill over
    long = [bytes(range(i, i + 1)) * (300 * i) for i in range(W)]
    if t.allgather_bytes(long[r], 20) != long:
        fails.append(f"rank {r}: allgather_bytes of long payloads wrong")
    if t.bcast_bytes(b"hello" if r == 1 % W else None, 1 % W, 20) != b"hello":
        fails.append(f"rank {r}: bcast_bytes wrong")
    t.barrier(20)
    # a real plan: S senders (dp x tp) -> W-S receivers (tp, one domain => phase 2 for replicas)
    arrays = {"w": ((37, 24), "bfloat16"), "v": ((24, 13), "float32"), "s": ((), "int64"), "b": ((6, 5, 4), "bool")}
    base = manifest_from_arrays(arrays)
    ms = parse_mesh(f"dp={2 if S % 2 == 0 else 1},tp={S // (2 if S % 2 == 0 else 1)}")
    md = parse_mesh(f"dp=2,tp={(W - S) // 2}") if (W - S) % 2 == 0 else parse_mesh(f"tp={W - S}")
    src = apply_layout(base, ms, [parse_rule("w=R,S(0)", ms), parse_rule("v=R,S(1)", ms)], file_pattern=None)
    dst_rules = [parse_rule("w=" + ",".join(["R"] * (md.ndim - 1) + ["S(1)"]), md),
                 parse_rule("b=" + ",".join(["R"] * (md.ndim - 1) + ["S(2)"]), md)]
    dst = apply_layout(base, md, dst_rules, file_pattern=None)
    plan = plan_transfers(src, dst, dst_domain_size=W - S, split_bytes=64)
    sched = build_schedule(plan, 128)
    full = {n: oracle(s, dt) for n, (s, dt) in arrays.items()}
    if r < S:
        tensors = {}
        for fqn, a, c in src.iter_chunks():
            if r in c.holders:
                sl = tuple(slice(o, o + s) for o, s in zip(c.region.offsets, c.region.sizes))
                tensors[c.tensor(fqn)] = np.array(full[fqn][sl], copy=True)
    else:
        tensors = {n: np.zeros(ts.shape, np_storage(DTYPES[ts.data_type])) for n, ts in dst.local_tensors(r - S).items()}
    if kind in ("nccl", "cuda-ipc"):  # GPU memory
        import torch

        tensors = {n: torch.from_numpy(v).to(t.device) for n, v in tensors.items()}

    def host(x: object) -> np.ndarray:
        return x if isinstance(x, np.ndarray) else x.cpu().numpy()  # type: ignore[attr-defined]

    for step in range(3):  # the same executor, several pushes
        Executor(t, plan, sched, tensors, timeout=30, verify=True).run()
        if r >= S:
            for fqn, a, c in dst.iter_chunks():
                if r - S in c.holders:
                    sl = tuple(slice(o, o + s) for o, s in zip(c.region.offsets, c.region.sizes))
                    lsl = tuple(slice(o, o + s) for o, s in zip(c.local_offsets, c.region.sizes))
                    if not np.array_equal(host(tensors[c.tensor(fqn)])[lsl], full[fqn][sl]):
                        fails.append(f"rank {r}: step {step}: {fqn} chunk {c.region} differs from the oracle")
            for v in tensors.values():
                v[...] = 0  # numpy and torch both accept this
    t.barrier(20)
    # a receive nobody answers must time out, naming the peer (MPI only: torch has no cancel)
    if kind == "mpi" and r == 0:
        from streamer.transport.base import wait_all

        buf = np.zeros(4, np.uint8)
        req = t.irecv(buf, W - 1, 999)
        t0 = time.monotonic()
        try:
            wait_all([req], 1.0, "probe")
            fails.append("rank 0: a receive nobody answers completed")
        except PeerTimeoutError as e:
            if f"rank {W - 1}" not in str(e) or time.monotonic() - t0 > 5:
                fails.append(f"rank 0: bad timeout: {e}")
        req.cancel()
    # the baseline's native broadcast among a subset of ranks
    members = [0] + list(range(S, W))
    if r in members:
        buf = np.arange(16, dtype=np.uint8) if r == 0 else np.zeros(16, np.uint8)
        gpu = kind in ("nccl", "cuda-ipc")
        t.bcast_buffer(buf if not gpu else __import__("torch").from_numpy(buf).to(t.device), 0, members, 20)
        if not gpu and not np.array_equal(buf, np.arange(16, dtype=np.uint8)):
            fails.append(f"rank {r}: bcast_buffer wrong")
    t.close()
    return fails


def torch_dist_default_ok() -> bool | None:
    """None when no default group exists; else whether an all_reduce on it still works."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    x = torch.ones(1)
    dist.all_reduce(x)
    return bool(x.item() == dist.get_world_size())


if __name__ == "__main__":
    rc = main(sys.argv[1])
    gc.freeze()  # exit without a last collection over the heap (torch's: 0.3 CPU-s a rank)
    sys.exit(rc)
