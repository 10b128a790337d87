"""torch.distributed transports: ``gloo`` (CPU tensors) and ``nccl`` (GPU tensors).

The transport builds its OWN process groups (``ProcessGroupGloo`` / ``ProcessGroupNCCL``
constructed from a store), never the default group, and never changes it: a trainer that
called ``init_process_group`` for its own collectives keeps running them before and after each
push. The store is the control plane's when it has one (a torchrun trainer joined through a
rendezvous file); otherwise rank 0 serves a TCPStore and sends its address over the MPI control
plane. The small control messages (barriers, manifest and digest exchange) stay on the control
plane, whose waits are bounded.

NCCL needs the data in GPU memory: buffers are then allocated on the device of the local
tensors. NCCL matches point-to-point operations in issue order per peer pair; the executor's
global message order guarantees both sides agree. Checksums are host data: they go over a
gloo group built beside the NCCL one (``control``).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Sequence
from typing import Any

from formats.errors import TransportError, UsageError
from streamer.transport.base import RemoteAbortError, Transport
from streamer.transport.device import cuda_device
from streamer.transport.store import open_store

__all__ = ["TorchDistTransport", "free_port"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def host_address(toward: str | None = None) -> str:
    """This host's address as peers should dial it ($SHARDSTREAM_MASTER_ADDR overrides).

    ``gethostbyname(hostname)`` is a loopback address on many machines (127.0.1.1 on Debian and
    Ubuntu). Where it is one and the peers sit at a known address ``toward`` that is not, the
    address of the interface that routes to ``toward`` is offered instead: the one the peers can
    reach this host at in any network where this host can reach them."""
    env = os.environ.get("SHARDSTREAM_MASTER_ADDR")
    if env:
        return env
    mine = socket.gethostbyname(socket.gethostname())
    if toward is None or not is_loopback(mine) or is_loopback(toward):
        return mine
    # no route: the loopback address stands, and the peers' own check refuses it by name
    return routed_address(toward) or mine


def routed_address(toward: str) -> str | None:
    """The address of this host's interface that routes to ``toward`` (a UDP connect sends
    nothing: it only picks the route), or None where there is no route or it is loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((toward, 9))
            routed = str(s.getsockname()[0])
    except OSError:
        return None
    return None if is_loopback(routed) else routed


def is_loopback(host: str) -> bool:
    """A loopback address (or name): one that reaches only the host that dials it."""
    return host == "localhost" or host.startswith("127.") or host in ("::1", "0:0:0:0:0:0:0:1")


class _Work:
    """A pending torch.distributed op. NCCL work is polled with ``is_completed()``; gloo's
    point-to-point work never reports completion and a timed ``wait`` closes the gloo pair, so a
    helper thread blocks in ``wait()`` (bounded by the group's timeout) and we poll its future."""

    def __init__(self, work: Any, kind: str, peer: int, pool: Any) -> None:
        self.work, self.kind, self.peer = work, kind, peer
        self.fut = pool.submit(work.wait) if pool is not None else None

    def test(self) -> bool:
        if self.fut is None:
            return bool(self.work.is_completed())
        if not self.fut.done():
            return False
        e = self.fut.exception()
        if e is not None:
            raise TransportError(f"{self.kind} with rank {self.peer} failed: {e}") from e
        return True

    def cancel(self) -> None:
        pass  # torch.distributed has no cancel; the group is dropped on failure


def _make_group(backend: str, store: Any, rank: int, size: int, timeout: float) -> Any:
    import torch.distributed as dist

    td = datetime.timedelta(seconds=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, td)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = td
    return dist.ProcessGroupNCCL(store, rank, size, opts)


class TorchDistTransport:
    """``backend`` is "gloo" or "nccl"; ``plane`` is the control plane of the merged group (an
    ``MPITransport`` or a ``StoreControl``); ``store`` the plane's TCPStore when it has one."""

    def __init__(self, plane: Transport, backend: str = "gloo", *, store: Any = None,
                 timeout: float = 300.0, prefix: str = "shardstream", device: Any = None) -> None:
        import torch
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):
            raise UsageError(f"unknown torch.distributed backend {backend!r} (gloo or nccl)")
        self.name = backend
        self.plane = plane
        self.rank = plane.rank
        self.size = plane.size
        self.timeout = timeout
        self.device: Any = None
        self.pool: Any = None
        self._subgroups: dict[tuple[int, ...], Any] = {}
        if backend == "gloo":
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="shardstream-gloo")
        else:
            if not torch.cuda.is_available():
                raise UsageError("--transport nccl needs CUDA GPUs; none are visible (use mpi or gloo on CPU)")
            # ``device``: the caller's own (a vLLM worker's), used as given; else the launcher's
            self.device = cuda_device(self.rank, device)
        self.store = store if store is not None else self._serve_store(timeout)
        self._prefix = f"{prefix}/{backend}"
        try:
            self.pg = _make_group(backend, dist.PrefixStore(  # type: ignore[attr-defined]
                self._prefix, self.store), self.rank, self.size, timeout)
        except Exception as e:  # noqa: BLE001 - torch raises many kinds here
            raise TransportError(f"rank {self.rank}: could not create the {backend} process group: {e}") from e
        # checksums are host memory: NCCL cannot carry them, a gloo group beside it can
        self._control: Any = self if backend == "gloo" else TorchDistTransport(
            plane, "gloo", store=self.store, timeout=timeout, prefix=f"{prefix}/control")

    def _serve_store(self, timeout: float) -> Any:
        addr = f"{host_address()}:{free_port()}" if self.rank == 0 else ""
        # the server must exist before clients dial it: rank 0 opens it before broadcasting
        server = open_store(addr.split(":")[0], int(addr.split(":")[1]), server=True, timeout=timeout) \
            if self.rank == 0 else None
        addr = self.plane.bcast_bytes(addr.encode(), 0, timeout).decode()
        if server is not None:
            return server
        host, port = addr.rsplit(":", 1)
        try:
            return open_store(host, int(port), server=False, timeout=timeout)
        except Exception as e:  # noqa: BLE001
            raise TransportError(f"rank {self.rank}: could not reach the {self.name} store at {addr}: {e}") from e

    @property
    def control(self) -> Any:
        return self._control

    # -- buffers
    def byte_view(self, tensor: Any) -> Any:
        from streamer.ops.buffers import torch_byte_view

        return torch_byte_view(tensor)

    def alloc(self, nbytes: int) -> Any:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=self.device or "cpu")

    @staticmethod
    def _t(buf: Any) -> Any:
        import numpy as np
        import torch

        if isinstance(buf, np.ndarray):
            return torch.from_numpy(buf.reshape(-1).view(np.uint8))
        return buf.reshape(-1)

    # -- point to point
    def isend(self, buf: Any, dst: int, tag: int) -> _Work:
        try:
            return _Work(self.pg.send([self._t(buf)], dst, tag), "send", dst, self.pool)
        except RuntimeError as e:  # a dead peer closes the connection under us
            raise TransportError(f"rank {self.rank}: send to rank {dst} failed ({e})") from e

    def irecv(self, buf: Any, src: int, tag: int) -> _Work:
        try:
            return _Work(self.pg.recv([self._t(buf)], src, tag), "recv", src, self.pool)
        except RuntimeError as e:
            raise TransportError(f"rank {self.rank}: receive from rank {src} failed ({e})") from e

    def bcast_buffer(self, buf: Any, root: int, ranks: Sequence[int], timeout: float) -> None:
        """A native broadcast in a group of ``ranks`` (made once per set, by its members only)."""
        import torch.distributed as dist

        from streamer.transport.base import wait_all

        key = tuple(sorted(ranks))
        pg = self._subgroups.get(key)
        if pg is None:
            sub_store = dist.PrefixStore(  # type: ignore[attr-defined]
                f"{self._prefix}/bcast/{'-'.join(map(str, key))}", self.store)
            pg = _make_group(self.name, sub_store, key.index(self.rank), len(key), timeout)
            self._subgroups[key] = pg
        opts = dist.BroadcastOptions()
        opts.rootRank = key.index(root)
        work = pg.broadcast([self._t(buf)], opts)
        wait_all([_Work(work, "collective", root, self.pool)], timeout, f"broadcast from rank {root}",
                 transport=self)

    # -- control plane
    def barrier(self, timeout: float) -> None:
        self.plane.barrier(timeout)

    def allgather_bytes(self, data: bytes, timeout: float) -> list[bytes]:
        return self.plane.allgather_bytes(data, timeout)

    def bcast_bytes(self, data: bytes | None, root: int, timeout: float) -> bytes:
        return self.plane.bcast_bytes(data, root, timeout)

    def poll_abort(self) -> RemoteAbortError | None:
        return self.plane.poll_abort()

    def post_abort(self, message: str, exit_code: int) -> None:
        self.plane.post_abort(message, exit_code)

    def close(self) -> None:
        # the groups are ours alone: dropping them frees them; the default group is untouched
        if self._control is not self:
            self._control.close()
        self._subgroups.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=False)
