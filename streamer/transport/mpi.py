"""MPI transport (mpi4py): non-blocking point-to-point and collectives, polled with timeouts.

Collectives use the non-blocking MPI-3 forms (Ibarrier, Iallgather, Ibcast) so that a missing
peer becomes a ``PeerTimeoutError`` instead of a hang.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import wait_all

__all__ = ["MPITransport"]


class _Req:
    def __init__(self, req: Any, kind: str, peer: int, keep: Any = None) -> None:
        self.req, self.kind, self.peer, self.keep = req, kind, peer, keep

    def test(self) -> bool:
        try:
            return bool(self.req.Test())
        except Exception as e:  # an MPI error (the peer's connection broke): name the peer
            from formats.errors import TransportError

            who = f"rank {self.peer}" if self.peer >= 0 else "a peer"
            raise TransportError(f"{self.kind} with {who} failed: the peer died or its connection broke "
                                 f"({str(e).splitlines()[0][:200]})") from e

    def cancel(self) -> None:
        try:
            self.req.Cancel()
        except Exception:  # noqa: BLE001 - cancelling a completed request is harmless
            pass


def _broken(kind: str, peer: int, e: BaseException) -> Exception:
    from formats.errors import TransportError

    return TransportError(f"{kind} with rank {peer} failed: the peer died or its connection broke "
                          f"({str(e).splitlines()[0][:200]})")


def _bytes_view(buf: Any) -> Any:
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return memoryview(buf).cast("B")


class MPITransport:
    name = "mpi"

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm
        # errors come back as exceptions we turn into TransportError (exit 3, naming the peer),
        # not as an abort with MPI's error stack
        try:
            comm.Set_errhandler(MPI.ERRORS_RETURN)
        except Exception:  # noqa: BLE001 - a communicator that refuses keeps its handler
            pass
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def isend(self, buf: Any, dst: int, tag: int) -> _Req:
        v = _bytes_view(buf)
        try:
            return _Req(self.comm.Isend([v, self.MPI.BYTE], dest=dst, tag=tag), "send", dst, v)
        except self.MPI.Exception as e:
            raise _broken("send", dst, e) from e

    def irecv(self, buf: Any, src: int, tag: int) -> _Req:
        v = _bytes_view(buf)
        try:
            return _Req(self.comm.Irecv([v, self.MPI.BYTE], source=src, tag=tag), "recv", src, v)
        except self.MPI.Exception as e:
            raise _broken("recv", src, e) from e

    def _wait(self, req: Any, timeout: float, what: str) -> None:
        # a collective has no single peer; name the whole group
        wait_all([_Req(req, "collective", -1)], timeout, what,
                 names=lambda _p: f"one or more of ranks 0..{self.size - 1}")

    def barrier(self, timeout: float) -> None:
        self._wait(self.comm.Ibarrier(), timeout, "barrier")

    def allgather_bytes(self, data: bytes, timeout: float) -> list[bytes]:
        n = np.array([len(data)], dtype=np.int64)
        sizes = np.zeros(self.size, dtype=np.int64)
        self._wait(self.comm.Iallgather([n, self.MPI.INT64_T], [sizes, self.MPI.INT64_T]), timeout,
                   "allgather (sizes)")
        recv = np.zeros(int(sizes.sum()), dtype=np.uint8)
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        send = np.frombuffer(data, dtype=np.uint8) if data else np.zeros(0, dtype=np.uint8)
        self._wait(self.comm.Iallgatherv([send, self.MPI.BYTE],
                                         [recv, (sizes.tolist(), displs.tolist()), self.MPI.BYTE]),
                   timeout, "allgather")
        return [recv[displs[i]:displs[i] + sizes[i]].tobytes() for i in range(self.size)]

    def bcast_bytes(self, data: bytes | None, root: int, timeout: float) -> bytes:
        n = np.array([len(data) if data is not None and self.rank == root else 0], dtype=np.int64)
        self._wait(self.comm.Ibcast([n, self.MPI.INT64_T], root=root), timeout, f"broadcast from rank {root}")
        buf = np.frombuffer(bytearray(data), dtype=np.uint8) if self.rank == root and data else np.zeros(
            int(n[0]), dtype=np.uint8)
        if int(n[0]):
            self._wait(self.comm.Ibcast([buf, self.MPI.BYTE], root=root), timeout, f"broadcast from rank {root}")
        return buf.tobytes()

    def close(self) -> None:
        pass
