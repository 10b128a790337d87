"""The Transport protocol every byte mover implements, and the timed wait they share.

A transport moves byte buffers between the ranks of one group (the merged trainer + inference
group in a refit). Every blocking operation takes an explicit timeout; a peer that does not
answer becomes a ``PeerTimeoutError`` naming it, never a hang.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from formats.errors import PeerTimeoutError

__all__ = ["Request", "Transport", "wait_all"]


class Request(Protocol):
    """A pending send or receive."""

    peer: int
    kind: str  # "send" | "recv"

    def test(self) -> bool: ...
    def cancel(self) -> None: ...


class Transport(Protocol):
    rank: int
    size: int
    name: str

    def isend(self, buf: Any, dst: int, tag: int) -> Request: ...
    def irecv(self, buf: Any, src: int, tag: int) -> Request: ...
    def barrier(self, timeout: float) -> None: ...
    def allgather_bytes(self, data: bytes, timeout: float) -> list[bytes]: ...
    def bcast_bytes(self, data: bytes | None, root: int, timeout: float) -> bytes: ...
    def close(self) -> None: ...


def wait_all(reqs: Sequence[Request], timeout: float, what: str = "transfer",
             names: Any = None) -> None:
    """Poll ``reqs`` until all complete; raise ``PeerTimeoutError`` naming the silent peers.

    Polling backs off from 0 to 1 ms so a busy wait does not starve the peers we share cores with.
    """
    pending = list(reqs)
    deadline = time.monotonic() + timeout
    sleep = 0.0
    while pending:
        pending = [r for r in pending if not r.test()]
        if not pending:
            return
        if time.monotonic() > deadline:
            peers = sorted({r.peer for r in pending})
            label = (lambda p: names(p)) if names else (lambda p: f"rank {p}")
            kinds = sorted({r.kind for r in pending})
            raise PeerTimeoutError(
                f"timed out after {timeout:g} s waiting for {', '.join(label(p) for p in peers)} "
                f"({'/'.join(kinds)} of {what} not completed; the peer died, hung or never arrived)")
        if sleep:
            time.sleep(sleep)
        sleep = min(1e-3, sleep + 5e-5)
