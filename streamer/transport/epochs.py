"""Sessions that outlive their sender job (store control plane only).

The receivers serve the TCPStore, so they can outlive the trainer: when it dies or its push
breaks off, the receivers leave that *epoch* of the session and open the next one. Every key of
epoch E lives under ``epoch_prefix(E)`` (epoch 0 keeps the plain names), and the rendezvous file
says which epoch a new sender job joins (``tcp://HOST:PORT/E``): receiver rank 0 writes it when
the receivers wait for a new trainer and removes it once everyone joined, so a sender job only
ever reads an epoch that no other sender job holds.

Liveness: each sender rank bumps a counter in the store from a thread (``Heartbeat``, its own
store connection); the receivers' waits (``SenderWatch``, polled with the abort notice) end
within ``silence_limit()`` seconds of a sender going quiet, and at once when the sender job
closed the session for good (its rank 0 sets ``done``). A sender that dies mid-push is noticed
sooner still: its gloo connections close under the receivers' pending receives.

MPI (MPICH) makes a peer's death fatal to the whole launch, so none of this applies there.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from formats.errors import UsageError
from streamer.transport.base import PeerClosedError, RemoteAbortError

__all__ = ["Heartbeat", "SenderWatch", "epoch_prefix", "parse_address", "sign_off", "silence_limit"]

#: seconds between a sender's signs of life
BEAT = 0.5
#: seconds of silence after which a sender counts as dead ($SHARDSTREAM_PEER_SILENCE overrides)
SILENCE = 5.0


def silence_limit() -> float:
    text = os.environ.get("SHARDSTREAM_PEER_SILENCE", "")
    if not text:
        return SILENCE
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v > BEAT:
        raise UsageError(f"SHARDSTREAM_PEER_SILENCE={text!r}: expected seconds above {BEAT:g}")
    return v


def epoch_prefix(epoch: int) -> str:
    return f"e{epoch}/" if epoch else ""


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT[/EPOCH]`` (the rendezvous file without ``tcp://``) -> (``HOST:PORT``, epoch)."""
    addr, _, epoch = text.partition("/")
    try:
        return addr, int(epoch or 0)
    except ValueError:
        raise UsageError(f"the rendezvous file names epoch {epoch!r}: expected a number") from None


class Heartbeat:
    """A sender rank's signs of life: ``key`` counts up every ``BEAT`` seconds over its own
    connection to the store (the main thread's client may be busy in a long wait)."""

    def __init__(self, address: str, key: str, timeout: float) -> None:
        from streamer.transport.store import open_store

        host, port = address.rsplit(":", 1)
        self._store = open_store(host, int(port), server=False, timeout=min(timeout, 10.0))
        self._key = key
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardstream-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(BEAT):
            try:
                self._store.add(self._key, 1)
            except Exception:  # noqa: BLE001 - the store's rank ended: nobody is listening
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * BEAT)


class SenderWatch:
    """What ends a receiver's wait besides an abort notice: the sender job closed the session
    (``PeerClosedError``), or a sender rank went silent (``RemoteAbortError``). Only receiver
    rank 0 reads the heartbeats (``heartbeats``): it then posts the abort notice, which the other
    receivers' waits read anyway (the store serves one small read per receiver and poll)."""

    def __init__(self, store: Any, prefix: str, n_send: int, heartbeats: bool = True) -> None:
        self.store = store
        self._done = f"{prefix}done"
        self._keys = [f"{prefix}hb/{r}" for r in range(n_send)] if heartbeats else []
        self._seen: list[tuple[int, float]] = []
        self._next = 0.0
        self._limit = silence_limit()
        #: set by the session while a push's bytes move: the sender job's close then does not end
        #: the wait (its ranks finish sending before the slowest receiver finishes receiving; a
        #: sender that died mid-push is still noticed by its silence)
        self.in_push = False

    def poll(self) -> RemoteAbortError | None:
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + BEAT / 2
        try:
            if not self.in_push and self.store.check([self._done]):
                return PeerClosedError()
            if not self._keys or not self.store.check(self._keys):
                return None  # still joining: the join's own timeout covers that
            counts = [int(v) for v in self.store.multi_get(self._keys)]
        except Exception:  # noqa: BLE001 - our own store: the abort poll reports it
            return None
        if not self._seen:
            self._seen = [(c, now) for c in counts]
        for r, c in enumerate(counts):
            last, since = self._seen[r]
            if c != last:
                self._seen[r] = (c, now)
            elif now - since > self._limit:
                return RemoteAbortError(f"sender rank {r} went silent: no sign of life for {now - since:.1f} s "
                                        "(the process died or hangs)", 3)
        return None


def sign_off(store: Any, key: str, n: int, timeout: float, wait: bool) -> None:
    """Count ``key`` up; with ``wait`` (the rank serving the store) until ``n`` signed off."""
    try:
        store.add(key, 1)
        deadline = time.monotonic() + timeout
        while wait and int(store.add(key, 0)) < n and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 - peers that already left took nothing with them
        pass
