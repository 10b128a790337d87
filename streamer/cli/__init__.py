"""The command line: ``shardstream`` (thin: parses, then calls the library)."""

from __future__ import annotations

import atexit
import gc

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """The ``shardstream`` command (``streamer.cli.app``, imported on call)."""
    from streamer.cli.app import main as run

    # the process ends with the command: skip the interpreter's last collection over the heap at
    # exit (with torch loaded it costs a rank 0.3 CPU-s, a quarter of its start; atexit handlers,
    # MPI's finalize among them, still run, and every output file is closed and renamed by then)
    atexit.register(gc.freeze)
    return run(argv)
