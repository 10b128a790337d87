"""The MPI control plane's forms of the rendezvous (``transport.rendezvous`` picks one).

- **one MPMD launch** (no rendezvous): ``mpiexec -n N ... send : -n M ... recv`` is split by role;
- **two launches and a rendezvous file**: the receivers open an MPI port and write it to the file;
  the senders read it and connect, and both merge (``MPI_Open_port`` / ``Connect`` / ``Accept``).

Either way the role exchange carries every rank's refusal, so one that refuses stops every rank
at once. MPI's ``Accept``/``Connect``/``Split`` cannot time out on their own: each runs under the
``Clock``'s watchdog.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from formats.errors import PeerTimeoutError, UsageError
from formats.manifest.wire import atomic_write_bytes
from streamer.ops.agree import AgreedRefusal, Refusal, agree
from streamer.transport.jobs import ROLES, Clock, Group, launched_by_mpi

__all__ = ["join_launch", "join_port", "launch_verdict"]


def launch_verdict(refusal: Refusal | None, clock: Clock) -> AgreedRefusal | None:
    """Under an MPI launcher: this launch's ranks agree before joining the other job."""
    if not launched_by_mpi():
        return None
    from mpi4py import MPI

    from streamer.transport.mpi import MPITransport

    try:
        agree(MPITransport(MPI.COMM_WORLD), refusal, clock.left())
    except AgreedRefusal as e:
        return e
    return None


def join_launch(role: str | None, clock: Clock, refusal: Refusal | None) -> Group:
    """One MPMD launch, split by role: the senders first, each side keeping its order."""
    from mpi4py import MPI

    from streamer.transport.mpi import MPITransport

    world = MPI.COMM_WORLD
    mine = ROLES.index(role) if role in ROLES else -1
    # the role exchange carries every rank's refusal: one that refuses stops every rank here
    roles = agree(MPITransport(world), refusal, clock.left(), extra=mine)
    n_send = roles.count(0)
    n_recv = roles.count(1)
    if n_send == 0 or n_recv == 0:
        raise UsageError(
            f"this launch has {n_send} sender(s) and {n_recv} receiver(s): launch both sides MPMD "
            "(mpiexec -n N shardstream refit send ... : -n M shardstream refit recv ...) or join two "
            "jobs with --rendezvous FILE")
    # senders first, each side keeping its order (every rank is past the exchange: no one is missing)
    with clock.watchdog("splitting the launch into the sender and receiver jobs"):
        merged = world.Split(0, mine * world.Get_size() + world.Get_rank())
        role_comm = world.Split(mine, world.Get_rank())
    return Group.from_mpi(merged, role_comm, role or ROLES[0], n_send, n_recv)


def join_port(role: str, path: Path, read: Callable[[float], str], clock: Clock, refusal: Refusal | None,
              refused: bool) -> Group:
    """Two launches joined through ``path``: receiver rank 0 writes an MPI port there, sender rank 0
    ``read``s it (until a deadline; "" when it never came) and both sides merge. ``refused``: this
    launch refused already (``launch_verdict``) and only joins to tell the other job."""
    from mpi4py import MPI

    from streamer.transport.mpi import MPITransport

    world = MPI.COMM_WORLD
    world.Set_errhandler(MPI.ERRORS_RETURN)
    mine = ROLES.index(role)
    quiet = refusal if refused else None
    with clock.watchdog("copying this job's communicator", refused=quiet):
        role_comm = world.Dup()
    if role == "recv":
        port = None
        if role_comm.Get_rank() == 0:
            port = MPI.Open_port()
            atomic_write_bytes(path, (port + "\n").encode())
        clock = clock.restart()  # from here on: waiting for the sender job

        def cleanup() -> None:
            # every rank: the first watchdog to fire aborts the job, maybe before rank 0's does
            path.unlink(missing_ok=True)

        with clock.watchdog(f"waiting for the sender job to connect through {path}", cleanup, quiet):
            inter = role_comm.Accept(port or "", root=0)  # the port matters on the root only
            cleanup()
            if port is not None:
                MPI.Close_port(port)
            inter.Set_errhandler(MPI.ERRORS_RETURN)
            merged = inter.Merge(high=True)
    else:
        port_s = ""
        clock = clock.restart()  # from here on: waiting for the receiver job
        if role_comm.Get_rank() == 0:
            port_s = read(clock.deadline)
        # tell the other sender ranks, even when it never came
        port_s = MPITransport(role_comm).bcast_bytes(port_s.encode(), 0, clock.left()).decode()
        if not port_s:
            raise PeerTimeoutError(f"timed out after {clock.timeout:g} s waiting for the receiver job to write "
                                   f"the rendezvous file {path}")
        with clock.watchdog(f"connecting to the receiver job at the port in {path}", refused=quiet):
            inter = role_comm.Connect(port_s, root=0)
            inter.Set_errhandler(MPI.ERRORS_RETURN)
            merged = inter.Merge(high=False)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    role_comm.Set_errhandler(MPI.ERRORS_RETURN)
    # the role exchange carries every rank's refusal, as in one launch
    roles = agree(MPITransport(merged), refusal, clock.left(), extra=mine)
    return Group.from_mpi(merged, role_comm, role, roles.count(0), roles.count(1), str(path))
