"""A receiver's watch over its sender job (store plane): the job's close ends a receiver's wait
for the next push at once, but not a push whose bytes are still arriving (the sender ranks finish
sending before the slowest receiver finishes receiving: ending there dropped a whole push), and a
silent sender rank ends either."""

from __future__ import annotations

import time
from typing import Any

import pytest

from streamer.transport.base import PeerClosedError, RemoteAbortError
from streamer.transport.epochs import SenderWatch


class _Store:
    """The part of a TCPStore that the watch reads."""

    def __init__(self) -> None:
        self.kv: dict[str, str] = {}

    def check(self, keys: list[str]) -> bool:
        return all(k in self.kv for k in keys)

    def multi_get(self, keys: list[str]) -> list[Any]:
        return [self.kv[k] for k in keys]


def test_close_ends_only_a_wait_for_the_next_push(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _Store()
    store.kv["p/hb/0"] = "1"
    w = SenderWatch(store, "p/", 1)
    assert w.poll() is None
    store.kv["p/done"] = "1"
    w.in_push = True
    w._next = 0.0
    assert w.poll() is None  # bytes still arriving: the close does not end the push
    w.in_push = False
    w._next = 0.0
    assert isinstance(w.poll(), PeerClosedError)


def test_a_silent_sender_ends_a_push(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSTREAM_PEER_SILENCE", "0.6")
    store = _Store()
    store.kv["p/hb/0"] = "1"
    w = SenderWatch(store, "p/", 1)
    w.in_push = True
    assert w.poll() is None
    time.sleep(0.7)
    w._next = 0.0
    err = w.poll()
    assert isinstance(err, RemoteAbortError) and "sender rank 0 went silent" in str(err)
