"""Every check on manifests and on the data files they name; returns all problems.

``validate_manifest`` looks at the manifest alone (coverage, overlaps, bounds, holders, int64
limits, local tensors, path syntax and symlink escapes) and opens no data file.
``validate_data`` adds the checks that need the files (existence, safetensors headers, stored
dtypes and shapes, byte ranges, checksums). Neither raises on bad input: each returns a list of
problems, one line each, in the CLI form (design §8)::

    WHERE: ARRAY: what is wrong (expected ..., got ...)

Coverage and overlap checks are O(n log n) per array: regions are snapped onto the grid of
their distinct breakpoints and hashed (exact and linear for grid-like layouts), or, when that
grid would be too large, sorted along one dim and swept (candidate pairs checked vectorised).

No MPI, no torch.distributed.
"""

from __future__ import annotations

import os
import stat
import string
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path, PureWindowsPath
from typing import Any, Protocol

import numpy as np

from .box import Box, contiguous_slabs
from .checksum import new_hasher
from .compact import fill_pattern
from .dtypes import DTYPES, DType
from .errors import FormatError, ShardNotFoundError, ShardstreamError, UsageError
from .limits import INT64_MAX
from .manifest import ArraySpec, Chunk, Manifest, TensorSpec

__all__ = ["INT64_MAX", "MAX_PER_KIND", "check_file_path", "validate_data", "validate_manifest"]

#: at most this many problems of one kind are printed per array; the rest are counted
MAX_PER_KIND = 20
#: overlap enumeration stops after this many pairs per array (the summary then says "more than")
_MAX_PAIRS = 10_000
#: the grid-snapping overlap finder is used while the snapped cells number at most this
_CELL_BUDGET_MIN = 1 << 18
#: candidate pairs checked per vectorised batch in the sweep
_SWEEP_BATCH = 1 << 19
#: checksum reads go through buffers of at most this many bytes
_CHECKSUM_SLAB = 16 << 20


# ------------------------------------------------------------------ reporting


class _Report:
    """Collects problem lines, capping each (context, kind) at ``MAX_PER_KIND`` lines."""

    def __init__(self, where: str, cap: int = MAX_PER_KIND) -> None:
        self.where = where
        self.cap = cap
        self.lines: list[str] = []
        self._count: dict[tuple[str, str], int] = {}
        self._extra: dict[tuple[str, str], tuple[int, bool]] = {}
        self._last: dict[tuple[str, str], int] = {}

    def add(self, ctx: str, kind: str, msg: str) -> None:
        key = (ctx, kind)
        n = self._count.get(key, 0) + 1
        self._count[key] = n
        if n <= self.cap:
            self.lines.append(f"{self.where}: {ctx}: {msg}" if ctx else f"{self.where}: {msg}")
            self._last[key] = len(self.lines) - 1

    def more(self, ctx: str, kind: str, n: int, *, at_least: bool = False) -> None:
        """Count ``n`` further problems of a kind without their lines (``at_least``: a lower bound)."""
        if n <= 0 and not at_least:
            return
        key = (ctx, kind)
        old, old_al = self._extra.get(key, (0, False))
        self._extra[key] = (old + n, old_al or at_least)

    def finish(self) -> list[str]:
        tails: list[tuple[int, str]] = []
        keys = set(self._count) | set(self._extra)
        for key in keys:
            shown = min(self._count.get(key, 0), self.cap)
            hidden = self._count.get(key, 0) - shown
            extra, at_least = self._extra.get(key, (0, False))
            hidden += extra
            if hidden <= 0 and not at_least:
                continue
            ctx, kind = key
            head = f"{self.where}: {ctx}: " if ctx else f"{self.where}: "
            txt = f"... and more than {hidden} more {kind}" if at_least else f"... and {hidden} more {kind}"
            tails.append((self._last.get(key, len(self.lines) - 1), head + txt))
        out = list(self.lines)
        for pos, line in sorted(tails, key=lambda t: t[0], reverse=True):
            out.insert(pos + 1, line)
        return out


def _dims(v: Sequence[int]) -> str:
    return "[" + ", ".join(str(x) for x in v) + "]"


def _ranks(rs: Iterable[int], limit: int = 8) -> str:
    rl = sorted(set(rs))
    if len(rl) == 1:
        return f"rank {rl[0]}"
    s = ", ".join(str(r) for r in rl[:limit])
    if len(rl) > limit:
        s += f", ... ({len(rl)} ranks)"
    return f"ranks [{s}]"


def _box_from(off: Sequence[int], stop: Sequence[int]) -> Box:
    return Box(tuple(int(o) for o in off), tuple(int(b) - int(a) for a, b in zip(off, stop)))


# ------------------------------------------------------------------ geometry


@dataclass
class _Geo:
    """Result of an overlap / coverage analysis of a set of non-empty boxes."""

    pairs: list[tuple[int, int]]  # overlapping (i, j), i < j, indices into the input
    truncated: bool  # more than _MAX_PAIRS pairs exist
    union: int | None  # exact union volume when known
    gap: Box | None  # first uncovered cell (row-major) when known and the union is short


#: below this many boxes overlaps are found by a plain Python sweep (numpy call overhead dominates)
_SMALL = 48


def _analyze(offs: list[tuple[int, ...]], stops: list[tuple[int, ...]], nd: int, *,
             shape: Sequence[int] | None = None, max_pairs: int = _MAX_PAIRS,
             cell_budget: int | None = None, small: int | None = None) -> _Geo:
    """Every overlapping pair among ``n`` non-empty ``nd``-d boxes (``offs[i]``, ``stops[i]``).

    With ``shape`` (boxes already clipped to it), also the exact union volume when it can be had
    cheaply, and the first uncovered cell of the breakpoint grid when the union falls short.
    ``cell_budget`` / ``small`` override the method thresholds (tests use them to force a path).
    """
    n = len(offs)
    if n == 0:
        gap: Box | None = None
        if shape is not None and all(x > 0 for x in shape):
            gap = Box.whole(shape)
        return _Geo([], False, 0, gap)
    if n <= (_SMALL if small is None else small):
        pairs, truncated = _pairs_python(offs, stops, nd, max_pairs)
        if shape is None:
            return _Geo(pairs, truncated, None, None)
        vol = sum(prod(b - a for a, b in zip(o, e)) for o, e in zip(offs, stops))
        if not pairs and vol >= prod(shape):
            return _Geo([], False, vol, None)  # disjoint and full: an exact tiling
        # something is wrong: spend a little more for the exact union and a gap location
        cells = _analyze_cells(_int64_rows(offs, nd), _int64_rows(stops, nd), shape, max_pairs,
                               max(_CELL_BUDGET_MIN, 4 * n) if cell_budget is None else cell_budget)
        if cells is not None:
            return _Geo(pairs, truncated, cells.union, cells.gap)
        return _Geo(pairs, truncated, None if pairs else vol, None)
    off = _int64_rows(offs, nd)
    stop = _int64_rows(stops, nd)
    budget = cell_budget if cell_budget is not None else max(_CELL_BUDGET_MIN, 4 * n)
    geo = _analyze_cells(off, stop, shape, max_pairs, budget)
    if geo is None:
        geo = _analyze_sweep(off, stop, max_pairs)
        if shape is not None and not geo.pairs:
            geo.union = sum(prod(b - a for a, b in zip(o, e)) for o, e in zip(offs, stops))
    return geo


def _pairs_python(offs: list[tuple[int, ...]], stops: list[tuple[int, ...]], nd: int,
                  max_pairs: int) -> tuple[list[tuple[int, int]], bool]:
    """Sort along the dim with the most distinct offsets; compare each box with those starting
    before it ends in that dim."""
    n = len(offs)
    if nd == 0:  # 0-d boxes always intersect
        allp = [(i, j) for i in range(n) for j in range(i + 1, n)]
        return allp[:max_pairs], len(allp) > max_pairs
    d = max(range(nd), key=lambda k: len({o[k] for o in offs}))
    order = sorted(range(n), key=lambda i: offs[i][d])
    pairs: list[tuple[int, int]] = []
    dims = range(nd)
    for x in range(n):
        i = order[x]
        oi, si = offs[i], stops[i]
        end = si[d]
        for y in range(x + 1, n):
            j = order[y]
            oj = offs[j]
            if oj[d] >= end:
                break
            sj = stops[j]
            if all(oj[k] < si[k] and oi[k] < sj[k] for k in dims):
                pairs.append((i, j) if i < j else (j, i))
                if len(pairs) > max_pairs:
                    return sorted(pairs)[:max_pairs], True
    return sorted(pairs), False


def _analyze_cells(off: np.ndarray[Any, Any], stop: np.ndarray[Any, Any], shape: Sequence[int] | None,
                   max_pairs: int, budget: int) -> _Geo | None:
    """Snap boxes onto the grid of distinct breakpoints; hash the cells. None when too many cells."""
    n, nd = off.shape
    breaks: list[np.ndarray[Any, Any]] = []
    for d in range(nd):
        parts = [off[:, d], stop[:, d]]
        if shape is not None:
            parts.append(np.array([0, shape[d]], dtype=np.int64))
        breaks.append(np.unique(np.concatenate(parts)))
    radix = [len(b) - 1 for b in breaks]
    total_grid = prod(radix)
    if total_grid > (1 << 62):
        return None
    lo = np.empty((n, nd), dtype=np.int64)
    span = np.empty((n, nd), dtype=np.int64)
    for d in range(nd):
        lo[:, d] = np.searchsorted(breaks[d], off[:, d])
        span[:, d] = np.searchsorted(breaks[d], stop[:, d]) - lo[:, d]
    ncells = float(np.prod(span.astype(np.float64), axis=1).sum())
    if ncells > budget:
        return None
    kstride = [1] * nd
    for d in range(nd - 2, -1, -1):
        kstride[d] = kstride[d + 1] * radix[d + 1]
    key, owner = _cell_keys(lo, span, kstride)
    order = np.argsort(key, kind="stable")
    ks = key[order]
    ow = owner[order]
    same = ks[1:] == ks[:-1]
    pairs, truncated = _shared_cells(ks, ow, same, max_pairs)
    union: int | None = None
    gap: Box | None = None
    if shape is not None:
        union, gap = _union_and_gap(ks, same, breaks, radix, kstride, shape)
    return _Geo(sorted(pairs)[:max_pairs], truncated, union, gap)


def _cell_keys(lo: np.ndarray[Any, Any], span: np.ndarray[Any, Any],
               kstride: list[int]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Every grid cell each box covers, as (row-major cell key, box index), one entry per cell."""
    n, nd = lo.shape
    owner = np.arange(n, dtype=np.int64)
    key = np.zeros(n, dtype=np.int64)
    for d in range(nd):
        r = span[owner, d]
        if bool((r == 1).all()):
            key = key + lo[owner, d] * kstride[d]
            continue
        rep_owner = np.repeat(owner, r)
        rep_key = np.repeat(key, r)
        starts = np.cumsum(r) - r
        within = np.arange(len(rep_owner), dtype=np.int64) - np.repeat(starts, r)
        key = rep_key + (lo[rep_owner, d] + within) * kstride[d]
        owner = rep_owner
    return key, owner


def _shared_cells(ks: np.ndarray[Any, Any], ow: np.ndarray[Any, Any], same: np.ndarray[Any, Any],
                  max_pairs: int) -> tuple[set[tuple[int, int]], bool]:
    """Pairs of boxes that share a cell (sorted keys ``ks``, their boxes ``ow``), at most
    ``max_pairs`` + 1 of them; True when there were more."""
    pairs: set[tuple[int, int]] = set()
    if not bool(same.any()):
        return pairs, False
    # runs of equal keys: positions [a, b) with b - a >= 2
    boundary = np.flatnonzero(~same) + 1
    starts_ = np.concatenate([[0], boundary])
    ends_ = np.concatenate([boundary, [len(ks)]])
    multi = np.flatnonzero(ends_ - starts_ >= 2)
    for k in multi.tolist():
        owners = sorted(set(ow[starts_[k]:ends_[k]].tolist()))
        for x in range(len(owners)):
            for y in range(x + 1, len(owners)):
                pairs.add((owners[x], owners[y]))
                if len(pairs) > max_pairs:
                    return pairs, True
    return pairs, False


def _union_and_gap(ks: np.ndarray[Any, Any], same: np.ndarray[Any, Any], breaks: list[np.ndarray[Any, Any]],
                   radix: list[int], kstride: list[int], shape: Sequence[int]) -> tuple[int, Box | None]:
    """Elements the covered cells hold, and the first uncovered cell (None: all covered)."""
    nd = len(radix)
    uniq = ks[np.concatenate([[True], ~same])] if len(ks) else ks
    vol = np.ones(len(uniq), dtype=np.int64)
    for d in range(nd):
        idx = (uniq // kstride[d]) % radix[d]
        vol *= np.diff(breaks[d])[idx]
    union = int(vol.sum(dtype=np.int64)) if len(uniq) else 0
    gap: Box | None = None
    if union < prod(shape) and len(uniq) < prod(radix):
        miss = np.flatnonzero(uniq != np.arange(len(uniq), dtype=np.int64))
        first = int(miss[0]) if len(miss) else len(uniq)
        g_off, g_stop = [], []
        for d in range(nd):
            i = (first // kstride[d]) % radix[d]
            g_off.append(int(breaks[d][i]))
            g_stop.append(int(breaks[d][i + 1]))
        gap = _box_from(g_off, g_stop)
    return union, gap


def _analyze_sweep(off: np.ndarray[Any, Any], stop: np.ndarray[Any, Any], max_pairs: int) -> _Geo:
    """Sort along the dim with the fewest candidate pairs (boxes starting before another ends in
    that dim) and check the candidates vectorised, in bounded batches, one dim at a time."""
    n, nd = off.shape
    best: tuple[int, np.ndarray[Any, Any], np.ndarray[Any, Any]] | None = None
    best_k = -1
    for d in range(nd):
        order = np.argsort(off[:, d], kind="stable")
        o = off[order, d]
        end = np.searchsorted(o, stop[order, d], side="left")
        c = np.maximum(end - np.arange(n) - 1, 0)
        k = int(c.sum())
        if best is None or k < best_k:
            best, best_k = (d, order, c), k
    assert best is not None
    sd, order, c = best
    others = [d for d in range(nd) if d != sd]
    cols = [(np.ascontiguousarray(off[order, d]), np.ascontiguousarray(stop[order, d])) for d in others]
    csum = np.cumsum(c)
    cstart = csum - c
    found: list[tuple[int, int]] = []

    def check(pa: np.ndarray[Any, Any], pb: np.ndarray[Any, Any]) -> bool:
        for co, cs in cols:
            keep = (co[pb] < cs[pa]) & (co[pa] < cs[pb])
            pa, pb = pa[keep], pb[keep]
            if not len(pa):
                return False
        x, y = order[pa], order[pb]
        found.extend(zip(np.minimum(x, y).tolist(), np.maximum(x, y).tolist()))
        return len(found) > max_pairs

    p = 0
    batch = _SWEEP_BATCH
    while p < n:
        cp = int(c[p])
        if cp > batch:  # one box with many candidates: in slices
            for s0 in range(0, cp, batch):
                pb = np.arange(p + 1 + s0, p + 1 + min(cp, s0 + batch), dtype=np.int64)
                if check(np.full(len(pb), p, dtype=np.int64), pb):
                    return _Geo(sorted(found)[:max_pairs], True, None, None)
            p += 1
            continue
        q = int(np.searchsorted(csum, int(cstart[p]) + batch, side="right"))
        reps = c[p:q]
        total = int(reps.sum())
        if total:
            pa = np.repeat(np.arange(p, q, dtype=np.int64), reps)
            within = np.arange(total, dtype=np.int64) - np.repeat(cstart[p:q] - cstart[p], reps)
            if check(pa, pa + 1 + within):
                return _Geo(sorted(found)[:max_pairs], True, None, None)
        p = q
    return _Geo(sorted(found), False, None, None)


def _int64_rows(rows: list[tuple[int, ...]], nd: int) -> np.ndarray[Any, Any]:
    if not rows:
        return np.zeros((0, nd), dtype=np.int64)
    return np.array(rows, dtype=np.int64).reshape(len(rows), nd)


# ------------------------------------------------------------------ paths

def check_file_path(base_dir: Path | None, rel: str) -> str | None:
    """The problem with ``rel`` as a manifest ``source.file`` (already ``{rank}``-expanded), or None.

    Syntax: relative, ``/``-separated, no ``..``, no empty component, no backslash, no NUL, no
    drive. With ``base_dir``: the real path must stay inside the real ``base_dir`` (symlinks
    included), and an existing entry must be a regular file or a directory (zarr group). The
    file need not exist.
    """
    if not isinstance(rel, str) or rel == "":
        return f"path {rel!r} is empty (expected a relative path inside the manifest's directory)"
    if "\x00" in rel:
        return f"path {rel!r} contains a NUL byte (expected a plain relative path)"
    if "\\" in rel:
        return f"path {rel!r} contains a backslash (expected '/' as the only separator)"
    win = PureWindowsPath(rel)
    if rel.startswith("/") or win.drive or win.is_absolute():
        return f"path {rel!r} is absolute (expected a relative path inside the manifest's directory)"
    parts = rel.split("/")
    if any(p == ".." for p in parts):
        return f"path {rel!r} contains '..' (expected a path inside the manifest's directory)"
    if any(p == "" for p in parts):
        return f"path {rel!r} has an empty component (expected 'dir/name' with no '//' or trailing '/')"
    if base_dir is None:
        return None
    try:
        base_real = os.path.realpath(base_dir)
        target = os.path.realpath(os.path.join(base_real, rel))
        if os.path.commonpath([base_real, target]) != base_real:
            return (f"path {rel!r} resolves outside the manifest's directory "
                    f"(expected inside {base_real}, got {target})")
        try:
            st = os.stat(target)
        except FileNotFoundError:
            return None
        except OSError as e:  # a symlink loop, permissions...
            return f"path {rel!r} cannot be examined ({e.strerror or e})"
    except (OSError, ValueError) as e:
        return f"path {rel!r} cannot be resolved ({e})"
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return f"path {rel!r} is a {_file_kind(st.st_mode)} (expected a regular file or a directory)"
    return None


def _file_kind(mode: int) -> str:
    if stat.S_ISCHR(mode):
        return "character device"
    if stat.S_ISBLK(mode):
        return "block device"
    if stat.S_ISFIFO(mode):
        return "named pipe"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "special file"


def _check_pattern(f: str) -> str | None:
    """Problem with a ``source.file`` ``{rank}`` pattern, or None (also None without braces)."""
    if "{" not in f:
        return None
    try:
        parsed = list(string.Formatter().parse(f))
    except ValueError as e:
        return f"source.file pattern {f!r} is not a valid format string ({e})"
    for _lit, field, spec, conv in parsed:
        if field is None:
            continue
        if field != "rank":
            return (f"source.file pattern {f!r} uses field {{{field}}} "
                    f"(expected only {{rank}}, e.g. 'rank-{{rank:05d}}.safetensors')")
        if conv is not None:
            return f"source.file pattern {f!r} uses conversion !{conv} (expected plain {{rank}} or {{rank:SPEC}})"
        if spec and ("{" in spec or "}" in spec):
            return f"source.file pattern {f!r} has a nested field in its format spec (expected e.g. {{rank:05d}})"
    try:
        f.format(rank=0)
    except (KeyError, ValueError, IndexError, AttributeError, TypeError) as e:
        return f"source.file pattern {f!r} does not format with an integer rank ({type(e).__name__}: {e})"
    return None


def _expand(f: str, rank: int) -> str:
    return f.format(rank=rank) if "{" in f else f


# ------------------------------------------------------------------ validate_manifest


#: identity of a local tensor: (name, source.file as written, source.byte_range)
_LocalKey = tuple[str, str | None, tuple[int, int] | None]


@dataclass
class _LocalEntry:
    fqn: str
    ci: int
    off: tuple[int, ...]
    stop: tuple[int, ...]
    holders: tuple[int, ...]
    data_type: str


def validate_manifest(m: Manifest, *, where: str = "<manifest>", check_paths: bool = True) -> list[str]:
    """Structural and semantic problems of ``m`` alone, one line each; ``[]`` when valid.

    Opens no data file. With ``check_paths`` and ``m.base_dir`` set, it resolves each
    ``source.file`` (per holder for ``{rank}`` patterns) for symlink escapes and special files.
    """
    rep = _Report(where)
    # local tensor identity: (name, file pattern, byte_range) -> entries
    local: dict[_LocalKey, list[_LocalEntry]] = {}
    files: dict[str, list[Any]] = {}  # file -> [first fqn, first chunk, uses, holders]
    compact = _Compact(m)
    for fqn, spec in m.arrays.items():
        try:
            if spec.ref is not None and not spec.expanded:
                compact.check(fqn, spec, rep, local, files)
            else:
                _validate_array(m, fqn, spec.shape, spec.data_type, spec.chunks, rep, local, files)
        except Exception as e:  # noqa: BLE001 - pragma: no cover - safety net, validation never raises
            rep.add(fqn, "internal errors", f"internal error while validating ({type(e).__name__}: {e})")
    try:
        _validate_tensors_section(m, rep)
        _validate_local(m, rep, local)
        if check_paths:
            _validate_paths(m, rep, files)
            _validate_sidecar(m, rep)
    except Exception as e:  # noqa: BLE001 - pragma: no cover - safety net
        rep.add("", "internal errors", f"internal error while validating ({type(e).__name__}: {e})")
    return rep.finish()


def _validate_sidecar(m: Manifest, rep: _Report) -> None:
    """A compact manifest's checksum sidecar: present, of the size and sha256 it names."""
    if m.base_dir is None:
        return
    table = next((t for spec in m.arrays.values() if spec.ref is not None
                  and (t := getattr(spec.ref, "table", None)) is not None), None)
    if table is not None:
        for line in table.problems():
            rep.add("", "checksum sidecar problems", line)


def _validate_array(m: Manifest, fqn: str, shape: tuple[int, ...], data_type: str,
                    chunks: Sequence[Chunk], rep: _Report, local: dict[_LocalKey, list[_LocalEntry]],
                    files: dict[str, list[Any]]) -> None:
    dt = _check_array_type(fqn, shape, data_type, rep)
    if dt is None:
        return
    isz = dt.itemsize
    elems = prod(shape)
    array_ok = elems * isz <= INT64_MAX
    if not array_ok:
        rep.add(fqn, "size problems",
                f"array size overflows int64 (expected at most {INT64_MAX} bytes, got {elems * isz} "
                f"bytes = {elems} elements x {isz})")
    nd = len(shape)
    offs: list[tuple[int, ...]] = []
    stops: list[tuple[int, ...]] = []
    box_chunk: list[int] = []
    zeros = (0,) * nd
    for ci, c in enumerate(chunks):
        r = c.region
        ro, rs = r.offsets, r.sizes
        if len(rs) != nd:
            rep.add(fqn, "rank problems", f"chunk {ci}: region has {len(rs)} dims (expected {nd}, got {len(rs)})")
            continue
        _check_holders(fqn, ci, c.holders, m.world_size, rep)
        rstop, in_bounds, empty = _check_region(fqn, ci, r, shape, isz, array_ok, rep)
        # source and local tensor
        src = c.source
        loff = zeros if src is None or src.offsets is None else src.offsets
        if src is not None or not empty:
            _validate_source(m, fqn, ci, c, dt, loff, rep, local, files, empty)
        if empty or not array_ok:
            continue
        if nd == 0:
            box_chunk.append(ci)
            continue
        if not in_bounds:  # coverage works on the part inside the array; the excess is reported above
            rstop = tuple([min(a, b) for a, b in zip(rstop, shape)])
            if any(a >= b for a, b in zip(ro, rstop)):
                continue
        offs.append(ro)
        stops.append(rstop)
        box_chunk.append(ci)
    if array_ok:
        _check_coverage(m, fqn, shape, offs, stops, box_chunk, rep)


class _Compact:
    """Validation of arrays given by a layout (compact manifests), without expanding them.

    A layout's regions tile the array by construction (torch.chunk pieces of the whole array),
    so coverage, overlaps, bounds and holders reduce to checks of the layout itself, made once
    per layout however many arrays share it and reported on the first array that uses it. Per
    array remain its local tensor name (the pattern must fill from the array's name) and its
    local box: ``[block, block + extent)`` on the layout's holders, one entry per array in the
    local tensor checks (``extent``: the largest region size per dim, a bounding box).
    """

    def __init__(self, m: Manifest) -> None:
        self.m = m
        self.layouts: dict[int, bool] = {}  # id(layout) -> usable
        self.files: set[tuple[str, int]] = set()
        self.holder_sets: dict[int, frozenset[int]] = {}  # id(layout) -> its holders
        self._declared: dict[str, list[tuple[int, TensorSpec]]] | None = None

    def declared(self, tensor: str) -> list[tuple[int, TensorSpec]]:
        if self._declared is None:
            self._declared = {}
            for r, ts in self.m.tensors.items():
                for name, t in ts.items():
                    self._declared.setdefault(name, []).append((r, t))
        return self._declared.get(tensor, [])

    def layout_ok(self, fqn: str, spec: ArraySpec, rep: _Report) -> bool:
        assert spec.ref is not None
        lay = spec.ref.layout
        ok = self.layouts.get(id(lay))
        if ok is None:
            dt = _check_array_type(fqn, lay.shape, lay.data_type, rep)
            problems = lay.check(self.m.world_size)
            if lay.file is not None:
                perr = _check_pattern(lay.file)
                if perr is not None:
                    problems.append(f"layout {lay.name!r}: {perr}")
            if dt is not None and prod(lay.shape) * dt.itemsize > INT64_MAX:
                problems.append(f"layout {lay.name!r}: array size overflows int64 (expected at most "
                                f"{INT64_MAX} bytes, got {prod(lay.shape) * dt.itemsize})")
            for msg in problems:
                rep.add(fqn, "layout problems", msg)
            ok = dt is not None and not problems
            self.layouts[id(lay)] = ok
        return ok

    def check(self, fqn: str, spec: ArraySpec, rep: _Report, local: dict[_LocalKey, list[_LocalEntry]],
              files: dict[str, list[Any]]) -> None:
        ref = spec.ref
        assert ref is not None
        if not self.layout_ok(fqn, spec, rep):
            return
        lay = ref.layout
        if lay.tensor is None:
            tensor = fqn
        else:
            try:
                tensor = fill_pattern(lay.tensor, fqn)
            except ValueError as e:
                rep.add(fqn, "source problems", f"layout {lay.name!r}: {e}")
                return
        nd = len(lay.shape)
        off = ref.block if ref.block is not None else (0,) * nd
        stop = tuple([o + e for o, e in zip(off, lay.extent)])
        dt = DTYPES[lay.data_type]
        if prod(stop) * dt.itemsize > INT64_MAX:
            rep.add(fqn, "size problems", f"local box {_box_from(off, stop)} overflows int64 (expected a local "
                                          f"tensor of at most {INT64_MAX} bytes)")
            return
        if lay.file is not None:
            use = files.get(lay.file)
            if use is None:
                use = files[lay.file] = [fqn, 0, 0, set()]
            use[2] += len(lay.regions)
            if (lay.file, id(lay)) not in self.files:  # holders once per layout, not per array
                self.files.add((lay.file, id(lay)))
                use[3].update(lay.holders)
        if not lay.regions:
            return
        key = (tensor, lay.file, None)
        local.setdefault(key, []).append(_LocalEntry(fqn, 0, off, stop, lay.holders, dt.name))
        declared = self.declared(tensor)
        if declared:  # most local tensors are not declared: no holder set for them
            holders = self.holder_sets.get(id(lay))
            if holders is None:
                holders = self.holder_sets[id(lay)] = frozenset(lay.holders)
            for hr, ts in declared:
                if hr in holders:
                    _check_declared(fqn, "", tensor, hr, ts, off, stop, rep)


def _check_array_type(fqn: str, shape: tuple[int, ...], data_type: str, rep: _Report) -> DType | None:
    """The array's dtype, or None (reported) when its data_type or shape is unusable."""
    dt = DTYPES.get(data_type)
    if dt is None:
        rep.add(fqn, "data_type problems",
                f"unknown data_type {data_type!r} (expected one of {', '.join(DTYPES)})")
        return None
    if any(x < 0 for x in shape):
        rep.add(fqn, "shape problems", f"shape {_dims(shape)} has a negative size")
        return None
    return dt


def _check_holders(fqn: str, ci: int, h: tuple[int, ...], ws: int, rep: _Report) -> None:
    """Holders: sorted, unique, in ``[0, world_size)``."""
    if len(h) == 1:
        if not 0 <= h[0] < ws:
            rep.add(fqn, "holder problems",
                    f"chunk {ci}: holder rank {h[0]} is out of range "
                    f"(expected 0 <= rank < world_size {ws}, got {h[0]})")
    elif not h:
        rep.add(fqn, "holder problems", f"chunk {ci}: holders is empty (expected at least one rank)")
    else:
        if any(h[k] >= h[k + 1] for k in range(len(h) - 1)):
            rep.add(fqn, "holder problems",
                    f"chunk {ci}: holders must be sorted and unique (expected {_dims(sorted(set(h)))}, "
                    f"got {_dims(h)})")
        for hr in h:
            if not 0 <= hr < ws:
                rep.add(fqn, "holder problems",
                        f"chunk {ci}: holder rank {hr} is out of range "
                        f"(expected 0 <= rank < world_size {ws}, got {hr})")


def _check_region(fqn: str, ci: int, r: Box, shape: tuple[int, ...], isz: int, array_ok: bool,
                  rep: _Report) -> tuple[tuple[int, ...], bool, bool]:
    """Bounds, byte size and emptiness of one chunk's region: ``(stops, in bounds, empty)``."""
    ro, rs = r.offsets, r.sizes
    rstop = tuple([o + z for o, z in zip(ro, rs)])
    in_bounds = True
    for d in range(len(shape)):
        if rstop[d] > shape[d]:
            in_bounds = False
            rep.add(fqn, "out-of-bounds regions",
                    f"chunk {ci} region {r} exceeds shape {_dims(shape)} in dim {d} "
                    f"(stop {rstop[d]} > {shape[d]})")
    if not (in_bounds and array_ok):  # else the region is no bigger than the array
        rb = prod(rs) * isz
        if rb > INT64_MAX:
            rep.add(fqn, "size problems",
                    f"chunk {ci}: region {r} size overflows int64 (expected at most {INT64_MAX} bytes, "
                    f"got {rb} bytes)")
    empty = 0 in rs
    if empty:
        rep.add(fqn, "empty regions",
                f"chunk {ci}: empty region listed {r} (expected sizes >= 1 in every dim, "
                f"got sizes {_dims(rs)})")
    return rstop, in_bounds, empty


def _check_coverage(m: Manifest, fqn: str, shape: tuple[int, ...], offs: list[tuple[int, ...]],
                    stops: list[tuple[int, ...]], box_chunk: list[int], rep: _Report) -> None:
    """Overlaps between the chunks' regions (``offs`` / ``stops``, clipped to the array; chunk
    numbers in ``box_chunk``) and, unless the manifest is partial, gaps."""
    elems = prod(shape)
    if not shape:
        k = len(box_chunk)
        if k > 1 or (k == 0 and not m.partial):
            rep.add(fqn, "coverage problems",
                    f"0-d array needs exactly one chunk with region offsets [] sizes [] "
                    f"(expected 1 chunk, got {k})")
        return
    geo = _analyze(offs, stops, len(shape), shape=shape)
    for i, j in geo.pairs:
        inter = _box_from(offs[i], stops[i]).intersect(_box_from(offs[j], stops[j]))
        rep.add(fqn, "overlaps", f"chunks {box_chunk[i]} and {box_chunk[j]} overlap in region {inter}")
    if geo.truncated:
        rep.more(fqn, "overlaps", 0, at_least=True)
    if m.partial:
        return
    if geo.union is not None:
        if geo.union < elems:
            loc = f"; first uncovered region {geo.gap}" if geo.gap is not None else ""
            rep.add(fqn, "gaps", f"chunks cover {geo.union} of {elems} elements "
                                 f"(gap of {elems - geo.union} elements{loc})")
    else:  # overlaps and too irregular for the exact union: bound it by the sum of volumes
        vol = sum(prod(b - a for a, b in zip(o, e)) for o, e in zip(offs, stops))
        if vol < elems:
            rep.add(fqn, "gaps", f"chunks cover at most {vol} of {elems} elements "
                                 f"(gap of at least {elems - vol} elements)")


def _validate_source(m: Manifest, fqn: str, ci: int, c: Chunk, dt: DType, loff: tuple[int, ...],
                     rep: _Report, local: dict[_LocalKey, list[_LocalEntry]],
                     files: dict[str, list[Any]], empty: bool) -> None:
    r = c.region
    nd = len(r.sizes)
    src = c.source
    if len(loff) != nd:
        rep.add(fqn, "source problems",
                f"chunk {ci}: source.offsets has {len(loff)} entries (expected {nd}, one per dim, got {len(loff)})")
        return
    if src is not None and src.offsets is not None and any(o < 0 for o in loff):
        rep.add(fqn, "source problems", f"chunk {ci}: source.offsets {_dims(loff)} must be non-negative")
        return
    lstop = tuple([o + z for o, z in zip(loff, r.sizes)])
    if prod(lstop) * dt.itemsize > INT64_MAX:
        rep.add(fqn, "size problems",
                f"chunk {ci}: local box {Box(loff, r.sizes)} overflows int64 (expected a local tensor of "
                f"at most {INT64_MAX} bytes, got stops {_dims(lstop)})")
        return
    tensor = fqn if src is None or src.tensor is None else src.tensor
    if src is not None:
        if src.file is not None:
            use = files.get(src.file)
            if use is None:
                files[src.file] = [fqn, ci, 1, set(c.holders)]
            else:
                use[2] += 1
                use[3].update(c.holders)
        if (src.byte_range is None) != (src.stored_shape is None):
            rep.add(fqn, "source problems",
                    f"chunk {ci}: source.byte_range and source.stored_shape must be given together "
                    f"(got byte_range {src.byte_range}, stored_shape {src.stored_shape})")
        elif src.byte_range is not None and src.stored_shape is not None:
            ss = src.stored_shape
            a, b = src.byte_range
            lbox = Box(loff, r.sizes)
            if len(ss) != nd:
                rep.add(fqn, "source problems",
                        f"chunk {ci}: source.stored_shape {_dims(ss)} has {len(ss)} dims "
                        f"(expected {nd}, got {len(ss)})")
            else:
                for d in range(nd):
                    if lstop[d] > ss[d]:
                        rep.add(fqn, "source problems",
                                f"chunk {ci}: local box {lbox} exceeds source.stored_shape {_dims(ss)} "
                                f"in dim {d} (stop {lstop[d]} > {ss[d]})")
            sdt = _declared_dtype(m, c.holders, tensor) or dt
            need = prod(ss) * sdt.itemsize
            if b < a:
                rep.add(fqn, "source problems", f"chunk {ci}: source.byte_range [{a}, {b}] has stop < start")
            elif b - a != need:
                rep.add(fqn, "source problems",
                        f"chunk {ci}: source.byte_range [{a}, {b}] holds {b - a} bytes but source.stored_shape "
                        f"{_dims(ss)} of {sdt.name} needs {need} (expected {need} bytes, got {b - a})")
    if empty:
        return
    key = (tensor, None, None) if src is None else (tensor, src.file, src.byte_range)
    ents = local.get(key)
    if ents is None:
        local[key] = [_LocalEntry(fqn, ci, loff, lstop, c.holders, dt.name)]
    else:
        ents.append(_LocalEntry(fqn, ci, loff, lstop, c.holders, dt.name))
    # declared local tensors must contain the chunk's local box
    if m.tensors:
        for hr in c.holders:
            ts = m.tensors.get(hr, {}).get(tensor)
            if ts is not None:
                _check_declared(fqn, f"chunk {ci}: ", tensor, hr, ts, loff, lstop, rep)


def _check_declared(fqn: str, lead: str, tensor: str, hr: int, ts: TensorSpec, off: tuple[int, ...],
                    stop: tuple[int, ...], rep: _Report) -> None:
    """A local box ``[off, stop)`` must fit the local tensor declared on rank ``hr``."""
    nd = len(off)
    if len(ts.shape) != nd:
        rep.add(fqn, "local tensor problems",
                f"{lead}local tensor {tensor!r} declared on rank {hr} has {len(ts.shape)} dims "
                f"(expected {nd}, got {len(ts.shape)})")
        return
    for d in range(nd):
        if stop[d] > ts.shape[d]:
            rep.add(fqn, "local tensor problems",
                    f"{lead}local box {_box_from(off, stop)} does not fit local tensor {tensor!r} "
                    f"declared on rank {hr} with shape {_dims(ts.shape)} in dim {d} "
                    f"(stop {stop[d]} > {ts.shape[d]})")


def _declared_dtype(m: Manifest, holders: Iterable[int], tensor: str) -> DType | None:
    for hr in holders:
        ts = m.tensors.get(hr, {}).get(tensor)
        if ts is not None and ts.data_type in DTYPES:
            return DTYPES[ts.data_type]
    return None


def _validate_tensors_section(m: Manifest, rep: _Report) -> None:
    for r, ts in m.tensors.items():
        ctx = f"tensors.{r}"
        if r >= m.world_size or r < 0:
            rep.add(ctx, "rank problems",
                    f"rank {r} is out of range (expected 0 <= rank < world_size {m.world_size}, got {r})")
        for name, t in ts.items():
            dt = DTYPES.get(t.data_type)
            if dt is None:
                rep.add(f"{ctx}.{name}", "data_type problems", f"unknown data_type {t.data_type!r}")
                continue
            n = prod(t.shape) * dt.itemsize
            if n > INT64_MAX:
                rep.add(f"{ctx}.{name}", "size problems",
                        f"local tensor size overflows int64 (expected at most {INT64_MAX} bytes, got {n})")


def _validate_local(m: Manifest, rep: _Report, local: dict[_LocalKey, list[_LocalEntry]]) -> None:
    """Chunks sharing a local tensor on a rank: same dtype (unless declared), same ndim, disjoint."""
    for (tensor, _file, _br), ents in local.items():
        if len(ents) < 2:
            continue
        # partition into rank groups: by holders tuple when those are pairwise disjoint, else per rank
        by_holders: dict[tuple[int, ...], list[int]] = {}
        for k, e in enumerate(ents):
            by_holders.setdefault(e.holders, []).append(k)
        groups: list[tuple[tuple[int, ...], list[int]]]
        all_ranks = [hr for h in by_holders for hr in h]
        if len(all_ranks) == len(set(all_ranks)):
            groups = [(h, ks) for h, ks in by_holders.items() if len(ks) >= 2]
        else:
            per_rank: dict[int, list[int]] = {}
            for k, e in enumerate(ents):
                for hr in e.holders:
                    per_rank.setdefault(hr, []).append(k)
            groups = [((hr,), ks) for hr, ks in sorted(per_rank.items()) if len(ks) >= 2]
        seen_pairs: dict[tuple[int, int], list[int]] = {}
        seen_dtype: dict[tuple[int, int], list[int]] = {}
        seen_ndim: dict[tuple[int, int], list[int]] = {}
        for ranks, ks in groups:
            first = ks[0]
            # dtype
            other = next((k for k in ks if ents[k].data_type != ents[first].data_type), None)
            if other is not None:
                undeclared = [hr for hr in ranks if tensor not in m.tensors.get(hr, {})]
                if undeclared:
                    seen_dtype.setdefault((first, other), []).extend(undeclared)
            # ndim
            by_nd: dict[int, list[int]] = {}
            for k in ks:
                by_nd.setdefault(len(ents[k].off), []).append(k)
            if len(by_nd) > 1:
                nds = sorted(by_nd)
                seen_ndim.setdefault((by_nd[nds[0]][0], by_nd[nds[1]][0]), []).extend(ranks)
            for nd, sub in by_nd.items():
                if len(sub) < 2:
                    continue
                if nd == 0:  # 0-d local tensors: any two chunks overlap
                    pairs = [(sub[0], sub[b]) for b in range(1, min(len(sub), _MAX_PAIRS + 1))]
                else:
                    geo = _analyze([ents[k].off for k in sub], [ents[k].stop for k in sub], nd)
                    pairs = [(sub[a], sub[b]) for a, b in geo.pairs]
                    if geo.truncated:
                        rep.more(ents[sub[0]].fqn, "local tensor overlaps", 0, at_least=True)
                for pr in pairs:
                    seen_pairs.setdefault(pr, []).extend(ranks)
        for (a, b), rs in seen_dtype.items():
            ea, eb = ents[a], ents[b]
            rep.add(ea.fqn, "local tensor problems",
                    f"local tensor {tensor!r} on {_ranks(rs)} is shared by arrays of different data_type "
                    f"without a 'tensors' declaration (expected one data_type, got {ea.data_type} "
                    f"({ea.fqn} chunk {ea.ci}) and {eb.data_type} ({eb.fqn} chunk {eb.ci}))")
        for (a, b), rs in seen_ndim.items():
            ea, eb = ents[a], ents[b]
            rep.add(ea.fqn, "local tensor problems",
                    f"local tensor {tensor!r} on {_ranks(rs)} is used with different numbers of dims "
                    f"(expected {len(ea.off)} ({ea.fqn} chunk {ea.ci}), got {len(eb.off)} "
                    f"({eb.fqn} chunk {eb.ci}))")
        for (a, b), rs in sorted(seen_pairs.items()):
            ea, eb = ents[a], ents[b]
            if ea.fqn == eb.fqn:
                who = f"chunks {ea.ci} and {eb.ci}"
            else:
                who = f"chunk {ea.ci} and {eb.fqn} chunk {eb.ci}"
            inter = _box_from(ea.off, ea.stop).intersect(_box_from(eb.off, eb.stop))
            where_inter = f" (overlap {inter})" if inter is not None and inter.ndim else ""
            rep.add(ea.fqn, "local tensor overlaps",
                    f"{who} write overlapping ranges of local tensor {tensor!r} on {_ranks(rs)}{where_inter}")


def _validate_paths(m: Manifest, rep: _Report, files: dict[str, list[Any]]) -> None:
    base = m.base_dir
    cache: dict[str, str | None] = {}
    for f, (fqn, ci, uses, holders) in files.items():
        also = f" (used by {uses} chunks)" if uses > 1 else ""
        perr = _check_pattern(f)
        if perr is not None:
            rep.add(fqn, "path problems", f"chunk {ci}: {perr}{also}")
            continue
        if "{" in f:
            expanded = []
            for hr in sorted(holders):
                try:
                    expanded.append((hr, f.format(rank=hr)))
                except (KeyError, ValueError, IndexError, AttributeError, TypeError) as e:
                    rep.add(fqn, "path problems",
                            f"chunk {ci}: source.file pattern {f!r} does not format for rank {hr} ({e})")
        else:
            expanded = [(-1, f)]
        for hr, p in expanded:
            if p not in cache:
                cache[p] = check_file_path(base, p)
            err = cache[p]
            if err is not None:
                on = f" for rank {hr}" if hr >= 0 else ""
                rep.add(fqn, "path problems", f"chunk {ci}: source.file{on}: {err}{also}")


# ------------------------------------------------------------------ validate_data


class _StoredLike(Protocol):
    name: str
    dtype: DType
    shape: tuple[int, ...]
    start: int
    nbytes: int


def _header_reader() -> Callable[[Path], Any]:
    # imported lazily: validate_manifest never needs it, and it keeps this module's imports light
    from .safetensors_io import read_header

    return read_header


def _same_checksum(a: str, b: str) -> bool:
    aa, _, ah = a.partition(":")
    ba, _, bh = b.partition(":")
    try:
        return aa == ba and int(ah, 16) == int(bh, 16)
    except ValueError:
        return False


def _region_checksum(path: Path, start: int, shape: tuple[int, ...], itemsize: int, box: Box,
                     spec: str) -> str:
    """Checksum of ``box`` inside a row-major tensor of ``shape`` stored at byte ``start`` of ``path``.

    Reads through a memory map of just that tensor, in slabs of at most ``_CHECKSUM_SLAB`` bytes.
    """
    h = new_hasher(spec)
    nbytes = prod(shape) * itemsize
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(nbytes,))
    try:
        if box.ndim == 0:
            h.update(np.ascontiguousarray(raw[:itemsize]))
            return h.result()
        view = raw.view(np.dtype(f"u{itemsize}") if itemsize in (1, 2, 4, 8) else np.uint8)
        arr = view.reshape(shape)
        region = arr[box.slices]
        for slab in contiguous_slabs(region.shape, itemsize, _CHECKSUM_SLAB):
            piece = np.ascontiguousarray(region[slab.slices])
            h.update(piece.view(np.uint8))
        return h.result()
    finally:
        mm = getattr(raw, "_mmap", None)
        del raw
        if mm is not None:
            try:
                mm.close()
            except (BufferError, ValueError):  # views still alive; the GC closes it
                pass


def validate_data(m: Manifest, *, where: str = "<manifest>", verify_checksums: bool = True) -> list[str]:
    """Problems found in the files ``m`` names, one line each; ``[]`` when all is well.

    Assumes ``m`` passed ``validate_manifest``: files whose paths ``check_file_path`` rejects are
    not opened (and not re-reported). Each file is stat'ed once and each safetensors header read
    once. A directory is a zarr group (``formats.zarr_io``): its array must exist with sane
    metadata and the chunk's dtype and shape. Checksums are computed from ranged reads with
    bounded memory.
    """
    dc = _DataChecker(m, _Report(where), verify_checksums)
    for fqn, spec in m.arrays.items():
        adt = DTYPES.get(spec.data_type)
        if adt is None:
            continue
        for ci, c in enumerate(spec.chunks):
            src = c.source
            if src is None or src.file is None or not c.holders or _check_pattern(src.file) is not None:
                continue
            per_rank = "{" in src.file
            for hr in (c.holders if per_rank else c.holders[:1]):
                try:
                    dc.check(fqn, adt, ci, c, hr, per_rank)
                except Exception as e:  # noqa: BLE001 - pragma: no cover - safety net, validation never raises
                    dc.rep.add(fqn, "internal errors",
                               f"chunk {ci}: internal error while checking data ({type(e).__name__}: {e})")
    return dc.rep.finish()


class _DataChecker:
    def __init__(self, m: Manifest, rep: _Report, verify_checksums: bool) -> None:
        self.m = m
        self.rep = rep
        self.verify = verify_checksums
        self.base = m.base_dir
        self.read_header: Callable[[Path], Any] | None = None
        self.reader_error: str | None = None
        self.path_ok: dict[str, bool] = {}
        self.stats: dict[str, os.stat_result | None] = {}
        self.headers: dict[str, Any] = {}
        self.reported: set[tuple[Any, ...]] = set()
        self.crc_missing = False
        self.zarr: Any = None  # formats.zarr_io.ZarrReader, made on the first zarr group
        self.zarr_bad: dict[tuple[str, str], bool] = {}

    def _once(self, *key: Any) -> bool:
        if key in self.reported:
            return False
        self.reported.add(key)
        return True

    def _reader(self) -> Callable[[Path], Any] | None:
        if self.read_header is None and self.reader_error is None:
            try:
                self.read_header = _header_reader()
            except Exception as e:  # noqa: BLE001 - a broken safetensors_io must not crash validation
                self.reader_error = f"{type(e).__name__}: {e}"
        return self.read_header

    def _stat(self, fqn: str, ci: int, rel: str, full: Path, on: str) -> os.stat_result | None:
        if rel not in self.stats:
            try:
                self.stats[rel] = os.stat(full)
            except FileNotFoundError:
                self.stats[rel] = None
                self.rep.add(fqn, "missing files", f"chunk {ci}: file {rel!r}{on} not found (expected a file at {full})")
            except OSError as e:
                self.stats[rel] = None
                self.rep.add(fqn, "file problems", f"chunk {ci}: cannot stat {rel!r}{on} ({e.strerror or e})")
        return self.stats[rel]

    def _header(self, fqn: str, ci: int, rel: str, full: Path, on: str) -> Any:
        if rel not in self.headers:
            self.headers[rel] = None
            reader = self._reader()
            if reader is None:
                if self._once("reader"):
                    self.rep.add(fqn, "file problems",
                                 f"chunk {ci}: cannot read safetensors headers (formats.safetensors_io failed "
                                 f"to import: {self.reader_error})")
                return None
            try:
                self.headers[rel] = reader(full)
            except FormatError as e:
                self.rep.add(fqn, "file problems", f"chunk {ci}: {rel!r}{on} is not a valid safetensors file ({e})")
            except OSError as e:
                self.rep.add(fqn, "file problems", f"chunk {ci}: cannot read {rel!r}{on} ({e.strerror or e})")
            except Exception as e:  # noqa: BLE001 - never raise on bad input
                self.rep.add(fqn, "file problems",
                             f"chunk {ci}: cannot read the header of {rel!r}{on} ({type(e).__name__}: {e})")
        return self.headers[rel]

    def _check_zarr(self, fqn: str, adt: DType, ci: int, c: Chunk, hr: int, rel: str, full: Path, on: str,
                    per_rank: bool) -> None:
        """A chunk stored in a zarr group: the array exists, its metadata is sane, its dtype and
        shape fit the chunk, and its checksum (when recorded) matches the bytes."""
        src = c.source
        assert src is not None
        tensor = c.tensor(fqn)
        key = (rel, tensor)
        if self.zarr_bad.get(key):
            return  # reported once per array
        try:
            from .zarr_io import ZarrReader, region_checksum

            if self.zarr is None:
                self.zarr = ZarrReader()
            za = self.zarr.open(full, tensor)
        except ShardNotFoundError:
            self.zarr_bad[key] = True
            self.rep.add(fqn, "missing tensors", f"chunk {ci}: zarr array {tensor!r} not found in {rel!r}{on} "
                         f"(expected {full / tensor / 'zarr.json'})")
            return
        except (FormatError, UsageError) as e:
            self.zarr_bad[key] = True
            self.rep.add(fqn, "file problems", f"chunk {ci}: zarr array {tensor!r} in {rel!r}{on} is unusable ({e})")
            return
        except Exception as e:  # noqa: BLE001 - never raise on bad input
            self.zarr_bad[key] = True
            self.rep.add(fqn, "file problems",
                         f"chunk {ci}: cannot open zarr array {tensor!r} in {rel!r}{on} ({type(e).__name__}: {e})")
            return
        ranks = [hr] if per_rank else list(c.holders)
        exp = _declared_dtype(self.m, ranks, tensor) or adt
        info = za.info
        lbox = c.local_box
        what = f"zarr array {tensor!r} in {rel!r}{on}"
        if not self._stored_fits(fqn, ci, what, (rel, tensor), exp, info.data_type, info.shape, lbox):
            return
        if src.checksum is not None and self.verify:
            want = src.checksum
            self._verify_checksum(fqn, ci, want, lambda: region_checksum(za, lbox, want),
                                  (ShardstreamError, OSError, ValueError),
                                  f"cannot read zarr array {tensor!r} in {rel!r}{on} for its checksum",
                                  f"checksum mismatch for chunk {ci} region {c.region} on rank {hr} in zarr array "
                                  f"{tensor!r} of {rel!r}")

    def _stored_fits(self, fqn: str, ci: int, what: str, key: tuple[str, str], exp: DType, got_dtype: str,
                     shape: Sequence[int], lbox: Box) -> bool:
        """The stored tensor ``what`` (at ``key`` = (file, tensor)) has the expected dtype, the local
        box's number of dims, and room for the local box; else reported, False."""
        if got_dtype != exp.name:
            if self._once("dtype", *key, exp.name):
                self.rep.add(fqn, "data_type problems",
                             f"chunk {ci}: {what} has the wrong data_type (expected {exp.name}, got {got_dtype})")
            return False
        if len(shape) != lbox.ndim:
            self.rep.add(fqn, "shape problems", f"chunk {ci}: {what} has {len(shape)} dims "
                         f"(expected {lbox.ndim}, got shape {_dims(shape)})")
            return False
        if not lbox.fits_in(shape):
            self.rep.add(fqn, "shape problems",
                         f"chunk {ci}: {what} is too small for local box {lbox} "
                         f"(expected shape >= {_dims(lbox.stops)} in every dim, got {_dims(shape)})")
            return False
        return True

    def _verify_checksum(self, fqn: str, ci: int, want: str, compute: Callable[[], str],
                         errors: tuple[type[Exception], ...], cannot_read: str, mismatch: str) -> None:
        """Compare ``compute()`` with the recorded checksum ``want``; a missing crc32c module is
        reported once per run, a read error or a mismatch per chunk."""
        try:
            got = compute()
        except ImportError as e:
            if not self.crc_missing:
                self.crc_missing = True
                self.rep.add(fqn, "checksum problems", f"chunk {ci}: cannot verify checksum {want} ({e})")
            return
        except errors as e:
            self.rep.add(fqn, "checksum problems", f"chunk {ci}: {cannot_read} ({e})")
            return
        if not _same_checksum(got, want):
            self.rep.add(fqn, "checksum mismatches", f"{mismatch} (expected {want}, got {got})")

    def check(self, fqn: str, adt: DType, ci: int, c: Chunk, hr: int, per_rank: bool) -> None:
        src = c.source
        assert src is not None and src.file is not None
        rel = _expand(src.file, hr)
        if rel not in self.path_ok:
            self.path_ok[rel] = check_file_path(self.base, rel) is None
        if not self.path_ok[rel]:
            return  # reported by validate_manifest; never open it
        full = (self.base / rel) if self.base is not None else Path(rel)
        on = f" for rank {hr}" if per_rank else ""
        st = self._stat(fqn, ci, rel, full, on)
        if st is None:
            return  # missing (reported)
        if stat.S_ISDIR(st.st_mode):
            self._check_zarr(fqn, adt, ci, c, hr, rel, full, on, per_rank)
            return
        if not stat.S_ISREG(st.st_mode):
            if self._once("special", rel):
                self.rep.add(fqn, "file problems",
                             f"chunk {ci}: {rel!r}{on} is a {_file_kind(st.st_mode)} (expected a regular file)")
            return
        tensor = c.tensor(fqn)
        ranks = [hr] if per_rank else list(c.holders)
        exp = _declared_dtype(self.m, ranks, tensor) or adt
        lbox = c.local_box
        if src.byte_range is not None and src.stored_shape is not None:
            loc = self._locate_range(fqn, ci, src.byte_range, src.stored_shape, st.st_size, exp, lbox, rel, on)
        else:
            loc = self._locate_tensor(fqn, ci, tensor, exp, lbox, rel, full, on)
        if loc is None or src.checksum is None or not self.verify:
            return
        base_off, sshape, isz = loc
        want = src.checksum
        self._verify_checksum(fqn, ci, want, lambda: _region_checksum(full, base_off, sshape, isz, lbox, want),
                              (OSError, ValueError), f"cannot read {rel!r}{on} for its checksum",
                              f"checksum mismatch for chunk {ci} region {c.region} on rank {hr} in {rel!r}")

    def _locate_range(self, fqn: str, ci: int, byte_range: tuple[int, int], sshape: tuple[int, ...], size: int,
                      exp: DType, lbox: Box, rel: str, on: str) -> tuple[int, tuple[int, ...], int] | None:
        """A raw byte range (DCP payload): ``(start, stored shape, itemsize)``, or None when it is
        past the end of the file (reported) or inconsistent (reported by validate_manifest)."""
        a, b = byte_range
        if b > size:
            self.rep.add(fqn, "byte range problems",
                         f"chunk {ci}: source.byte_range [{a}, {b}] is past the end of {rel!r}{on} "
                         f"(expected stop <= file size {size}, got {b})")
            return None
        if b - a != prod(sshape) * exp.itemsize or not lbox.fits_in(sshape):
            return None  # reported by validate_manifest
        return a, sshape, exp.itemsize

    def _locate_tensor(self, fqn: str, ci: int, tensor: str, exp: DType, lbox: Box, rel: str, full: Path,
                       on: str) -> tuple[int, tuple[int, ...], int] | None:
        """A tensor of a safetensors file: ``(data start, stored shape, itemsize)``, or None when
        the header is unreadable, the tensor missing, or its dtype / shape wrong (reported)."""
        hdr = self._header(fqn, ci, rel, full, on)
        if hdr is None:
            return None
        stt: _StoredLike | None = hdr.tensors.get(tensor)
        if stt is None:
            if self._once("missing", rel, tensor):
                names = sorted(hdr.tensors)
                avail = ", ".join(repr(x) for x in names[:5])
                if len(names) > 5:
                    avail += f" and {len(names) - 5} more"
                self.rep.add(fqn, "missing tensors",
                             f"chunk {ci}: tensor {tensor!r} not found in {rel!r}{on} "
                             f"(available: {avail or 'none'})")
            return None
        sshape = tuple(stt.shape)
        if not self._stored_fits(fqn, ci, f"stored tensor {tensor!r} in {rel!r}{on}", (rel, tensor), exp,
                                 stt.dtype.name, sshape, lbox):
            return None
        return stt.start, sshape, stt.dtype.itemsize
