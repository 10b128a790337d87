"""The registry of replicas waiting for a trainer: a TCPStore that trainer rank 0 serves at
``tcp://HOST:PORT`` when the jobs share no filesystem (``transport.rendezvous``, the
``tcp://HOST:PORT@NAME`` form).

Replica NAME's rank 0 keeps its entry (what a rendezvous file would hold: its own store's address
and epoch) under NAME while it waits (``Registrar``, a thread: the registry may not be up yet, and
a restarted trainer serves a new, empty one), and withdraws it once every rank joined. The
trainer lists the entries (``registered``); the replica's other ranks read their own (``peek``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Registrar", "entry_key", "peek", "registered"]

#: registry keys (the trainer's store): how many names were ever listed, the K-th name, a name's
#: entry while its replica waits, and a mark that a name is listed
_REG_COUNT, _REG_NAME, _REG_AT, _REG_LISTED = "reg/n", "reg/name/", "reg/at/", "reg/listed/"
#: seconds between a registrar's checks that its entry is still in the registry
_REG_EVERY = 0.5


_ABSENT = b"\x01absent"


def entry_key(name: str) -> str:
    """The registry key of replica ``name``'s entry (there while it waits)."""
    return f"{_REG_AT}{name}"


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
        text = peek(registry, entry_key(name))
        if text is not None:  # None: joined, or not waiting
            out[name] = text
    return out


class Registrar:
    """Keeps replica ``name``'s entry ``text`` in the trainer's registry until stopped: connects
    (``connect(timeout)``, again) while the registry is down, and enters it again into a registry
    that lost it (a restarted trainer)."""

    def __init__(self, name: str, connect: Callable[[float], Any], text: str) -> None:
        self.name, self.connect, self.text = name, connect, text
        self.stopped = threading.Event()
        self.client: Any = None
        self.thread = threading.Thread(target=self._run, name=f"shardstream-registrar-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        key = entry_key(self.name)
        while not self.stopped.is_set():
            try:
                if self.client is None:
                    self.client = self.connect(5.0)
                if peek(self.client, key) != self.text:
                    self.client.set(key, self.text)  # the entry first: a lister finds it once the name is listed
                    if not self.client.check([f"{_REG_LISTED}{self.name}"]):
                        k = int(self.client.add(_REG_COUNT, 1)) - 1
                        self.client.set(f"{_REG_NAME}{k}", self.name)
                        self.client.set(f"{_REG_LISTED}{self.name}", "1")
            except Exception:  # noqa: BLE001 - no trainer (yet), or it went away: try again
                self.client = None
            self.stopped.wait(_REG_EVERY)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10.0)
        try:  # withdrawn: a trainer that lists the registry now must not join this epoch again
            if self.client is not None and peek(self.client, entry_key(self.name)) == self.text:
                self.client.delete_key(entry_key(self.name))
        except Exception:  # noqa: BLE001 - the registry went away: nothing to withdraw from
            pass
