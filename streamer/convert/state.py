"""The output directory while a conversion writes it. ``DIR/.shardstream/`` holds the lock and one
completion record per finished job; it exists only while the output is incomplete: a finished
output holds its data, ``manifest.json`` (written last) and the HF index, nothing else."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from formats.files.outdir import STATE_DIR, Lock, open_output, remove_state
from formats.integrity.sidecar import sidecar_name
from formats.manifest.wire import atomic_write_bytes

__all__ = ["MANIFEST", "STATE_DIR", "Lock", "Records", "mark_incomplete", "open_output", "remove_state"]

MANIFEST = "manifest.json"


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


def mark_incomplete(out: Path, rel_paths: Iterable[str]) -> None:
    """With the lock held: remove the manifest, so that the directory reads as incomplete until
    the new one lands, and the temp files of an interrupted run (``.NAME.tmp-PID``, ours or
    atomic_write_bytes'; ``rel_paths``: what is written through temp files). No live writer owns
    them: the lock is ours."""
    (out / MANIFEST).unlink(missing_ok=True)
    # the checksum sidecar is written through a temp file too, just before the manifest
    paths = [out / r for r in rel_paths] + [out / MANIFEST, out / sidecar_name(MANIFEST)]
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
