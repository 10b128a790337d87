"""The rendezvous: how the two jobs of a refit find each other and form their ``Group``.

``join`` is the one entry (``RefitSession.open`` calls it): it picks the form from its arguments
and returns the group (``transport.jobs``), whose first collective carries every rank's refusal.
The side that writes the rendezvous (the receivers) picks the control plane; the senders follow.

- **The MPI plane** (``transport.mpi_plane``): one MPMD launch (no rendezvous), or an MPI port
  that receivers launched by ``mpiexec`` write into the rendezvous file.
- **The store plane** (any launcher): receiver rank 0 serves the TCPStore both jobs join (it
  outlives any sender job: a restarted trainer finds the same store, in the next *epoch*,
  ``transport.epochs``). The rendezvous says where that store is, and in which epoch the
  receivers wait:

  - **a file** (``/shared/refit.rdv``, both jobs see it): receiver rank 0 binds a free port on its
    host and writes ``tcp://HOST:PORT[/EPOCH]`` into the file; the others read it. The file is
    removed once every rank has joined, so a new sender job waits for the next one.
  - **``tcp://HOST:PORT``** (no shared filesystem: Kubernetes pods, Ray clusters): receiver rank 0
    binds ``PORT`` on ``HOST``, which must be an address of its own host that the other job can
    reach (the port must be open between the jobs; the gloo or NCCL connections the transport
    opens afterwards use ports of their own, see docs/refit.md); everyone else connects to it.
    The epoch lives in the store (key ``rdv/epoch``), set while the receivers wait for a sender
    job and removed once every rank has joined, as the file is.

- **An inference replica** (``replica=NAME``; several fed by one trainer, ``refit.fleet``) joins
  through a form of its own, named after it: ``PATH@NAME``, a file beside the trainer's rendezvous
  file, or ``tcp://HOST:PORT@NAME`` (no shared filesystem), an entry in the *registry* that
  trainer rank 0 serves at ``HOST:PORT`` (``transport.registry``): the replica's rank 0 serves its
  own store on a free port of its host, as under a file, and keeps the entry there while it waits;
  its other ranks and the trainer read the entry as they would read the file
  (:class:`RegistryRendezvous`).
- **The trainer serving replicas** (``replicas=True``): a group of its own ranks only, over a store
  served by its rank 0 (found through ``PATH.trainer``, or the registry itself at
  ``tcp://HOST:PORT``), on which they agree which replicas they join and which they dropped.

Every store form is a :class:`Rendezvous`: ``serve`` / ``publish`` / ``retire`` on the rank that
serves the store, ``dial`` everywhere else, and ``plane`` for a sender that follows the receivers.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from formats.errors import PeerTimeoutError, UsageError
from streamer.ops.agree import AgreedRefusal, LocalChecks, Refusal, agree
from streamer.transport.base import RemoteAbortError
from streamer.transport.jobs import CONTROLS, ROLES, Clock, Group, launched_by_mpi, launcher_rank, rank_name
from streamer.transport.mpi_plane import join_launch, join_port, launch_verdict
from streamer.transport.registry import Registrar, entry_key, peek

__all__ = ["FileRendezvous", "RegistryRendezvous", "Rendezvous", "TCP", "TcpRendezvous", "check_name", "check_reachable",
           "close_store", "is_name", "join", "rejoin", "rendezvous_from", "replica_form", "replica_path",
           "replica_rendezvous", "store_wait", "trainer_form"]

TCP = "tcp://"
#: the store key of a ``tcp://`` rendezvous that names the epoch the receivers wait in
EPOCH_KEY = "rdv/epoch"
#: where receiver rank 0 says which host it runs on (a store key; the file's second line)
HOST_KEY = "rdv/host"


def join(role: str | None, rendezvous: str | None = None, *, timeout: float = 300.0, control: str = "auto",
         refusal: Refusal | None = None, announce: Callable[[AgreedRefusal], None] | None = None,
         replica: str | None = None, replicas: bool = False) -> Group:
    """Join the refit group as ``role`` ("send" or "recv") through ``rendezvous`` (None: one MPMD
    launch); the forms are in the module docstring. ``replica="NAME"``: an inference replica's
    receiver job, through ``RENDEZVOUS@NAME``; ``replicas=True``: the trainer serving replicas,
    whose group holds its own ranks only (the replicas join it later, ``refit.fleet``).

    ``control`` picks the control plane: "mpi", "store", or "auto" (the receivers: mpi when
    launched by an MPI launcher, else store; the senders: whatever the rendezvous file says).

    ``refusal``: what this rank refuses with (its manifest did not load, a bad option...). It
    joins all the same, and the group's first collective carries the refusal: every rank of both
    jobs then raises the same ``AgreedRefusal`` (``ops.agree``) instead of waiting for this
    one. Two separate launches: the ranks of this launch agree first, ``announce`` is called with
    their verdict at once, and they still join (up to ``timeout``) to tell the other job.
    """
    if replicas:
        return _join_trainer(trainer_form(role, rendezvous), timeout, refusal)
    if replica is not None:
        rendezvous, control = replica_form(role, replica, rendezvous, control)
    clock = Clock.start(timeout)
    checks = LocalChecks(refusal)
    with checks.capture():
        _check_args(role, rendezvous, control)
    if rendezvous is None:
        return join_launch(role, clock, checks.refusal)
    verdict = launch_verdict(checks.refusal, clock)
    if verdict is not None and announce is not None:
        announce(verdict)
    carried = verdict.refusal() if verdict is not None else checks.refusal
    try:
        if role not in ROLES:  # only a refused rank (its command line did not parse) has no role
            raise verdict or AgreedRefusal([(launcher_rank()[0], carried or Refusal(2, ("no role",)))])
        return _join_jobs(role, rendezvous_from(rendezvous), clock, control, carried, verdict is not None)
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


def replica_form(role: str | None, name: str, rendezvous: str | None, control: str) -> tuple[str, str]:
    """A replica's rendezvous (``RENDEZVOUS@NAME``: a file, or an entry in the trainer's registry at
    ``tcp://HOST:PORT``) and control plane (the store's)."""
    if role != "recv":
        raise UsageError("replica=NAME is for an inference replica (recv); the trainer opens with replicas=True")
    if rendezvous is None:
        raise UsageError("replica=NAME joins the trainer through a rendezvous: pass rendezvous=FILE (a path every job "
                         "sees) or tcp://HOST:PORT (the trainer's rank 0 serves it)")
    if control == "mpi":
        raise UsageError("replicas join and leave on the store control plane only (under MPI a peer's death "
                         "ends the launch): use control='store'")
    return replica_rendezvous(rendezvous, name), "store"


def trainer_form(role: str | None, rendezvous: str | None) -> str:
    """The rendezvous of a trainer serving replicas, or the usage error."""
    if role != "send":
        raise UsageError("replicas=True is for the trainer (send); an inference replica opens with replica=NAME")
    if rendezvous is None:
        raise UsageError("replicas=True joins replica jobs through a rendezvous: pass rendezvous=FILE (a path every "
                         "job sees) or tcp://HOST:PORT (served by trainer rank 0: no shared filesystem)")
    return rendezvous


def _join_jobs(role: str, rdv: Rendezvous, clock: Clock, control: str, refusal: Refusal | None, refused: bool) -> Group:
    """Two jobs through ``rdv``: the receivers pick the control plane, the senders follow it."""
    tcp = isinstance(rdv, TcpRendezvous)
    if tcp and control == "mpi":
        raise UsageError(f"rendezvous {rdv} joins the jobs over a TCPStore: the MPI control plane takes a rendezvous "
                         "file (or use --control store)")
    if role == "recv":
        plane = control if control != "auto" else ("mpi" if launched_by_mpi() and not tcp else "store")
        return (_join_store(role, rdv, clock, refusal) if plane == "store"
                else _join_port(role, rdv, clock, refusal, refused))
    if control == "auto":  # follow the receivers (every sender rank reads the file; it is written once)
        control = rdv.plane(clock.deadline, clock.timeout)
    if control == "mpi" and not launched_by_mpi():
        raise UsageError(f"the receiver job uses the MPI control plane ({rdv} holds an MPI port) but this job "
                         "was not started by mpiexec: start the receiver job with --control store")
    return (_join_store(role, rdv, clock, refusal) if control == "store"
            else _join_port(role, rdv, clock, refusal, refused))


def _join_port(role: str, rdv: Rendezvous, clock: Clock, refusal: Refusal | None, refused: bool) -> Group:
    """The MPI plane: an MPI port in the rendezvous file (``mpi_plane.join_port``)."""
    path = Path(str(rdv))
    return join_port(role, path, FileRendezvous(path).read, clock, refusal, refused)


#: seconds a receiver rank accepts a rendezvous file written before it started (see _join_store)
FRESH_SLACK = 60.0


def _join_store(role: str, rdv: Rendezvous, clock: Clock, refusal: Refusal | None, *, epoch: int = 0,
                store: Any = None, address: str = "") -> Group:
    """Join through a TCPStore served by receiver rank 0 (see the module docstring). ``epoch``
    (receivers, with their ``store`` and its ``address``): open the session again for a new sender
    job (``rejoin``); senders read the epoch where the rendezvous says it."""
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
        return _join_store("recv", rdv, Clock.start(timeout), None, epoch=group.epoch + 1, store=group.store,
                           address=group.address)
    except BaseException:
        if group.role_rank == 0:  # no sender job may join an epoch the receivers gave up on
            rdv.retire(group.store)
        raise


def _join_trainer(rendezvous: str, timeout: float, refusal: Refusal | None) -> Group:
    """The trainer's ranks (``_trainer_group``); their first collective carries every rank's refusal."""
    group = _trainer_group(rendezvous, timeout)
    try:
        agree(group.control, refusal, timeout)
    except AgreedRefusal:
        group.close(timeout)
        raise
    return group


def _trainer_group(rendezvous: str, timeout: float) -> Group:
    """The trainer job's own group (every rank a sender, no receiver) over a store served by its
    rank 0: found through ``RENDEZVOUS.trainer`` (written fresh, removed once every rank joined),
    or served at ``tcp://HOST:PORT``, where it is also the registry the replicas enter."""
    from streamer.transport.store import StoreControl

    rdv: Rendezvous
    if rendezvous.startswith(TCP):
        rdv = TcpRendezvous.parse(rendezvous, serving="trainer rank 0 (the replicas' registry)")
        path = str(rdv)
    else:
        p = Path(rendezvous)
        path = str(p.with_name(f"{p.name}.trainer"))
        rdv = FileRendezvous(Path(path))
    rank, size = launcher_rank()
    clock = Clock.start(timeout)
    t_start = time.time()
    if rank == 0:
        store, address = rdv.serve(timeout)
        rdv.publish(store, address, 0)
    else:
        store, _ = rdv.dial(clock.deadline, clock.timeout, t_start - FRESH_SLACK, "trainer rank 0's store")
    try:
        store.add("trainer/joined", 1)
        store.set(f"trainer/in/{rank}", "1")
        store_wait(store, [f"trainer/in/{r}" for r in range(size)], clock.deadline,
                   f"the trainer's {size} ranks to join through {path}")
    finally:
        if rank == 0:
            rdv.retire(store)

    def names(r: int) -> str:
        return rank_name(r, size)

    group = Group(StoreControl(store, rank, size, "trainer/all", names), StoreControl(store, rank, size, "trainer/send"),
                  "send", size, 0, rendezvous, store=store, plane="store", prefix="trainer/")
    group._closers.append(lambda t: close_store(store, rank, size, rank == 0, t, "trainer/"))
    return group


#: replica names: letters, digits, '_', '-' and '.' (not first)
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def is_name(name: str) -> bool:
    return isinstance(name, str) and bool(_NAME.fullmatch(name)) and not name.startswith(".")


def check_name(name: str) -> str:
    if not is_name(name):
        raise UsageError(f"replica name {name!r}: use letters, digits, '_', '-' and '.' (not first)")
    return name


def replica_path(rendezvous: str | Path, name: str) -> Path:
    """The file through which replica ``name`` joins: ``RENDEZVOUS@NAME``."""
    p = Path(rendezvous)
    return p.with_name(f"{p.name}@{check_name(name)}")


def replica_rendezvous(rendezvous: str | Path, name: str) -> str:
    """The rendezvous through which replica ``name`` joins: ``PATH@NAME`` or ``tcp://HOST:PORT@NAME``."""
    s = str(rendezvous)
    if s.startswith(TCP):
        TcpRendezvous.parse(s)  # a bad address is refused here, by name
        return f"{s.rstrip('/')}@{check_name(name)}"
    return str(replica_path(s, name))


def check_reachable(address_host: str, server_host: str, where: str) -> None:
    """Refuse, by name, a loopback address that receiver rank 0 on another host offers: this rank
    would reach its own host, not the store (``gethostbyname(hostname)`` is 127.0.1.1 on many
    machines)."""
    import socket

    from streamer.transport.torch_dist import is_loopback

    me = socket.gethostname()
    if is_loopback(address_host) and server_host and server_host != me:
        raise UsageError(f"{where}: receiver rank 0 (host {server_host}) offers the loopback address {address_host}, "
                         f"which this rank (host {me}) cannot reach it at; set SHARDSTREAM_MASTER_ADDR on the "
                         "receivers to an address of theirs that this host can reach, or give tcp://HOST:PORT")


class Rendezvous(Protocol):
    """One way for the jobs to find receiver rank 0's store (see the module docstring)."""

    def serve(self, timeout: float) -> tuple[Any, str]:
        """Receiver rank 0: open the store's server; (store, its ``HOST:PORT``)."""

    def publish(self, store: Any, address: str, epoch: int) -> None:
        """Receiver rank 0: say where the store is and which epoch the receivers wait in."""

    def retire(self, store: Any) -> None:
        """Receiver rank 0, once every rank joined (or the receivers gave up): a new sender job
        must wait for the next ``publish``."""

    def dial(self, deadline: float, timeout: float, fresh_from: float | None, whose: str) -> tuple[Any, str]:
        """Everyone else: (a client of the store, ``HOST:PORT[/EPOCH]``), waiting until ``deadline``."""

    def plane(self, deadline: float, timeout: float) -> str:
        """The receivers' control plane ("store" or "mpi"), for senders that follow it."""


def rendezvous_from(text: str | Path) -> Rendezvous:
    """``tcp://HOST:PORT``, ``tcp://HOST:PORT@NAME`` (a replica in a trainer's registry) or a file path."""
    s = str(text)
    if s.startswith(TCP) and "@" in s:
        address, _, name = s.rpartition("@")
        t = TcpRendezvous.parse(address)
        return RegistryRendezvous(t.host, t.port, name)
    if s.startswith(TCP):
        return TcpRendezvous.parse(s)
    return FileRendezvous(Path(s))


def _serve_free_port(timeout: float, toward: str | None = None) -> tuple[Any, str]:
    """Receiver rank 0's store on a free port of this host (``host_address``: peers dial it;
    ``toward``: where the peers are, when known)."""
    from streamer.transport.store import open_store
    from streamer.transport.torch_dist import free_port, host_address

    address = f"{host_address(toward)}:{free_port()}"
    host, port = address.rsplit(":", 1)
    return open_store(host, int(port), server=True, timeout=timeout), address


def _entry(address: str, epoch: int) -> str:
    """What a file (or a registry entry) holds: the store's address, the host that serves it, and
    when it was written (a rank that started later ignores an older one, as it does a stale file)."""
    import socket

    return f"{TCP}{address}{f'/{epoch}' if epoch else ''}\nhost={socket.gethostname()}\nat={time.time():.3f}\n"


def _fields(text: str) -> dict[str, str]:
    """An entry's ``key=value`` lines after its address (``host``, ``at``)."""
    return dict(line.split("=", 1) for line in text.splitlines()[1:] if "=" in line)


def _dial_entry(text: str, where: str, deadline: float) -> tuple[Any, str]:
    """A client of the store that an entry names (``_entry``), and its ``HOST:PORT[/EPOCH]``."""
    from streamer.transport.store import open_store

    first = text.partition("\n")[0]
    host, port = first[len(TCP):].split("/")[0].rsplit(":", 1)
    check_reachable(host, _fields(text).get("host", ""), where)
    left = max(0.5, deadline - time.monotonic())
    return open_store(host, int(port), server=False, timeout=min(5.0, left)), first[len(TCP):]


def _written_at(text: str) -> float | None:
    """When an entry was written (None: an entry without the time, or one that does not parse)."""
    try:
        return float(_fields(text)["at"])
    except (KeyError, ValueError):
        return None


class FileRendezvous:
    """A file both jobs can see (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __str__(self) -> str:
        return str(self.path)

    def serve(self, timeout: float) -> tuple[Any, str]:
        return _serve_free_port(timeout)

    def publish(self, store: Any, address: str, epoch: int) -> None:
        from formats.manifest.wire import atomic_write_bytes

        atomic_write_bytes(self.path, _entry(address, epoch).encode())

    def retire(self, store: Any) -> None:
        self.path.unlink(missing_ok=True)

    def read(self, deadline: float, fresh_from: float | None = None) -> str:
        """The file's text once it exists (and, with ``fresh_from``, was written since), else ""."""
        while time.monotonic() < deadline:
            try:
                if fresh_from is None or self.path.stat().st_mtime >= fresh_from:
                    text = self.path.read_text().strip()
                    if text:
                        return text
            except (FileNotFoundError, PermissionError):
                pass
            time.sleep(0.05)
        return ""

    def dial(self, deadline: float, timeout: float, fresh_from: float | None, whose: str) -> tuple[Any, str]:
        last = ""
        while time.monotonic() < deadline:
            text = self.read(deadline, fresh_from)
            if not text:
                break
            if not text.startswith(TCP):
                raise UsageError(f"{self.path} holds an MPI port, not a store address: the receiver job uses the MPI "
                                 "control plane; start it with --control store (or launch this job with mpiexec)")
            try:
                return _dial_entry(text, str(self.path), deadline)
            except UsageError:
                raise
            except Exception as e:  # noqa: BLE001 - a stale file names a dead store: read it again
                last = str(e).splitlines()[0] if str(e) else type(e).__name__
                time.sleep(0.2)
        raise PeerTimeoutError(f"timed out after {timeout:g} s waiting for {whose} through {self.path}"
                               + (f" (last error: {last})" if last else ""))

    def plane(self, deadline: float, timeout: float) -> str:
        text = self.read(deadline)
        if not text:
            raise PeerTimeoutError(f"timed out after {timeout:g} s waiting for the receiver job to write the "
                                   f"rendezvous file {self.path}")
        return "store" if text.startswith(TCP) else "mpi"


class TcpRendezvous:
    """``tcp://HOST:PORT``: receiver rank 0's store at a known address (see the module docstring)."""

    def __init__(self, host: str, port: int, serving: str = "receiver rank 0") -> None:
        self.host, self.port = host, port
        #: who serves the store here: receiver rank 0 (one pair of jobs), or trainer rank 0 (replicas)
        self.serving = serving

    @classmethod
    def parse(cls, text: str, serving: str = "receiver rank 0") -> TcpRendezvous:
        host, sep, port = text[len(TCP):].rstrip("/").rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"rendezvous {text!r}: expected tcp://HOST:PORT (a port from 1 to 65535)")
        return cls(host.strip("[]"), int(port), serving)

    def __str__(self) -> str:
        return f"{TCP}{self.host}:{self.port}"

    def serve(self, timeout: float) -> tuple[Any, str]:
        from streamer.transport.store import open_store

        try:
            store = open_store(self.host, self.port, server=True, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - one line naming the address
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UsageError(f"rendezvous {self}: {self.serving} cannot serve the store there ({first}); HOST must be "
                             "an address of this host and PORT free") from None
        return store, f"{self.host}:{self.port}"

    def publish(self, store: Any, address: str, epoch: int) -> None:
        import socket

        store.set(HOST_KEY, socket.gethostname())
        store.set(EPOCH_KEY, str(epoch))

    def retire(self, store: Any) -> None:
        try:
            store.delete_key(EPOCH_KEY)
        except Exception:  # noqa: BLE001 - the store is going away anyway
            pass

    def dial(self, deadline: float, timeout: float, fresh_from: float | None, whose: str) -> tuple[Any, str]:
        from streamer.transport.store import open_store

        last = ""
        store = None
        while time.monotonic() < deadline:
            try:
                if store is None:
                    left = max(0.5, deadline - time.monotonic())
                    store = open_store(self.host, self.port, server=False, timeout=min(5.0, left))
                if store.check([EPOCH_KEY]):
                    check_reachable(self.host, store.get(HOST_KEY).decode() if store.check([HOST_KEY]) else "", str(self))
                    return store, f"{self.host}:{self.port}/{int(store.get(EPOCH_KEY))}"
            except UsageError:
                raise
            except Exception as e:  # noqa: BLE001 - the receivers' store is not up (yet): try again
                last = str(e).splitlines()[0] if str(e) else type(e).__name__
                store = None
            time.sleep(0.2)
        raise PeerTimeoutError(f"timed out after {timeout:g} s waiting for {whose} at {self}"
                               + (f" (last error: {last})" if last else ""))

    def plane(self, deadline: float, timeout: float) -> str:
        return "store"


class RegistryRendezvous:
    """``tcp://HOST:PORT@NAME``: replica NAME, entered in the registry that trainer rank 0 serves at
    ``HOST:PORT`` (see the module docstring)."""

    def __init__(self, host: str, port: int, name: str) -> None:
        self.host, self.port, self.name = host, port, name
        self._registrar: Registrar | None = None

    def __str__(self) -> str:
        return f"{TCP}{self.host}:{self.port}@{self.name}"

    def registry(self, timeout: float) -> Any:
        """A client of the trainer's registry (raises while it is not up)."""
        from streamer.transport.store import open_store

        return open_store(self.host, self.port, server=False, timeout=timeout)

    def serve(self, timeout: float) -> tuple[Any, str]:
        # the trainer dials this store from the registry's host: offer the address that reaches it
        return _serve_free_port(timeout, toward=self.host)

    def publish(self, store: Any, address: str, epoch: int) -> None:
        self.retire(store)
        self._registrar = Registrar(self.name, self.registry, _entry(address, epoch))

    def retire(self, store: Any) -> None:
        if self._registrar is not None:
            self._registrar.stop()
            self._registrar = None

    def dial(self, deadline: float, timeout: float, fresh_from: float | None, whose: str) -> tuple[Any, str]:
        last, registry = "", None
        key = entry_key(self.name)
        while time.monotonic() < deadline:
            try:
                if registry is None:
                    registry = self.registry(timeout=min(5.0, max(0.5, deadline - time.monotonic())))
                text = peek(registry, key)
                if text is not None:
                    at = _written_at(text)
                    if fresh_from is None or at is None or at >= fresh_from:
                        return _dial_entry(text, str(self), deadline)
            except UsageError:
                raise
            except Exception as e:  # noqa: BLE001 - no registry yet, or a stale entry: read it again
                last = str(e).splitlines()[0] if str(e) else type(e).__name__
                registry = None
            time.sleep(0.2)
        raise PeerTimeoutError(f"timed out after {timeout:g} s waiting for {whose} through the trainer's registry "
                               f"at {TCP}{self.host}:{self.port} (replica {self.name})"
                               + (f" (last error: {last})" if last else ""))

    def plane(self, deadline: float, timeout: float) -> str:
        return "store"
