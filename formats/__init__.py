"""shardstream data model and file formats. No MPI, no torch.distributed."""

from __future__ import annotations

from .errors import ShardstreamError
from .manifest.box import Box
from .manifest.wire import (
           ArraySpec,
           Chunk,
           Manifest,
           Source,
           TensorSpec,
           load_manifest,
           parse_manifest,
           save_manifest,
)

__all__ = ["Box", "ShardstreamError", "ArraySpec", "Chunk", "Manifest", "Source", "TensorSpec",
           "load_manifest", "parse_manifest", "save_manifest"]
