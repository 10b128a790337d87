"""The delta codec's threads: one pool per process, sized to this rank's share of its host.

A delta message is XOR-scanned and compressed in pieces (``FRAME`` bytes of Zstd each), so a
rank encodes and decodes with several cores. The pieces run on a thread pool: numpy's XOR and
copies and numcodecs' Zstd release the GIL, so threads scale where processes would copy. How
many threads a rank uses: ``SHARDSTREAM_CODEC_THREADS`` when set, else the cores this process
may run on divided by the ranks of its own job on its host (eight trainer ranks on one node
share its cores; a lone receiver process takes them all).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from formats.errors import UsageError

__all__ = ["ENV", "FRAME", "codec_threads", "job_threads", "pmap"]

#: raw bytes per Zstd frame of a framed delta: large enough that Zstd's level-1 window (1 MiB)
#: loses nothing at the seams, small enough that a 64 MiB bucket gives 16 pieces to share out
FRAME = 4 << 20
ENV = "SHARDSTREAM_CODEC_THREADS"

T = TypeVar("T")
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def codec_threads(local_ranks: int = 1) -> int:
    """Threads for this rank's codec: ``SHARDSTREAM_CODEC_THREADS``, else its share of the
    cores (``local_ranks``: ranks of its job on its host)."""
    env = os.environ.get(ENV)
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise UsageError(f"{ENV} must be a number of threads >= 1, got {env!r}")
        return n
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_ranks))


def job_threads(hosts: tuple[str, ...], rank: int, n_send: int) -> int:
    """``codec_threads`` of ``rank`` in a session whose ranks run on ``hosts`` (senders first,
    ``n_send`` of them): its job's ranks on its host share the cores."""
    job = range(n_send) if rank < n_send else range(n_send, len(hosts))
    return codec_threads(sum(1 for r in job if hosts[r] == hosts[rank]) if hosts else 1)


def pmap(fn: Callable[[Any], T], items: Sequence[Any], threads: int) -> list[T]:
    """``[fn(x) for x in items]`` on up to ``threads`` threads, in order; the first exception
    raised by any piece is raised here (after every piece ended: none writes on after a return)."""
    k = min(threads, len(items))
    if k <= 1:
        return [fn(x) for x in items]
    out: list[Any] = [None] * len(items)

    def lane(j: int) -> None:  # one task per thread: never more than ``threads`` at once
        for i in range(j, len(items), k):
            out[i] = fn(items[i])

    futures = [_executor(k).submit(lane, j) for j in range(k)]
    errors = [f.exception() for f in futures]  # waits for each: no piece outlives the call
    for e in errors:
        if e is not None:
            raise e
    return out


def _executor(threads: int) -> ThreadPoolExecutor:
    """The process's pool, grown (never shrunk) to ``threads``."""
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < threads:
            old = _pool
            _pool, _pool_size = ThreadPoolExecutor(threads, thread_name_prefix="shardstream-codec"), threads
            if old is not None:
                old.shutdown(wait=False)
        return _pool
