"""One-sided transports for ranks on one node: the sender exposes its buffer, the receiver copies.

``HandleTransport`` implements the ``Transport`` protocol over a memory ``Backend`` and a small
control channel (the group's MPI communicator, or gloo on the store plane):

- ``isend(buf, dst, tag)``: the backend *exposes* ``buf`` (a segment the peer can map, and where
  ``buf`` starts in it); once the bytes are ready (a CUDA event), a fixed-size header (sequence
  number, segment, offset, length; the segment's descriptor the first time it travels on this
  stream) goes to ``dst`` over the control channel. The send completes when ``dst`` acks, so the
  caller may then reuse ``buf``.
- ``irecv(buf, src, tag)``: waits for that header, maps the peer's segment (once per session:
  the mapping is cached), copies the bytes into ``buf`` (its own memory, written in place) and
  acks once the copy is complete.

Every wait is the caller's polling loop (``Request.test``), so the executor's timeouts and
abort polling apply unchanged. Headers and acks match in post order per (peer, tag) stream,
like MPI messages; a request whose turn has not come waits for the earlier ones, so they stay
in that order even when tested out of order.

Backends: ``shm`` (host memory in memfd segments, numpy copies; the CPU twin that tests this
logic everywhere) and ``cuda-ipc`` (CUDA IPC handles of device memory, device-to-device copies).
``colocated.open_handle_transport`` builds one, or refuses when the ranks span several nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from formats.errors import TransportError
from streamer.transport.base import RemoteAbortError, Request, Transport, wait_all

__all__ = ["ACK_TAG_BASE", "HEADER_BYTES", "HEADER_TAG_BASE", "Backend", "Exposure", "HandleTransport"]

#: control tags: header of data tag t is HEADER_TAG_BASE + t, its ack ACK_TAG_BASE + t (data tags
#: stay below 2**16: phases 0..2, checksums 7, baseline 11, delta 17..18 and 4096..20479)
HEADER_TAG_BASE = 1 << 16
ACK_TAG_BASE = 1 << 17
#: a header: 6 int64 words, then the segment's descriptor (JSON) when it travels
HEADER_BYTES = 2048
_WORDS = 6
_MAGIC = 0x5353_4950
#: ack status words
_OK, _REFUSED = 0, 1


@dataclass
class Exposure:
    """A send buffer as a peer sees it: ``nbytes`` at ``offset`` of ``segment``."""

    segment: int
    offset: int
    nbytes: int
    #: how a peer maps the segment (sent once per stream)
    descriptor: bytes
    #: the backend's readiness token (a CUDA event; None: ready now)
    pending: Any = None
    #: the backend's staging segment to give back once the peer copied (shm, foreign buffers)
    staged: Any = None


class Backend(Protocol):
    """Memory that a process on the same node can map: allocation, exposure, mapping, copies."""

    name: str
    device: Any

    def byte_view(self, tensor: Any) -> Any: ...
    def alloc(self, nbytes: int) -> Any: ...
    def expose(self, buf: Any) -> Exposure: ...
    def ready(self, exp: Exposure) -> bool: ...
    def release(self, exp: Exposure) -> None: ...
    def attach(self, peer: int, segment: int, descriptor: bytes) -> None: ...
    def attached(self, peer: int, segment: int) -> bool: ...
    def copy(self, dst: Any, peer: int, segment: int, offset: int, nbytes: int) -> Any: ...
    def copied(self, token: Any) -> bool: ...
    def close(self) -> None: ...


def _flat_len(buf: Any) -> int:
    return int(buf.nbytes) if isinstance(buf, np.ndarray) else int(buf.numel() * buf.element_size())


class _Streams:
    """Per (peer, tag) stream: the next sequence number to hand out and the one whose turn it is."""

    def __init__(self) -> None:
        self.issued: dict[tuple[int, int], int] = {}
        self.turn: dict[tuple[int, int], int] = {}

    def issue(self, key: tuple[int, int]) -> int:
        seq = self.issued.get(key, 0)
        self.issued[key] = seq + 1
        return seq

    def my_turn(self, key: tuple[int, int], seq: int) -> bool:
        return self.turn.get(key, 0) == seq

    def advance(self, key: tuple[int, int]) -> None:
        self.turn[key] = self.turn.get(key, 0) + 1


class _Send:
    kind = "send"

    def __init__(self, t: HandleTransport, buf: Any, dst: int, tag: int) -> None:
        self.t, self.peer, self.tag = t, dst, tag
        self.key = (dst, tag)
        self.seq = t._out.issue(self.key)
        self.exp = t.backend.expose(buf) if _flat_len(buf) else None
        self.ack = np.zeros(2, dtype=np.int64)
        # posted now, in stream order: acks come back in that order
        self.ack_req = t.ctrl.irecv(self.ack, dst, ACK_TAG_BASE + tag)
        self.hdr_req: Request | None = None
        self.done = False

    def test(self) -> bool:
        if self.done:
            return True
        t = self.t
        if self.hdr_req is None:
            if not t._out.my_turn(self.key, self.seq) or (self.exp is not None and not t.backend.ready(self.exp)):
                return False
            self.hdr_req = t.ctrl.isend(self._header(), self.peer, HEADER_TAG_BASE + self.tag)
            t._out.advance(self.key)
        if not self.ack_req.test():
            return False
        if int(self.ack[0]) != self.seq:
            raise TransportError(f"rank {t.rank}: {t.names(self.peer)} acked message {int(self.ack[0])} of tag "
                                 f"{self.tag} where {self.seq} was due (a bug: please report)")
        if int(self.ack[1]) != _OK:
            raise TransportError(f"rank {t.rank}: {t.names(self.peer)} refused message {self.seq} of tag {self.tag} "
                                 "(see its error)")
        if self.exp is not None:
            t.backend.release(self.exp)
        t._linger(self.hdr_req)
        self.done = True
        return True

    def _header(self) -> np.ndarray:
        hdr = np.zeros(HEADER_BYTES, dtype=np.uint8)
        desc = b""
        seg = off = n = -1
        if self.exp is not None:
            seg, off, n = self.exp.segment, self.exp.offset, self.exp.nbytes
            if (self.peer, self.tag, seg) not in self.t._described:
                desc = self.exp.descriptor
                self.t._described.add((self.peer, self.tag, seg))
        if len(desc) > HEADER_BYTES - 8 * _WORDS:
            raise TransportError(f"rank {self.t.rank}: a {self.t.name} segment descriptor of {len(desc)} bytes does "
                                 f"not fit a {HEADER_BYTES}-byte header (a bug: please report)")
        hdr[:8 * _WORDS].view(np.int64)[:] = [_MAGIC, self.seq, seg, off, max(n, 0), len(desc)]
        hdr[8 * _WORDS:8 * _WORDS + len(desc)] = np.frombuffer(desc, dtype=np.uint8)
        return hdr

    def cancel(self) -> None:
        self.ack_req.cancel()


class _Recv:
    kind = "recv"

    def __init__(self, t: HandleTransport, buf: Any, src: int, tag: int) -> None:
        self.t, self.peer, self.tag, self.buf = t, src, tag, buf
        self.key = (src, tag)
        self.seq = t._in.issue(self.key)
        self.hdr = np.zeros(HEADER_BYTES, dtype=np.uint8)
        self.hdr_req = t.ctrl.irecv(self.hdr, src, HEADER_TAG_BASE + tag)
        self.started = False
        self.token: Any = None
        self.error = ""
        self.done = False

    def test(self) -> bool:
        if self.done:
            return True
        t = self.t
        if not self.started:
            if not self.hdr_req.test():
                return False
            self.started = True
            self._start()
        if not self.error and self.token is not None and not t.backend.copied(self.token):
            return False
        if not t._in.my_turn(self.key, self.seq):
            return False  # an earlier message of this stream acks first
        ack = np.array([self.seq, _REFUSED if self.error else _OK], dtype=np.int64)
        t._linger(t.ctrl.isend(ack, self.peer, ACK_TAG_BASE + self.tag))
        t._in.advance(self.key)
        self.done = True
        if self.error:
            raise TransportError(self.error)
        return True

    def _start(self) -> None:
        t = self.t
        magic, seq, seg, off, n, dlen = (int(x) for x in self.hdr[:8 * _WORDS].view(np.int64))
        cap = _flat_len(self.buf)
        where = f"rank {t.rank}: message {self.seq} of tag {self.tag} from {t.names(self.peer)}"
        if magic != _MAGIC or seq != self.seq:
            self.error = f"{where}: unexpected header (magic {magic:#x}, sequence {seq}; a bug: please report)"
        elif n > cap:
            self.error = f"{where}: {n} bytes do not fit the {cap}-byte receive buffer"
        elif n > 0:
            try:
                if dlen:
                    t.backend.attach(self.peer, seg, self.hdr[8 * _WORDS:8 * _WORDS + dlen].tobytes())
                elif not t.backend.attached(self.peer, seg):
                    raise TransportError(f"segment {seg} was never described (a bug: please report)")
                self.token = t.backend.copy(self.buf, self.peer, seg, off, n)
            except TransportError as e:
                self.error = f"{where}: {e}"

    def cancel(self) -> None:
        self.hdr_req.cancel()


class HandleTransport:
    """``Transport`` over ``backend`` memory, with headers and acks over ``control`` (p2p-capable)."""

    def __init__(self, backend: Backend, control: Transport, names: Any = None, *, own_control: bool = False) -> None:
        self.backend = backend
        self.ctrl = control
        #: a control channel made for this transport (gloo on the store plane) closes with it
        self._own_control = own_control
        self.rank, self.size = control.rank, control.size
        self.name = backend.name
        self.device = backend.device
        self.names = names or (lambda r: f"rank {r}")
        self._out, self._in = _Streams(), _Streams()
        self._described: set[tuple[int, int, int]] = set()
        self._lingering: list[Request] = []

    def _linger(self, req: Request | None) -> None:
        """Keep a control send alive until it completes (MPI reads its buffer until then)."""
        if req is not None:
            self._lingering = [r for r in self._lingering if not r.test()]
            if not req.test():
                self._lingering.append(req)

    @property
    def control(self) -> Transport:
        return self.ctrl

    def byte_view(self, tensor: Any) -> Any:
        return self.backend.byte_view(tensor)

    def alloc(self, nbytes: int) -> Any:
        return self.backend.alloc(nbytes)

    def isend(self, buf: Any, dst: int, tag: int) -> _Send:
        return _Send(self, buf, dst, tag)

    def irecv(self, buf: Any, src: int, tag: int) -> _Recv:
        return _Recv(self, buf, src, tag)

    def bcast_buffer(self, buf: Any, root: int, ranks: Sequence[int], timeout: float) -> None:
        """Point-to-point from ``root`` to the other ``ranks`` (colocated ranks: copies, no fabric)."""
        if self.rank == root:
            reqs: list[Any] = [self.isend(buf, r, _BCAST_TAG) for r in ranks if r != root]
        else:
            reqs = [self.irecv(buf, root, _BCAST_TAG)]
        wait_all(reqs, timeout, f"broadcast from {self.names(root)}", names=self.names, transport=self)

    def barrier(self, timeout: float) -> None:
        self.ctrl.barrier(timeout)

    def allgather_bytes(self, data: bytes, timeout: float) -> list[bytes]:
        return self.ctrl.allgather_bytes(data, timeout)

    def bcast_bytes(self, data: bytes | None, root: int, timeout: float) -> bytes:
        return self.ctrl.bcast_bytes(data, root, timeout)

    def poll_abort(self) -> RemoteAbortError | None:
        return self.ctrl.poll_abort()

    def post_abort(self, message: str, exit_code: int) -> None:
        self.ctrl.post_abort(message, exit_code)

    def close(self) -> None:
        self.backend.close()
        if self._own_control:
            self.ctrl.close()


#: the broadcast's data tag (the baseline's bucket broadcasts)
_BCAST_TAG = 13
