"""What a command's manifest argument may be: a manifest file, a directory holding one, or a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_input(path: str) -> Any:
    """A manifest file, a directory with manifest.json, or a checkpoint to import on the fly."""
    from formats.manifest.wire import load_manifest

    p = Path(path)
    if p.is_file() and p.suffix == ".json" and not p.name.endswith(".index.json"):
        return load_manifest(p)
    if p.is_dir() and (p / "manifest.json").exists():
        return load_manifest(p / "manifest.json")
    from streamer.convert.importer import import_checkpoint  # the importer only when there is one to read

    return import_checkpoint([p])


def where(path: str) -> str:
    """How problem lines name a manifest given as PATH: the manifest file a directory stands for."""
    p = Path(path)
    return str(p / "manifest.json") if p.is_dir() and (p / "manifest.json").exists() else path
