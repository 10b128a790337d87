"""Offline conversion: execute a plan with files (design §7).

Every destination job (a safetensors file, or a zarr array) is laid out first, then filled from
the plan's transfers with ranged reads of only the source bytes needed, in bounded slabs, so
memory stays bounded by ``memory_limit`` whatever the model size. Output is atomic and
``manifest.json`` is written last; ``resume`` skips jobs already complete and verified; under
``mpiexec -n K`` the jobs are split across K workers.

Modules: ``pipeline`` (the one job pipeline), ``sinks`` (the ``Sink`` protocol),
``safetensors_sink`` / ``zarr_sink`` (its two formats), ``fill`` (ranged reads into a box),
``files`` (destination files), ``cast`` (``--cast``), ``state`` (lock and completion records),
``options`` (options, report, jobs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# names load on first use: a submodule (the importer that every command taking a checkpoint may
# need) must not pull the whole converter into every refit rank's start
if TYPE_CHECKING:
    from formats.safetensors.rankfiles import DEFAULT_PATTERN, plan_files
    from streamer.convert.options import ConvertOptions, ConvertReport, FileJob
    from streamer.convert.pipeline import convert
    from streamer.convert.safetensors_sink import PACK_BYTES
    from streamer.convert.state import STATE_DIR
    from streamer.ops.cast import FLOATS, cast_bytes, cast_manifest

__all__ = ["ConvertOptions", "ConvertReport", "FileJob", "convert", "plan_files", "DEFAULT_PATTERN",
           "cast_bytes", "cast_manifest", "FLOATS", "PACK_BYTES", "STATE_DIR"]

_LAZY = {"DEFAULT_PATTERN": "formats.safetensors.rankfiles", "plan_files": "formats.safetensors.rankfiles",
         "ConvertOptions": "streamer.convert.options", "ConvertReport": "streamer.convert.options",
         "FileJob": "streamer.convert.options", "convert": "streamer.convert.pipeline",
         "PACK_BYTES": "streamer.convert.safetensors_sink", "STATE_DIR": "streamer.convert.state",
         "FLOATS": "streamer.ops.cast", "cast_bytes": "streamer.ops.cast", "cast_manifest": "streamer.ops.cast"}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'streamer.convert' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(mod), name)
