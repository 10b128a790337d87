"""Manifest from a live torch state dict (DTensors, plain tensors, buffers).

``manifest_from_state_dict(state_dict)`` is called on every rank of an SPMD torch job (a
TorchTitan or verl FSDP2 trainer launched by ``torchrun``, with its own process group). It
returns the :class:`~formats.manifest.wire.Manifest` that describes what every rank holds, so that
``push(state_dict)`` can send each rank's local tensors as they are.

How a DTensor becomes chunks
----------------------------
A DTensor carries its device mesh, its placements (one per mesh axis) and its global shape.
The placements are applied left to right, exactly as DTensor does (and as
``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` does):

* ``Replicate()`` keeps the current local tensor;
* ``Shard(d)`` splits dim ``d`` of the current local tensor with ``torch.chunk`` semantics
  (``c = ceil(n/k)``, trailing pieces may be empty) and keeps piece ``coord``;
* ``_StridedShard(d, split_factor=sf)`` (FSDP2 over TP) first splits dim ``d`` into ``sf`` pieces,
  splits each of those into ``k`` pieces, and concatenates piece ``coord`` of each: the local
  tensor is then the concatenation of several global regions.

Per dim, the local tensor is tracked as a list of *segments* ``(local start, global start,
length)``; adjacent segments that are contiguous in both are merged. Every combination of one
segment per dim is one chunk, with ``source.offsets`` pointing inside the local tensor. So
FSDP2+TP's ``[_StridedShard(0, sf=tp), Shard(0)]`` gives one chunk per rank (the usual case), and
any other ``_StridedShard`` combination gives several chunks per rank instead of an error.
``Partial()`` (and any placement this module does not know) is refused with an error naming
the tensor.

Which ranks hold what (no communication)
----------------------------------------
``DeviceMesh.mesh`` lists *global* ranks of the trainer's world, but only the copy of a
sub-mesh that contains the calling rank: FSDP2's ``dp`` sub-mesh is ``[0, 2]`` on rank 0 and
``[1, 3]`` on rank 1. This module reads every copy of the mesh from the root mesh's rank map
(``mesh._layout.remap_to_tensor(mesh._rank_map)`` in torch >= 2.9: all parallel copies of the
sub-mesh inside its root mesh), so every rank computes the same holders for every chunk. On a
torch without that layout the mesh must be its own root (or span its root), else a clear error.
Each copy is assumed to hold the same array laid out the same way (the other root axes act as
replicas), which is what FSDP2/TP/HSDP do.

Holders are global ranks (``torch.distributed.get_rank()``), and ``world_size`` is
``torch.distributed.get_world_size()`` when torch.distributed is initialised. A mesh that does
not cover the whole world is fine: ranks outside every mesh simply hold no DTensor chunk. Plain
tensors (and buffers) are held whole by every rank of ``group`` (default: the default process
group), at ``source.offsets`` zero. Without torch.distributed, ``world_size`` is the largest
mesh rank + 1 (1 when there is no DTensor), and plain tensors are held by ranks
``0..world_size-1``.

Different keys on different ranks (pipeline stages)
---------------------------------------------------
When torch.distributed is initialised and ``group`` has more than one rank, every rank first
computes a digest of its key list and metadata and all-gathers it (one ``all_gather_object`` of
a sha256 hex digest and an error flag). Equal digests mean every rank holds the same keys with
the same metadata: each rank builds the manifest on its own, and the JSON is byte-identical on
every rank. When the
digests differ, one more ``all_gather_object`` carries every rank's metadata (names, shapes,
dtypes, placements, mesh copies; never tensor data); an array is then held only by the ranks
(for DTensors: the mesh copies) whose state dict has its key. ``same_keys=True`` skips the
digest (no communication at all: the caller promises that every rank holds every key);
``same_keys=False`` always gathers the metadata. Errors found on any rank (a ``Partial``, a
non-contiguous local tensor...) travel with the digest, so every rank raises the same
:class:`StateDictError` instead of some ranks waiting in a collective.

A key held by several ranks is one array: its copies are taken as replicas (for plain tensors)
or as the mesh copies of one DTensor; ranks that disagree about its shape, dtype or placements
are refused.

Tied weights
------------
Two keys that share one storage (tied embeddings: ``lm_head.weight`` is
``model.embed_tokens.weight``) are one array, under the first key, as HF checkpoints store
them: the shared bytes are described, and so sent, once. Every preset reads a tied weight from
that name. ``keep_tied=True`` lists every key as its own array instead.

torch is imported lazily: importing this module costs nothing.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from formats.errors import FormatError, ValidationError
from formats.manifest.box import Box
from formats.manifest.dtypes import DTYPES, from_torch
from formats.manifest.wire import ArraySpec, Chunk, Manifest, Source

__all__ = ["StateDictError", "manifest_from_state_dict"]


class StateDictError(ValidationError):
    """A state dict cannot be described by a manifest (``Partial`` placement, unsupported
    dtype or layout, ranks that disagree...). Every problem is one line in ``problems``, naming
    the tensor. A :class:`~formats.errors.ValidationError` (exit 1)."""


#: rank-independent placement: ("R",), ("S", dim), ("SS", dim, split_factor)
_Pl = tuple[Any, ...]
#: per dim: (local start, global start, length)
_Seg = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class _Record:
    """What one rank knows about one state-dict entry: the same on every rank that holds it
    (no rank-local value), so it can be digested, gathered and compared."""

    key: str
    name: str
    shape: tuple[int, ...]
    data_type: str
    #: DTensor only: placements, mesh shape, every copy of the mesh as flat global-rank tuples
    placements: tuple[_Pl, ...] | None = None
    mesh_shape: tuple[int, ...] = ()
    copies: tuple[tuple[int, ...], ...] = ()
    #: the root mesh's axis names and shape (the manifest's informative ``mesh``)
    root: tuple[tuple[str, ...], tuple[int, ...]] | None = None
    #: a refusal, one line naming the tensor
    error: str | None = None


# ---------------------------------------------------------------- geometry (pure)


def _restrict(segs: Sequence[_Seg], lo: int, hi: int) -> list[_Seg]:
    """Local positions ``[lo, hi)`` of a segment list, renumbered from 0."""
    out: list[_Seg] = []
    for ls, gs, n in segs:
        a, b = max(lo, ls), min(hi, ls + n)
        if a < b:
            out.append((a - lo, gs + (a - ls), b - a))
    return out


def _concat(parts: Iterable[Sequence[_Seg]]) -> list[_Seg]:
    """Concatenate segment lists (each numbered from 0), merging contiguous neighbours."""
    out: list[_Seg] = []
    pos = 0
    for part in parts:
        for _ls, gs, n in part:
            if out and out[-1][1] + out[-1][2] == gs:
                ls0, gs0, n0 = out[-1]
                out[-1] = (ls0, gs0, n0 + n)
            else:
                out.append((pos, gs, n))
            pos += n
    return out


def _piece(n: int, k: int, i: int) -> tuple[int, int]:
    """Piece ``i`` of ``formats.layouts.mesh.shard_ranges(n, k)`` (torch.chunk), without the list."""
    c = -(-n // k)
    return (min(i * c, n), min((i + 1) * c, n))


def _length(segs: Sequence[_Seg]) -> int:
    return sum(n for _, _, n in segs)


def local_segments(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[_Pl],
                   coords: Sequence[int]) -> list[list[_Seg]]:
    """Per dim, the global intervals that the local tensor at mesh ``coords`` holds, in local
    order: ``[(local start, global start, length), ...]``. Empty lists mean an empty local
    tensor along that dim.

    >>> local_segments((7,), (2, 2), [("SS", 0, 2), ("S", 0)], (0, 1))
    [[(0, 4, 2)]]
    >>> local_segments((8,), (2,), [("SS", 0, 2)], (1,))
    [[(0, 2, 2), (2, 6, 2)]]
    """
    segs: list[list[_Seg]] = [[(0, 0, n)] if n else [] for n in shape]
    for p, k, c in zip(placements, mesh_shape, coords):
        if p[0] == "R":
            continue
        d = p[1]
        cur = segs[d]
        n = _length(cur)
        if p[0] == "S":
            lo, hi = _piece(n, k, c)
            segs[d] = _restrict(cur, lo, hi)
        else:  # "SS": split into sf pieces, each into k pieces, keep piece c of each
            parts = []
            for j in range(p[2]):
                a, b = _piece(n, p[2], j)
                lo, hi = _piece(b - a, k, c)
                parts.append(_restrict(cur, a + lo, a + hi))
            segs[d] = _concat(parts)
    return [_concat([s]) for s in segs]


#: (region offsets, region sizes, local offsets, holders) of one chunk
_Geo = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]
_GeoKey = tuple[tuple[int, ...], tuple[_Pl, ...], tuple[int, ...], tuple[tuple[int, ...], ...]]


def _dtensor_chunks(rec: _Record, copies: Sequence[tuple[int, ...]],
                    cache: dict[_GeoKey, list[_Geo]] | None = None) -> list[Chunk]:
    """The chunks of a DTensor record held by the given mesh copies (flat global-rank tuples).
    ``cache`` shares the geometry between arrays of one shape, placements and mesh (layers)."""
    assert rec.placements is not None
    key = (rec.shape, rec.placements, rec.mesh_shape, tuple(copies))
    geo = cache.get(key) if cache is not None else None
    if geo is None:
        geo = _geometry(rec.shape, rec.placements, rec.mesh_shape, copies)
        if cache is not None:
            cache[key] = geo
    return [Chunk(Box(offs, sizes), holders, _source(rec, loffs)) for offs, sizes, loffs, holders in geo]


def _geometry(shape: tuple[int, ...], placements: Sequence[_Pl], mshape: tuple[int, ...],
              copies: Sequence[tuple[int, ...]]) -> list[_Geo]:
    strides = [1] * len(mshape)
    for i in range(len(mshape) - 2, -1, -1):
        strides[i] = strides[i + 1] * mshape[i + 1]
    split_axes = [a for a, p in enumerate(placements) if p[0] != "R"]
    rep_axes = [a for a, p in enumerate(placements) if p[0] == "R"]
    rep_offsets = [0]
    for a in rep_axes:
        rep_offsets = [o + c * strides[a] for o in rep_offsets for c in range(mshape[a])]
    found: dict[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], list[int]] = {}
    order: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []
    coords = [0] * len(mshape)
    for combo in itertools.product(*(range(mshape[a]) for a in split_axes)):
        base = 0
        for a, c in zip(split_axes, combo):
            coords[a] = c
            base += c * strides[a]
        segs = local_segments(shape, mshape, placements, coords)
        if any(not s for s in segs):
            continue
        holders = [copy[base + o] for copy in copies for o in rep_offsets]
        for pick in itertools.product(*segs):
            key = (tuple(g for _, g, _ in pick), tuple(n for _, _, n in pick), tuple(lo for lo, _, _ in pick))
            hs = found.get(key)
            if hs is None:
                found[key] = list(holders)
                order.append(key)
            else:  # pragma: no cover - valid placements give disjoint regions per coordinate
                hs.extend(holders)
    return [(k[0], k[1], k[2], tuple(sorted(set(found[k])))) for k in sorted(order)]


def _source(rec: _Record, loffs: tuple[int, ...]) -> Source | None:
    tensor = rec.key if rec.key != rec.name else None
    offsets = loffs if any(loffs) else None
    if tensor is None and offsets is None:
        return None
    return Source(tensor=tensor, offsets=offsets)


def _plain_chunks(rec: _Record, holders: Sequence[int]) -> list[Chunk]:
    if any(n == 0 for n in rec.shape) or not holders:
        return []
    return [Chunk(Box.whole(rec.shape), tuple(sorted(holders)), _source(rec, (0,) * len(rec.shape)))]


# ---------------------------------------------------------------- torch side


def _torch_placement(p: Any) -> _Pl | str:
    """A torch placement as a rank-independent tuple, or the reason it is refused."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    strided: Any
    try:
        from torch.distributed.tensor.placement_types import _StridedShard as strided
    except ImportError:  # pragma: no cover - every torch with DTensor has it
        strided = None
    if strided is not None and isinstance(p, strided):
        return ("SS", int(p.dim), int(p.split_factor))
    if isinstance(p, Shard):
        return ("S", int(p.dim))
    if isinstance(p, Replicate):
        return ("R",)
    if isinstance(p, Partial):
        return (f"placement {p!r} is a partial value (a pending reduction), not a layout: "
                f"redistribute it to Replicate() or Shard(d) (e.g. dt.redistribute(placements=...)) "
                f"before describing it")
    return f"unsupported placement {p!r} (supported: Shard(d), Replicate(), _StridedShard(d, sf))"


def _mesh_copies(mesh: Any) -> tuple[tuple[int, ...], ...]:
    """Every parallel copy of ``mesh`` inside its root mesh, as flat (row-major) tuples of
    global ranks; the copy holding this rank is ``mesh.mesh``. Uses the private CuTe layout of
    torch >= 2.9 DeviceMesh; without it, only a mesh that spans its root works."""
    try:
        own: tuple[int, ...] | None = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    except RuntimeError:  # a sub-mesh that does not contain this rank
        own = None
    layout = getattr(mesh, "_layout", None)
    rank_map = getattr(mesh, "_rank_map", None)
    if layout is not None and rank_map is not None and hasattr(layout, "remap_to_tensor"):
        full = layout.remap_to_tensor(rank_map)
        full = full.reshape(-1, *tuple(mesh.shape))
        copies = tuple(tuple(int(r) for r in c.flatten().tolist()) for c in full)
        if own is not None and own not in copies:
            raise RuntimeError(f"the mesh copies {copies} read from the root mesh do not include "
                               f"this rank's mesh {own}")
        return copies
    if own is None:
        raise RuntimeError("this rank is outside the mesh and this torch's DeviceMesh has no "
                           "_layout/_rank_map to list its copies")
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    if root is mesh or root.size() == mesh.size():
        return (own,)
    raise RuntimeError("this torch's DeviceMesh has no _layout/_rank_map, so the other copies of "
                       "a sub-mesh cannot be listed without communication; pass a state dict "
                       "whose DTensors live on their root mesh, or use torch >= 2.9")


def _my_coordinate(mesh: Any, mshape: tuple[int, ...], copies: Sequence[Sequence[int]]
                   ) -> tuple[int, ...] | None:
    """This rank's coordinate in ``mesh`` (None outside it), from its global rank when
    torch.distributed is initialised (``DeviceMesh.get_coordinate`` otherwise)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        c = mesh.get_coordinate()
        return None if c is None else tuple(int(x) for x in c)
    me = int(dist.get_rank())
    for copy in copies:
        if me in copy:
            flat = list(copy).index(me)
            out = []
            for n in reversed(mshape):
                flat, c = divmod(flat, n)
                out.append(c)
            return tuple(reversed(out))
    return None


def _root_info(mesh: Any) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    try:
        root = mesh._get_root_mesh()
    except AttributeError:
        root = mesh
    names = root.mesh_dim_names
    if not names:
        return None
    return (tuple(str(n) for n in names), tuple(int(n) for n in root.shape))


def _record(key: str, name: str, value: Any,
            meshes: dict[int, tuple[Any, tuple[tuple[int, ...], ...]]] | None = None) -> _Record:
    """Describe one state-dict entry, or record why it is refused."""
    import torch
    from torch.distributed.tensor import DTensor

    def refuse(why: str, shape: tuple[int, ...] = (), data_type: str = "") -> _Record:
        return _Record(key, name, shape, data_type, error=f"{key}: {why}")

    if not isinstance(value, torch.Tensor):
        return refuse(f"is a {type(value).__name__}, not a tensor (leave it out of the state dict, "
                      f"or map it to None with rename=)")
    shape = tuple(int(n) for n in value.shape)
    try:
        dt = from_torch(value.dtype).name
    except FormatError:
        return refuse(f"dtype {value.dtype} has no shardstream data_type (supported: "
                      f"{', '.join(DTYPES)})", shape)
    if isinstance(value, DTensor):
        local = value.to_local()
        pls: list[_Pl] = []
        for p in value.placements:
            q = _torch_placement(p)
            if isinstance(q, str):
                return refuse(q, shape, dt)
            if q[0] != "R" and not 0 <= q[1] < len(shape):
                return refuse(f"placement {p!r} shards dim {q[1]} of a {len(shape)}-d tensor", shape, dt)
            pls.append(q)
        mesh = value.device_mesh
        mshape = tuple(int(n) for n in mesh.shape)
        hit = meshes.get(id(mesh)) if meshes is not None else None
        if hit is not None and hit[0] is mesh:
            copies = hit[1]
        else:
            try:
                copies = _mesh_copies(mesh)
            except (RuntimeError, AttributeError) as e:
                return refuse(f"cannot list the ranks of its device mesh {mesh}: {e}", shape, dt)
            if meshes is not None:
                meshes[id(mesh)] = (mesh, copies)
        rec = _Record(key, name, shape, dt, tuple(pls), mshape, copies, _root_info(mesh))
        coord = _my_coordinate(mesh, mshape, copies)
        if coord is not None:  # this rank is in the mesh: its local tensor must match
            segs = local_segments(shape, mshape, rec.placements or (), coord)
            expect = tuple(_length(s) for s in segs)
            if tuple(local.shape) != expect:
                return refuse(f"local tensor has shape {list(local.shape)} but placements "
                              f"{list(value.placements)} on mesh {mshape} give {list(expect)} at mesh "
                              f"coordinate {list(coord)} (unsupported DTensor layout)", shape, dt)
            problem = _local_problem(local)
            if problem:
                return refuse(problem, shape, dt)
        return rec
    problem = _local_problem(value)
    if problem:
        return refuse(problem, shape, dt)
    return _Record(key, name, shape, dt)


def _local_problem(t: Any) -> str | None:
    import torch

    if t.layout != torch.strided:
        return f"local tensor has layout {t.layout}; only dense (torch.strided) tensors are supported"
    if not t.is_contiguous():
        return (f"local tensor is not contiguous (shape {list(t.shape)}, stride {list(t.stride())}); "
                f"make it contiguous before describing or pushing it")
    return None


def _digest(records: Sequence[_Record]) -> str:
    h = hashlib.sha256()
    for r in records:
        h.update(repr(r).encode())
        h.update(b"\n")
    return h.hexdigest()


# ---------------------------------------------------------------- the entry point


def _alias_key(value: Any) -> tuple[Any, ...] | None:
    """Identity of the bytes behind a tensor (DTensors: their local shard), or None."""
    try:
        t = value.to_local() if hasattr(value, "to_local") else value
        if not hasattr(t, "untyped_storage") or t.numel() == 0:
            return None
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), str(t.dtype))
    except Exception:  # noqa: BLE001 - anything odd is described (or refused) by _record
        return None


def manifest_from_state_dict(state_dict: Mapping[str, Any], *, name: str | None = None,
                             rename: Callable[[str], str | None] | None = None,
                             group: Any = None, same_keys: bool | None = None,
                             keep_tied: bool = False) -> Manifest:
    """The manifest of a live SPMD state dict; call it on every rank, with that rank's dict.

    Parameters
    ----------
    state_dict:
        ``{key: tensor}``: DTensors (FSDP2 ``fully_shard``, TP ``parallelize_module``, both),
        plain tensors and buffers (held whole by every rank), 0-d tensors. Any dtype with a
        shardstream ``data_type`` is kept as it is (fp32 masters stay ``float32``).
    name:
        The manifest's ``name``.
    rename:
        Maps a state-dict key to the published array name (e.g. strip ``"_orig_mod."``); a
        ``None`` result leaves the key out. ``source.tensor`` stays the state-dict key, so
        ``push(state_dict)`` finds each local tensor.
    group:
        The process group of the ranks that call this (default: the default group). It is used
        only for the metadata digest (and the metadata gather when keys differ), and its ranks
        hold the plain tensors. Holders are always global ranks.
    same_keys:
        ``None`` (default): all-gather a digest to find out whether ranks hold different keys
        (one tiny collective when torch.distributed is initialised and ``group`` has more than
        one rank). ``True``: no communication at all; every rank must hold every key.
        ``False``: always gather the metadata.

    keep_tied:
        List each key of a tied (storage-sharing) weight as its own array (default: only the
        first key, so the shared bytes move once).

    Returns a full (non-partial) manifest: the chunks of every array tile it exactly. Every
    rank gets the same manifest (``dumps_manifest`` is byte-identical).

    Raises :class:`StateDictError` (a ``ValidationError``, exit 1) naming every refused tensor:
    ``Partial`` placements, dtypes without a ``data_type``, non-contiguous local tensors,
    non-tensor values, ranks that disagree about a key, two keys renamed to one name.
    See the module docstring for the geometry, the holders and the communication.
    """
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    records, errors = _describe_all(state_dict, rename, keep_tied)
    group_ranks: list[int] = []
    world_size = 0
    if initialised:
        group_ranks = sorted(int(r) for r in dist.get_process_group_ranks(
            group if group is not None else dist.group.WORLD))
        world_size = int(dist.get_world_size())
    gathered = (_gather_if_needed(records, errors, group, len(group_ranks), same_keys)
                if initialised and len(group_ranks) > 1 and same_keys is not True else None)
    if gathered is not None:
        errors = list(dict.fromkeys(f"rank {r}: {e}" for r, _recs, errs in gathered for e in errs))
    if errors:
        n = len(gathered) if gathered is not None else 1
        raise StateDictError(problems=_dedupe_rank_prefix(errors, n))
    if not initialised:
        ranks = [r for rec in records for c in rec.copies for r in c]
        world_size = max(ranks) + 1 if ranks else 1
        group_ranks = list(range(world_size))
    if gathered is None:
        cache: dict[_GeoKey, list[_Geo]] = {}
        arrays = {rec.name: ArraySpec(rec.shape, rec.data_type,
                                      tuple(_dtensor_chunks(rec, rec.copies, cache) if rec.placements is not None
                                            else _plain_chunks(rec, group_ranks)))
                  for rec in records}
        all_records = records
    else:
        arrays, all_records = _merge(gathered)
    root = _common_root(all_records)
    mesh = {"axes": list(root[0]), "shape": list(root[1])} if root else None
    return Manifest(world_size=world_size, arrays=arrays, name=name, mesh=mesh)


def _describe_all(state_dict: Mapping[str, Any], rename: Callable[[str], str | None] | None,
                  keep_tied: bool) -> tuple[list[_Record], list[str]]:
    """This rank's record of every key, and the problems found. Nothing may raise here on one
    rank only: the collectives that follow would hang the others, so errors travel with them."""
    records: list[_Record] = []
    problems: list[str] = []
    names: dict[str, str] = {}
    meshes: dict[int, tuple[Any, tuple[tuple[int, ...], ...]]] = {}  # id -> (mesh, copies)
    seen: set[tuple[Any, ...]] = set()
    for key, value in state_dict.items():
        alias = None if keep_tied else _alias_key(value)
        if alias is not None:
            if alias in seen:
                continue  # a tied weight's second name: the bytes are listed (and sent) once
            seen.add(alias)
        try:
            published = rename(key) if rename is not None else key
        except Exception as e:  # noqa: BLE001 - reported on every rank, named
            problems.append(f"{key}: rename raised {type(e).__name__}: {e}")
            continue
        if published is None:
            continue
        if not isinstance(published, str) or not published:
            problems.append(f"{key}: rename returned {published!r}, expected a non-empty str or None")
            continue
        if published in names:
            problems.append(f"{key}: renamed to {published!r}, which {names[published]!r} is renamed to too")
            continue
        names[published] = key
        try:
            rec = _record(key, published, value, meshes)
        except Exception as e:  # noqa: BLE001 - reported on every rank, named
            rec = _Record(key, published, (), "", error=f"{key}: cannot describe it ({type(e).__name__}: {e})")
        records.append(rec)
    return records, problems + [r.error for r in records if r.error]


def _gather_if_needed(records: list[_Record], errors: list[str], group: Any, n: int,
                      same_keys: bool | None) -> list[tuple[int, list[_Record], list[str]]] | None:
    """Every rank's records, when ranks hold different keys or one of them found a problem (one
    tiny digest all-gather decides; ``same_keys=False`` always gathers); else None."""
    import torch.distributed as dist

    if same_keys is None:
        digests: list[Any] = [None] * n
        dist.all_gather_object(digests, (_digest(records), bool(errors)), group=group)
        if len({d for d, _ in digests}) == 1 and not any(e for _, e in digests):
            return None
    payload: list[Any] = [None] * n
    dist.all_gather_object(payload, (int(dist.get_rank()), records, errors), group=group)
    return sorted(payload)


def _dedupe_rank_prefix(errors: list[str], nranks: int) -> list[str]:
    """``rank R: X`` lines that differ only by R become one ``ranks R1, R2: X`` line, or plain
    ``X`` when all ``nranks`` ranks report it."""
    by_msg: dict[str, list[str]] = {}
    for e in errors:
        head, sep, msg = e.partition(": ")
        if sep and head.startswith("rank "):
            by_msg.setdefault(msg, []).append(head[5:])
        else:
            by_msg.setdefault(e, [])
    out = []
    for msg, rs in by_msg.items():
        if not rs or len(rs) == nranks:
            out.append(msg)
        elif len(rs) == 1:
            out.append(f"rank {rs[0]}: {msg}")
        else:
            shown = ", ".join(rs[:8]) + (f", ... ({len(rs)} ranks)" if len(rs) > 8 else "")
            out.append(f"ranks {shown}: {msg}")
    return out


def _common_root(records: Sequence[_Record]) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    roots = {r.root for r in records if r.placements is not None}
    if len(roots) != 1:
        return None
    return next(iter(roots))


def _merge(gathered: Sequence[tuple[int, list[_Record], list[str]]]
           ) -> tuple[dict[str, ArraySpec], list[_Record]]:
    """Arrays from every rank's records: an array is held by the ranks (mesh copies) whose
    state dict has it. Order: first appearance, by rank."""
    first: dict[str, _Record] = {}
    holders: dict[str, list[int]] = {}
    problems: list[str] = []
    for r, recs, _ in gathered:
        for rec in recs:
            f = first.get(rec.name)
            if f is None:
                first[rec.name] = rec
                holders[rec.name] = [r]
                continue
            holders[rec.name].append(r)
            if f != rec:
                problems.append(f"{rec.key}: ranks {holders[rec.name][0]} and {r} disagree about it "
                                f"({_describe(f)} vs {_describe(rec)})")
    gathered_ranks = {r for r, _, _ in gathered}
    arrays: dict[str, ArraySpec] = {}
    cache: dict[_GeoKey, list[_Geo]] = {}
    for nm, rec in first.items():
        hs = set(holders[nm])
        if rec.placements is None:
            chunks = _plain_chunks(rec, sorted(hs))
        else:
            copies = []
            for copy in rec.copies:
                inside = [x for x in copy if x in gathered_ranks]
                held = [x for x in inside if x in hs]
                if held and len(held) != len(inside):
                    missing = sorted(set(inside) - hs)
                    problems.append(f"{rec.key}: ranks {missing} lack it although their mesh copy "
                                    f"{list(copy)} holds it on ranks {held}")
                if held or not inside:
                    copies.append(copy)
            chunks = _dtensor_chunks(rec, copies, cache)
        arrays[nm] = ArraySpec(rec.shape, rec.data_type, tuple(chunks))
    if problems:
        raise StateDictError(problems=problems)
    return arrays, list(first.values())


def _describe(rec: _Record) -> str:
    s = f"shape {list(rec.shape)} {rec.data_type}"
    if rec.placements is not None:
        s += f", placements {list(rec.placements)} on mesh {list(rec.mesh_shape)} copies {list(rec.copies)}"
    else:
        s += ", plain tensor"
    if rec.key != rec.name:
        s += f", published as {rec.name!r}"
    return s
