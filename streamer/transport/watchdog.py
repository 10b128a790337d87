"""Bounded waits for what MPI cannot time out itself: print the reason, then end every rank.

``MPI_Comm_accept`` / ``connect`` and a send to a peer that died can block inside MPI with no
timeout of their own; a ``Watchdog`` thread ends the process with exit 3 and a message naming
what never arrived, so no rank waits forever.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

__all__ = ["Watchdog", "abort"]


def abort(message: str, code: int = 3) -> None:
    """Print ``message`` (none if empty) and abort every rank with ``code`` (mpiexec then exits with it)."""
    if message:
        try:
            os.write(2, (message.rstrip() + "\n").encode())
        except OSError:
            pass
        # hydra forwards output asynchronously and drops what is in flight when it tears the job
        # down: give it a moment so the reason reaches the user
        time.sleep(0.5)
    try:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(code)
    finally:
        os._exit(code)


class Watchdog:
    """Abort with exit ``code`` (3) if the guarded block takes longer than ``timeout`` seconds.
    ``quiet``: print nothing (a refused job waiting to tell the other job: its reason is printed
    already, and its exit code is the refusal's)."""

    def __init__(self, timeout: float, message: str, cleanup: Any = None, *, code: int = 3,
                 quiet: bool = False, shown: float | None = None) -> None:
        self.timeout = timeout
        #: the timeout the message names (the user's --timeout, when this is what is left of it)
        self.shown = timeout if shown is None else shown
        self.message = message
        self.cleanup = cleanup
        self.code = code
        self.quiet = quiet
        self._t: threading.Timer | None = None

    def _fire(self) -> None:
        if self.cleanup is not None:
            try:
                self.cleanup()
            except Exception:  # noqa: BLE001 - best effort before aborting
                pass
        abort("" if self.quiet else f"shardstream: timed out after {self.shown:g} s {self.message}", self.code)

    def __enter__(self) -> Watchdog:
        self._t = threading.Timer(self.timeout, self._fire)
        self._t.daemon = True
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._t is not None:
            self._t.cancel()
