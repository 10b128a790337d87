"""A refit session joined on a thread, so that ``init_weight_transfer_engine`` returns at once.

Joining the trainer's session (``RefitSession.open``) waits for the trainer. Inside
``init_weight_transfer_engine`` that wait held the engine: ``vllm serve`` answered nothing, not even
``/v1/completions`` or ``/weight_info``, until the trainer came or the init timed out. So the
engine starts the join on a thread and returns; the engine serves meanwhile. The first update
waits for it: ``start_weight_update`` waits (bounded by the timeout) and never raises for it, since
vLLM 0.32's executor, at TP > 1, reads only the first worker's error of a failed call and leaves the
others for the next call (``replies.py``); ``update_weights``, whose replies ``one_reply`` keeps in
step, raises the join's failure, by name.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Join"]


class Join:
    """``open_()`` run on a thread; ``result`` waits for it and gives the session or raises why not."""

    def __init__(self, open_: Callable[[], Any], what: str = "the trainer's refit session") -> None:
        self.what = what
        self.session: Any = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._abandoned = False
        self._thread = threading.Thread(target=self._run, args=(open_,), daemon=True, name="shardstream-join")
        self._thread.start()

    def _run(self, open_: Callable[[], Any]) -> None:
        try:
            session = open_()
        except BaseException as e:  # noqa: BLE001 - raised by result(), in update_weights
            self.error = e
        else:
            with self._lock:
                if self._abandoned:  # the engine left before the join ended: nobody will use it
                    session.close()
                else:
                    self.session = session
        finally:
            self._done.set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s; True once the join ended (joined or failed)."""
        return self._done.wait(timeout)

    def result(self, timeout: float, waited: bool = False) -> Any:
        """The joined session, waiting up to ``timeout`` s (``waited``: the caller waited that long
        already, so not again); raises the join's failure, or a timeout."""
        if not (self._done.is_set() if waited else self.wait(timeout)):
            raise TimeoutError(f"shardstream: {self.what} was not joined within {timeout:g} s of the update: is the "
                               "trainer's RefitSession.open running, with the same rendezvous?")
        if self.error is not None:
            raise RuntimeError(f"shardstream: joining {self.what} failed ({type(self.error).__name__}: "
                               f"{self.error}); call init_weight_transfer_engine again") from self.error
        return self.session

    def abandon(self) -> None:
        """The engine leaves (shutdown, or a new init): close the session if it was joined, or
        once it is."""
        with self._lock:
            self._abandoned = True
            session, self.session = self.session, None
        if session is not None:
            session.close()
