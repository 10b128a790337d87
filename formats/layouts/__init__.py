"""Layouts: mesh + placement rules -> manifest (design §4). No I/O, no MPI, no torch.

``mesh`` holds the mesh, the placements and the DTensor geometry; ``rules`` the glob rules, the
special axes (``pp``, ``ep``) and manifest building. Presets (megatron, vllm, ...) build on
:func:`resolve_placements` / :func:`build_manifest` with their own ``make_chunks``.
"""

from __future__ import annotations

from .mesh import (
    DEFAULT_MESH,
    LayoutError,
    Mesh,
    Pin,
    Placement,
    Replicate,
    Shard,
    check_placements,
    chunk_regions,
    format_placements,
    parse_mesh,
    parse_placements,
    shard_ranges,
)
from .rules import (
    DEFAULT_FILE_PATTERN,
    EP_AXIS,
    PP_AXIS,
    ChunkMaker,
    Rule,
    apply_layout,
    build_manifest,
    check_file_pattern,
    expert_block,
    expert_index,
    file_chunk_maker,
    is_stacked_experts,
    layer_index,
    manifest_from_arrays,
    match_rule,
    parse_rule,
    pp_stage,
    resolve_placements,
    stage_of_layer,
    unmatched_rules,
)

__all__ = [
    "DEFAULT_FILE_PATTERN",
    "DEFAULT_MESH",
    "EP_AXIS",
    "PP_AXIS",
    "ChunkMaker",
    "LayoutError",
    "Mesh",
    "Pin",
    "Placement",
    "Replicate",
    "Rule",
    "Shard",
    "apply_layout",
    "build_manifest",
    "check_file_pattern",
    "check_placements",
    "chunk_regions",
    "expert_block",
    "expert_index",
    "file_chunk_maker",
    "format_placements",
    "is_stacked_experts",
    "layer_index",
    "manifest_from_arrays",
    "match_rule",
    "parse_mesh",
    "parse_placements",
    "parse_rule",
    "pp_stage",
    "resolve_placements",
    "shard_ranges",
    "stage_of_layer",
    "unmatched_rules",
]
