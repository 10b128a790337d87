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

from formats.rankfiles import DEFAULT_PATTERN, plan_files
from streamer.convert.options import ConvertOptions, ConvertReport, FileJob
from streamer.convert.pipeline import convert
from streamer.convert.safetensors_sink import PACK_BYTES
from streamer.convert.state import STATE_DIR
from streamer.ops.cast import FLOATS, cast_bytes, cast_manifest

__all__ = ["ConvertOptions", "ConvertReport", "FileJob", "convert", "plan_files", "DEFAULT_PATTERN",
           "cast_bytes", "cast_manifest", "FLOATS", "PACK_BYTES", "STATE_DIR"]
