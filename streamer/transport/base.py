"""The Transport protocol every byte mover implements, and the timed wait they share.

A transport moves byte buffers between the ranks of one group (the merged trainer + inference
group in a refit). The executor and the refit session use nothing but this protocol:

- point-to-point ``isend`` / ``irecv`` of byte buffers, polled with ``Request.test``;
- ``byte_view`` / ``alloc``: buffers in the transport's own kind (numpy in host memory for MPI,
  torch tensors for gloo and NCCL, on ``device``), so callers never ask which transport it is;
- small host-side collectives (``barrier``, ``allgather_bytes``, ``bcast_bytes``) and
  ``control``, the transport that carries small host messages (checksums): a GPU transport
  cannot carry numpy arrays;
- ``bcast_buffer``: one native broadcast of a buffer inside a subset of ranks, for the
  gather-broadcast baseline, so that the baseline runs on every transport;
- ``poll_abort``: the reason another rank gave up, if it posted one (store control plane), so
  that a failure on one rank ends every rank promptly.

Every blocking operation takes an explicit timeout; a peer that does not answer becomes a
``PeerTimeoutError`` naming it, never a hang.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from formats.errors import PeerTimeoutError, TransportError

__all__ = ["HostBuffers", "RemoteAbortError", "Request", "Transport", "wait_all"]


class RemoteAbortError(TransportError):
    """Another rank gave up and said why; ``exit_code`` is the one it exits with."""

    def __init__(self, message: str, exit_code: int = 3) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class PeerClosedError(RemoteAbortError):
    """The sender job closed the session for good (store plane): a waiting receiver ends cleanly."""

    def __init__(self, message: str = "the sender job closed the session") -> None:
        super().__init__(message, 0)


class Request(Protocol):
    """A pending send or receive."""

    peer: int
    kind: str  # "send" | "recv" | "collective"

    def test(self) -> bool: ...
    def cancel(self) -> None: ...


class Transport(Protocol):
    rank: int
    size: int
    name: str
    #: where buffers live: None for host memory, else a torch device
    device: Any

    @property
    def control(self) -> Transport: ...

    def byte_view(self, tensor: Any) -> Any: ...
    def alloc(self, nbytes: int) -> Any: ...
    def isend(self, buf: Any, dst: int, tag: int) -> Request: ...
    def irecv(self, buf: Any, src: int, tag: int) -> Request: ...
    def barrier(self, timeout: float) -> None: ...
    def allgather_bytes(self, data: bytes, timeout: float) -> list[bytes]: ...
    def bcast_bytes(self, data: bytes | None, root: int, timeout: float) -> bytes: ...
    def bcast_buffer(self, buf: Any, root: int, ranks: Sequence[int], timeout: float) -> None: ...
    def poll_abort(self) -> RemoteAbortError | None: ...
    def post_abort(self, message: str, exit_code: int) -> None: ...
    def close(self) -> None: ...


class HostBuffers:
    """Buffers in host memory as numpy uint8 arrays (MPI, loopback, store control)."""

    device: Any = None

    @property
    def control(self) -> Any:
        return self

    def byte_view(self, tensor: Any) -> np.ndarray:
        from streamer.ops.buffers import byte_view

        return byte_view(tensor)

    def alloc(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def poll_abort(self) -> RemoteAbortError | None:
        return None

    def post_abort(self, message: str, exit_code: int) -> None:
        """Nothing to post: MPI jobs end together through ``MPI_Abort`` (``jobs.abort``)."""


#: how often a long wait asks the transport whether another rank gave up (seconds)
ABORT_POLL_INTERVAL = 0.25


def wait_all(reqs: Sequence[Request], timeout: float, what: str = "transfer",
             names: Callable[[int], str] | None = None, transport: Transport | None = None) -> None:
    """Poll ``reqs`` until all complete; raise ``PeerTimeoutError`` naming the silent peers.

    Polling backs off from 0 to 1 ms so a busy wait does not starve the peers we share cores
    with. With ``transport``, a wait also ends when another rank posted an abort.
    """
    pending = list(reqs)
    start = time.monotonic()
    deadline = start + timeout
    next_abort_poll = start + ABORT_POLL_INTERVAL
    sleep = 0.0
    while pending:
        pending = [r for r in pending if not r.test()]
        if not pending:
            return
        now = time.monotonic()
        if transport is not None and now > next_abort_poll:
            next_abort_poll = now + ABORT_POLL_INTERVAL
            err = transport.poll_abort()
            if err is not None:
                raise err
        if now > deadline:
            peers = sorted({r.peer for r in pending})
            label = names or (lambda p: f"rank {p}")
            kinds = sorted({r.kind for r in pending})
            raise PeerTimeoutError(
                f"timed out after {timeout:g} s waiting for {', '.join(label(p) for p in peers)} "
                f"({'/'.join(kinds)} of {what} not completed; the peer died, hung or never arrived)")
        if sleep:
            time.sleep(sleep)
        sleep = min(1e-3, sleep + 5e-5)
