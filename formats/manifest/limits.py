"""Constants shared across the formats (design §3): define them here, once, and import them.

>>> INT64_MAX == 2**63 - 1, RANK_FILE_PATTERN.format(rank=3)
(True, 'rank-00003.safetensors')
"""

from __future__ import annotations

__all__ = ["INT64_MAX", "RANK_FILE_PATTERN"]

#: the largest element count x itemsize (and byte offset) of an array, a region or a file (int64)
INT64_MAX = (1 << 63) - 1
#: the default per-rank file of an on-disk manifest (``source.file``; ``{rank}`` in format syntax)
RANK_FILE_PATTERN = "rank-{rank:05d}.safetensors"
