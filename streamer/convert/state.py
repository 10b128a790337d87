"""The output directory while a conversion writes it. ``DIR/.shardstream/`` holds the lock and one
completion record per finished job; it exists only while the output is incomplete: a finished
output holds its data, ``manifest.json`` (written last) and the HF index, nothing else."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from formats.errors import OutputLockedError, UsageError
from formats.manifest import atomic_write_bytes

__all__ = ["MANIFEST", "STATE_DIR", "Lock", "Records", "mark_incomplete", "open_output", "remove_state"]

STATE_DIR = ".shardstream"
MANIFEST = "manifest.json"


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


class Records:
    """Completion records: ``NAME`` is done when ``DIR/.shardstream/NAME`` holds its record."""

    def __init__(self, out: Path) -> None:
        self.dir = out / STATE_DIR

    def load(self, name: str) -> dict[str, Any] | None:
        try:
            record = json.loads((self.dir / name).read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def save(self, name: str, record: dict[str, Any]) -> None:
        atomic_write_bytes(self.dir / name, json.dumps(record).encode())

    def drop(self, name: str) -> None:
        (self.dir / name).unlink(missing_ok=True)


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


def mark_incomplete(out: Path, rel_paths: Iterable[str]) -> None:
    """With the lock held: remove the manifest, so that the directory reads as incomplete until
    the new one lands, and the temp files of an interrupted run (``.NAME.tmp-PID``, ours or
    atomic_write_bytes'; ``rel_paths``: what is written through temp files). No live writer owns
    them: the lock is ours."""
    (out / MANIFEST).unlink(missing_ok=True)
    paths = [out / r for r in rel_paths] + [out / MANIFEST]
    dirs = {out / STATE_DIR} | {p.parent for p in paths}
    names = {p.name for p in paths}
    for d in dirs:
        try:
            entries = list(d.iterdir())
        except OSError:
            continue
        for p in entries:
            base, sep, _ = p.name.rpartition(".tmp-")
            if sep and base.startswith(".") and (d.name == STATE_DIR or base[1:] in names):
                try:
                    p.unlink()
                except OSError:
                    pass


def remove_state(out: Path, lock: Lock) -> None:
    """Once the manifest is written (with ``lock`` still held): the records are not needed any
    more. The lock file goes last, so a kill on the way leaves a state a resume accepts."""
    state = out / STATE_DIR
    # the output is complete already: what cannot be removed stays, and is no error
    with contextlib.suppress(OSError):
        for p in state.iterdir():
            if p != lock.path:
                p.unlink(missing_ok=True)
        lock.path.unlink(missing_ok=True)
        state.rmdir()  # fails where another convert --resume made a new lock meanwhile: its directory now
