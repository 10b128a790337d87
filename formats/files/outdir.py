"""An output directory that one writer owns: ``convert --out`` and ``refit recv --save``.

``DIR/.shardstream/lock`` is held (``flock``) while a run writes ``DIR``; a directory that holds
anything else is refused unless the command resumes. No MPI: the one rank that opens the
output takes the lock, and the command's agreement round tells the others how it went.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from formats.errors import OutputLockedError, UsageError

__all__ = ["STATE_DIR", "Lock", "open_output", "remove_state"]

STATE_DIR = ".shardstream"


class Lock:
    """An exclusive ``flock`` on ``DIR/.shardstream/lock``: one convert writes a directory."""

    def __init__(self, out: Path) -> None:
        (out / STATE_DIR).mkdir(parents=True, exist_ok=True)
        self.path = out / STATE_DIR / "lock"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutputLockedError(f"{out}: another shardstream convert or refit --save is writing this "
                                        "directory (lock held); wait for it or choose another output directory") from e
            raise
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)


def open_output(out: Path, resume: bool, *, flag: str = "--out", resumable: bool = True) -> Lock:
    """One rank, once bad input is ruled out: make ``out`` and take its lock. A directory that
    holds anything but an interrupted run's lock is refused unless ``resume`` (``resumable``:
    the command has ``--resume``; ``refit --save`` writes a whole output every time)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: {flag} exists and is not a directory")
    if out.exists() and not resume and any(p.name != STATE_DIR for p in out.iterdir()):
        hint = "pass --resume to continue an interrupted conversion, or " if resumable else ""
        raise UsageError(f"{out}: output directory is not empty; {hint}choose an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    return Lock(out)


def remove_state(out: Path, lock: Lock) -> None:
    """When the run is over (convert: once the manifest is written; refit --save: either way),
    with ``lock`` still held: the records are not needed any more. The lock file goes last, so a
    kill on the way leaves a state a resume accepts."""
    state = out / STATE_DIR
    # the output is complete already: what cannot be removed stays, and is no error
    with contextlib.suppress(OSError):
        for p in state.iterdir():
            if p != lock.path:
                p.unlink(missing_ok=True)
        lock.path.unlink(missing_ok=True)
        state.rmdir()  # fails where another convert --resume made a new lock meanwhile: its directory now
