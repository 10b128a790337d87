"""Under mpiexec: rank ``absent`` stays out of an allgather; every other rank must fail within its
timeout with PeerTimeoutError naming exactly that rank (the roll call has no coordinator, so it
works when rank 0 is the one missing). Prints OK on each rank that checked."""

from __future__ import annotations

import gc
import sys
import time

from mpi4py import MPI

from formats.errors import PeerTimeoutError
from streamer.transport.mpi import MPITransport


def main(absent: int) -> int:
    t = MPITransport(MPI.COMM_WORLD)
    if t.rank == absent:
        time.sleep(8.0)  # longer than the others' timeout plus the roll call
        print("OK", flush=True)
        return 0
    t0 = time.monotonic()
    try:
        t.allgather_bytes(b"x", timeout=2.0)
    except PeerTimeoutError as e:
        took = time.monotonic() - t0
        msg = str(e)
        want = f"rank {absent} did not arrive"
        if want not in msg or took > 8.0:
            print(f"rank {t.rank}: wanted {want!r} within 8 s, got after {took:.1f} s: {msg}", flush=True)
            return 1
        print("OK", flush=True)
        return 0
    print(f"rank {t.rank}: the allgather completed without rank {absent}", flush=True)
    return 1


if __name__ == "__main__":
    rc = main(int(sys.argv[1]))
    gc.freeze()  # exit without a last collection over the heap (torch's: 0.3 CPU-s a rank)
    sys.exit(rc)
