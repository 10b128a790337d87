"""Every check on manifests and on the data files they name; returns all problems.

``validate_manifest`` looks at the manifest alone (coverage, overlaps, bounds, holders, int64
limits, local tensors, path syntax and symlink escapes) and opens no data file.
``validate_data`` adds the checks that need the files (existence, safetensors headers, stored
dtypes and shapes, byte ranges, checksums). Neither raises on bad input: each returns a list of
problems, one line each, in the CLI form (design §8)::

    WHERE: ARRAY: what is wrong (expected ..., got ...)

Coverage and overlap checks are O(n log n) per array (``formats.validate.overlap``). ``validate_data``
lives in ``formats.validate.data`` and is re-exported here, as are ``check_file_path``
(``formats.validate.paths``) and ``MAX_PER_KIND`` (``formats.validate.problems``).

No MPI, no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

from ..manifest.box import Box
from ..manifest.compact_patterns import fill_pattern
from ..manifest.dtypes import DTYPES, DType
from ..manifest.limits import INT64_MAX
from ..manifest.wire import ArraySpec, Chunk, Manifest, TensorSpec
from .data import declared_dtype, validate_data
from .overlap import MAX_PAIRS, analyze_boxes, box_from
from .paths import check_file_path, check_file_pattern
from .problems import MAX_PER_KIND, Report, fmt_dims, fmt_ranks

__all__ = ["INT64_MAX", "MAX_PER_KIND", "check_file_path", "validate_data", "validate_manifest"]


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
    rep = Report(where)
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


def _validate_sidecar(m: Manifest, rep: Report) -> None:
    """A compact manifest's checksum sidecar: present, of the size and sha256 it names."""
    if m.base_dir is None:
        return
    table = next((t for spec in m.arrays.values() if spec.ref is not None
                  and (t := getattr(spec.ref, "table", None)) is not None), None)
    if table is not None:
        for line in table.problems():
            rep.add("", "checksum sidecar problems", line)


def _validate_array(m: Manifest, fqn: str, shape: tuple[int, ...], data_type: str,
                    chunks: Sequence[Chunk], rep: Report, local: dict[_LocalKey, list[_LocalEntry]],
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

    def layout_ok(self, fqn: str, spec: ArraySpec, rep: Report) -> bool:
        assert spec.ref is not None
        lay = spec.ref.layout
        ok = self.layouts.get(id(lay))
        if ok is None:
            dt = _check_array_type(fqn, lay.shape, lay.data_type, rep)
            problems = lay.check(self.m.world_size)
            if lay.file is not None:
                perr = check_file_pattern(lay.file)
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

    def check(self, fqn: str, spec: ArraySpec, rep: Report, local: dict[_LocalKey, list[_LocalEntry]],
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
            rep.add(fqn, "size problems", f"local box {box_from(off, stop)} overflows int64 (expected a local "
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


def _check_array_type(fqn: str, shape: tuple[int, ...], data_type: str, rep: Report) -> DType | None:
    """The array's dtype, or None (reported) when its data_type or shape is unusable."""
    dt = DTYPES.get(data_type)
    if dt is None:
        rep.add(fqn, "data_type problems",
                f"unknown data_type {data_type!r} (expected one of {', '.join(DTYPES)})")
        return None
    if any(x < 0 for x in shape):
        rep.add(fqn, "shape problems", f"shape {fmt_dims(shape)} has a negative size")
        return None
    return dt


def _check_holders(fqn: str, ci: int, h: tuple[int, ...], ws: int, rep: Report) -> None:
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
                    f"chunk {ci}: holders must be sorted and unique (expected {fmt_dims(sorted(set(h)))}, "
                    f"got {fmt_dims(h)})")
        for hr in h:
            if not 0 <= hr < ws:
                rep.add(fqn, "holder problems",
                        f"chunk {ci}: holder rank {hr} is out of range "
                        f"(expected 0 <= rank < world_size {ws}, got {hr})")


def _check_region(fqn: str, ci: int, r: Box, shape: tuple[int, ...], isz: int, array_ok: bool,
                  rep: Report) -> tuple[tuple[int, ...], bool, bool]:
    """Bounds, byte size and emptiness of one chunk's region: ``(stops, in bounds, empty)``."""
    ro, rs = r.offsets, r.sizes
    rstop = tuple([o + z for o, z in zip(ro, rs)])
    in_bounds = True
    for d in range(len(shape)):
        if rstop[d] > shape[d]:
            in_bounds = False
            rep.add(fqn, "out-of-bounds regions",
                    f"chunk {ci} region {r} exceeds shape {fmt_dims(shape)} in dim {d} "
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
                f"got sizes {fmt_dims(rs)})")
    return rstop, in_bounds, empty


def _check_coverage(m: Manifest, fqn: str, shape: tuple[int, ...], offs: list[tuple[int, ...]],
                    stops: list[tuple[int, ...]], box_chunk: list[int], rep: Report) -> None:
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
    geo = analyze_boxes(offs, stops, len(shape), shape=shape)
    for i, j in geo.pairs:
        inter = box_from(offs[i], stops[i]).intersect(box_from(offs[j], stops[j]))
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
                     rep: Report, local: dict[_LocalKey, list[_LocalEntry]],
                     files: dict[str, list[Any]], empty: bool) -> None:
    r = c.region
    nd = len(r.sizes)
    src = c.source
    if len(loff) != nd:
        rep.add(fqn, "source problems",
                f"chunk {ci}: source.offsets has {len(loff)} entries (expected {nd}, one per dim, got {len(loff)})")
        return
    if src is not None and src.offsets is not None and any(o < 0 for o in loff):
        rep.add(fqn, "source problems", f"chunk {ci}: source.offsets {fmt_dims(loff)} must be non-negative")
        return
    lstop = tuple([o + z for o, z in zip(loff, r.sizes)])
    if prod(lstop) * dt.itemsize > INT64_MAX:
        rep.add(fqn, "size problems",
                f"chunk {ci}: local box {Box(loff, r.sizes)} overflows int64 (expected a local tensor of "
                f"at most {INT64_MAX} bytes, got stops {fmt_dims(lstop)})")
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
                        f"chunk {ci}: source.stored_shape {fmt_dims(ss)} has {len(ss)} dims "
                        f"(expected {nd}, got {len(ss)})")
            else:
                for d in range(nd):
                    if lstop[d] > ss[d]:
                        rep.add(fqn, "source problems",
                                f"chunk {ci}: local box {lbox} exceeds source.stored_shape {fmt_dims(ss)} "
                                f"in dim {d} (stop {lstop[d]} > {ss[d]})")
            sdt = declared_dtype(m, c.holders, tensor) or dt
            need = prod(ss) * sdt.itemsize
            if b < a:
                rep.add(fqn, "source problems", f"chunk {ci}: source.byte_range [{a}, {b}] has stop < start")
            elif b - a != need:
                rep.add(fqn, "source problems",
                        f"chunk {ci}: source.byte_range [{a}, {b}] holds {b - a} bytes but source.stored_shape "
                        f"{fmt_dims(ss)} of {sdt.name} needs {need} (expected {need} bytes, got {b - a})")
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
                    stop: tuple[int, ...], rep: Report) -> None:
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
                    f"{lead}local box {box_from(off, stop)} does not fit local tensor {tensor!r} "
                    f"declared on rank {hr} with shape {fmt_dims(ts.shape)} in dim {d} "
                    f"(stop {stop[d]} > {ts.shape[d]})")


def _validate_tensors_section(m: Manifest, rep: Report) -> None:
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


def _validate_local(m: Manifest, rep: Report, local: dict[_LocalKey, list[_LocalEntry]]) -> None:
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
                    pairs = [(sub[0], sub[b]) for b in range(1, min(len(sub), MAX_PAIRS + 1))]
                else:
                    geo = analyze_boxes([ents[k].off for k in sub], [ents[k].stop for k in sub], nd)
                    pairs = [(sub[a], sub[b]) for a, b in geo.pairs]
                    if geo.truncated:
                        rep.more(ents[sub[0]].fqn, "local tensor overlaps", 0, at_least=True)
                for pr in pairs:
                    seen_pairs.setdefault(pr, []).extend(ranks)
        for (a, b), rs in seen_dtype.items():
            ea, eb = ents[a], ents[b]
            rep.add(ea.fqn, "local tensor problems",
                    f"local tensor {tensor!r} on {fmt_ranks(rs)} is shared by arrays of different data_type "
                    f"without a 'tensors' declaration (expected one data_type, got {ea.data_type} "
                    f"({ea.fqn} chunk {ea.ci}) and {eb.data_type} ({eb.fqn} chunk {eb.ci}))")
        for (a, b), rs in seen_ndim.items():
            ea, eb = ents[a], ents[b]
            rep.add(ea.fqn, "local tensor problems",
                    f"local tensor {tensor!r} on {fmt_ranks(rs)} is used with different numbers of dims "
                    f"(expected {len(ea.off)} ({ea.fqn} chunk {ea.ci}), got {len(eb.off)} "
                    f"({eb.fqn} chunk {eb.ci}))")
        for (a, b), rs in sorted(seen_pairs.items()):
            ea, eb = ents[a], ents[b]
            if ea.fqn == eb.fqn:
                who = f"chunks {ea.ci} and {eb.ci}"
            else:
                who = f"chunk {ea.ci} and {eb.fqn} chunk {eb.ci}"
            inter = box_from(ea.off, ea.stop).intersect(box_from(eb.off, eb.stop))
            where_inter = f" (overlap {inter})" if inter is not None and inter.ndim else ""
            rep.add(ea.fqn, "local tensor overlaps",
                    f"{who} write overlapping ranges of local tensor {tensor!r} on {fmt_ranks(rs)}{where_inter}")


def _validate_paths(m: Manifest, rep: Report, files: dict[str, list[Any]]) -> None:
    base = m.base_dir
    cache: dict[str, str | None] = {}
    for f, (fqn, ci, uses, holders) in files.items():
        also = f" (used by {uses} chunks)" if uses > 1 else ""
        perr = check_file_pattern(f)
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
