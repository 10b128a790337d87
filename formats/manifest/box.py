"""Box: a half-open region inside an N-d array, and row-major geometry helpers.

No I/O, no MPI. Everything here is exact integer arithmetic on tuples.

>>> a = Box((0, 0), (4, 6)); b = Box((2, 3), (4, 6))
>>> a.intersect(b)
Box([2, 4), [3, 6))
>>> a.intersect(b).volume
6
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import prod

__all__ = ["Box", "row_major_strides", "is_row_major", "contiguous_slabs", "uniform_runs", "split_box", "split_dim",
           "cut_points", "slab"]


@dataclass(frozen=True, slots=True)
class Box:
    """Half-open box ``[offsets[d], offsets[d] + sizes[d])`` per dim. 0-d boxes have volume 1."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"box rank mismatch: {len(self.offsets)} offsets vs {len(self.sizes)} sizes")
        # min() in C: boxes are made by the million when a full-size plan is scheduled
        if self.offsets and min(self.offsets) < 0:
            raise ValueError(f"negative offset {min(self.offsets)} in box")
        if self.sizes and min(self.sizes) < 0:
            raise ValueError(f"negative size {min(self.sizes)} in box")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def stops(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    @property
    def volume(self) -> int:
        return prod(self.sizes)

    @property
    def empty(self) -> bool:
        return any(s == 0 for s in self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The common part, or None when it is empty (0-d boxes always intersect)."""
        offs = []
        sizes = []
        for a0, a1, b0, b1 in zip(self.offsets, self.stops, other.offsets, other.stops):
            lo = a0 if a0 > b0 else b0
            hi = a1 if a1 < b1 else b1
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offs), tuple(sizes))

    def contains(self, other: Box) -> bool:
        return all(a0 <= b0 and b1 <= a1 for a0, a1, b0, b1 in
                   zip(self.offsets, self.stops, other.offsets, other.stops))

    def fits_in(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(e <= n for e, n in zip(self.stops, shape))

    @property
    def slices(self) -> tuple[slice, ...]:
        """Basic-indexing slices of this box (numpy and torch)."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def shift(self, delta: Sequence[int]) -> Box:
        """Translate by ``delta`` (may be negative as long as the result stays >= 0)."""
        return Box(tuple(o + d for o, d in zip(self.offsets, delta)), self.sizes)

    def relative_to(self, origin: Sequence[int]) -> Box:
        return Box(tuple(o - d for o, d in zip(self.offsets, origin)), self.sizes)

    def __repr__(self) -> str:
        dims = ", ".join(f"[{o}, {o + s})" for o, s in zip(self.offsets, self.sizes))
        return f"Box({dims})"

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of ``shape``."""
    strides = [1] * len(shape)
    acc = 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = acc
        acc *= shape[d]
    return tuple(strides)


def uniform_runs(box: Box, shape: Sequence[int]) -> Iterator[tuple[int, int, int, int]]:
    """Contiguous element runs of ``box`` inside a row-major buffer of ``shape``.

    Yields ``(start, count, stride, length)``: ``count`` runs of ``length`` elements, the i-th
    starting at ``start + i*stride``. Runs come in increasing order. Grouping runs this way keeps
    the number of Python iterations at ``prod(sizes[:k-1])`` instead of one per row, where ``k`` is
    the first dim after which the box spans the buffer fully.

    >>> list(uniform_runs(Box((1, 2), (2, 3)), (4, 8)))
    [(10, 2, 8, 3)]
    >>> list(uniform_runs(Box((0, 0), (2, 8)), (4, 8)))
    [(0, 1, 16, 16)]
    """
    n = len(shape)
    if box.empty:
        return
    if n == 0:
        yield (0, 1, 1, 1)
        return
    strides = row_major_strides(shape)
    # k: first dim such that all dims after it are full.
    k = n - 1
    while k > 0 and box.sizes[k] == shape[k] and box.offsets[k] == 0:
        k -= 1
    length = box.sizes[k] * strides[k]
    base = sum(o * s for o, s in zip(box.offsets, strides))
    if k == 0:
        yield (base, 1, length, length)
        return
    # Runs vary along dim k-1 with stride strides[k-1]; dims < k-1 are iterated.
    count = box.sizes[k - 1]
    step = strides[k - 1]
    outer = box.sizes[: k - 1]
    if not outer:
        yield (base, count, step, length)
        return
    import itertools

    for idx in itertools.product(*(range(s) for s in outer)):
        off = base + sum(i * strides[d] for d, i in enumerate(idx))
        yield (off, count, step, length)


def contiguous_slabs(shape: Sequence[int], itemsize: int, budget: int) -> Iterator[Box]:
    """Split a row-major buffer into boxes, each contiguous in memory and at most ``budget``
    bytes (never less than one element), in buffer order. Used to stream a large local tensor
    through a bounded buffer.

    >>> [str(b) for b in contiguous_slabs((4, 8), 1, 16)]
    ['[0:2, 0:8]', '[2:4, 0:8]']
    """
    n = len(shape)
    if n == 0:
        yield Box((), ())
        return
    if any(s == 0 for s in shape):
        return
    strides = row_major_strides(shape)
    # Split dim k: rows of dim k (each strides[k] elements) are grouped into slabs.
    max_elems = max(1, budget // max(1, itemsize))
    k = 0
    while k < n - 1 and strides[k] > max_elems:
        k += 1
    per = max(1, max_elems // strides[k])
    import itertools

    for idx in itertools.product(*(range(s) for s in shape[:k])):
        for a in range(0, shape[k], per):
            b = min(shape[k], a + per)
            yield Box(tuple(idx) + (a,) + (0,) * (n - k - 1),
                      (1,) * k + (b - a,) + tuple(shape[k + 1:]))


def cut_points(box: Box, d: int, grid: Sequence[int]) -> list[int]:
    """Where ``box`` may be cut along dim ``d``, relative to its start, when cuts must fall on
    multiples of ``grid[d]`` in array coordinates (or at the box's ends)."""
    a, n = box.offsets[d], box.sizes[d]
    g = grid[d]
    if g <= 1:
        return list(range(n + 1))
    return [0] + [x - a for x in range((a // g + 1) * g, a + n, g)] + [n]


def split_dim(box: Box, parts: int, grid: Sequence[int] | None = None) -> tuple[int, list[int] | None]:
    """The dim :func:`split_box` cuts along (the first with room for ``parts`` pieces, else the
    largest), and the cut points allowed there (None: anywhere)."""
    if grid is None:
        dim = next((d for d, s in enumerate(box.sizes) if s >= parts), None)
        if dim is None:
            dim = max(range(box.ndim), key=lambda d: box.sizes[d])
        return dim, None
    cells = [cut_points(box, d, grid) for d in range(box.ndim)]
    dim = next((d for d in range(box.ndim) if len(cells[d]) - 1 >= parts), None)
    if dim is None:
        dim = max(range(box.ndim), key=lambda d: (len(cells[d]), -d))
    return dim, cells[dim]


def slab(box: Box, dim: int, lo: int, hi: int) -> Box:
    """``box`` restricted to ``[lo, hi)`` (relative to its start) along ``dim``."""
    offs, sizes = list(box.offsets), list(box.sizes)
    offs[dim] += lo
    sizes[dim] = hi - lo
    return Box(tuple(offs), tuple(sizes))


def split_box(box: Box, parts: int, grid: Sequence[int] | None = None) -> list[Box]:
    """Split ``box`` into at most ``parts`` non-empty pieces along its first dim with size >= parts
    (else its largest dim), in row-major order; used to spread one region over several ranks.
    With ``grid``, cuts fall only on multiples of ``grid[d]`` (FP8 weights: every piece carries
    whole scale blocks)."""
    if parts <= 1 or box.volume <= 1 or box.ndim == 0:
        return [box]
    dim, pts = split_dim(box, parts, grid)
    n = box.sizes[dim]
    m = n if pts is None else len(pts) - 1
    k = min(parts, m)
    bounds = [n * i // k if pts is None else pts[m * i // k] for i in range(k + 1)]
    return [slab(box, dim, lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def is_row_major(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether ``strides`` lay ``sizes`` out C-contiguously (dims of size 1 may have any stride)."""
    return all(n <= 1 or st == ex for n, st, ex in zip(sizes, strides, row_major_strides(sizes)))
