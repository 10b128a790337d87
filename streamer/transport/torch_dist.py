"""torch.distributed transports: ``gloo`` (CPU tensors) and ``nccl`` (GPU tensors).

The process group is created from MPI: rank 0 of the merged group picks a free TCP port on its
host and broadcasts ``host:port`` over MPI; every rank then calls ``init_process_group`` with an
explicit timeout. Bulk data moves over torch.distributed point-to-point ops; the small control
messages (barriers, manifest and digest exchange) stay on MPI, whose waits we bound ourselves.

NCCL needs the data in GPU memory: the executor then keeps its bucket buffers on the device of
the local tensors and packs with ``Tensor.copy_``. NCCL matches point-to-point operations in
issue order per peer pair; the executor's global message order guarantees both sides agree.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

from formats.errors import TransportError, UsageError

from .mpi import MPITransport

__all__ = ["TorchDistTransport", "free_port"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class _Req:
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
        pass  # torch.distributed has no cancel; the group is torn down on failure


class TorchDistTransport:
    """``backend`` is "gloo" or "nccl". ``comm`` is the merged MPI communicator."""

    def __init__(self, comm: Any, backend: str = "gloo", *, timeout: float = 300.0) -> None:
        import torch
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):
            raise UsageError(f"unknown torch.distributed backend {backend!r} (gloo or nccl)")
        self.name = backend
        self.ctrl = MPITransport(comm)
        self.rank = self.ctrl.rank
        self.size = self.ctrl.size
        self.dist = dist
        self.device: Any = torch.device("cpu")
        self.pool: Any = None
        if backend == "gloo":
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="shardstream-gloo")
        if backend == "nccl":
            if not torch.cuda.is_available():
                raise UsageError("--transport nccl needs CUDA GPUs; none are visible (use mpi or gloo on CPU)")
            local = int(os.environ.get("MPI_LOCALRANKID", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", self.rank)))
            self.device = torch.device("cuda", local % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        addr = ""
        if self.rank == 0:
            host = os.environ.get("SHARDSTREAM_MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
            addr = f"{host}:{free_port()}"
        addr = self.ctrl.bcast_bytes(addr.encode(), 0, timeout).decode()
        if dist.is_initialized():
            raise TransportError("torch.distributed is already initialised in this process; pass your own "
                                 "transport to RefitSession instead")
        try:
            dist.init_process_group(backend, init_method=f"tcp://{addr}", rank=self.rank, world_size=self.size,
                                    timeout=datetime.timedelta(seconds=timeout))
        except Exception as e:  # noqa: BLE001 - torch raises many kinds here
            raise TransportError(f"rank {self.rank}: could not create the {backend} process group at {addr}: {e}") from e

    def _t(self, buf: Any) -> Any:
        import numpy as np
        import torch

        if isinstance(buf, np.ndarray):
            return torch.from_numpy(buf.reshape(-1).view(np.uint8))
        return buf.reshape(-1)

    def isend(self, buf: Any, dst: int, tag: int) -> _Req:
        try:
            return _Req(self.dist.isend(self._t(buf), dst, tag=tag), "send", dst, self.pool)
        except RuntimeError as e:  # a dead peer closes the connection under us
            raise TransportError(f"rank {self.rank}: send to rank {dst} failed ({e})") from e

    def irecv(self, buf: Any, src: int, tag: int) -> _Req:
        try:
            return _Req(self.dist.irecv(self._t(buf), src, tag=tag), "recv", src, self.pool)
        except RuntimeError as e:
            raise TransportError(f"rank {self.rank}: receive from rank {src} failed ({e})") from e

    def barrier(self, timeout: float) -> None:
        self.ctrl.barrier(timeout)

    def allgather_bytes(self, data: bytes, timeout: float) -> list[bytes]:
        return self.ctrl.allgather_bytes(data, timeout)

    def bcast_bytes(self, data: bytes | None, root: int, timeout: float) -> bytes:
        return self.ctrl.bcast_bytes(data, root, timeout)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)
        if self.dist.is_initialized():
            self.dist.destroy_process_group()
