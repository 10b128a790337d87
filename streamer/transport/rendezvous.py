"""Where two jobs on the store control plane find each other: a shared file, or ``tcp://HOST:PORT``.

Receiver rank 0 serves the TCPStore both jobs join (it outlives any sender job: a restarted
trainer finds the same store). The rendezvous says where that store is, and in which *epoch* the
receivers wait (each new sender job is one epoch, ``transport.epochs``):

- **a file** (``/shared/refit.rdv``, both jobs see it): receiver rank 0 binds a free port on its
  host and writes ``tcp://HOST:PORT[/EPOCH]`` into the file; the others read it. The file is
  removed once every rank has joined, so a new sender job waits for the next one.
- **``tcp://HOST:PORT``** (no shared filesystem: Kubernetes pods, Ray clusters): receiver rank 0
  binds ``PORT`` on ``HOST``, which must be an address of its own host that the other job can
  reach (the port must be open between the jobs; the gloo or NCCL connections the transport opens
  afterwards use ports of their own, see docs/refit.md); everyone else connects to it. The epoch
  lives in the store (key ``rdv/epoch``), set while the receivers wait for a sender job and
  removed once every rank has joined, as the file is.

Several inference replicas fed by one trainer (``transport.roster``) join through a form of
their own each, named after the replica:

- **``PATH@NAME``**, a file beside the trainer's rendezvous file: a file rendezvous as above;
- **``tcp://HOST:PORT@NAME``** (no shared filesystem): the trainer's rank 0 serves a *registry*
  (a TCPStore) at ``HOST:PORT``. Replica NAME's rank 0 serves its own store on a free port of its
  host, as under a file, and keeps ``tcp://ADDRESS/EPOCH`` registered under NAME in the registry
  while it waits for a trainer (a thread: the registry may not be up yet, and a restarted trainer
  serves a new, empty one); it withdraws the entry once every rank joined. The replica's other
  ranks and the trainer read the entry as they would read the file (:class:`RegistryRendezvous`).

Every form is a :class:`Rendezvous`: ``serve`` / ``publish`` / ``retire`` on receiver rank 0,
``dial`` everywhere else, and ``plane`` for a sender that follows the receivers' choice.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Protocol

from formats.errors import PeerTimeoutError, UsageError

__all__ = ["FileRendezvous", "RegistryRendezvous", "Rendezvous", "TcpRendezvous", "TCP", "peek", "registered",
           "rendezvous_from"]

TCP = "tcp://"
#: the store key of a ``tcp://`` rendezvous that names the epoch the receivers wait in
EPOCH_KEY = "rdv/epoch"
#: where receiver rank 0 says which host it runs on (a store key; the file's second line)
HOST_KEY = "rdv/host"


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host in ("::1", "0:0:0:0:0:0:0:1")


def check_reachable(address_host: str, server_host: str, where: str) -> None:
    """Refuse, by name, a loopback address that receiver rank 0 on another host offers: this rank
    would reach its own host, not the store (``gethostbyname(hostname)`` is 127.0.1.1 on many
    machines)."""
    import socket

    me = socket.gethostname()
    if _is_loopback(address_host) and server_host and server_host != me:
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


def _serve_free_port(timeout: float) -> tuple[Any, str]:
    """Receiver rank 0's store on a free port of this host (``host_address``: peers dial it)."""
    from streamer.transport.store import open_store
    from streamer.transport.torch_dist import free_port, host_address

    address = f"{host_address()}:{free_port()}"
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


#: registry keys (the trainer's store): how many names were ever listed, the K-th name, a name's
#: entry while its replica waits, and a mark that a name is listed
_REG_COUNT, _REG_NAME, _REG_AT, _REG_LISTED = "reg/n", "reg/name/", "reg/at/", "reg/listed/"
#: seconds between a registrar's checks that its entry is still in the registry
_REG_EVERY = 0.5


_ABSENT = b"\x01absent"


def peek(store: Any, key: str) -> str | None:
    """A key's value, or None when it is not there, without waiting (a TCPStore ``get`` waits for
    a missing key up to the store's timeout; ``compare_set`` with an expected value that no key
    holds answers at once and creates nothing)."""
    got = store.compare_set(key, _ABSENT, _ABSENT)
    return None if got == _ABSENT else bytes(got).decode()


def registered(registry: Any) -> dict[str, str]:
    """The replicas whose entries are in the registry now (a trainer rank's client of it, or the
    server): name -> entry."""
    out: dict[str, str] = {}
    for k in range(int(registry.add(_REG_COUNT, 0))):
        name = peek(registry, f"{_REG_NAME}{k}")
        if name is None or name in out:  # None: being listed right now
            continue
        text = peek(registry, f"{_REG_AT}{name}")
        if text is not None:  # None: joined, or not waiting
            out[name] = text
    return out


class _Registrar:
    """Keeps one replica's entry in the trainer's registry until stopped: connects (again) while the
    registry is down, and enters it again into a registry that lost it (a restarted trainer)."""

    def __init__(self, rdv: RegistryRendezvous, text: str) -> None:
        self.rdv, self.text = rdv, text
        self.stopped = threading.Event()
        self.client: Any = None
        self.thread = threading.Thread(target=self._run, name=f"shardstream-registrar-{rdv.name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        key = f"{_REG_AT}{self.rdv.name}"
        while not self.stopped.is_set():
            try:
                if self.client is None:
                    self.client = self.rdv.registry(timeout=5.0)
                if peek(self.client, key) != self.text:
                    self.client.set(key, self.text)  # the entry first: a lister finds it once the name is listed
                    if not self.client.check([f"{_REG_LISTED}{self.rdv.name}"]):
                        k = int(self.client.add(_REG_COUNT, 1)) - 1
                        self.client.set(f"{_REG_NAME}{k}", self.rdv.name)
                        self.client.set(f"{_REG_LISTED}{self.rdv.name}", "1")
            except Exception:  # noqa: BLE001 - no trainer (yet), or it went away: try again
                self.client = None
            self.stopped.wait(_REG_EVERY)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10.0)
        try:  # withdrawn: a trainer that lists the registry now must not join this epoch again
            if self.client is not None and peek(self.client, f"{_REG_AT}{self.rdv.name}") == self.text:
                self.client.delete_key(f"{_REG_AT}{self.rdv.name}")
        except Exception:  # noqa: BLE001 - the registry went away: nothing to withdraw from
            pass


class RegistryRendezvous:
    """``tcp://HOST:PORT@NAME``: replica NAME, entered in the registry that trainer rank 0 serves at
    ``HOST:PORT`` (see the module docstring)."""

    def __init__(self, host: str, port: int, name: str) -> None:
        self.host, self.port, self.name = host, port, name
        self._registrar: _Registrar | None = None

    def __str__(self) -> str:
        return f"{TCP}{self.host}:{self.port}@{self.name}"

    def registry(self, timeout: float) -> Any:
        """A client of the trainer's registry (raises while it is not up)."""
        from streamer.transport.store import open_store

        return open_store(self.host, self.port, server=False, timeout=timeout)

    def serve(self, timeout: float) -> tuple[Any, str]:
        return _serve_free_port(timeout)

    def publish(self, store: Any, address: str, epoch: int) -> None:
        self.retire(store)
        self._registrar = _Registrar(self, _entry(address, epoch))

    def retire(self, store: Any) -> None:
        if self._registrar is not None:
            self._registrar.stop()
            self._registrar = None

    def dial(self, deadline: float, timeout: float, fresh_from: float | None, whose: str) -> tuple[Any, str]:
        last, registry = "", None
        key = f"{_REG_AT}{self.name}"
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
