"""``streamer.vllm.staging.Stager`` without vLLM: the buffer roles a staged engine relies on, driven
by a scripted receiver (each ``pull`` takes the next scripted push). The process that receives in
the engine (``stage_proc.ProcessReceiver``) is tested in test_vllm_stage_proc.py."""

from __future__ import annotations

import queue
import time
from typing import Any

import pytest

from formats.errors import PushFailed
from streamer.vllm.staging import Received, StageFailed, Stager


class _Session:
    """A scripted receiver: ``pull`` blocks until the test scripts a push: a version (the buffer gets
    it as values), "fail" (a ``PushFailed``) or "close" (the trainer closed: None)."""

    def __init__(self) -> None:
        self.pushes: queue.Queue[Any] = queue.Queue()
        self.pulling = 0
        self.closed = False
        self.bufs: list[dict[str, Any]] = []

    def open(self) -> dict[str, Any]:
        import torch

        return {"w": ((4,), torch.float32)}

    def buffers(self, n: int) -> list[dict[str, Any]]:
        import torch

        self.bufs = [{"w": torch.empty(4)} for _ in range(n)]
        return self.bufs

    def pull(self, index: int) -> Received | None:
        self.pulling += 1
        what = self.pushes.get(timeout=30)
        if what == "fail":
            raise StageFailed(f"PushFailed: {PushFailed('the trainer died half-way', what)}")
        if what == "close":
            return None
        self.bufs[index]["w"].fill_(what)
        return Received(what, 0.0, 8)

    def close(self) -> None:
        self.closed = True


def _until(cond: Any, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < 10, what
        time.sleep(0.01)


@pytest.fixture
def staged() -> Any:
    session = _Session()
    stager = Stager(session, timeout=5)
    stager.start()
    yield stager, session
    session.pushes.put("close")
    stager.stop()


def test_a_push_completing_during_a_commit_supersedes_nothing_the_engine_reads(staged: Any) -> None:
    stager, session = staged
    session.pushes.put(1)
    buf = stager.take(None)
    assert (buf.version, buf.role, float(buf.tensors["w"][0])) == (1, "committing", 1.0)
    session.pushes.put(2)  # lands in the other buffer while version 1 is being committed
    _until(lambda: any(b.role == "staged" for b in stager.buffers), "version 2 staged")
    assert buf.role == "committing" and float(buf.tensors["w"][0]) == 1.0
    stager.committed(buf)
    # both buffers taken (committed 1, staged 2): the thread does not pull until the next commit
    time.sleep(0.2)
    assert session.pulling == 2
    nxt = stager.take(None)
    assert nxt.version == 2
    stager.committed(nxt)
    _until(lambda: session.pulling == 3, "the freed buffer receives again")
    assert [b.role for b in stager.buffers].count("committed") == 1
    with pytest.raises(RuntimeError, match="version 1 is not staged: the engine serves version 2 already"):
        stager.take(1)


def test_a_broken_push_frees_its_buffer_and_the_thread_waits_for_the_next(staged: Any) -> None:
    stager, session = staged
    session.pushes.put(1)
    stager.committed(stager.take(None))
    session.pushes.put("fail")
    _until(lambda: stager.error is not None, "the failure recorded")
    assert "PushFailed" in stager.error and ("staged", 2) not in [(b.role, b.version) for b in stager.buffers]
    session.pushes.put(2)  # a restarted trainer: no call on the engine side
    assert stager.take(None).version == 2 and stager.error is None


def test_a_failed_commit_stages_again_unless_a_newer_push_came(staged: Any) -> None:
    stager, session = staged
    session.pushes.put(1)
    buf = stager.take(None)
    stager.release(buf)
    assert buf.role == "staged"
    buf = stager.take(1)
    session.pushes.put(2)
    _until(lambda: any(b.role == "staged" for b in stager.buffers), "version 2 staged")
    stager.release(buf)  # version 2 arrived meanwhile: version 1 is dropped
    assert buf.role == "free" and stager.take(None).version == 2


def test_a_closed_session_ends_the_wait_with_the_reason(staged: Any) -> None:
    stager, session = staged
    session.pushes.put("close")
    with pytest.raises(RuntimeError, match="the trainer closed the session"):
        stager.take(None)
    _until(lambda: session.closed, "the thread closes the session")
