"""Colocated refit through ``RefitSession`` over a one-sided transport, run under mpiexec:
``mpiexec -n N python tests/mpi/ipc_worker.py shm|cuda-ipc`` (the first N//2 ranks train, the
others serve; N=2 puts one of each on one GPU). Prints OK on rank 0.

Three pushes of changing torch tensors (CPU for shm, on the GPU for cuda-ipc) with large regions
sent in place and small ones packed; every receiver checks each push byte for byte against the
oracle and that its tensors kept their data pointers (written in place: CUDA graphs stay valid).
With shm, no segment stays open or mapped in any rank after the session closes.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from formats.layouts import apply_layout, manifest_from_arrays, parse_mesh, parse_rule
from formats.manifest.dtypes import DTYPES, np_storage
from streamer.refit.options import RefitOptions
from streamer.refit.session import RefitSession

# w: 1 KiB rows (large shards go in place); v split by columns on one side (packed)
ARRAYS = {"w": ((1024, 256), "float32"), "v": ((96, 64), "bfloat16"), "n": ((96,), "bfloat16"), "s": ((), "int64")}


def oracle(shape: tuple[int, ...], dt: str, step: int) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt].itemsize
    raw = ((np.arange(n, dtype=np.uint64) * 7 + np.uint64(step * 13)) % np.uint64(251)).astype(np.uint8)
    return raw.view(np_storage(DTYPES[dt])).reshape(shape)


def host_bytes(t: Any) -> np.ndarray:
    import torch

    return t.detach().reshape(-1).view(torch.uint8).cpu().numpy()


def fill(t: Any, data: np.ndarray) -> None:
    """Write ``data``'s bytes into tensor (view) ``t`` in place (its device, its dtype)."""
    import torch

    t.copy_(torch.from_numpy(np.array(data)).view(t.dtype).to(t.device))  # np.array keeps 0-d shapes


def main(kind: str) -> int:
    import torch

    world = MPI.COMM_WORLD
    W, rank = world.Get_size(), world.Get_rank()
    S = max(1, W // 2)
    role = "send" if rank < S else "recv"
    base = manifest_from_arrays(ARRAYS)
    ms, md = parse_mesh(f"tp={S}"), parse_mesh(f"tp={W - S}")
    src = apply_layout(base, ms, [parse_rule("w=S(0)", ms), parse_rule("v=S(1)", ms)], file_pattern=None)
    dst = apply_layout(base, md, [parse_rule("w=S(0)", md), parse_rule("v=S(0)", md)], file_pattern=None)
    mine = src if role == "send" else dst
    local = rank if role == "send" else rank - S
    fails: list[str] = []
    with RefitSession.open(mine, role, transport=kind, timeout=60,
                           options=RefitOptions(bucket_size=256 << 10)) as s:
        dev = s._t.device or "cpu"
        tensors = {n: torch.zeros(tuple(spec.shape), dtype=getattr(torch, spec.data_type), device=dev)
                   for n, spec in mine.local_tensors(local).items()}
        ptrs = {n: t.data_ptr() for n, t in tensors.items()}
        for step in range(3):
            full = {n: oracle(sh, dt, step) for n, (sh, dt) in ARRAYS.items()}
            if role == "send":
                for fqn, _a, c in src.iter_chunks():
                    if local in c.holders:
                        fill(tensors[c.tensor(fqn)][c.local_box.slices], full[fqn][c.region.slices])
                s.push(tensors)
            else:
                s.pull(tensors)
                fails += check(dst, local, tensors, full, step)
            if {n: t.data_ptr() for n, t in tensors.items()} != ptrs:
                fails.append(f"rank {rank}: step {step}: a local tensor moved (data pointer changed)")
        moved = sum(st.bytes_received + st.bytes_sent for st in s.steps)
    if kind == "shm":
        fails += leftover_segments(rank)
    verdicts = [f for fs in world.allgather(fails) for f in fs]
    total = world.allreduce(moved)
    if rank == 0:
        print("\n".join(verdicts) if verdicts else f"moved {total} bytes\nOK")
    return 1 if verdicts else 0


def check(dst: Any, local: int, tensors: dict[str, Any], full: dict[str, np.ndarray], step: int) -> list[str]:
    bad = []
    for fqn, _a, c in dst.iter_chunks():
        if local in c.holders:
            got = host_bytes(tensors[c.tensor(fqn)][c.local_box.slices].contiguous())
            want = np.ascontiguousarray(full[fqn][c.region.slices]).reshape(-1).view(np.uint8)
            if not np.array_equal(got, want):
                bad.append(f"receiver {local}: step {step}: {fqn} region {c.region} differs from the oracle")
    return bad


def leftover_segments(rank: int) -> list[str]:
    import gc

    gc.collect()
    left = [f for f in os.listdir("/proc/self/fd") if "memfd:shardstream" in _link(f)]
    maps = [m for m in Path("/proc/self/maps").read_text().splitlines() if "memfd:shardstream" in m]
    return [f"rank {rank}: {len(left)} segment descriptors and {len(maps)} mappings left after close"] if left or maps \
        else []


def _link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


if __name__ == "__main__":
    rc = main(sys.argv[1])
    gc.freeze()  # exit without a last collection over the heap (torch's: 0.3 CPU-s a rank)
    sys.exit(rc)
