"""Who is who in a refit: one MPMD launch split by role, or two jobs joined by a rendezvous file.

Either way the result is a ``Group``: a control plane over the merged group (the senders, i.e.
trainers, first, then the receivers, i.e. inference), and one over one's own job.

Two control planes:

- **mpi** (jobs launched by ``mpiexec``): one MPMD launch is split by role; two launches are
  joined with ``MPI_Open_port`` / ``Connect`` / ``Accept`` through the rendezvous file, which
  holds the MPI port name.
- **store** (any job, e.g. a trainer launched by ``torchrun``): receiver rank 0 serves a
  TCPStore and writes ``tcp://HOST:PORT`` to the rendezvous file; every rank of both jobs reads
  the file and joins. Ranks are numbered by the launcher's own (``RANK``/``WORLD_SIZE``, or
  MPI's). Bulk bytes then move over gloo or NCCL groups built from that store.

The side that writes the rendezvous file (the receivers) picks the plane; the senders follow
what the file says. Every wait is bounded: MPI's ``Accept``/``Connect`` cannot time out on
their own, so a watchdog aborts with exit code 3 and a message naming what never arrived.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from formats.errors import PeerTimeoutError, UsageError
from formats.manifest.wire import atomic_write_bytes
from streamer.ops.agree import AgreedRefusal, LocalChecks, Refusal, agree
from streamer.transport.base import RemoteAbortError, Transport
from streamer.transport.rendezvous import FileRendezvous, Rendezvous, TcpRendezvous, rendezvous_from
from streamer.transport.watchdog import Watchdog, abort

__all__ = ["CONTROLS", "Clock", "Group", "Watchdog", "abort", "close_store", "connect", "launcher_rank", "rank_name",
           "rejoin", "store_wait"]

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


def connect(role: str | None, *, rendezvous: str | None = None, timeout: float = 300.0,
            control: str = "auto", refusal: Refusal | None = None,
            announce: Callable[[AgreedRefusal], None] | None = None) -> Group:
    """Join the refit group as ``role`` ("send" or "recv").

    ``control`` picks the control plane: "mpi", "store", or "auto" (the receivers: mpi when
    launched by an MPI launcher, else store; the senders: whatever the rendezvous file says).

    ``refusal``: what this rank refuses with (its manifest did not load, a bad option...). It
    joins all the same, and the group's first collective carries the refusal: every rank of both
    jobs then raises the same ``AgreedRefusal`` (``ops.agree``) instead of waiting for this
    one. Two separate launches: the ranks of this launch agree first, ``announce`` is called with
    their verdict at once, and they still join (up to ``timeout``) to tell the other job.
    """
    clock = Clock.start(timeout)
    checks = LocalChecks(refusal)
    with checks.capture():
        _check_args(role, rendezvous, control)
    if rendezvous is None:
        return _connect_mpmd(role, clock, checks.refusal)
    verdict = _launch_verdict(checks.refusal, clock)
    if verdict is not None and announce is not None:
        announce(verdict)
    carried = verdict.refusal() if verdict is not None else checks.refusal
    try:
        if role not in ROLES:  # only a refused rank (its command line did not parse) has no role
            raise verdict or AgreedRefusal([(launcher_rank()[0], carried or Refusal(2, ("no role",)))])
        return _connect_rendezvous(role, rendezvous_from(rendezvous), clock, control, carried, verdict is not None)
    except PeerTimeoutError:
        # the other job never came: this job's verdict stands (torchrun: this rank's own refusal)
        if verdict is not None:
            raise verdict from None
        if carried is not None:
            raise AgreedRefusal([(launcher_rank()[0], carried)]) from None
        raise


def _check_args(role: str | None, rendezvous: str | None, control: str) -> None:
    if role not in ROLES:
        raise UsageError(f"role must be send or recv, got {role!r}")
    if control not in CONTROLS:
        raise UsageError(f"--control must be one of {', '.join(CONTROLS)}, got {control!r}")
    if rendezvous is None and control == "store":
        raise UsageError("--control store joins two jobs through a rendezvous file: pass --rendezvous FILE")


def _launch_verdict(refusal: Refusal | None, clock: Clock) -> AgreedRefusal | None:
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


def _connect_rendezvous(role: str, rdv: Rendezvous, clock: Clock, control: str, refusal: Refusal | None,
                        refused: bool) -> Group:
    tcp = isinstance(rdv, TcpRendezvous)
    if tcp and control == "mpi":
        raise UsageError(f"rendezvous {rdv} joins the jobs over a TCPStore: the MPI control plane takes a rendezvous "
                         "file (or use --control store)")
    if role == "recv":
        plane = control if control != "auto" else ("mpi" if launched_by_mpi() and not tcp else "store")
        return (_connect_store(role, rdv, clock, refusal) if plane == "store"
                else _connect_mpi_port(role, Path(str(rdv)), clock, refusal, refused))
    if control == "auto":  # follow the receivers (every sender rank reads the file; it is written once)
        control = rdv.plane(clock.deadline, clock.timeout)
    if control == "mpi" and not launched_by_mpi():
        raise UsageError(f"the receiver job uses the MPI control plane ({rdv} holds an MPI port) but this job "
                         "was not started by mpiexec: start the receiver job with --control store")
    return (_connect_store(role, rdv, clock, refusal) if control == "store"
            else _connect_mpi_port(role, Path(str(rdv)), clock, refusal, refused))


def _connect_mpmd(role: str | None, clock: Clock, refusal: Refusal | None) -> Group:
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


def _connect_mpi_port(role: str, path: Path, clock: Clock, refusal: Refusal | None, refused: bool) -> Group:
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
            port_s = FileRendezvous(path).read(clock.deadline)
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


#: seconds a receiver rank accepts a rendezvous file written before it started (see _connect_store)
FRESH_SLACK = 60.0


def _connect_store(role: str, rdv: Rendezvous, clock: Clock, refusal: Refusal | None, *, epoch: int = 0,
                   store: Any = None, address: str = "") -> Group:
    """Join through a TCPStore served by receiver rank 0 (see the module docstring and
    ``transport.rendezvous``). ``epoch`` (receivers, with their ``store`` and its ``address``):
    open the session again for a new sender job (``rejoin``); senders read the epoch where the
    rendezvous says it."""
    from streamer.transport.epochs import parse_address

    rank, size = launcher_rank()
    t_start = time.time()
    clock = clock.restart()  # from here on: waiting for the other job
    server = role == "recv" and rank == 0
    if server:
        if store is None:
            store, address = rdv.serve(clock.left())
        rdv.publish(store, address, epoch)
    elif store is None:
        # receiver ranks wait for the file their rank 0 writes now, not a stale one; "now" with
        # slack: the ranks of one job start seconds apart on a loaded node (CI once saw rank 1
        # start after rank 0 had written it, and wait out its timeout), and a stale file names a
        # dead store that dial reads again (a finished job's rank 0 removes the file)
        store, text = rdv.dial(clock.deadline, clock.timeout, t_start - FRESH_SLACK if role == "recv" else None,
                               "the receiver job's store")
        address, epoch = parse_address(text)
    try:
        group = _store_group(store, role, rank, size, str(rdv), clock, server, epoch, address)
        try:  # everyone is in; the first collective carries every rank's refusal
            agree(group.control, refusal, clock.left())
        except AgreedRefusal:
            group.close(clock.left(5.0))  # the store's server waits for every rank to sign off
            raise
        return group
    finally:
        if server:  # everyone is in, or this job gives up: the rendezvous has served either way
            rdv.retire(store)


def _store_group(store: Any, role: str, rank: int, size: int, path: str, clock: Clock, server: bool,
                 epoch: int = 0, address: str = "") -> Group:
    """Both jobs' sizes, once each has joined the store (under the epoch's prefix): the group
    over it. Senders beat a heartbeat from now on; receivers watch it (``transport.epochs``)."""
    from streamer.transport.epochs import Heartbeat, SenderWatch, epoch_prefix
    from streamer.transport.store import StoreControl

    p = epoch_prefix(epoch)
    store.set(f"{p}job/{role}/size", str(size))
    store.add(f"{p}job/{role}/joined", 1)
    if role == "send":  # alive from now on: receivers notice a silent sender within seconds
        store.add(f"{p}hb/{rank}", 1)
    sizes = {}
    for r in ROLES:
        key = f"{p}job/{r}/size"
        store_wait(store, [key], clock.deadline,
                    f"the {'sender' if r == 'send' else 'receiver'} job to join through {path}")
        sizes[r] = int(store.get(key))
    n_send, n_recv = sizes["send"], sizes["recv"]
    g = rank if role == "send" else n_send + rank
    if size != sizes[role]:
        raise UsageError(f"two {role} jobs joined through {path}: one rendezvous file serves one pair of jobs")
    group = Group(StoreControl(store, g, n_send + n_recv, f"{p}ss/all", lambda r: rank_name(r, n_send)),
                  StoreControl(store, rank, size, f"{p}ss/{role}"), role, n_send, n_recv, path,
                  store=store, plane="store", epoch=epoch, prefix=p, address=address)
    if role == "recv":
        # the senders' close or silence ends the receivers' waits on both jobs' plane (their own
        # plane's waits, e.g. saving after the sender job closed, go on)
        group.control.watch = SenderWatch(store, p, n_send, heartbeats=rank == 0)  # type: ignore[attr-defined]
    else:
        beat = Heartbeat(address, f"{p}hb/{rank}", clock.timeout)
        group._closers.append(lambda t: beat.stop())
    group._closers.append(lambda t: close_store(store, g, n_send + n_recv, server, t, p))
    return group


def store_wait(store: Any, keys: list[str], deadline: float, what: str) -> None:
    while True:
        try:
            if store.check(keys):
                return
        except Exception as e:  # noqa: BLE001 - the server's rank ended
            raise RemoteAbortError(f"waiting for {what}: the rendezvous store went away (receiver rank 0 "
                                   f"ended: {str(e).splitlines()[0] if str(e) else type(e).__name__})", 3) from e
        if time.monotonic() > deadline:
            raise PeerTimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


def close_store(store: Any, g: int, size: int, server: bool, timeout: float, prefix: str = "") -> None:
    """Everyone signs off; the rank serving the store waits for all (else its exit strands them)."""
    try:
        store.add(f"{prefix}ss/closed", 1)
        if server:
            deadline = time.monotonic() + timeout
            while int(store.add(f"{prefix}ss/closed", 0)) < size and time.monotonic() < deadline:
                time.sleep(0.02)
    except Exception:  # noqa: BLE001 - peers that already left took nothing with them
        pass


def rejoin(group: Group, timeout: float) -> Group:
    """Receivers, after ``group.leave``: wait (up to ``timeout``) for a new sender job in the
    next epoch (``transport.epochs``); its rank count may differ. Raises ``PeerTimeoutError``
    when none comes."""
    if group.plane != "store" or group.rendezvous is None:
        raise UsageError("a session reopens for a new sender job on the store control plane only")
    rdv = rendezvous_from(group.rendezvous)
    group.close(timeout)  # our sign-off of the old epoch (no wait on the dead senders)
    try:
        return _connect_store("recv", rdv, Clock.start(timeout), None, epoch=group.epoch + 1, store=group.store,
                              address=group.address)
    except BaseException:
        if group.role_rank == 0:  # no sender job may join an epoch the receivers gave up on
            rdv.retire(group.store)
        raise
