"""Layout rules: which placement each array gets on a mesh, and the manifest that results.

No I/O, no MPI, no torch.

The generic path (``shardstream layout --like M --mesh ... --rule GLOB=PL``) is three steps,
each a pure function a preset can reuse or replace:

1. :func:`resolve_placements` -- one placement per mesh axis for every array: the first
   :class:`Rule` whose glob matches (unmatched arrays are replicated), then the special axes
   ``pp`` and ``ep`` (design §4) turned into :class:`~.mesh.Pin` / :class:`~.mesh.Shard`.
2. :func:`~.mesh.chunk_regions` -- the distinct regions of one array and their holders.
3. :func:`build_manifest` -- chunks with their sources. A preset passes ``make_chunks`` to name
   its own local tensors and offsets (fused ``qkv_proj``, padded vocab, ...); the generic maker
   stores each region as a whole local tensor named after the array.

Special axes
------------
``pp``
    Not a sharding axis: each array lives on one pipeline stage (``Pin(stage)``). Arrays named
    ``…layers.{i}.…`` go to the stage of layer ``i`` (:func:`stage_of_layer`: a balanced split
    in order, the first ``num_layers % pp`` stages get one extra layer); names containing
    ``embed`` go to stage 0; the final norm (a ``norm`` name component, ``final_layernorm``,
    ``final_norm``, ``ln_f``) and ``lm_head`` / ``output_layer`` to the last stage; anything
    else to stage 0. A rule must say ``R`` for ``pp``.
``ep``
    Indexed expert arrays (``…experts.{E}.…``) are pinned to the ep coordinate of their
    contiguous expert block (:func:`expert_block`: blocks of ``ceil(num_experts/ep)``, the same
    split ``S(0)`` gives a stacked array); stacked expert arrays (a name component ``experts``
    with no index, e.g. ``mlp.experts.gate_up_proj`` of shape ``[E, …]``) get ``S(0)`` on ``ep``;
    every other array is replicated along ``ep`` (expert-data-parallel). A rule must say ``R``
    for ``ep``.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from ..manifest.box import Box
from ..manifest.dtypes import by_name
from ..manifest.limits import RANK_FILE_PATTERN
from ..manifest.spec import ArraySpec, Chunk, Manifest, Source
from .mesh import (
    LayoutError,
    Mesh,
    Pin,
    Placement,
    Replicate,
    Shard,
    check_placements,
    chunk_regions,
    format_placements,
    parse_placements,
)

__all__ = [
    "DEFAULT_FILE_PATTERN",
    "EP_AXIS",
    "PP_AXIS",
    "ChunkMaker",
    "Rule",
    "apply_layout",
    "build_manifest",
    "check_file_pattern",
    "expert_block",
    "expert_index",
    "file_chunk_maker",
    "is_stacked_experts",
    "layer_index",
    "manifest_from_arrays",
    "match_rule",
    "parse_rule",
    "pp_stage",
    "resolve_placements",
    "stage_of_layer",
    "unmatched_rules",
]

PP_AXIS = "pp"
EP_AXIS = "ep"
SPECIAL_AXES = (PP_AXIS, EP_AXIS)
DEFAULT_FILE_PATTERN = RANK_FILE_PATTERN


# ---------------------------------------------------------------- rules


@dataclass(frozen=True)
class Rule:
    """``pattern=placements``: arrays whose name matches the glob (``fnmatch.fnmatchcase``,
    case-sensitive; ``*`` also crosses dots) get ``placements``, one per mesh axis."""

    pattern: str
    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "placements", tuple(self.placements))
        if not self.pattern:
            raise LayoutError(f"rule {self}: empty glob")

    def matches(self, fqn: str) -> bool:
        return fnmatchcase(fqn, self.pattern)

    def __str__(self) -> str:
        return f"{self.pattern}={format_placements(self.placements)}"


def parse_rule(text: str, mesh: Mesh) -> Rule:
    """Parse ``'GLOB=R,S(0)'`` for ``mesh``.

    The text is split on its *last* ``=``: placements never contain one, so a glob may.
    The placement count must equal the number of mesh axes, and the special axes ``pp`` and
    ``ep`` must be ``R`` (they place arrays by name, see the module docstring).

    >>> parse_rule("*.q_proj.weight=R,S(0)", Mesh(("dp", "tp"), (2, 4)))
    Rule(pattern='*.q_proj.weight', placements=(Replicate(), Shard(dim=0)))
    """
    glob, eq, rhs = text.rpartition("=")
    glob = glob.strip()
    if not eq or not glob or not rhs.strip():
        raise LayoutError(f"bad rule {text!r}: expected GLOB=PLACEMENTS, e.g. '*.q_proj.weight=R,S(0)'")
    try:
        placements = parse_placements(rhs, mesh)
    except LayoutError as e:
        raise LayoutError(f"bad rule {text!r}: {e}") from e
    _check_special_axes(placements, mesh, f"rule {text!r}")
    return Rule(glob, placements)


def _check_special_axes(placements: Sequence[Placement], mesh: Mesh, what: str) -> None:
    for axis, p in zip(mesh.axes, placements):
        if axis in SPECIAL_AXES and not isinstance(p, Replicate):
            how = ("places each array on one pipeline stage by its name" if axis == PP_AXIS else
                   "distributes expert arrays by name (indexed experts in blocks, stacked experts S(0))")
            raise LayoutError(f"{what}: axis {axis!r} {how}; write R for it, got {p}")


def match_rule(fqn: str, rules: Sequence[Rule]) -> Rule | None:
    """The first rule whose glob matches ``fqn``, or None (the array is replicated)."""
    for r in rules:
        if fnmatchcase(fqn, r.pattern):
            return r
    return None


def unmatched_rules(names: Iterable[str], rules: Sequence[Rule]) -> list[Rule]:
    """Rules that are the first match of no array (a typo in a glob, or shadowed); the CLI
    warns about them."""
    used: set[int] = set()
    for n in names:
        for i, r in enumerate(rules):
            if fnmatchcase(n, r.pattern):
                used.add(i)
                break
    return [r for i, r in enumerate(rules) if i not in used]


# ---------------------------------------------------------------- name classification

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?=\.|$)")
_EXPERT_RE = re.compile(r"(?:^|\.)(?:local_)?experts\.(\d+)(?=\.|$)")
_LAST_STAGE_COMPONENTS = frozenset({"norm", "lm_head", "output_layer", "final_layernorm", "final_norm", "ln_f"})


def layer_index(fqn: str) -> int | None:
    """``i`` of the first ``layers.{i}`` component, or None.

    >>> layer_index("model.layers.12.mlp.up_proj.weight"), layer_index("model.norm.weight")
    (12, None)
    """
    m = _LAYER_RE.search(fqn)
    return int(m.group(1)) if m else None


def expert_index(fqn: str) -> tuple[str, int] | None:
    """``(prefix, E)`` of an indexed expert array (``…experts.{E}.…``), or None. ``prefix`` (the
    name before ``experts``) groups the experts of one MoE layer.

    >>> expert_index("model.layers.3.mlp.experts.7.down_proj.weight")
    ('model.layers.3.mlp.', 7)
    """
    m = _EXPERT_RE.search(fqn)
    if not m:
        return None
    return fqn[: m.start() + (1 if m.group(0).startswith(".") else 0)], int(m.group(1))


def is_stacked_experts(fqn: str) -> bool:
    """A stacked expert array: a name component ``experts`` and no expert index
    (``mlp.experts.gate_up_proj``, vLLM ``mlp.experts.w13_weight``). ``shared_experts`` is not."""
    return "experts" in fqn.split(".") and _EXPERT_RE.search(fqn) is None


def stage_of_layer(layer: int, num_layers: int, pp: int) -> int:
    """Pipeline stage of ``layer``: layers split in order into ``pp`` contiguous blocks, the
    first ``num_layers % pp`` blocks one layer longer (like ``torch.tensor_split``). Equals
    Megatron's even split when ``pp`` divides ``num_layers``, and never leaves a stage empty
    while ``num_layers >= pp``.

    >>> [stage_of_layer(i, 6, 4) for i in range(6)]
    [0, 0, 1, 1, 2, 3]
    """
    if not 0 <= layer < num_layers:
        raise LayoutError(f"layer {layer} out of range for {num_layers} layers")
    q, r = divmod(num_layers, pp)
    big = r * (q + 1)  # layers in the first r (longer) stages
    if layer < big:
        return layer // (q + 1)
    return r + (layer - big) // q


def _is_last_stage(fqn: str) -> bool:
    parts = fqn.split(".")
    return any(p in _LAST_STAGE_COMPONENTS or "final_layernorm" in p or "final_norm" in p for p in parts)


def pp_stage(fqn: str, *, num_layers: int, pp: int) -> int:
    """The pipeline stage an array lives on (see the module docstring)."""
    li = layer_index(fqn)
    if li is not None:
        if li >= num_layers:
            raise LayoutError(f"{fqn}: layer index {li} >= num_layers {num_layers}")
        return stage_of_layer(li, num_layers, pp)
    if "embed" in fqn:
        return 0
    if _is_last_stage(fqn):
        return pp - 1
    return 0


def expert_block(expert: int, num_experts: int, ep: int) -> int:
    """The ep coordinate holding ``expert``: contiguous blocks of ``ceil(num_experts/ep)``
    experts, the torch.chunk split that ``S(0)`` gives a stacked ``[E, …]`` array.

    >>> [expert_block(e, 8, 3) for e in range(8)]
    [0, 0, 0, 1, 1, 1, 2, 2]
    """
    if not 0 <= expert < num_experts:
        raise LayoutError(f"expert {expert} out of range for {num_experts} experts")
    return expert // -(-num_experts // ep)


def resolve_placements(arrays: Mapping[str, Sequence[int]], mesh: Mesh, rules: Sequence[Rule], *,
                       num_layers: int | None = None,
                       num_experts: int | None = None) -> dict[str, tuple[Placement, ...]]:
    """One placement per mesh axis for every array (name -> global shape), special axes
    resolved: ``pp`` -> ``Pin(stage)``; ``ep`` -> ``Pin(block)`` / ``S(0)`` / ``R``.

    ``num_layers`` defaults to the largest ``layers.{i}`` index + 1; ``num_experts`` to the
    largest ``experts.{E}`` index + 1 of each MoE layer (experts grouped by name prefix).
    """
    axes = mesh.axes
    pp_i = axes.index(PP_AXIS) if PP_AXIS in axes else None
    ep_i = axes.index(EP_AXIS) if EP_AXIS in axes else None
    for r in rules:
        if len(r.placements) != mesh.ndim:
            raise LayoutError(f"rule {str(r)!r}: {len(r.placements)} placement(s) for a {mesh.ndim}-axis "
                              f"mesh {mesh}: expected one per mesh axis ({', '.join(axes)})")
        _check_special_axes(r.placements, mesh, f"rule {str(r)!r}")
    if num_layers is not None and num_layers < 1:
        raise LayoutError(f"num_layers must be >= 1, got {num_layers}")
    if num_experts is not None and num_experts < 1:
        raise LayoutError(f"num_experts must be >= 1, got {num_experts}")

    n_layers = num_layers
    if pp_i is not None and n_layers is None:
        idx = [li for li in (layer_index(n) for n in arrays) if li is not None]
        n_layers = max(idx) + 1 if idx else 1
    experts: dict[str, tuple[str, int]] = {}
    per_prefix: dict[str, int] = {}
    if ep_i is not None:
        for n in arrays:
            ei = expert_index(n)
            if ei is not None:
                experts[n] = ei
                per_prefix[ei[0]] = max(per_prefix.get(ei[0], 0), ei[1] + 1)

    out: dict[str, tuple[Placement, ...]] = {}
    repl = (Replicate(),) * mesh.ndim
    for fqn, shape in arrays.items():
        rule = match_rule(fqn, rules)
        pl = list(rule.placements if rule is not None else repl)
        if pp_i is not None:
            assert n_layers is not None
            pl[pp_i] = Pin(pp_stage(fqn, num_layers=n_layers, pp=mesh.shape[pp_i]))
        if ep_i is not None:
            ei = experts.get(fqn)
            if ei is not None:
                ne = num_experts if num_experts is not None else per_prefix[ei[0]]
                if ei[1] >= ne:
                    raise LayoutError(f"{fqn}: expert index {ei[1]} >= num_experts {ne}")
                pl[ep_i] = Pin(expert_block(ei[1], ne, mesh.shape[ep_i]))
            elif is_stacked_experts(fqn):
                if len(shape) == 0:
                    raise LayoutError(f"{fqn}: stacked expert array is 0-d; axis 'ep' needs a dim 0 "
                                      f"of experts to shard")
                pl[ep_i] = Shard(0)
        where = f"{fqn}" + (f" (rule {str(rule)!r})" if rule is not None else "")
        check_placements(shape, mesh, pl, what=where)
        out[fqn] = tuple(pl)
    return out


# ---------------------------------------------------------------- manifests

#: ``(array name, region, sorted holders) -> chunks`` covering exactly that region on those
#: holders. Presets use it to name local tensors and offsets (fused weights split a region).
ChunkMaker = Callable[[str, Box, tuple[int, ...]], Iterable[Chunk]]


def check_file_pattern(file_pattern: str) -> None:
    """Raise :class:`LayoutError` unless ``file_pattern`` formats with ``rank=0`` into a relative
    path inside the manifest's directory."""
    try:
        f = file_pattern.format(rank=0)
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
        raise LayoutError(f"bad file pattern {file_pattern!r}: it must format with only {{rank}} "
                          f"(e.g. 'rank-{{rank:05d}}.safetensors'), got {type(e).__name__}: {e}") from None
    if not f or f.startswith("/") or ".." in posixpath.normpath(f).split("/") or "\\" in f:
        raise LayoutError(f"bad file pattern {file_pattern!r}: expected a relative path inside the "
                          f"manifest's directory, got {f!r}")


def file_chunk_maker(file_pattern: str | None) -> ChunkMaker:
    """The generic maker: each region is a whole local tensor named after its array (so
    ``source.tensor`` and ``source.offsets`` are left at their defaults and not written), stored
    in ``file_pattern`` (``{rank}`` -> one copy per holder). ``None``: no source at all (a live,
    in-memory manifest)."""
    source = None
    if file_pattern is not None:
        check_file_pattern(file_pattern)
        source = Source(file=file_pattern)  # one shared frozen instance for every chunk

    def make(fqn: str, region: Box, holders: tuple[int, ...]) -> Iterable[Chunk]:
        return (Chunk(region, holders, source),)

    return make


def _chunk_key(c: Chunk) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (c.region.offsets, c.holders)


def build_manifest(arrays: Mapping[str, tuple[Sequence[int], str]], mesh: Mesh,
                   placements: Mapping[str, Sequence[Placement]], *,
                   file_pattern: str | None = DEFAULT_FILE_PATTERN,
                   make_chunks: ChunkMaker | None = None,
                   domain_size: int | None = None,
                   name: str | None = None) -> Manifest:
    """The manifest of ``arrays`` (name -> (shape, data_type)) laid out on ``mesh`` with
    per-array ``placements`` (as :func:`resolve_placements` returns). ``make_chunks`` overrides
    the generic :func:`file_chunk_maker` (``file_pattern`` is then unused). Chunks are sorted by
    region offsets."""
    if domain_size is not None and (not isinstance(domain_size, int) or domain_size < 1):
        raise LayoutError(f"domain_size must be an integer >= 1, got {domain_size!r}")
    maker = make_chunks if make_chunks is not None else file_chunk_maker(file_pattern)
    out: dict[str, ArraySpec] = {}
    # The generic maker's chunks do not depend on the array's name, so arrays with one shape and
    # one placement share one chunks tuple: a DSv3 generator manifest has 45k expert arrays but a
    # handful of distinct layouts, and the planner plans each distinct layout once.
    shared: dict[tuple[Any, ...], tuple[Chunk, ...]] = {}
    for fqn, (shape, data_type) in arrays.items():
        shape_t = tuple(shape)
        by_name(data_type)
        pl = placements.get(fqn)
        if pl is None:
            raise LayoutError(f"{fqn}: no placements given for this array")
        key = (shape_t, tuple(pl))
        if make_chunks is None and key in shared:
            out[fqn] = ArraySpec(shape_t, data_type, shared[key])
            continue
        chunks: list[Chunk] = []
        for region, holders in chunk_regions(shape_t, mesh, pl, what=fqn):
            chunks.extend(maker(fqn, region, holders))
        if make_chunks is not None:  # the generic maker keeps chunk_regions' order
            chunks.sort(key=_chunk_key)
        ct = tuple(chunks)
        if make_chunks is None:
            shared[key] = ct
        out[fqn] = ArraySpec(shape_t, data_type, ct)
    return Manifest(world_size=mesh.size, arrays=out, name=name, mesh=mesh.to_dict(),
                    topology={"domain_size": domain_size} if domain_size is not None else None)


def apply_layout(src: Manifest, mesh: Mesh, rules: Sequence[Rule], *,
                 file_pattern: str | None = DEFAULT_FILE_PATTERN,
                 domain_size: int | None = None,
                 name: str | None = None,
                 num_layers: int | None = None,
                 num_experts: int | None = None) -> Manifest:
    """Lay out the arrays of ``src`` (names, shapes, data types; its chunks are ignored) on
    ``mesh`` by ``rules`` (first match wins, unmatched arrays replicated): the generic
    ``shardstream layout --like`` path.

    >>> src = manifest_from_arrays({"w": ((5, 4), "float32")})
    >>> m = apply_layout(src, Mesh(("tp",), (2,)), [Rule("w", (Shard(0),))], file_pattern=None)
    >>> [(str(c.region), c.holders) for c in m.arrays["w"].chunks]
    [('[0:3, 0:4]', (0,)), ('[3:5, 0:4]', (1,))]
    """
    shapes = {fqn: a.shape for fqn, a in src.arrays.items()}
    placements = resolve_placements(shapes, mesh, rules, num_layers=num_layers, num_experts=num_experts)
    arrays = {fqn: (a.shape, a.data_type) for fqn, a in src.arrays.items()}
    return build_manifest(arrays, mesh, placements, file_pattern=file_pattern,
                          domain_size=domain_size, name=name)


def manifest_from_arrays(arrays: Mapping[str, tuple[Sequence[int], str]], *,
                         name: str | None = None, file: str | None = None) -> Manifest:
    """A one-rank manifest: each array (name -> (shape, data_type)) is one chunk held by rank 0,
    stored in ``file`` when given (arrays with a 0 in their shape have no chunks).

    >>> m = manifest_from_arrays({"b": ((3,), "bfloat16")}, file="model.safetensors")
    >>> m.world_size, m.arrays["b"].chunks[0].source
    (1, Source(tensor=None, offsets=None, file='model.safetensors', byte_range=None, stored_shape=None, checksum=None))
    """
    if file is not None:
        check_file_pattern(file)
    source = Source(file=file) if file is not None else None
    out: dict[str, ArraySpec] = {}
    for fqn, (shape, data_type) in arrays.items():
        shape_t = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape_t):
            raise LayoutError(f"{fqn}: negative size in shape {list(shape_t)}")
        by_name(data_type)
        box = Box.whole(shape_t)
        chunks = () if box.empty else (Chunk(box, (0,), source),)
        out[fqn] = ArraySpec(shape_t, data_type, chunks)
    return Manifest(world_size=1, arrays=out, name=name)
