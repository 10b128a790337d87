"""In-process transport for tests: N endpoints share a hub; each rank runs in its own thread.

It records every message (``hub.log``) and can corrupt one in flight (``hub.corrupt``) so tests
can prove that ``--verify`` catches it.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from formats.errors import PeerTimeoutError
from streamer.transport.base import HostBuffers

__all__ = ["LoopbackHub", "LoopbackTransport"]


class LoopbackHub:
    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Condition()
        self.queues: dict[tuple[int, int, int], deque[bytes]] = defaultdict(deque)
        # receives posted and not yet matched, per (src, dst, tag): like MPI, messages match
        # receives in the order the receives were posted, whatever order they are tested in
        self.posted: dict[tuple[int, int, int], deque[_Req]] = defaultdict(deque)
        self.log: list[tuple[int, int, int, int]] = []  # (src, dst, tag, nbytes)
        self.corrupt: Callable[[int, int, int, bytearray], None] | None = None
        self._coll: dict[tuple[str, tuple[int, ...], int], dict[int, bytes]] = defaultdict(dict)
        self._coll_seq: dict[tuple[int, str, tuple[int, ...]], int] = defaultdict(int)
        self.dead: set[int] = set()

    def endpoints(self) -> list[LoopbackTransport]:
        return [LoopbackTransport(self, r) for r in range(self.size)]


class _Req:
    def __init__(self, t: LoopbackTransport, kind: str, peer: int, tag: int, buf: Any) -> None:
        self.t, self.kind, self.peer, self.tag, self.buf = t, kind, peer, tag, buf
        self.done = kind == "send"

    def test(self) -> bool:
        if self.done:
            return True
        hub = self.t.hub
        key = (self.peer, self.t.rank, self.tag)
        with hub.lock:
            q = hub.queues.get(key)
            posted = hub.posted.get(key)
            if not q or not posted or posted[0] is not self:
                return False
            data = q.popleft()
            posted.popleft()
        dst = np.frombuffer(memoryview(self.buf).cast("B"), dtype=np.uint8) if not isinstance(
            self.buf, np.ndarray) else self.buf.reshape(-1).view(np.uint8)
        if len(data) != dst.size:
            raise ValueError(f"loopback: message of {len(data)} bytes from rank {self.peer} tag {self.tag} "
                             f"does not fit a {dst.size}-byte buffer")
        dst[:] = np.frombuffer(data, dtype=np.uint8)
        self.done = True
        return True

    def cancel(self) -> None:
        if not self.done and self.kind == "recv":
            hub = self.t.hub
            with hub.lock:
                posted = hub.posted.get((self.peer, self.t.rank, self.tag))
                if posted is not None and self in posted:
                    posted.remove(self)
        self.done = True


class LoopbackTransport(HostBuffers):
    name = "loopback"

    def __init__(self, hub: LoopbackHub, rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self.size = hub.size

    def isend(self, buf: Any, dst: int, tag: int) -> _Req:
        data = bytearray(np.ascontiguousarray(buf).reshape(-1).view(np.uint8).tobytes()
                         if isinstance(buf, np.ndarray) else bytes(memoryview(buf).cast("B")))
        hub = self.hub
        if hub.corrupt is not None:
            hub.corrupt(self.rank, dst, tag, data)
        with hub.lock:
            if dst not in hub.dead:
                hub.queues[(self.rank, dst, tag)].append(bytes(data))
            hub.log.append((self.rank, dst, tag, len(data)))
        return _Req(self, "send", dst, tag, None)

    def irecv(self, buf: Any, src: int, tag: int) -> _Req:
        req = _Req(self, "recv", src, tag, buf)
        with self.hub.lock:
            self.hub.posted[(src, self.rank, tag)].append(req)
        return req

    def _collective(self, kind: str, data: bytes, timeout: float,
                    members: Sequence[int] | None = None) -> dict[int, bytes]:
        hub = self.hub
        group = tuple(sorted(members)) if members is not None else tuple(range(self.size))
        # numbered per (rank, kind, members): a collective of a subset leaves the others' count alone
        seq_key = (self.rank, kind, group)
        seq = hub._coll_seq[seq_key]
        hub._coll_seq[seq_key] += 1
        key = (kind, group, seq)
        deadline = time.monotonic() + timeout
        with hub.lock:
            hub._coll[key][self.rank] = data
            hub.lock.notify_all()
            while len(hub._coll[key]) < len(group):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(group) - set(hub._coll[key]))
                    raise PeerTimeoutError(f"timed out after {timeout:g} s waiting for rank(s) "
                                           f"{', '.join(map(str, missing))} in {kind}")
                hub.lock.wait(min(left, 0.05))
            return dict(hub._coll[key])

    def barrier(self, timeout: float) -> None:
        self._collective("barrier", b"", timeout)

    def allgather_bytes(self, data: bytes, timeout: float) -> list[bytes]:
        got = self._collective("allgather", data, timeout)
        return [got[r] for r in range(self.size)]

    def bcast_bytes(self, data: bytes | None, root: int, timeout: float) -> bytes:
        got = self._collective(f"bcast{root}", data or b"", timeout)
        return got[root]

    def bcast_buffer(self, buf: Any, root: int, ranks: Sequence[int], timeout: float) -> None:
        flat = buf.reshape(-1).view(np.uint8)
        got = self._collective(f"bcast_buffer{root}", flat.tobytes() if self.rank == root else b"", timeout, ranks)
        if self.rank != root:
            flat[:] = np.frombuffer(got[root], dtype=np.uint8)

    def close(self) -> None:
        pass
