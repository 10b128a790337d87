"""A control plane over a ``torch.distributed.TCPStore``: for jobs that were not launched by MPI.

A trainer started by ``torchrun`` has no MPI; it joins a refit through the rendezvous file,
which then holds ``tcp://HOST:PORT`` of a TCPStore served by receiver rank 0. The store carries
the small collectives (barrier, allgather, broadcast of bytes) and the abort notice; bulk
bytes move over gloo or NCCL process groups built from the same store (``torch_dist``).

Keys are numbered per collective. A rank deletes its own key of collective ``k-1`` once it has
seen every key of collective ``k`` of the same kind: by then every rank has finished ``k-1``.
Each wait polls with a short timeout so that an abort posted by any rank ends it promptly.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from formats.errors import PeerTimeoutError, UsageError
from streamer.transport.base import HostBuffers, RemoteAbortError, Request

__all__ = ["StoreControl", "open_store"]

#: how often a wait checks the abort key (seconds)
_ABORT_POLL = 0.2


def open_store(host: str, port: int, *, server: bool, timeout: float) -> Any:
    """A TCPStore client, or the server (``port`` 0 picks a free one) when ``server``."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not in torch's stubs' __all__

    return TCPStore(host, port, None, server, timeout=datetime.timedelta(seconds=timeout),
                    wait_for_workers=False)


@contextmanager
def _gone(what: str) -> Iterator[None]:
    """A store call whose server's rank ended (torch raises its own errors): ``RemoteAbortError``."""
    try:
        yield
    except RemoteAbortError:
        raise
    except Exception as e:  # noqa: BLE001 - DistNetworkError, RuntimeError, ...: the server is gone
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RemoteAbortError(f"{what}: the rendezvous store went away ({first})", 3) from e


class StoreControl(HostBuffers):
    """Collectives of ``size`` ranks over ``store`` under ``prefix`` (no bulk data)."""

    name = "store"

    def __init__(self, store: Any, rank: int, size: int, prefix: str,
                 names: Any = None, abort_key: str | None = None) -> None:
        self.store, self.rank, self.size, self.prefix = store, rank, size, prefix
        self.names = names or (lambda r: f"rank {r}")
        self._seq: dict[str, int] = {}
        self._abort_key = abort_key or prefix.rsplit("/", 1)[0] + "/abort"
        #: what else ends a wait (``transport.epochs.SenderWatch``: a sender's silence, its close)
        self.watch: Any = None

    # -- data movement is not this plane's job
    def isend(self, buf: Any, dst: int, tag: int) -> Request:
        raise UsageError("the store control plane moves no bulk data: use the gloo or nccl transport")

    def irecv(self, buf: Any, src: int, tag: int) -> Request:
        raise UsageError("the store control plane moves no bulk data: use the gloo or nccl transport")

    def bcast_buffer(self, buf: Any, root: int, ranks: Sequence[int], timeout: float) -> None:
        raise UsageError("the store control plane moves no bulk data: use the gloo or nccl transport")

    # -- abort notice
    def post_abort(self, message: str, exit_code: int) -> None:
        try:  # the first reason wins: later ranks fail because of it
            self.store.compare_set(self._abort_key, "",
                                   json.dumps({"message": message, "exit_code": exit_code}))
        except Exception:  # noqa: BLE001 - the store may be gone already; we exit anyway
            pass

    def poll_abort(self) -> RemoteAbortError | None:
        if self.watch is not None:
            err = self.watch.poll()
            if err is not None:
                return err  # type: ignore[no-any-return]
        try:
            if not self.store.check([self._abort_key]):
                return None
            info = json.loads(self.store.get(self._abort_key))
        except Exception:  # noqa: BLE001 - a vanished store server means its rank ended
            return RemoteAbortError("the rendezvous store went away: receiver rank 0 ended", 3)
        return RemoteAbortError(str(info["message"]), int(info["exit_code"]))

    # -- collectives
    def _key(self, kind: str, seq: int, rank: int) -> str:
        return f"{self.prefix}/{kind}/{seq}/{rank}"

    def _wait(self, keys: list[str], timeout: float, what: str, ranks: Sequence[int]) -> None:
        # ``check`` polls without the C++ warnings a timed-out ``store.wait`` prints
        deadline = time.monotonic() + timeout
        next_abort = 0.0
        nap = 2e-4
        while True:
            try:
                if self.store.check(keys):
                    return
            except Exception as e:  # noqa: BLE001 - the server's rank ended
                raise RemoteAbortError(f"{what}: the rendezvous store went away ({str(e).splitlines()[0]})", 3) from e
            now = time.monotonic()
            if now > next_abort:
                next_abort = now + _ABORT_POLL
                err = self.poll_abort()
                if err is not None:
                    raise err
            if now > deadline:
                missing = [r for r, k in zip(ranks, keys) if not self.store.check([k])]
                raise PeerTimeoutError(f"timed out after {timeout:g} s waiting for "
                                       f"{', '.join(self.names(r) for r in missing)} in {what} (the peer died, "
                                       "hung or never arrived)")
            time.sleep(nap)
            nap = min(nap * 2, 0.01)

    def wait_keys(self, keys: list[str], timeout: float, what: str, ranks: Sequence[int]) -> None:
        """Until every one of ``keys`` (one per rank of ``ranks``) is set: an abort notice, the
        store going away or the timeout ends the wait (naming the ranks missing)."""
        self._wait(keys, timeout, what, ranks)

    def _next(self, kind: str) -> int:
        seq = self._seq.get(kind, 0)
        self._seq[kind] = seq + 1
        return seq

    def allgather_bytes(self, data: bytes, timeout: float) -> list[bytes]:
        seq = self._next("ag")
        keys = [self._key("ag", seq, r) for r in range(self.size)]
        with _gone("allgather"):
            self.store.set(self._key("ag", seq, self.rank), data)
        self._wait(keys, timeout, "allgather", range(self.size))
        with _gone("allgather"):  # the server's rank may end between the wait and the read
            out = [bytes(v) for v in self.store.multi_get(keys)]
            if seq:
                self.store.delete_key(self._key("ag", seq - 1, self.rank))
        return out

    def barrier(self, timeout: float) -> None:
        self.allgather_bytes(b"", timeout)

    def bcast_bytes(self, data: bytes | None, root: int, timeout: float) -> bytes:
        # broadcasts are rare (manifests at start): their keys stay until the store closes
        seq = self._next(f"bc{root}")
        key = self._key(f"bc{root}", seq, root)
        if self.rank == root:
            with _gone("broadcast"):
                self.store.set(key, data or b"")
            return data or b""
        self._wait([key], timeout, f"broadcast from {self.names(root)}", [root])
        with _gone("broadcast"):
            return bytes(self.store.get(key))

    def close(self) -> None:
        pass
