"""A trainer's pushes to its replicas (``streamer.refit.fleet``), every trainer rank a thread over
the loopback transport (the trainer's own group) and each replica a stand-in session: what the
trainer ranks agree on when the replicas' pushes end at different times, fail, or refuse."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from formats.errors import PeerTimeoutError, TransportError
from streamer.execute.executor import ExecStats
from streamer.refit.fleet import Fleet
from streamer.refit.session import RefusedError
from streamer.transport.loopback import LoopbackHub


class _Replica:
    """What a trainer rank's session with one replica does in a push, as ``Fleet`` calls it."""

    def __init__(self, push_s: float = 0.0, receipts_s: float = 0.0, receipts_fail: bool = False,
                 refuse_at: int | None = None, close_s: float = 0.0) -> None:
        self.push_s, self.receipts_s, self.receipts_fail = push_s, receipts_s, receipts_fail
        self.refuse_at, self.close_s = refuse_at, close_s
        self.transport = SimpleNamespace(device=None)
        self.group = SimpleNamespace(control=SimpleNamespace(post_abort=lambda message, code: None))
        self.held_at_start: tuple[int | None, ...] = ()
        self.last: int | None = None  # as RefitSession._decide: a version must follow the last
        self.closed = False

    def push(self, tensors: Any, *, version: int) -> ExecStats:
        time.sleep(self.push_s)
        if (self.last is not None and version <= self.last) or version == self.refuse_at:
            raise RefusedError(problems=[f"version {version} refused (last {self.last})"])
        self.last = version
        return ExecStats(bytes_sent=10, full_bytes_sent=10)

    def await_receipts(self, version: int) -> None:
        time.sleep(self.receipts_s)
        if self.receipts_fail:
            raise PeerTimeoutError(f"timed out waiting for the receipts of version {version}")

    def close(self, done: bool = True) -> None:
        time.sleep(self.close_s)
        self.closed = True


def _fleets(tmp_path: Path, replicas: list[dict[str, _Replica]], timeout: float) -> list[Fleet]:
    hub = LoopbackHub(len(replicas))
    out = []
    for rank, (t, subs) in enumerate(zip(hub.endpoints(), replicas)):
        owner = SimpleNamespace(group=SimpleNamespace(role_control=t, role_rank=rank), timeout=timeout)
        f = Fleet(owner, lambda *a, **k: None, str(tmp_path / "rdv"), "gloo")
        f.subs = dict(subs)
        out.append(f)
    return out


def _on_every_rank(fleets: list[Fleet], act: Any) -> tuple[dict[int, Any], dict[int, BaseException]]:
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def run(r: int) -> None:
        try:
            results[r] = act(fleets[r])
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(fleets))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads)
    return results, errors


STATE = {"w": np.zeros(4, dtype=np.float32)}


def test_a_replica_without_receipts_is_dropped_on_every_trainer_rank(tmp_path: Path) -> None:
    """Only trainer rank 0 waits for replica a's receipts (up to the timeout, after its own
    bytes took a while to leave); the other rank's push ended long before. The trainer ranks
    still agree that a is dropped and b holds the version: the verdict exchange outwaits a push
    that took a whole timeout on another rank."""
    timeout = 1.0
    fleets = _fleets(tmp_path, [
        {"a": _Replica(push_s=0.3, receipts_s=timeout, receipts_fail=True), "b": _Replica()},
        {"a": _Replica(), "b": _Replica()},
    ], timeout)
    results, errors = _on_every_rank(fleets, lambda f: f.push(STATE, None))
    assert not errors, errors
    for r in range(2):
        _, v, got, _ = results[r]
        assert v == 1
        assert [(x.name, x.version) for x in got] == [("a", None), ("b", 1)], (r, got)
        assert "receipts" in str(got[0].error)
        assert sorted(fleets[r].subs) == ["b"]


def test_a_refusal_from_one_replica_leaves_the_numbering_going(tmp_path: Path) -> None:
    """Replica a refuses version 1 while b receives it: the trainer's push raises the refusal,
    and the next push (numbered by the trainer) is version 2 for both, not a repeated 1 that b
    refuses from then on. A replica whose push failed beside the refusal is dropped on every rank."""
    def subs() -> dict[str, _Replica]:
        return {"a": _Replica(refuse_at=1), "b": _Replica()}

    fleets = _fleets(tmp_path, [subs(), subs()], 5.0)
    for f in fleets:  # c's push fails on trainer rank 1 only (its connection broke there)
        f.subs["c"] = _Replica()
    fleets[1].subs["c"].push = lambda *a, **k: (_ for _ in ()).throw(TransportError("c's connection broke"))
    _, errors = _on_every_rank(fleets, lambda f: f.push(STATE, None))
    assert sorted(errors) == [0, 1] and all(isinstance(e, RefusedError) for e in errors.values()), errors
    assert all(sorted(f.subs) == ["a", "b"] for f in fleets)  # c dropped on both ranks
    results, errors = _on_every_rank(fleets, lambda f: f.push(STATE, None))
    assert not errors, errors
    for r in range(2):
        _, v, got, _ = results[r]
        assert v == 2 and [(x.name, x.version) for x in got] == [("a", 2), ("b", 2)], (r, got)


def test_close_does_not_wait_for_hung_replicas_one_after_another(tmp_path: Path) -> None:
    """Closing the sessions of replicas that hang (their stores answer only at the timeout) takes
    about one such wait, not one per replica."""
    (f,) = _fleets(tmp_path, [{n: _Replica(close_s=1.0) for n in "abc"}], 5.0)
    subs = dict(f.subs)
    t0 = time.monotonic()
    f.close(True)
    assert time.monotonic() - t0 < 2.5
    assert f.subs == {} and all(s.closed for s in subs.values())


def test_a_refusal_on_one_rank_where_another_lost_the_replica_is_a_drop_everywhere(tmp_path: Path) -> None:
    """Replica a's agreement completed on trainer rank 0 (a refusal) but broke off on rank 1 (a
    died in it): a is dropped on both ranks and neither raises; b received the version."""
    fleets = _fleets(tmp_path, [{"a": _Replica(refuse_at=1), "b": _Replica()}, {"a": _Replica(), "b": _Replica()}],
                     5.0)
    fleets[1].subs["a"].push = lambda *a, **k: (_ for _ in ()).throw(TransportError("a's connection broke"))
    results, errors = _on_every_rank(fleets, lambda f: f.push(STATE, None))
    assert not errors, errors
    for r in range(2):
        _, v, got, _ = results[r]
        assert v == 1 and [(x.name, x.version) for x in got] == [("a", None), ("b", 1)], (r, got)
        assert sorted(fleets[r].subs) == ["b"]


def test_a_stale_replica_file_is_passed_over_at_once(tmp_path: Path) -> None:
    """A replica file left by a job that is gone (nothing listens on its port) costs the trainer's
    listing no wait: the refused connection says so at once (a TCPStore client retried it 5 s)."""
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nobody listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "rdv@old").write_text(f"tcp://127.0.0.1:{port}")
    (fleet,) = _fleets(tmp_path, [{}], timeout=30)
    t0 = time.monotonic()
    assert fleet._listing(wait=False) == {}
    assert time.monotonic() - t0 < 1.0
    assert fleet.refused == {"old": f"tcp://127.0.0.1:{port}"}  # not tried again through the same file
