"""Device mesh, placements and the DTensor geometry that turns them into regions.

No I/O, no MPI, no torch. Everything is exact integer arithmetic on tuples.

A *mesh* names the axes of a job's ranks (``dp=2,tp=4``: 8 ranks, row-major, the last axis
varies fastest). A *placement* says what one mesh axis does to one array: ``R`` replicates it,
``S(d)`` splits tensor dim ``d`` with ``torch.chunk`` semantics. Several axes sharding one dim
nest in mesh-axis order, exactly as DTensor does with ``[Shard(0), Shard(0)]``.

>>> m = parse_mesh("dp=2,tp=4")
>>> m.size, m.coords(6), m.rank_of((1, 2))
(8, (1, 2), 6)
>>> shard_ranges(5, 4)
[(0, 2), (2, 4), (4, 5), (5, 5)]
>>> [(str(b), h) for b, h in chunk_regions((6,), m, parse_placements("S(0),S(0)", m))][:3]
[('[0:1]', (0,)), ('[1:2]', (1,)), ('[2:3]', (2,))]
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from ..errors import ShardstreamError
from ..manifest.box import Box

__all__ = [
    "DEFAULT_MESH",
    "LayoutError",
    "Mesh",
    "Pin",
    "Placement",
    "Replicate",
    "Shard",
    "check_placements",
    "chunk_regions",
    "format_placements",
    "parse_mesh",
    "parse_placements",
    "shard_ranges",
]


class LayoutError(ShardstreamError, ValueError):
    """A mesh, placement, rule or layout request is invalid (CLI exit 1)."""


_AXIS_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

#: what ``--mesh`` means when it is not given: one rank
DEFAULT_MESH = "tp=1"


@dataclass(frozen=True)
class Mesh:
    """Named mesh axes and their sizes. Ranks are numbered row-major (last axis fastest).

    Attributes
    ----------
    axes : tuple[str, ...]
        Axis names, slowest first (``("dp", "tp")``). Unique, at least one.
    shape : tuple[int, ...]
        Ranks along each axis, every one >= 1.
    """

    axes: tuple[str, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        axes, shape = tuple(self.axes), tuple(self.shape)
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "shape", shape)
        if not axes:
            raise LayoutError("mesh needs at least one axis (e.g. 'tp=1')")
        if len(axes) != len(shape):
            raise LayoutError(f"mesh has {len(axes)} axes {list(axes)} but {len(shape)} sizes {list(shape)}")
        seen: set[str] = set()
        for a, n in zip(axes, shape):
            if not isinstance(a, str) or not _AXIS_RE.match(a):
                raise LayoutError(f"mesh axis name {a!r} is not an identifier (letters, digits, '_')")
            if a in seen:
                raise LayoutError(f"mesh axis {a!r} appears twice")
            seen.add(a)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise LayoutError(f"mesh axis {a!r} has size {n!r}, expected an integer >= 1")

    @property
    def size(self) -> int:
        """Number of ranks (product of the axis sizes)."""
        return prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.axes)

    @property
    def strides(self) -> tuple[int, ...]:
        """Rank distance between neighbours along each axis."""
        out = [1] * len(self.shape)
        acc = 1
        for i in range(len(self.shape) - 1, -1, -1):
            out[i] = acc
            acc *= self.shape[i]
        return tuple(out)

    def axis_index(self, axis: str) -> int:
        try:
            return self.axes.index(axis)
        except ValueError:
            raise LayoutError(f"mesh has no axis {axis!r} (axes: {', '.join(self.axes)})") from None

    def size_of(self, axis: str) -> int:
        return self.shape[self.axis_index(axis)]

    def coords(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinates of ``rank`` (row-major, last axis fastest)."""
        if not 0 <= rank < self.size:
            raise LayoutError(f"rank {rank} out of range for mesh {self} ({self.size} ranks)")
        out = []
        for n in reversed(self.shape):
            rank, c = divmod(rank, n)
            out.append(c)
        return tuple(reversed(out))

    def rank_of(self, coords: Sequence[int]) -> int:
        """Inverse of :meth:`coords`."""
        if len(coords) != len(self.shape):
            raise LayoutError(f"{len(coords)} coordinates for a {len(self.shape)}-axis mesh {self}")
        r = 0
        for a, c, n in zip(self.axes, coords, self.shape):
            if not 0 <= c < n:
                raise LayoutError(f"coordinate {c} out of range for axis {a!r} of size {n}")
            r = r * n + c
        return r

    def to_dict(self) -> dict[str, list[str] | list[int]]:
        """The manifest's informative ``mesh`` object."""
        return {"axes": list(self.axes), "shape": list(self.shape)}

    def __str__(self) -> str:
        return ",".join(f"{a}={n}" for a, n in zip(self.axes, self.shape))


def parse_mesh(text: str | None) -> Mesh:
    """Parse ``"dp=2,tp=4"``. ``None`` or blank text gives the default one-rank mesh ``tp=1``.

    >>> parse_mesh("pp=2, tp=2")
    Mesh(axes=('pp', 'tp'), shape=(2, 2))
    """
    if text is None or not text.strip():
        text = DEFAULT_MESH
    axes: list[str] = []
    shape: list[int] = []
    for part in text.split(","):
        item = part.strip()
        name, eq, num = item.partition("=")
        name, num = name.strip(), num.strip()
        if not eq or not name or not num:
            raise LayoutError(f"bad mesh entry {item!r} in {text!r}: expected AXIS=N (e.g. 'dp=2,tp=4')")
        if not _AXIS_RE.match(name):
            raise LayoutError(f"bad mesh axis name {name!r} in {text!r}: expected letters, digits or '_'")
        try:
            n = int(num)
        except ValueError:
            raise LayoutError(f"bad mesh entry {item!r} in {text!r}: expected AXIS=N with N an integer") from None
        if name in axes:
            raise LayoutError(f"mesh axis {name!r} appears twice in {text!r}")
        if n < 1:
            raise LayoutError(f"mesh axis {name!r} has size {n} in {text!r}, expected >= 1")
        axes.append(name)
        shape.append(n)
    return Mesh(tuple(axes), tuple(shape))


# ---------------------------------------------------------------- placements


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every rank along the axis holds the same region (``R``)."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Shard:
    """The axis splits tensor dim ``dim`` of the current region with torch.chunk (``S(d)``)."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise LayoutError(f"S({self.dim!r}): the dim must be an integer >= 0 (negative dims are not allowed)")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Pin:
    """The array lives only on ranks whose coordinate along the axis is ``coord``; it is not
    split by that axis. Produced for the special axes (a ``pp`` stage, an ``ep`` expert block),
    never written in a rule."""

    coord: int

    def __post_init__(self) -> None:
        if not isinstance(self.coord, int) or isinstance(self.coord, bool) or self.coord < 0:
            raise LayoutError(f"Pin({self.coord!r}): the coordinate must be an integer >= 0")

    def __str__(self) -> str:
        return f"P({self.coord})"


Placement = Replicate | Shard | Pin

_PLACEMENT_RE = re.compile(r"(?:(R|Replicate\(\s*\))|(?:S|Shard)\(\s*([+-]?\d+)\s*\))\Z", re.IGNORECASE)


def parse_placements(text: str, mesh: Mesh | None = None) -> tuple[Placement, ...]:
    """Parse ``"R,S(0)"`` into ``(Replicate(), Shard(0))``; one placement per mesh axis.

    ``Replicate()`` / ``Shard(d)`` (DTensor spellings) are accepted too. With ``mesh`` the count
    must equal its number of axes.

    >>> parse_placements("R, S(1)")
    (Replicate(), Shard(dim=1))
    """
    out: list[Placement] = []
    for part in text.split(","):
        item = part.strip()
        m = _PLACEMENT_RE.match(item)
        if not m:
            raise LayoutError(f"bad placement {item!r} in {text!r}: expected R or S(d) with d a tensor dim >= 0")
        if m.group(1):
            out.append(Replicate())
        else:
            d = int(m.group(2))
            if d < 0:
                raise LayoutError(f"bad placement {item!r} in {text!r}: negative dims are not allowed, "
                                  f"write the dim counted from 0")
            out.append(Shard(d))
    if mesh is not None and len(out) != mesh.ndim:
        raise LayoutError(f"{len(out)} placement(s) {text!r} for a {mesh.ndim}-axis mesh {mesh}: "
                          f"expected one per mesh axis ({', '.join(mesh.axes)})")
    return tuple(out)


def format_placements(placements: Sequence[Placement]) -> str:
    """Inverse of :func:`parse_placements` (``"R,S(0)"``)."""
    return ",".join(str(p) for p in placements)


# ---------------------------------------------------------------- geometry


def shard_ranges(n: int, k: int) -> list[tuple[int, int]]:
    """Split ``[0, n)`` into ``k`` pieces with ``torch.chunk`` semantics.

    Chunk length ``c = ceil(n/k)``; piece ``i`` is ``[i*c, min((i+1)*c, n))``; trailing pieces may
    be empty, returned as ``(n, n)`` (callers omit them). ``n == 0`` gives ``k`` empty pieces.

    >>> shard_ranges(10, 4)
    [(0, 3), (3, 6), (6, 9), (9, 10)]
    >>> shard_ranges(2, 3)
    [(0, 1), (1, 2), (2, 2)]
    """
    if k < 1:
        raise LayoutError(f"cannot split into {k} pieces, expected >= 1")
    if n < 0:
        raise LayoutError(f"cannot split a negative extent {n}")
    c = -(-n // k)
    return [(min(i * c, n), min((i + 1) * c, n)) for i in range(k)]


def _piece(n: int, k: int, i: int) -> tuple[int, int]:
    """Piece ``i`` of :func:`shard_ranges` ``(n, k)``, without building the list."""
    c = -(-n // k)
    return (min(i * c, n), min((i + 1) * c, n))


def check_placements(shape: Sequence[int], mesh: Mesh, placements: Sequence[Placement],
                     *, what: str = "array") -> None:
    """Raise :class:`LayoutError` unless ``placements`` fit ``mesh`` and an array of ``shape``."""
    if len(placements) != mesh.ndim:
        raise LayoutError(f"{what}: {len(placements)} placement(s) {format_placements(placements)!r} "
                          f"for a {mesh.ndim}-axis mesh {mesh}: expected one per mesh axis")
    for axis, n, p in zip(mesh.axes, mesh.shape, placements):
        if isinstance(p, Shard):
            if p.dim >= len(shape):
                raise LayoutError(f"{what}: S({p.dim}) on axis {axis!r} but the array has {len(shape)} "
                                  f"dim(s) (shape {list(shape)}); shard a dim < {len(shape)} or use R")
        elif isinstance(p, Pin):
            if p.coord >= n:
                raise LayoutError(f"{what}: pinned to coordinate {p.coord} of axis {axis!r}, "
                                  f"which has size {n}")
        elif not isinstance(p, Replicate):
            raise LayoutError(f"{what}: unknown placement {p!r} on axis {axis!r}")


def chunk_regions(shape: Sequence[int], mesh: Mesh, placements: Sequence[Placement],
                  *, what: str = "array", order: Sequence[int] | None = None) -> list[tuple[Box, tuple[int, ...]]]:
    """The distinct non-empty regions of an array laid out on ``mesh``, each with its sorted
    holders, sorted by region offsets.

    The region of a rank is computed DTensor-style: start from the whole array; for each mesh
    axis in order, ``S(d)`` splits dim ``d`` of the *current* region with torch.chunk and keeps
    piece ``coords[axis]``; ``R`` keeps it; ``Pin(c)`` keeps it on ranks with coordinate ``c``
    and gives nothing to the others. Work is one region per combination of the coordinates of
    the sharding axes (not one per rank): the replicate axes only multiply the holders.
    ``order`` (a permutation of the mesh axis indices) changes the order in which the sharding
    axes split: ``(1, 0)`` on ``(fsdp, tp)`` splits by tp first, then fsdp splits each TP piece
    (FSDP2 over a TP-local tensor, DTensor's ``_StridedShard``).

    >>> m = Mesh(("dp", "tp"), (2, 2))
    >>> [(str(b), h) for b, h in chunk_regions((3, 4), m, (Replicate(), Shard(1)))]
    [('[0:3, 0:2]', (0, 2)), ('[0:3, 2:4]', (1, 3))]
    """
    shape = tuple(shape)
    check_placements(shape, mesh, placements, what=what)
    strides = mesh.strides
    # Ranks that differ only along replicate axes hold the same region: precompute their
    # rank offsets once, sorted, so each region's holders are ``base + offset`` (still sorted).
    rep_offsets = [0]
    split_axes: list[tuple[int, int, int]] = []  # (axis, dim, size) of the sharding axes, in order
    ranges: list[Sequence[int]] = []  # coordinates to visit on each sharding/pinned axis
    pin_base = 0
    for a, (n, p) in enumerate(zip(mesh.shape, placements)):
        if isinstance(p, Replicate):
            rep_offsets = [o + c * strides[a] for o in rep_offsets for c in range(n)]
        elif isinstance(p, Pin):
            pin_base += p.coord * strides[a]
        else:
            assert isinstance(p, Shard)
            split_axes.append((a, p.dim, n))
            ranges.append(range(n))
    rep_offsets.sort()
    if order is not None:
        if sorted(order) != list(range(mesh.ndim)):
            raise LayoutError(f"{what}: shard order {list(order)} is not a permutation of the mesh axes 0..{mesh.ndim - 1}")
        pos = {a: i for i, a in enumerate(order)}
        both = sorted(zip(split_axes, ranges), key=lambda t: pos[t[0][0]])
        split_axes, ranges = [t[0] for t in both], [t[1] for t in both]
    if any(s == 0 for s in shape):
        return []
    found: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for combo in itertools.product(*ranges):
        offs = [0] * len(shape)
        sizes = list(shape)
        base = pin_base
        empty = False
        for (a, d, n), c in zip(split_axes, combo):
            lo, hi = _piece(sizes[d], n, c)
            if hi <= lo:
                empty = True
                break
            offs[d] += lo
            sizes[d] = hi - lo
            base += c * strides[a]
        if empty:
            continue
        key = (tuple(offs), tuple(sizes))
        holders = found.get(key)
        if holders is None:
            found[key] = [base + o for o in rep_offsets]
        else:  # cannot happen for non-empty pieces; kept so the result is right regardless
            holders.extend(base + o for o in rep_offsets)
    out = []
    for (offs_t, sizes_t), hs in sorted(found.items()):
        hs_t = tuple(hs) if len(hs) == len(rep_offsets) else tuple(sorted(set(hs)))
        out.append((Box(offs_t, sizes_t), hs_t))
    return out
