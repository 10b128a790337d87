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

Both forms are a :class:`Rendezvous`: ``serve`` / ``publish`` / ``retire`` on receiver rank 0,
``dial`` everywhere else, and ``plane`` for a sender that follows the receivers' choice.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from formats.errors import PeerTimeoutError, UsageError

__all__ = ["FileRendezvous", "Rendezvous", "TcpRendezvous", "TCP", "rendezvous_from"]

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
    """``tcp://HOST:PORT`` or a file path."""
    s = str(text)
    if s.startswith(TCP):
        return TcpRendezvous.parse(s)
    return FileRendezvous(Path(s))


class FileRendezvous:
    """A file both jobs can see (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __str__(self) -> str:
        return str(self.path)

    def serve(self, timeout: float) -> tuple[Any, str]:
        from streamer.transport.store import open_store
        from streamer.transport.torch_dist import free_port, host_address

        address = f"{host_address()}:{free_port()}"
        host, port = address.rsplit(":", 1)
        return open_store(host, int(port), server=True, timeout=timeout), address

    def publish(self, store: Any, address: str, epoch: int) -> None:
        import socket

        from formats.manifest.wire import atomic_write_bytes

        text = f"{TCP}{address}{f'/{epoch}' if epoch else ''}\nhost={socket.gethostname()}\n"
        atomic_write_bytes(self.path, text.encode())

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
        from streamer.transport.store import open_store

        last = ""
        while time.monotonic() < deadline:
            text = self.read(deadline, fresh_from)
            if not text:
                break
            if not text.startswith(TCP):
                raise UsageError(f"{self.path} holds an MPI port, not a store address: the receiver job uses the MPI "
                                 "control plane; start it with --control store (or launch this job with mpiexec)")
            first, _, rest = text.partition("\n")
            host, port = first[len(TCP):].split("/")[0].rsplit(":", 1)
            check_reachable(host, rest.strip().removeprefix("host=") if rest.startswith("host=") else "", str(self.path))
            try:
                left = max(0.5, deadline - time.monotonic())
                return open_store(host, int(port), server=False, timeout=min(5.0, left)), first[len(TCP):]
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

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    @classmethod
    def parse(cls, text: str) -> TcpRendezvous:
        host, sep, port = text[len(TCP):].rstrip("/").rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"rendezvous {text!r}: expected tcp://HOST:PORT (a port from 1 to 65535)")
        return cls(host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"{TCP}{self.host}:{self.port}"

    def serve(self, timeout: float) -> tuple[Any, str]:
        from streamer.transport.store import open_store

        try:
            store = open_store(self.host, self.port, server=True, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - one line naming the address
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UsageError(f"rendezvous {self}: receiver rank 0 cannot serve the store there ({first}); HOST must be "
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
