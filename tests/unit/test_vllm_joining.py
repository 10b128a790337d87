"""``Join`` (streamer/vllm/joining.py): the engine joins the trainer's session on a thread, so that
``init_weight_transfer_engine`` returns at once; the first update waits for the join and raises its
failure by name; an engine that leaves first closes what the join opens. No vLLM needed."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from streamer.vllm.joining import Join


class Session:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _gated() -> tuple[threading.Event, Session, Join]:
    """A join whose trainer comes when the event is set."""
    go, s = threading.Event(), Session()

    def open_() -> Session:
        go.wait(10)
        return s

    return go, s, Join(open_)


def test_the_update_gets_the_session_the_thread_joined() -> None:
    go, s, j = _gated()
    assert not j.wait(0.05)  # the trainer has not come: the engine goes on meanwhile
    with pytest.raises(TimeoutError, match="not joined within 0.05 s"):
        j.result(0.05)
    go.set()
    assert j.result(10) is s and not s.closed


def test_a_failed_join_is_raised_by_name_at_the_update() -> None:
    def open_() -> Any:
        raise ValueError("the trainer's manifest lacks model.norm.weight")

    j = Join(open_)
    assert j.wait(10) and isinstance(j.error, ValueError)
    with pytest.raises(RuntimeError, match="joining the trainer's refit session failed .*model.norm.weight.*init_"):
        j.result(10)


def test_an_engine_that_leaves_first_closes_what_the_join_opens() -> None:
    go, s, j = _gated()
    j.abandon()  # shutdown_weight_transfer_engine while the join waits for the trainer
    go.set()
    assert j.wait(10) and s.closed and j.session is None
    done = Session()
    j2 = Join(lambda: done)
    assert j2.wait(10)
    j2.abandon()  # joined, then left: closed at once
    assert done.closed


def test_an_update_whose_start_waited_already_does_not_wait_again() -> None:
    go, _, j = _gated()
    assert not j.wait(0.05)  # start_weight_update waited its timeout: no trainer
    with pytest.raises(TimeoutError, match="not joined within 300 s"):
        j.result(300, waited=True)  # update_weights: at once, naming the timeout that ran out
    go.set()
