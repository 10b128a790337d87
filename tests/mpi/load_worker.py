"""200 pushes over one RefitSession (run under ``mpiexec -n S+D``; ranks < S send).

Senders XOR their tensors with a per-step byte before every push; receivers zero theirs,
pull, and compare with the expected bytes (their layout converted from the same checkpoint,
XORed the same way). Records RSS and open file descriptors at push 10 and at the last push.
Prints one JSON line on rank 0.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import numpy as np
from mpi4py import MPI

from formats.manifest.wire import load_manifest
from streamer.refit.options import RefitOptions
from streamer.refit.persist import alloc_local, load_local
from streamer.refit.session import RefitSession
from streamer.transport.jobs import Group


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(train: str, serve: str, expected: str, senders: int, steps: int) -> int:
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    role = "send" if rank < senders else "recv"
    role_comm = world.Split(0 if role == "send" else 1, rank)
    group = Group.from_mpi(world, role_comm, role, senders, world.Get_size() - senders)
    rr = role_comm.Get_rank()
    m = load_manifest(train if role == "send" else serve)
    tensors = load_local(m, rr) if role == "send" else alloc_local(m, rr)
    want = load_local(load_manifest(expected), rr) if role == "recv" else {}
    sess = RefitSession.open(m, role, group=group, timeout=60, options=RefitOptions(bucket_size=1 << 16))
    bad = 0
    marks: dict[int, tuple[int, int]] = {}
    for step in range(1, steps + 1):
        x = np.uint8(step % 251 + 1)
        if role == "send":
            for v in tensors.values():
                b = v.reshape(-1).view(np.uint8)
                b ^= x
            sess.push(tensors)
            for v in tensors.values():
                b = v.reshape(-1).view(np.uint8)
                b ^= x  # back to the base values
        else:
            for v in tensors.values():
                v[...] = 0
            sess.pull(tensors)
            for n, v in tensors.items():
                if not np.array_equal(v.reshape(-1).view(np.uint8), want[n].reshape(-1).view(np.uint8) ^ x):
                    bad += 1
        if step in (10, steps):
            marks[step] = (rss(), len(os.listdir("/proc/self/fd")))
    res = world.gather({"rank": rank, "bad": bad, "rss10": marks[10][0], "rss_end": marks[steps][0],
                        "fd10": marks[10][1], "fd_end": marks[steps][1]}, root=0)
    if rank == 0:
        print(json.dumps({"steps": steps, "ranks": res}))
    return 0


if __name__ == "__main__":
    rc = main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    gc.freeze()  # exit without a last collection over the heap (torch's: 0.3 CPU-s a rank)
    sys.exit(rc)
