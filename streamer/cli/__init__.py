"""The command line: ``shardstream`` (thin: parses, then calls the library)."""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """The ``shardstream`` command (``streamer.cli.app``, imported on call)."""
    from streamer.cli.app import main as run

    return run(argv)
