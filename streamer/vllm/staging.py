"""Staged receive for the vLLM backend: pushes land in host buffers while the engine serves.

With ``init_info={"staging": "host"}`` each worker runs one thread that has every push of the
session pulled into a host staging buffer (one tensor per local tensor, this worker's bytes), while
the engine goes on serving. The pulls happen in a process of the worker's own
(:mod:`streamer.vllm.stage_proc`, buffers in shared memory): a thread in the worker would share the
GIL with the engine's busy loop and crawl. The trainer's ``push`` returns once every worker's
buffer holds it: it never waits for the engine to pause. The staging process also joins the
trainer's session, so ``init_weight_transfer_engine`` returns at once and the engine serves before
any trainer is there. ``update_weights`` then only *commits* a staged version: it copies the staged
bytes into the served tensors (``engine.ShardstreamWeightTransferEngine``).

Two buffers, in rotating roles:

- **committed**: the bytes of the version the engine serves (none before the first commit);
- **staged**: a version received in full, not committed yet;
- a push is received into the buffer that is neither. A push that breaks off leaves that buffer
  "free" again and touches neither the served tensors nor a staged version.

When both buffers are taken (a version staged and not committed, and a committed copy), the thread
waits for the next commit before it pulls again: the trainer's next push then waits for the
engine (back-pressure: at most one version ahead, never more than two buffers of this worker's bytes).
Committing a version frees the older committed buffer.

After a failed push (``PushFailed``) or a wait for a push that timed out, the thread goes back to
pulling: the session, on the store control plane, waits for the next push from this trainer job or
a restarted one, with no call on the engine side. It ends when the trainer job closes the session
(``pull`` returns None) or the engine shuts the backend down. In a delta session the buffer about to
receive first takes a copy of the last complete push, which the deltas apply to (``stage_proc``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["Received", "Receiver", "StageFailed", "Stager", "Staged"]

#: a child of vLLM's logger: the lines show in the engine's log with its format and level
_log = logging.getLogger("vllm.shardstream")


@dataclass(eq=False)  # compared by identity: the roles move between these two objects
class Staged:
    """One host buffer and what it holds: ``version`` (None: nothing complete)."""

    tensors: dict[str, Any]
    version: int | None = None
    role: str = "free"  # free | receiving | staged | committing | committed


@dataclass
class Received:
    """One complete push in a buffer: its version, the seconds the pull took, the bytes received."""

    version: int
    seconds: float
    nbytes: int


class StageFailed(Exception):
    """A push broke off (``PushFailed``, a timeout between pushes): the next pull waits for the next."""


class Receiver(Protocol):
    """Where the staging thread's pulls happen (:class:`ProcessReceiver` in the engine)."""

    def open(self) -> Mapping[str, tuple[tuple[int, ...], Any]]:
        """Join the trainer; this worker's local tensors (name -> (shape, torch dtype))."""

    def buffers(self, n: int) -> list[dict[str, Any]]:
        """``n`` host buffers the pulls fill, shaped as ``open`` said."""

    def pull(self, index: int) -> Received | None:
        """The next push into buffer ``index``; None once the trainer closed the session. Raises
        :class:`StageFailed` for a push that broke off."""

    def close(self) -> None:
        """Leave the session; also ends a pull in flight."""


@dataclass
class Stager:
    """The staging thread of one worker (see the module docstring), pulling through ``receiver``
    (joined on the thread: ``init_weight_transfer_engine`` returns at once, and the engine serves
    while the trainer is not there yet)."""

    receiver: Receiver
    timeout: float
    buffers: list[Staged] = field(default_factory=list)
    #: the last push failure (one line), cleared by the next complete push
    error: str | None = None
    #: nothing more will be staged, and why (the trainer job closed the session, a join that failed)
    closed: bool = False
    why_closed: str = ""
    #: per complete push: (version, seconds it took, bytes received)
    received: list[tuple[int, float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="shardstream-staging", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for b in self.buffers for t in b.tensors.values())

    # ------------------------------------------------------------------ the thread
    def _free(self) -> Staged | None:
        return next((b for b in self.buffers if b.role == "free"), None)

    def _join(self) -> bool:
        """Join the trainer and allocate the buffers; False when that fails: for good (``closed``,
        the error kept), or because no trainer came within the timeout (tried again by ``_run``)."""
        try:
            self.receiver.open()
            buffers = [Staged(t) for t in self.receiver.buffers(2)]
        except StageFailed as e:
            _log.info("shardstream staging: no trainer joined (%s); waiting again", e)
            return False
        except BaseException as e:  # noqa: BLE001 - reported by the next commit, by name
            if self._stop:  # the engine shut the backend down while joining: nothing to report
                return False
            with self._cond:
                self.error = f"joining the trainer failed: {type(e).__name__}: {e}"
                self.closed, self.why_closed = True, "the staging process could not join the trainer"
                self._cond.notify_all()
            _log.error("shardstream staging: %s", self.error)
            return False
        with self._cond:
            self.buffers = buffers
            self._cond.notify_all()
        return True

    def _run(self) -> None:
        while not self._join():  # an engine outlives a trainer that has not come yet: wait again
            if self._stop or self.closed:
                self.receiver.close()
                return
        while True:
            with self._cond:
                while not self._stop and self._free() is None:
                    self._cond.wait(1.0)
                if self._stop:
                    break
                buf = self._free()
                assert buf is not None
                buf.role, buf.version = "receiving", None
            try:
                got = self.receiver.pull(self.buffers.index(buf))
            except StageFailed as e:
                _log.warning("shardstream staging: a push failed (%s); the served weights are untouched, "
                             "waiting for the next push", e)
                self._settle(buf, None, str(e))
                continue
            except BaseException as e:  # noqa: BLE001 - the thread must not die silently: the commit reports it
                if not self._stop:
                    _log.error("shardstream staging: the staging thread ends (%s: %s); the next commit reports it",
                               type(e).__name__, e)
                self._settle(buf, None, f"{type(e).__name__}: {e}", closed="the staging process ended")
                break
            if got is None:  # the trainer job closed the session
                self._settle(buf, None, None, closed="the trainer closed the session")
                break
            self._settle(buf, got.version, None, stats=(got.version, got.seconds, got.nbytes))
            _log.info("shardstream staging: version %s staged (%d bytes)", got.version, got.nbytes)
        self.receiver.close()

    def _settle(self, buf: Staged, version: int | None, error: str | None, *, closed: str = "",
                stats: tuple[int, float, int] | None = None) -> None:
        with self._cond:
            if version is None:
                buf.role, buf.version = "free", None
            else:
                for b in self.buffers:  # an older staged version is superseded: its buffer is free again
                    if b is not buf and b.role == "staged":
                        b.role, b.version = "free", None
                buf.role, buf.version = "staged", version
                self.received.append(stats)  # type: ignore[arg-type]
            self.error = error  # a complete push clears the last failure
            if closed and not self.closed:
                self.closed, self.why_closed = True, closed
            self._cond.notify_all()

    # ------------------------------------------------------------------ the engine's side
    def take(self, version: int | None) -> Staged:
        """The staged buffer to commit: ``version``, or the newest staged one; waits (up to the
        timeout) while a push is under way or none has come. Raises naming what is missing."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                staged = [b for b in self.buffers if b.role == "staged"]
                hit = [b for b in staged if version is None or b.version == version]
                if hit:
                    # held for the commit: a push completing meanwhile supersedes nothing the engine reads
                    buf = max(hit, key=lambda b: b.version or 0)
                    buf.role = "committing"
                    return buf
                done = next((b.version for b in self.buffers if b.role == "committed"), None)
                if version is not None and done is not None and version <= done:
                    raise RuntimeError(f"shardstream: version {version} is not staged: the engine serves version "
                                       f"{done} already" + ("" if version == done else " (a newer one)"))
                if version is not None and staged and all((b.version or 0) > version for b in staged):
                    raise RuntimeError(f"shardstream: version {version} is not staged (staged: "
                                       f"{sorted(b.version or 0 for b in staged)}); a newer push replaced it")
                left = deadline - time.monotonic()
                if self.closed or left <= 0:
                    have = sorted(b.version or 0 for b in staged)
                    why = self.why_closed if self.closed else f"none arrived within {self.timeout:.0f} s"
                    raise RuntimeError(f"shardstream: no staged version{'' if version is None else f' {version}'} to "
                                       f"commit ({why}; staged: {have or 'none'}"
                                       f"{f'; last push failure: {self.error}' if self.error else ''})")
                self._cond.wait(min(left, 1.0))

    def committed(self, buf: Staged) -> None:
        """``buf``'s version is now served: it becomes the committed copy, the previous one is freed."""
        with self._cond:
            for b in self.buffers:
                if b is not buf and b.role == "committed":
                    b.role, b.version = "free", None
            buf.role = "committed"
            self._cond.notify_all()

    def release(self, buf: Staged) -> None:
        """A commit of ``buf`` failed: it is staged again, unless a newer push was staged meanwhile."""
        with self._cond:
            newer = any(b is not buf and b.role == "staged" for b in self.buffers)
            buf.role, buf.version = ("free", None) if newer else ("staged", buf.version)
            self._cond.notify_all()

    def last_committed(self) -> Staged | None:
        with self._cond:
            return next((b for b in self.buffers if b.role == "committed"), None)

    def stop(self) -> None:
        """End the thread: at once when it waits for a buffer, else when its pull returns (the
        session's timeout bounds it)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self.receiver.close()  # ends a pull in flight
        self._thread.join(self.timeout)
