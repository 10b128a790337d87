"""Manifest wire formats (design §3): v1 and the compact v2 (``compact.py``); parse strictly,
serialise exactly.

The wire form is plain JSON; the model is frozen dataclasses (``spec.py``, re-exported here). ``parse_manifest`` reports every
structural problem it finds (unknown keys, wrong types, versions) in one ``ManifestError``.
Semantic checks (coverage, overlaps, bounds, paths) live in :mod:`formats.validate`.

No I/O except ``load_manifest`` / ``save_manifest``; no MPI.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import ManifestError, ShardNotFoundError
from ..integrity.sidecar import ChecksumTable, ChecksumWriter, sidecar_name
from .box import Box
from .compact import Layout, parse_compact, parse_ref, parse_run
from .compact_fit import compact_dict
from .dtypes import DTYPES
from .limits import INT64_MAX
from .spec import (
    COMPACT_FORMAT_VERSION,
    FORMAT,
    FORMAT_VERSION,
    FORMAT_VERSIONS,
    ArraySpec,
    Chunk,
    Manifest,
    Source,
    TensorSpec,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "COMPACT_FORMAT_VERSION",
    "Source",
    "Chunk",
    "ArraySpec",
    "TensorSpec",
    "Manifest",
    "parse_manifest",
    "loads_manifest",
    "load_manifest",
    "save_manifest",
    "without_checksums",
    "dumps_manifest",
    "atomic_write_bytes",
]

MAX_MANIFEST_BYTES = 2 << 30  # refuse to json-parse more than 2 GiB


# ---------------------------------------------------------------- parsing

_TOP_KEYS = {"format", "format_version", "name", "world_size", "mesh", "topology", "partial",
             "tensors", "arrays", "open_rows"}
_COMPACT_TOP_KEYS = _TOP_KEYS | {"meshes", "layouts", "checksums"}
_ARRAY_KEYS = {"shape", "data_type", "chunks"}
_CHUNK_KEYS = {"region", "holders", "source"}
_REGION_KEYS = {"offsets", "sizes"}
_SOURCE_KEYS = {"tensor", "offsets", "file", "byte_range", "stored_shape", "checksum"}
_TOPOLOGY_KEYS = {"domain_size"}
_MESH_KEYS = {"axes", "shape"}
_TENSOR_KEYS = {"shape", "data_type"}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Parser:
    def __init__(self, where: str) -> None:
        self.where = where
        self.problems: list[str] = []

    def bad(self, ctx: str, msg: str) -> None:
        self.problems.append(f"{self.where}: {ctx}: {msg}" if ctx else f"{self.where}: {msg}")

    def keys(self, obj: Mapping[str, Any], allowed: set[str], ctx: str) -> None:
        for k in obj:
            if k not in allowed:
                self.bad(ctx, f"unknown key {k!r} (allowed: {', '.join(sorted(allowed))})")

    def ints(self, v: object, ctx: str, what: str, *, ndim: int | None = None,
             nonneg: bool = True) -> tuple[int, ...] | None:
        # one pass, no generators: this runs several times per chunk on 100k-chunk manifests
        if type(v) is not list:
            self.bad(ctx, f"{what} must be a list of integers, got {_short(v)}")
            return None
        lo = 0 if nonneg else -INT64_MAX - 1
        for x in v:
            if type(x) is not int:  # bool is not int here
                self.bad(ctx, f"{what} must be a list of integers, got {_short(v)}")
                return None
            if x < lo:
                self.bad(ctx, f"{what} must be non-negative, got {_short(v)}")
                return None
            if x > INT64_MAX:
                self.bad(ctx, f"{what} entry exceeds int64, got {_short(v)}")
                return None
        if ndim is not None and len(v) != ndim:
            self.bad(ctx, f"{what} has {len(v)} entries, expected {ndim} (one per dim)")
            return None
        return tuple(v)

    def source(self, v: object, ctx: str, ndim: int) -> Source | None:
        if not isinstance(v, dict):
            self.bad(ctx, f"source must be an object, got {_short(v)}")
            return None
        self.keys(v, _SOURCE_KEYS, ctx + ".source")
        tensor = v.get("tensor")
        if tensor is not None and not isinstance(tensor, str):
            self.bad(ctx, f"source.tensor must be a string, got {_short(tensor)}")
            tensor = None
        offsets = None
        if "offsets" in v:
            offsets = self.ints(v["offsets"], ctx, "source.offsets", ndim=ndim)
        file = v.get("file")
        if file is not None and (not isinstance(file, str) or not file):
            self.bad(ctx, f"source.file must be a non-empty string, got {_short(file)}")
            file = None
        br = None
        if "byte_range" in v:
            t = self.ints(v["byte_range"], ctx, "source.byte_range", ndim=2)
            if t is not None:
                if t[1] < t[0]:
                    self.bad(ctx, f"source.byte_range stop {t[1]} < start {t[0]}")
                else:
                    br = (t[0], t[1])
        ss = None
        if "stored_shape" in v:
            ss = self.ints(v["stored_shape"], ctx, "source.stored_shape")
        if (br is None) != (ss is None) and ("byte_range" in v) != ("stored_shape" in v):
            self.bad(ctx, "source.byte_range and source.stored_shape must be given together")
        ck = v.get("checksum")
        if ck is not None and (not isinstance(ck, str) or not _valid_checksum(ck)):
            self.bad(ctx, f"source.checksum must be 'xxh64:<hex>' or 'crc32c:<hex>', got {_short(ck)}")
            ck = None
        return Source(tensor=tensor, offsets=offsets, file=file, byte_range=br,
                      stored_shape=ss, checksum=ck)

    def chunk(self, v: object, ctx: str, ndim: int) -> Chunk | None:
        if not isinstance(v, dict):
            self.bad(ctx, f"chunk must be an object, got {_short(v)}")
            return None
        self.keys(v, _CHUNK_KEYS, ctx)
        ok = True
        region = v.get("region")
        box = None
        if not isinstance(region, dict):
            self.bad(ctx, "missing or invalid 'region' (expected {\"offsets\": [...], \"sizes\": [...]})")
            ok = False
        else:
            self.keys(region, _REGION_KEYS, ctx + ".region")
            if "offsets" not in region or "sizes" not in region:
                self.bad(ctx, "region needs both 'offsets' and 'sizes'")
                ok = False
            else:
                o = self.ints(region["offsets"], ctx, "region.offsets", ndim=ndim)
                s = self.ints(region["sizes"], ctx, "region.sizes", ndim=ndim)
                if o is None or s is None:
                    ok = False
                else:
                    box = Box(o, s)
        holders = v.get("holders")
        hs: tuple[int, ...] | None = None
        if holders is None:
            self.bad(ctx, "missing required key 'holders'")
            ok = False
        else:
            hs = self.ints(holders, ctx, "holders")
            if hs is None:
                ok = False
            elif not hs:
                self.bad(ctx, "holders is empty (every chunk needs at least one rank)")
                ok = False
        src = None
        if "source" in v:
            src = self.source(v["source"], ctx, ndim)
        if not ok or box is None or hs is None:
            return None
        return Chunk(box, hs, src)


    # ---- top-level sections of parse_manifest, in the order their problems are reported

    def format(self, obj: Mapping[str, Any]) -> None:
        if obj.get("format") != FORMAT:
            self.bad("", f"'format' must be {FORMAT!r}, got {_short(obj.get('format'))}")
        fv = obj.get("format_version")
        if fv not in FORMAT_VERSIONS or not _is_int(fv):
            self.bad("", f"unsupported format_version {_short(fv)} (this shardstream reads versions "
                         f"{' and '.join(map(str, FORMAT_VERSIONS))})")

    def world_size(self, ws: object) -> int:
        if not isinstance(ws, int) or isinstance(ws, bool) or ws < 1:
            self.bad("", f"world_size must be a positive integer, got {_short(ws)}")
            return 0
        return ws

    def section(self, v: object, what: str, allowed: set[str]) -> dict[str, Any] | None:
        """An optional object-valued top-level key (``mesh``, ``topology``): None when absent or bad."""
        if v is None:
            return None
        if not isinstance(v, dict):
            self.bad("", f"{what} must be an object, got {_short(v)}")
            return None
        self.keys(v, allowed, what)
        return v

    def mesh(self, v: object) -> dict[str, Any] | None:
        mesh = self.section(v, "mesh", _MESH_KEYS)
        if mesh is not None:
            axes, shp = mesh.get("axes"), mesh.get("shape")
            if not (isinstance(axes, list) and all(isinstance(a, str) for a in axes)):
                self.bad("mesh", f"axes must be a list of strings, got {_short(axes)}")
            sizes = self.ints(shp, "mesh", "shape")
            if sizes is not None and isinstance(axes, list) and len(axes) != len(sizes):
                self.bad("mesh", f"{len(axes)} axes but {len(sizes)} sizes")
        return mesh

    def topology(self, v: object) -> dict[str, Any] | None:
        topo = self.section(v, "topology", _TOPOLOGY_KEYS)
        if topo is not None:
            dsz = topo.get("domain_size")
            if dsz is not None and (not _is_int(dsz) or dsz < 1):
                self.bad("topology", f"domain_size must be a positive integer, got {_short(dsz)}")
        return topo

    def tensors(self, tv: object) -> dict[int, dict[str, TensorSpec]]:
        tensors: dict[int, dict[str, TensorSpec]] = {}
        if tv is None:
            return tensors
        if not isinstance(tv, dict):
            self.bad("", f"tensors must be an object keyed by rank, got {_short(tv)}")
            return tensors
        for rk, ts in tv.items():
            if not (isinstance(rk, str) and rk.isdigit()):
                self.bad("tensors", f"key {rk!r} is not a rank number")
                continue
            if not isinstance(ts, dict):
                self.bad(f"tensors.{rk}", f"must be an object of local tensors, got {_short(ts)}")
                continue
            m: dict[str, TensorSpec] = {}
            for tn, t in ts.items():
                spec = self.tensor_spec(t, f"tensors.{rk}.{tn}")
                if spec is not None:
                    m[tn] = spec
            tensors[int(rk)] = m
        return tensors

    def tensor_spec(self, t: object, ctx: str) -> TensorSpec | None:
        if not isinstance(t, dict):
            self.bad(ctx, f"must be an object, got {_short(t)}")
            return None
        self.keys(t, _TENSOR_KEYS, ctx)
        shp = self.ints(t.get("shape"), ctx, "shape")
        dt = t.get("data_type")
        if not isinstance(dt, str) or dt not in DTYPES:
            self.bad(ctx, f"unknown data_type {_short(dt)}")
            return None
        return None if shp is None else TensorSpec(shp, dt)

    def arrays(self, av: object, layouts: Mapping[str, Layout] | None,
               table: ChecksumTable | None = None) -> dict[str, ArraySpec]:
        arrays: dict[str, ArraySpec] = {}
        if not isinstance(av, dict):
            self.bad("", f"missing or invalid 'arrays' (expected an object), got {_short(av)}")
            return arrays
        for fqn, a in av.items():
            if layouts is not None and fqn.endswith(".{expert}"):
                self.expert_run(fqn, a, layouts, arrays, table)
                continue
            if isinstance(a, str) or (isinstance(a, dict) and "layout" in a):
                spec = self.compact_array(fqn, a, layouts, table)
            else:
                spec = self.array(fqn, a)
            if spec is not None:
                if fqn in arrays:
                    self.bad(fqn, "array is given twice (by a run of expert arrays and on its own)")
                arrays[fqn] = spec
        return arrays

    def expert_run(self, key: str, a: object, layouts: Mapping[str, Layout], arrays: dict[str, ArraySpec],
                   table: ChecksumTable | None = None) -> None:
        for fqn, ref in parse_run(self, key, a, layouts, table):
            if fqn in arrays:
                self.bad(key, f"array {fqn!r} is given twice")
                continue
            arrays[fqn] = ArraySpec(ref.layout.shape, ref.layout.data_type, ref=ref, fqn=fqn)

    def compact_array(self, fqn: str, a: str | dict[str, Any], layouts: Mapping[str, Layout] | None,
                      table: ChecksumTable | None = None) -> ArraySpec | None:
        if layouts is None:
            self.bad(fqn, "an array given by a layout needs format_version 2")
            return None
        ref = parse_ref(self, fqn, a, layouts, table)
        if ref is None:
            return None
        return ArraySpec(ref.layout.shape, ref.layout.data_type, ref=ref, fqn=fqn)

    def array(self, fqn: str, a: object) -> ArraySpec | None:
        if not isinstance(a, dict):
            self.bad(fqn, f"array must be an object, got {_short(a)}")
            return None
        self.keys(a, _ARRAY_KEYS, fqn)
        miss = [k for k in ("shape", "data_type", "chunks") if k not in a]
        if miss:
            self.bad(fqn, f"missing required key(s) {', '.join(miss)}")
            return None
        shape = self.ints(a["shape"], fqn, "shape")
        dt = a["data_type"]
        known = isinstance(dt, str) and dt in DTYPES
        if not known:
            self.bad(fqn, f"unknown data_type {_short(dt)} (expected one of {', '.join(DTYPES)})")
        if shape is None:
            return None
        cv = a["chunks"]
        if not isinstance(cv, list):
            self.bad(fqn, f"chunks must be a list, got {_short(cv)}")
            return None
        chunks = []
        nd = len(shape)
        for i, c in enumerate(cv):
            ch = self.chunk(c, f"{fqn}: chunk {i}", nd)
            if ch is not None:
                chunks.append(ch)
        return ArraySpec(shape, dt, tuple(chunks)) if known else None


def _valid_checksum(s: str) -> bool:
    algo, _, hexpart = s.partition(":")
    if algo not in ("xxh64", "crc32c") or not hexpart:
        return False
    try:
        int(hexpart, 16)
    except ValueError:
        return False
    return True


def _short(v: object, n: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def parse_manifest(obj: object, *, where: str = "<manifest>", base_dir: Path | None = None) -> Manifest:
    """Build a Manifest from its wire form, raising ``ManifestError`` with every problem."""
    p = _Parser(where)
    if not isinstance(obj, dict):
        raise ManifestError(problems=[f"{where}: top level must be a JSON object, got {type(obj).__name__}"])
    p.format(obj)
    if p.problems:  # wrong format / version: the rest would only be noise
        raise ManifestError(problems=p.problems)
    compact = obj.get("format_version") == COMPACT_FORMAT_VERSION
    p.keys(obj, _COMPACT_TOP_KEYS if compact else _TOP_KEYS, "")
    ws = p.world_size(obj.get("world_size"))
    name = obj.get("name")
    if name is not None and not isinstance(name, str):
        p.bad("", f"name must be a string, got {_short(name)}")
        name = None
    mesh = p.mesh(obj.get("mesh"))
    topo = p.topology(obj.get("topology"))
    partial = obj.get("partial", False)
    if not isinstance(partial, bool):
        p.bad("", f"partial must be true or false, got {_short(partial)}")
        partial = False
    tensors = p.tensors(obj.get("tensors"))
    open_rows = obj.get("open_rows", [])
    if not isinstance(open_rows, list) or not all(isinstance(n, str) for n in open_rows):
        p.bad("", f"open_rows must be a list of array names, got {_short(open_rows)}")
        open_rows = []
    layouts: dict[str, Layout] | None = None
    table = None
    if compact:
        layouts = parse_compact(p, obj.get("meshes"), obj.get("layouts"))
        if "checksums" in obj:
            table = ChecksumTable.parse(p, obj["checksums"], base_dir, where)
    arrays = p.arrays(obj.get("arrays"), layouts, table)
    for n in open_rows:
        if n not in arrays:
            p.bad("open_rows", f"names {n!r}, which is not an array of this manifest")
    if p.problems:
        raise ManifestError(problems=p.problems)
    return Manifest(world_size=ws, arrays=arrays, name=name, mesh=mesh, topology=topo,
                    partial=partial, tensors=tensors, base_dir=base_dir, open_rows=tuple(open_rows))


def loads_manifest(text: str | bytes, *, where: str = "<manifest>", base_dir: Path | None = None) -> Manifest:
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ManifestError(f"{where}: not UTF-8 ({e})") from e
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{where}: not valid JSON ({e})") from e
    return parse_manifest(obj, where=where, base_dir=base_dir)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid in a manifest")


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read a manifest file (or ``DIR/manifest.json`` when given a directory)."""
    p = Path(path)
    if p.is_dir():
        p = p / "manifest.json"
    try:
        size = p.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{p}: manifest is {size} bytes, over the {MAX_MANIFEST_BYTES} limit")
        data = p.read_bytes()
    except FileNotFoundError as e:
        raise ShardNotFoundError(f"{p}: no such manifest file") from e
    except IsADirectoryError as e:
        raise ShardNotFoundError(f"{p}: is a directory, not a manifest") from e
    except OSError as e:
        raise ManifestError(f"{p}: cannot read ({e.strerror})") from e
    return loads_manifest(data, where=str(p), base_dir=p.parent.resolve())


def without_checksums(m: Manifest) -> Manifest:
    """``m`` with no chunk checksums (explicit or in a sidecar): the layout alone, for peers that
    never read the files (a refit's manifest exchange), so its compact form needs no sidecar."""
    from .compact import ArrayRef as CompactRef

    arrays: dict[str, ArraySpec] = {}
    for fqn, spec in m.arrays.items():
        ref = spec.ref
        if isinstance(ref, CompactRef) and ref.checksums is not None:  # expanded or not: the layout alone
            spec = ArraySpec(spec.shape, spec.data_type, ref=CompactRef(ref.layout, ref.block), fqn=fqn)
        elif (spec.expanded or ref is None) and any(c.source is not None and c.source.checksum is not None
                                                    for c in spec.chunks):
            spec = ArraySpec(spec.shape, spec.data_type, tuple(
                Chunk(c.region, c.holders, replace(c.source, checksum=None) if c.source is not None else None)
                for c in spec.chunks))
        arrays[fqn] = spec
    return replace(m, arrays=arrays)


def dumps_manifest(m: Manifest, *, format_version: int = FORMAT_VERSION) -> str:
    """The wire form: version 1 lists every chunk, version 2 is the compact form (arrays a
    layout describes exactly refer to it, the rest keep explicit chunks)."""
    if format_version == COMPACT_FORMAT_VERSION:
        d = compact_dict(m)
    elif format_version == FORMAT_VERSION:
        d = m.to_dict()
    else:
        raise ManifestError(f"cannot write format_version {format_version!r} (expected 1 or 2)")
    return json.dumps(d, separators=(",", ":"), sort_keys=False) + "\n"


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write via temp file + fsync + rename, then fsync the directory."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    try:
        fd = os.open(p.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def save_manifest(m: Manifest, path: str | os.PathLike[str], *, format_version: int = FORMAT_VERSION) -> None:
    """Write ``m`` atomically. Version 2 puts chunk checksums in a sidecar beside it
    (``formats.integrity.sidecar``), written (atomically) before the manifest that names it."""
    p = Path(path)
    if format_version != COMPACT_FORMAT_VERSION:
        atomic_write_bytes(p, dumps_manifest(m, format_version=format_version).encode())
        return
    writer = ChecksumWriter(sidecar_name(p.name))
    text = json.dumps(compact_dict(m, writer), separators=(",", ":"), sort_keys=False) + "\n"
    if writer:
        atomic_write_bytes(p.with_name(writer.file), writer.data())
    atomic_write_bytes(p, text.encode())
