"""The command line: ``shardstream`` (thin: parses, then calls the library)."""

from __future__ import annotations

import atexit
import gc
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """The ``shardstream`` command (``streamer.cli.app``, imported on call)."""
    from streamer.cli.app import main as run

    atexit.unregister(_skip_last_collection)  # once, however often main() runs in one process
    atexit.register(_skip_last_collection)
    return run(argv)


def _skip_last_collection() -> None:
    """The process ends with the command: skip the interpreter's last collection over the heap at
    exit (with torch loaded it costs a rank 0.3 CPU-s, a quarter of its start). Other atexit
    handlers, MPI's finalize among them, still run, and every output file is closed and renamed by
    then. Not with triton loaded (``bench vllm``): its nanobind bindings list each object left at
    exit as a leak."""
    if "triton" not in sys.modules:
        gc.freeze()
