"""Streaming safetensors I/O: bounded header parse, ranged region reads, plan-driven writer.

The format, as the official implementation reads and writes it::

    [8 bytes]  N, a little-endian u64
    [N bytes]  a UTF-8 JSON object, padded with spaces so that 8 + N is a multiple of 8:
               {"__metadata__": {str: str},
                NAME: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...}
    [rest]     the data section. Offsets are relative to its start (byte 8 + N). Tensors are
               packed back to back: sorted by begin, the first at 0, no gaps, no overlaps, and
               nothing after the last one. Elements are little-endian, row-major.


``read_header`` (:mod:`formats.safetensors.header`) treats every file as hostile: it never
allocates more than the file holds, and every broken rule is one ``FormatError`` line naming the
file, the tensor and the rule. ``read_region`` (:mod:`formats.safetensors.read`) reads only the
bytes of a region, coalescing runs whose gaps are small, through a bounded buffer.
``layout_file`` (:mod:`formats.safetensors.write`) is the pure planner of a file;
``SafetensorsWriter`` streams regions into the file it lays out, atomically (temp file + rename).
This module gathers their public names.

No MPI. No torch at import time: ``save_tensors`` imports it only when handed a torch tensor.
"""

from __future__ import annotations

from .header import MAX_HEADER_BYTES, Header, StoredTensor, read_header
from .read import ReadStats, SafetensorsReader, read_region
from .write import SafetensorsWriter, layout_file, save_tensors

__all__ = [
    "MAX_HEADER_BYTES",
    "Header",
    "ReadStats",
    "SafetensorsReader",
    "SafetensorsWriter",
    "StoredTensor",
    "layout_file",
    "read_header",
    "read_region",
    "save_tensors",
]
