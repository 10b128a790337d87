"""``one_reply`` (streamer/vllm/replies.py): after a failed call, only the engine's last worker
raises, so that vLLM's executor reads every worker's reply of the call and none is left for the
next call. The process group is faked: each case says what every worker's call did."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from streamer.vllm import replies  # noqa: E402


def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, outcomes: list[str | None]) -> None:
    """This worker is ``rank``; the exchange returns ``outcomes`` (None: that worker succeeded)."""
    import torch.distributed as dist

    monkeypatch.setattr(replies, "world_cpu_group", lambda: object())
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: len(outcomes))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)

    def gather(out: list[Any], mine: Any, group: Any = None) -> None:
        assert mine == outcomes[rank]  # what this worker sends is its own outcome
        out[:] = outcomes

    monkeypatch.setattr(dist, "all_gather_object", gather)

    def reduce_max(t: Any, op: Any = None, group: Any = None) -> None:  # the any-failed flag first
        assert op == dist.ReduceOp.MAX and int(t.item()) == int(outcomes[rank] is not None)
        t.fill_(int(any(o is not None for o in outcomes)))

    monkeypatch.setattr(dist, "all_reduce", reduce_max)


def _call(fail: bool, swallowed: list[Any] | None = None) -> Any:
    class Engine:
        @replies.one_reply(None if swallowed is None else swallowed.append)
        def method(self) -> str:
            if fail:
                raise ValueError("LoRA id 1 is registered already")
            return "done"

    return Engine().method()


def test_when_every_worker_failed_only_the_last_raises_its_own_error(monkeypatch: pytest.MonkeyPatch) -> None:
    every = ["ValueError: LoRA id 1 is registered already"] * 3
    for rank in (0, 1):
        _as_rank(monkeypatch, rank, every)
        ended: list[Any] = []
        assert _call(True, ended) is None  # its reply is a success: vLLM reads on to the last worker
        assert len(ended) == 1  # ... and it ends vLLM's update there as a raise would have
    _as_rank(monkeypatch, 2, every)
    with pytest.raises(ValueError, match="registered already"):
        _call(True)


def test_a_failure_of_another_worker_is_raised_by_the_last_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = [None, "ValueError: LoRA id 1 is registered already", None]
    _as_rank(monkeypatch, 0, outcomes)
    ended: list[Any] = []
    assert _call(False, ended) is None and len(ended) == 1  # a success on a failed call ends the update too
    _as_rank(monkeypatch, 1, outcomes)
    assert _call(True) is None
    _as_rank(monkeypatch, 2, outcomes)
    with pytest.raises(replies.WorkerFailed, match="worker 1 of 3 failed: ValueError: LoRA id 1 is registered"):
        _call(False)


def test_without_failures_or_a_group_results_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    _as_rank(monkeypatch, 1, [None, None])
    ended = []
    assert _call(False, ended) == "done" and ended == []
    monkeypatch.setattr(replies, "world_cpu_group", lambda: None)
    assert _call(False) == "done"
    with pytest.raises(ValueError):
        _call(True)
