"""Who is who in a refit: the ``Group`` both jobs form, and what a rank knows of its launch.

A ``Group`` is a control plane over the merged group (the senders, i.e. trainers, first, then the
receivers, i.e. inference) and one over one's own job, on one of two planes: **mpi** (jobs
launched by ``mpiexec``: an MPI communicator) or **store** (any launcher: a TCPStore served by
receiver rank 0). How the jobs find each other and form it is ``transport.rendezvous``.
Every wait is bounded (``Clock``): MPI's calls that cannot time out run under a watchdog, which
aborts with exit code 3 and a message naming what never arrived.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from streamer.ops.agree import Refusal
from streamer.transport.base import Transport
from streamer.transport.watchdog import Watchdog, abort

__all__ = ["CONTROLS", "ROLES", "Clock", "Group", "Watchdog", "abort", "launched_by_mpi", "launcher_rank", "rank_name"]

ROLES = ("send", "recv")
CONTROLS = ("auto", "mpi", "store")
#: environment variables by which MPI launchers announce a rank (MPICH/hydra, Open MPI, Slurm PMI)
_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


def launched_by_mpi() -> bool:
    return any(k in os.environ for k in _MPI_ENV)


def launcher_rank() -> tuple[int, int]:
    """(rank, size) of this process in its own job, from torch.distributed or the launcher."""
    dist = sys.modules.get("torch.distributed")  # importing torch costs seconds: only if already loaded
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    for r, n in (("RANK", "WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                 ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if r in os.environ and n in os.environ:
            return int(os.environ[r]), int(os.environ[n])
    return 0, 1


def rank_name(g: int, n_send: int) -> str:
    if g < n_send:
        return f"sender rank {g} (global {g})"
    return f"receiver rank {g - n_send} (global {g})"


@dataclass
class Group:
    control: Transport  # merged group: senders 0..n_send-1, receivers n_send..
    role_control: Transport  # this job's ranks
    role: str
    n_send: int
    n_recv: int
    rendezvous: str | None = None
    #: the merged MPI communicator (mpi plane) or TCPStore (store plane)
    comm: Any = None
    store: Any = None
    plane: str = "mpi"
    #: store plane: which opening of the session this is (0, then one more per trainer restart;
    #: its keys live under ``prefix``), and the store's ``host:port``
    epoch: int = 0
    prefix: str = ""
    address: str = ""
    _closers: list[Any] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.control.rank

    @property
    def role_rank(self) -> int:
        return self.role_control.rank

    def name(self, g: int) -> str:
        """Human name of merged rank ``g``: which job, which rank in it."""
        return rank_name(g, self.n_send)

    def close(self, timeout: float = 30.0) -> None:
        for c in self._closers:
            c(timeout)
        self._closers.clear()

    def post_done(self) -> None:
        """The sender job ends the session for good: waiting receivers return from ``pull()``."""
        if self.plane == "store" and self.role == "send" and self.role_rank == 0:
            try:
                self.store.set(f"{self.prefix}done", "1")
            except Exception:  # noqa: BLE001 - the receivers are gone already
                pass

    def leave(self, message: str) -> None:
        """Receivers leave a broken epoch (store plane): the others in it end with ``message``,
        and closing no longer waits for the senders' sign-off (they are gone); the rank serving
        the store still waits for the other receivers'."""
        from streamer.transport.epochs import sign_off

        self.control.post_abort(message, 3)
        store, key, n, server = self.store, f"{self.prefix}ss/rclosed", self.n_recv, self.role_rank == 0
        self._closers = [lambda t: sign_off(store, key, n, t, server)]

    @classmethod
    def from_mpi(cls, comm: Any, role_comm: Any, role: str, n_send: int, n_recv: int,
                 rendezvous: str | None = None) -> Group:
        from streamer.transport.mpi import MPITransport

        role_names = (lambda r: rank_name(r, n_send)) if role == "send" else (lambda r: rank_name(r + n_send, n_send))
        return cls(MPITransport(comm, lambda r: rank_name(r, n_send)), MPITransport(role_comm, role_names), role,
                   n_send, n_recv, rendezvous, comm=comm)


@dataclass(frozen=True)
class Clock:
    """A deadline ``timeout`` seconds from its start: every step of one wait shares it."""

    timeout: float
    deadline: float

    @classmethod
    def start(cls, timeout: float) -> Clock:
        return cls(timeout, time.monotonic() + timeout)

    def restart(self) -> Clock:
        """A new wait (for the other job, once this one is ready for it): its own ``timeout``."""
        return Clock.start(self.timeout)

    def left(self, floor: float = 0.5) -> float:
        return max(floor, self.deadline - time.monotonic())

    def watchdog(self, what: str, cleanup: Any = None, refused: Refusal | None = None) -> Watchdog:
        """A watchdog for an MPI call that cannot time out. A refused job waiting to tell the
        other job exits quietly with its refusal's code (its reason is printed already)."""
        if refused is None:
            return Watchdog(self.left(), what, cleanup, shown=self.timeout)
        return Watchdog(self.left(), what, cleanup, code=refused.exit_code, quiet=True)
