"""Who is who in a refit: one MPMD launch split by role, or two jobs joined by a rendezvous file.

Either way the result is one merged intracommunicator with the senders (trainers) first, then
the receivers (inference), plus a communicator of one's own role. Every wait is bounded: MPI's
``Accept``/``Connect`` cannot time out on their own, so a watchdog aborts with exit code 3 and a
message naming what never arrived.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from formats.errors import PeerTimeoutError, UsageError
from formats.manifest import atomic_write_bytes

__all__ = ["Group", "connect", "Watchdog", "abort"]

ROLES = ("send", "recv")


@dataclass
class Group:
    comm: Any  # merged: senders 0..n_send-1, receivers n_send..
    role_comm: Any
    role: str
    n_send: int
    n_recv: int
    rendezvous: str | None = None

    @property
    def rank(self) -> int:
        return int(self.comm.Get_rank())

    @property
    def role_rank(self) -> int:
        return int(self.role_comm.Get_rank())

    def name(self, g: int) -> str:
        """Human name of merged rank ``g``: which job, which rank in it."""
        if g < self.n_send:
            return f"sender rank {g} (global {g})"
        return f"receiver rank {g - self.n_send} (global {g})"


def abort(message: str, code: int = 3) -> None:
    """Print ``message`` and abort every rank with ``code`` (mpiexec then exits with it)."""
    try:
        os.write(2, (message.rstrip() + "\n").encode())
    except OSError:
        pass
    # hydra forwards output asynchronously and drops what is in flight when it tears the job down:
    # give it a moment so the reason reaches the user
    time.sleep(0.5)
    try:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(code)
    finally:
        os._exit(code)


class Watchdog:
    """Abort with exit 3 if the guarded block takes longer than ``timeout`` seconds."""

    def __init__(self, timeout: float, message: str, cleanup: Any = None) -> None:
        self.timeout = timeout
        self.message = message
        self.cleanup = cleanup
        self._t: threading.Timer | None = None

    def _fire(self) -> None:
        if self.cleanup is not None:
            try:
                self.cleanup()
            except Exception:  # noqa: BLE001 - best effort before aborting
                pass
        abort(f"shardstream: timed out after {self.timeout:g} s {self.message}")

    def __enter__(self) -> Watchdog:
        self._t = threading.Timer(self.timeout, self._fire)
        self._t.daemon = True
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._t is not None:
            self._t.cancel()


def _iallgather_int(comm: Any, value: int, timeout: float, what: str) -> list[int]:
    from mpi4py import MPI

    from .transport.base import wait_all
    from .transport.mpi import _Req

    send = np.array([value], dtype=np.int64)
    recv = np.zeros(comm.Get_size(), dtype=np.int64)
    req = comm.Iallgather([send, MPI.INT64_T], [recv, MPI.INT64_T])
    wait_all([_Req(req, "collective", -1)], timeout, what)
    return [int(x) for x in recv]


def connect(role: str, *, rendezvous: str | None = None, timeout: float = 300.0) -> Group:
    """Join the refit group as ``role`` ("send" or "recv")."""
    from mpi4py import MPI

    if role not in ROLES:
        raise UsageError(f"role must be send or recv, got {role!r}")
    world = MPI.COMM_WORLD
    world.Set_errhandler(MPI.ERRORS_RETURN)  # failures become exceptions -> exit 3, not MPI aborts
    mine = ROLES.index(role)
    if rendezvous is None:
        roles = _iallgather_int(world, mine, timeout, "role exchange")
        n_send = roles.count(0)
        n_recv = roles.count(1)
        if n_send == 0 or n_recv == 0:
            raise UsageError(
                f"this launch has {n_send} sender(s) and {n_recv} receiver(s): launch both sides MPMD "
                "(mpiexec -n N shardstream refit send ... : -n M shardstream refit recv ...) or join two "
                "jobs with --rendezvous FILE")
        # senders first, each side keeping its order
        merged = world.Split(0, mine * world.Get_size() + world.Get_rank())
        role_comm = world.Split(mine, world.Get_rank())
        return Group(merged, role_comm, role, n_send, n_recv)

    path = Path(rendezvous)
    role_comm = world.Dup()
    if role == "recv":
        port = None
        if role_comm.Get_rank() == 0:
            port = MPI.Open_port()
            atomic_write_bytes(path, (port + "\n").encode())

        def cleanup() -> None:
            # every rank: the first watchdog to fire aborts the job, maybe before rank 0's does
            path.unlink(missing_ok=True)

        with Watchdog(timeout, f"waiting for the sender job to connect through {path}", cleanup):
            inter = role_comm.Accept(port, root=0)
        cleanup()
        if port is not None:
            MPI.Close_port(port)
        inter.Set_errhandler(MPI.ERRORS_RETURN)
        merged = inter.Merge(high=True)
    else:
        port_s = ""
        if role_comm.Get_rank() == 0:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    port_s = path.read_text().strip()
                    if port_s:
                        break
                except FileNotFoundError:
                    pass
                if time.monotonic() > deadline:
                    # tell the other sender ranks before failing
                    port_s = ""
                    break
                time.sleep(0.05)
        from .transport.mpi import MPITransport

        port_s = MPITransport(role_comm).bcast_bytes(port_s.encode(), 0, timeout + 5).decode()
        if not port_s:
            raise PeerTimeoutError(f"timed out after {timeout:g} s waiting for the receiver job to write "
                                   f"the rendezvous file {path}")
        with Watchdog(timeout, f"connecting to the receiver job at the port in {path}"):
            inter = role_comm.Connect(port_s, root=0)
        inter.Set_errhandler(MPI.ERRORS_RETURN)
        merged = inter.Merge(high=False)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    role_comm.Set_errhandler(MPI.ERRORS_RETURN)
    n_recv_send = _iallgather_int(merged, mine, timeout, "role exchange")
    return Group(merged, role_comm, role, n_recv_send.count(0), n_recv_send.count(1), rendezvous)
