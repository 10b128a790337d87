"""Offline conversion: execute a plan with files (design §7).

Every destination file is laid out first (its header follows from the destination manifest),
then its local tensors are streamed, in file order, through bounded slabs: for every slab, the
plan's transfers that land in it are read from the source files with ranged reads (only the
bytes needed, adjacent runs coalesced) into its place in one of two write buffers, and a
background thread writes each full buffer sequentially while the next is filled. Memory is
bounded by ``memory_limit`` whatever the model size.

Output is atomic: files are written to temp names, fsynced and renamed; a completion record per
file (``DIR/.shardstream/``) makes ``resume`` skip finished files after re-verifying their
checksums; ``DIR/manifest.json`` is written last, so a directory with a manifest is complete.
Under ``mpiexec -n K`` the destination files are split across K workers.

``--format zarr`` (``_convert_zarr``): ``DIR`` becomes a zarr v3 group with one array per logical
array; the plan runs against the destination regions placed in their global arrays, each zarr
chunk (or shard) is filled from ranged source reads and written whole, and ``manifest.json``
(regions and holders of the destination, ``file: "."``) is still written last.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from formats.box import Box, contiguous_slabs, uniform_runs
from formats.checksum import DEFAULT_ALGO, new_hasher
from formats.dtypes import by_name
from formats.errors import (
    FormatError,
    OutputLockedError,
    PlanError,
    ShardstreamError,
    UsageError,
    ValidationError,
)
from formats.manifest import ArraySpec, Chunk, Manifest, Source, TensorSpec, atomic_write_bytes, save_manifest
from formats.store import SourceStore
from formats.validate import validate_manifest

from .plan import Plan, Transfer, plan_transfers
from .progress import Progress

__all__ = ["ConvertOptions", "ConvertReport", "FileJob", "convert", "plan_files", "DEFAULT_PATTERN"]

DEFAULT_PATTERN = "rank-{rank:05d}.safetensors"
STATE_DIR = ".shardstream"
#: a write buffer packs consecutive slabs of a file up to this many bytes (_Writer.buffer)
PACK_BYTES = 64 << 20


@dataclass(frozen=True)
class ConvertOptions:
    """Knobs of one conversion."""

    #: bytes of buffers one worker may hold (slab buffer + read buffers)
    memory_limit: int = 1 << 30
    #: continue an interrupted conversion, skipping files already complete and verified
    resume: bool = False
    #: one-rank (HF) output: split into files of at most this many bytes (None: one file)
    max_shard_size: int | None = None
    #: drop source arrays the destination does not list (otherwise an error)
    allow_extra: bool = False
    #: checksum algorithm recorded per chunk in the output manifest
    checksum: str = DEFAULT_ALGO
    #: show a progress bar (None: only on a terminal)
    progress: bool | None = None
    #: cast floating-point arrays to this data_type on the way (e.g. fp32 master weights -> bfloat16)
    cast: str | None = None
    #: output format: "safetensors" (one file per destination file) or "zarr" (DIR is a zarr v3 group)
    format: str = "safetensors"
    #: zarr output: chunk compression ("none" or "zstd")
    zarr_compressor: str = "none"


@dataclass
class FileJob:
    """One destination file: its local tensors, in file order, each filled from ``rank``'s plan."""

    rel: str
    tensors: list[tuple[str, TensorSpec, int]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(ts.nbytes for _, ts, _ in self.tensors)


@dataclass
class ConvertReport:
    files_written: int = 0
    files_skipped: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    reads: int = 0
    seconds: float = 0.0
    workers: int = 1
    plan_stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("files_written", "files_skipped", "bytes_written",
                                               "bytes_read", "reads", "seconds", "workers")}


# ------------------------------------------------------------------ destination files

def _empty_arrays(m: Manifest) -> dict[str, TensorSpec]:
    """Arrays with a 0 in their shape (no chunks): a one-rank (HF) file still stores them."""
    if m.world_size != 1:
        return {}
    return {fqn: TensorSpec(tuple(a.shape), a.data_type) for fqn, a in m.arrays.items()
            if not a.chunks and any(s == 0 for s in a.shape)}


def _hf_files(dst: Manifest, max_shard_size: int | None) -> dict[str, str]:
    """Tensor -> file for a one-rank output in Hugging Face style."""
    local = dst.local_tensors(0)
    empty = _empty_arrays(dst)
    tensors: dict[str, TensorSpec] = {}
    for fqn, a in dst.arrays.items():  # array order, so that an HF -> HF round trip keeps the file order
        if fqn in empty:
            tensors[fqn] = empty[fqn]
        for c in a.chunks:
            t = c.tensor(fqn)
            if t in local and t not in tensors:
                tensors[t] = local[t]
    for t, ts in local.items():
        tensors.setdefault(t, ts)
    if not max_shard_size:
        return {t: "model.safetensors" for t in tensors}
    groups: list[list[str]] = [[]]
    size = 0
    for t, ts in tensors.items():
        n = ts.nbytes
        if groups[-1] and size + n > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    total = len(groups)
    out = {}
    for i, g in enumerate(groups):
        for t in g:
            out[t] = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
    return out


def plan_files(dst: Manifest, *, max_shard_size: int | None = None) -> tuple[Manifest, list[FileJob]]:
    """Assign every destination chunk a file and list the files to write.

    Chunks that name a ``source.file`` keep it; others get ``rank-{rank:05d}.safetensors`` (or HF
    names for a one-rank destination). Returns the destination manifest with files filled in,
    and one job per distinct output file.
    """
    hf = _hf_files(dst, max_shard_size) if dst.world_size == 1 else {}
    arrays: dict[str, ArraySpec] = {}
    for fqn, a in dst.arrays.items():
        chunks = []
        for c in a.chunks:
            src = c.source or Source()
            if src.file is None:
                f = hf.get(c.tensor(fqn), "model.safetensors") if dst.world_size == 1 else DEFAULT_PATTERN
                src = replace(src, file=f)
            src = replace(src, tensor=c.tensor(fqn), offsets=c.local_offsets, byte_range=None,
                          stored_shape=None, checksum=None)
            chunks.append(Chunk(c.region, c.holders, src))
        arrays[fqn] = ArraySpec(a.shape, a.data_type, tuple(chunks))
    filled = replace(dst, arrays=arrays, base_dir=None)
    jobs: dict[str, FileJob] = {}
    seen: set[tuple[str, str]] = set()
    local = {r: filled.local_tensors(r) for r in filled.ranks_holding()}
    empty = _empty_arrays(filled)
    named = {c.file_for(0) for _, _, c in dst.iter_chunks() if c.source is not None and c.source.file}
    for fqn, a, c in _chunks_and_empties(filled, empty):
        if c is None:  # with one file named by the destination, empty arrays go there too
            rel = next(iter(named)) if len(named) == 1 else hf.get(fqn, "model.safetensors")
            assert rel is not None
            if (rel, fqn) not in seen:
                seen.add((rel, fqn))
                jobs.setdefault(rel, FileJob(rel)).tensors.append((fqn, empty[fqn], 0))
            continue
        for h in c.holders:
            rel = c.file_for(h)
            assert rel is not None
            t = c.tensor(fqn)
            if (rel, t) in seen:
                continue
            seen.add((rel, t))
            jobs.setdefault(rel, FileJob(rel)).tensors.append((t, local[h][t], h))
    # local tensors declared in `tensors` that no chunk names (a rank holding only vocab padding,
    # a vLLM EP rank with no experts) are still part of that rank's file, zero-filled
    named_tensors = {(h, c.tensor(fqn)) for fqn, _, c in filled.iter_chunks() for h in c.holders}
    for r, ts in sorted(filled.tensors.items()):
        files = {c.file_for(r) for _, _, c in filled.iter_chunks() if r in c.holders}
        pattern = next((c.source.file for _, _, c in filled.iter_chunks() if c.source and c.source.file), None)
        rel = (sorted(f for f in files if f)[0] if files else
               (pattern.format(rank=r) if pattern and "{" in pattern else
                pattern or ("model.safetensors" if filled.world_size == 1 else DEFAULT_PATTERN.format(rank=r))))
        for name, spec in ts.items():
            if (r, name) in named_tensors or (rel, name) in seen:
                continue
            seen.add((rel, name))
            jobs.setdefault(rel, FileJob(rel)).tensors.append((name, spec, r))
    return filled, sorted(jobs.values(), key=lambda j: j.rel)


def _chunks_and_empties(m: Manifest, empty: dict[str, TensorSpec]) -> Any:
    """``iter_chunks`` in array order, with ``(fqn, spec, None)`` where an empty array stands."""
    for fqn, a in m.arrays.items():
        if fqn in empty:
            yield fqn, a, None
        for c in a.chunks:
            yield fqn, a, c


# ------------------------------------------------------------------ casting

FLOATS = ("float16", "bfloat16", "float32", "float64")


def _to_f32(raw: np.ndarray, dt: str) -> np.ndarray:
    if dt == "bfloat16":
        return (raw.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    return raw.view(np.dtype(dt).newbyteorder("<")).astype(np.float32 if dt != "float64" else np.float64)


def cast_bytes(raw: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Row-major bytes of ``src`` elements -> bytes of ``dst`` elements (round to nearest even)."""
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is the IEEE answer
        return _cast(raw, src, dst)


def _cast(raw: np.ndarray, src: str, dst: str) -> np.ndarray:
    f = _to_f32(raw, src)
    if dst == "bfloat16":
        f32 = f.astype(np.float32)
        u = f32.view(np.uint32)
        out = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
        out[np.isnan(f32)] = 0x7FC0  # keep NaN a NaN (rounding could carry it into infinity)
        return out.view(np.uint8)
    return f.astype(np.dtype(dst).newbyteorder("<")).view(np.uint8)


def cast_manifest(m: Manifest, to: str) -> Manifest:
    """``m`` with every floating-point array (and declared local tensor) stored as ``to``."""
    if to not in FLOATS:
        raise UsageError(f"--cast {to}: only floating-point targets are supported ({', '.join(FLOATS)})")
    arrays = {f: (ArraySpec(a.shape, to, a.chunks) if a.data_type in FLOATS else a) for f, a in m.arrays.items()}
    tensors = {r: {n: (TensorSpec(t.shape, to) if t.data_type in FLOATS else t) for n, t in ts.items()}
               for r, ts in m.tensors.items()}
    return replace(m, arrays=arrays, tensors=tensors)


# ------------------------------------------------------------------ execution

class _Writer:
    """Fills one destination file from the plan, slab by slab."""

    def __init__(self, src: Manifest, store: SourceStore, plan: Plan, dst: Manifest,
                 opts: ConvertOptions, progress: Progress) -> None:
        self.src = src
        self.store = store
        self.dst = dst
        self.opts = opts
        self.progress = progress
        self.by_target: dict[tuple[int, str], list[Transfer]] = defaultdict(list)
        for t in plan.transfers:
            self.by_target[(plan.dst_local(t.dst_rank), t.dst_tensor)].append(t)
        self.chunks_in: dict[tuple[int, str], list[tuple[str, int, Box]]] = defaultdict(list)
        for fqn, a in dst.arrays.items():
            for ci, c in enumerate(a.chunks):
                for h in c.holders:
                    self.chunks_in[(h, c.tensor(fqn))].append((fqn, ci, c.local_box))
        #: (rank, local tensor) -> dtype the plan moves (differs from the output with --cast)
        self.src_dtypes: dict[tuple[int, str], str] = {}
        self.slab_budget = max(1 << 16, opts.memory_limit // 4)
        self.read_budget = max(1 << 16, opts.memory_limit // 4)
        store.read_budget = self.read_budget
        # Two write buffers: the background writer drains one while the next is filled. A file's
        # tensors are packed back to back and filled in file order, so its data is one sequential
        # stream: consecutive slabs, across tensors, are packed into the current buffer and written
        # with one pwrite when it is full. (One pwrite per slab made the writer wait on the filler:
        # a 4 KiB norm between two 64 MiB slabs left it idle for the whole next fill, ~1 s of a
        # 2.3 GB convert, in 480 pwrites where ~40 now do.)
        self._bufs = [np.empty(0, dtype=np.uint8), np.empty(0, dtype=np.uint8)]
        self._turn = 0
        self._fill = 0  # bytes of the current buffer filled, not yet queued
        self._fill_at = 0  # absolute file offset of the current buffer's first byte
        self._w: Any = None  # the SafetensorsWriter being filled
        self._scratch = np.empty(0, dtype=np.uint8)
        self._cast_src = np.empty(0, dtype=np.uint8)  # --cast: a slab in the source dtype
        self._pending: Any = None
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardstream-write")
        self._resolved: dict[tuple[str, int, int], Any] = {}

    def buffer(self, n: int) -> np.ndarray:
        """The next ``n`` bytes of the file's stream, in the current write buffer (n <= slab_budget)."""
        if self._fill + n > self._bufs[self._turn].size:
            self.flush()
            if self._bufs[self._turn].size < n:
                # room to pack small slabs, capped: a pwrite past tens of MB saves nothing more,
                # and full 1/4-limit buffers would double the RSS of a default (1 GiB) convert
                self._bufs[self._turn] = np.empty(max(n, min(self.slab_budget, PACK_BYTES)), dtype=np.uint8)
        return self._bufs[self._turn][self._fill:self._fill + n]

    def flush(self) -> None:
        """Queue the filled part of the current buffer and turn to the other one."""
        if not self._fill:
            return
        buf = self._bufs[self._turn][:self._fill]
        self.drain()  # the other buffer's write: it is filled next, and writes stay in file order
        self._pending = self._pool.submit(self._w.write_at, self._fill_at, buf)
        self._fill_at += self._fill
        self._fill = 0
        self._turn ^= 1

    def cast_src(self, n: int) -> np.ndarray:
        if self._cast_src.size < n:
            self._cast_src = np.empty(n, dtype=np.uint8)
        return self._cast_src[:n]

    def scratch(self, n: int) -> np.ndarray:
        """A reused read buffer: fresh allocations per read cost a page fault per 4 KiB."""
        if self._scratch.size < n:
            self._scratch = np.empty(n, dtype=np.uint8)
        return self._scratch[:n]

    def drain(self) -> None:
        if self._pending is not None:
            p, self._pending = self._pending, None
            p.result()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)

    def resolve(self, t: Transfer) -> Any:
        key = (t.fqn, t.src_chunk, t.src_rank)
        rt = self._resolved.get(key)
        if rt is None:
            chunk = self.src.arrays[t.fqn].chunks[t.src_chunk]
            rt = self.store.resolve(t.fqn, chunk, t.src_rank)
            self._resolved[key] = rt
        return rt

    def write_file(self, out_dir: Path, job: FileJob) -> dict[str, str]:
        from formats.safetensors_io import SafetensorsWriter

        specs = [(name, by_name(ts.data_type), tuple(ts.shape)) for name, ts, _ in job.tensors]
        path = out_dir / job.rel
        path.parent.mkdir(parents=True, exist_ok=True)
        checksums: dict[str, str] = {}
        w = SafetensorsWriter(path, specs)
        ranges = w.tensor_ranges
        self._w, self._fill, self._fill_at = w, 0, w.data_start
        try:
            for name, ts, rank in job.tensors:
                # the stream invariant buffer() relies on: tensors are filled in file order
                assert ranges[name][0] == self._fill_at + self._fill, (job.rel, name)
                checksums.update(self._fill_tensor(name, ts, rank))
            self.flush()
            self.drain()
            w.commit()
        except BaseException:
            self._fill = 0  # what was filled belongs to this file: never queue it
            try:
                self.drain()
            except BaseException:  # noqa: BLE001 - the first error is the one re-raised below
                pass
            w.abort()
            raise
        finally:
            self._w = None
        return checksums

    def _fill_tensor(self, name: str, ts: TensorSpec, rank: int) -> dict[str, str]:
        isz = by_name(ts.data_type).itemsize
        shape = tuple(ts.shape)
        transfers = self.by_target.get((rank, name), [])
        chunks = self.chunks_in.get((rank, name), [])
        hashers = {(fqn, ci): new_hasher(self.opts.checksum) for fqn, ci, _ in chunks}
        volume = 1
        for s in shape:
            volume *= s
        covered = sum(t.region.volume for t in transfers)
        need_zero = covered < volume  # padding rows (vLLM vocab) that no chunk covers
        src_dt = self.src_dtypes.get((rank, name), ts.data_type)
        out_isz = isz
        isz = by_name(src_dt).itemsize  # slabs are filled in the source dtype, cast before writing
        cast = src_dt != ts.data_type
        for slab in contiguous_slabs(shape, max(isz, out_isz), self.slab_budget):
            n = slab.volume * isz
            out = self.buffer(slab.volume * out_isz)
            buf = out if not cast else self.cast_src(n)  # filled in the source dtype
            if need_zero:
                buf[:] = 0
            view = buf.reshape(slab.sizes + (isz,)) if slab.ndim else buf.reshape((isz,))
            for t in transfers:
                sub = slab.intersect(t.dst_box)
                if sub is None or sub.empty:
                    continue
                rt = self.resolve(t)
                sbox = sub.shift(tuple(so - do for so, do in zip(t.src_offsets, t.dst_offsets)))
                if sub == slab:
                    self.store.read(rt, sbox, buf)
                elif (span := _contiguous_span(sub.relative_to(slab.offsets), slab.sizes)) is not None:
                    # One contiguous byte range of the slab (the common case: a row block of an
                    # S(0) shard, ~70% of the bytes of a TP4 -> TP3 convert): read straight into
                    # place. Through scratch it cost one more full memcpy of those bytes.
                    lo = span[0] * isz
                    self.store.read(rt, sbox, buf[lo:lo + span[1] * isz])
                else:
                    tmp = self.store.read(rt, sbox, self.scratch(sbox.volume * isz))
                    rel = sub.relative_to(slab.offsets)
                    sl = rel.slices
                    view[sl] = tmp.reshape(sub.sizes + (isz,))
            if cast:
                out[:] = cast_bytes(buf, src_dt, ts.data_type)
                view = out.reshape(slab.sizes + (out_isz,)) if slab.ndim else out.reshape((out_isz,))
            for fqn, ci, lbox in chunks:
                inter = slab.intersect(lbox)
                if inter is None or inter.empty:
                    continue
                rel = inter.relative_to(slab.offsets)
                sl = rel.slices
                hashers[(fqn, ci)].update(np.ascontiguousarray(view[sl]))
            self._fill += out.size  # written by flush(), with the slabs around it
            self.progress.update(out.size)
        return {f"{fqn}|{ci}": h.result() for (fqn, ci), h in hashers.items()}


def _contiguous_span(rel: Box, sizes: tuple[int, ...]) -> tuple[int, int] | None:
    """``(first element, element count)`` when ``rel`` is one contiguous run of a row-major buffer
    of ``sizes``, else None."""
    runs = list(itertools.islice(uniform_runs(rel, sizes), 2))
    if len(runs) == 1 and runs[0][1] == 1:
        return runs[0][0], runs[0][3]
    return None


def _verify_existing(out_dir: Path, job: FileJob, record: dict[str, Any], opts: ConvertOptions,
                     filled: Manifest) -> bool:
    """A finished file from an earlier run is reused only if its header, size and every chunk
    checksum still match its completion record."""
    from formats.safetensors_io import layout_file, read_header

    path = out_dir / job.rel
    try:
        specs = [(name, by_name(ts.data_type), tuple(ts.shape)) for name, ts, _ in job.tensors]
        prefix, ranges = layout_file(specs)
        if record.get("prefix_sha") != _sha(prefix):
            return False
        size = max((e for _, e in ranges.values()), default=len(prefix))
        if path.stat().st_size != size:
            return False
        with open(path, "rb") as f:
            if f.read(len(prefix)) != prefix:
                return False
        read_header(path)
        # re-hash the chunks from the file itself
        m = Manifest(world_size=filled.world_size, arrays=filled.arrays, base_dir=out_dir)
        store = SourceStore(m)
        try:
            want = record.get("checksums", {})
            names = {n for n, _, _ in job.tensors}
            for fqn, a in filled.arrays.items():
                for ci, c in enumerate(a.chunks):
                    key = f"{fqn}|{ci}"
                    if c.tensor(fqn) not in names or key not in want:
                        continue
                    holder = next(h for h in c.holders if c.file_for(h) == job.rel) if any(
                        c.file_for(h) == job.rel for h in c.holders) else None
                    if holder is None:
                        continue
                    rt = store.resolve(fqn, c, holder)
                    h = new_hasher(want[key])
                    for piece in contiguous_slabs(c.region.sizes, rt.dtype.itemsize, 64 << 20):
                        h.update(store.read(rt, piece.shift(c.local_offsets)))
                    if h.result() != want[key]:
                        return False
        finally:
            store.close()
        return True
    except (OSError, ShardstreamError, ValueError):
        return False


def _remove_stale_temps(out: Path, jobs: Sequence[FileJob]) -> None:
    """Temp files of an interrupted run (``.NAME.tmp-PID``, ours or atomic_write_bytes'). Called
    with the lock held, so no live writer owns them."""
    dirs = {out / STATE_DIR} | {(out / j.rel).parent for j in jobs}
    names = {(out / j.rel).name for j in jobs} | {"manifest.json", "model.safetensors.index.json"}
    for d in dirs:
        try:
            entries = list(d.iterdir())
        except OSError:
            continue
        for p in entries:
            base, sep, _ = p.name.rpartition(".tmp-")
            if sep and base.startswith(".") and (d.name == STATE_DIR or base[1:] in names):
                try:
                    p.unlink()
                except OSError:
                    pass


def _sha(b: bytes) -> str:
    import hashlib

    return hashlib.sha256(b).hexdigest()


class _Lock:
    def __init__(self, out_dir: Path) -> None:
        (out_dir / STATE_DIR).mkdir(parents=True, exist_ok=True)
        self.path = out_dir / STATE_DIR / "lock"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutputLockedError(f"{out_dir}: another shardstream convert is writing this directory "
                                        "(lock held); wait for it or choose another --out") from e
            raise
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)


def _preflight(src: Manifest, dst: Manifest, plan: Plan) -> list[str]:
    """Open every source tensor the plan reads, before anything is written."""
    problems: list[str] = []
    reported: set[str] = set()
    seen: set[tuple[str, int, int]] = set()
    store = SourceStore(src)
    try:
        for t in plan.transfers:
            key = (t.fqn, t.src_chunk, t.src_rank)
            if key in seen:
                continue
            seen.add(key)
            chunk = src.arrays[t.fqn].chunks[t.src_chunk]
            try:
                rt = store.resolve(t.fqn, chunk, t.src_rank)
                if not chunk.local_box.fits_in(rt.shape):
                    problems.append(f"{rt.path}: {t.fqn}: stored tensor {rt.name!r} has shape {list(rt.shape)}, "
                                    f"too small for chunk region {chunk.region} at offsets {list(chunk.local_offsets)}")
            except ShardstreamError as e:
                # one line per problem: a broken file is reported once, not once per chunk in it
                problems.extend(p for p in (e.problems or [str(e)]) if p not in reported)
                reported.update(e.problems or [str(e)])
            if len(problems) > 200:
                problems.append("... (stopping after 200 problems)")
                break
    finally:
        store.close()
    return problems


def _assign(jobs: Sequence[Any], workers: int, name: Any = lambda j: j.rel) -> list[list[Any]]:
    """Largest job first onto the least loaded worker (deterministic: ties broken by ``name``)."""
    loads = [0] * workers
    share: list[list[Any]] = [[] for _ in range(workers)]
    for j in sorted(jobs, key=lambda j: (-j.nbytes, name(j))):
        w = min(range(workers), key=lambda i: (loads[i], i))
        loads[w] += j.nbytes
        share[w].append(j)
    return share


def _checked_plan(src: Manifest, dst: Manifest, opts: ConvertOptions, rank: int, comm: Any, src_where: str,
                  dst_where: str) -> Plan:
    """The plan, after every source tensor it reads has been opened (rank 0; the verdict is shared)."""
    try:
        plan = plan_transfers(src, dst, allow_extra=opts.allow_extra)
    except PlanError as e:  # its lines name the array; say which manifests were being matched
        raise PlanError(problems=[f"{dst_where}: {ln}; source manifest {src_where}" for ln in e.problems]) from e
    problems = _preflight(src, dst, plan) if rank == 0 else []
    if comm is not None:
        problems = comm.bcast(problems, root=0)
    if problems:
        raise FormatError(problems=problems)
    return plan


def _open_output(out: Path, opts: ConvertOptions, jobs: Sequence[FileJob]) -> _Lock:
    """Rank 0, once bad input is ruled out: make ``out``, take its lock, and remove the manifest
    and stale temp files, so the directory reads as incomplete until the new manifest lands."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: --out exists and is not a directory")
    if out.exists() and not opts.resume and any(p.name != STATE_DIR for p in out.iterdir()):
        raise UsageError(f"{out}: output directory is not empty; pass --resume to continue an "
                         "interrupted conversion, or choose an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    lock = _Lock(out)
    try:
        (out / "manifest.json").unlink()
    except FileNotFoundError:
        pass
    _remove_stale_temps(out, jobs)
    return lock


def convert(src: Manifest, dst: Manifest, out_dir: str | os.PathLike[str], opts: ConvertOptions | None = None,
            *, comm: Any = None, log: Any = None, src_where: str = "SRC", dst_where: str = "DST") -> ConvertReport:
    """Convert the checkpoint ``src`` describes into ``dst``'s layout under ``out_dir``.

    Raises ``ValidationError`` / ``PlanError`` / ``FormatError`` (nothing written) for bad input,
    ``OutputLockedError`` when another convert holds ``out_dir``. ``src_where`` / ``dst_where``
    name the manifests in problem lines (the CLI passes their paths).
    """
    opts = opts or ConvertOptions()
    t0 = time.perf_counter()
    out = Path(out_dir)
    rank = comm.Get_rank() if comm is not None else 0
    size = comm.Get_size() if comm is not None else 1

    problems = validate_manifest(src, where=src_where) + validate_manifest(dst, where=dst_where)
    if problems:
        raise ValidationError(problems=problems)
    if any(c.source is None or c.source.file is None for _, _, c in src.iter_chunks()):
        missing = sorted({f for f, _, c in src.iter_chunks() if c.source is None or c.source.file is None})
        raise ValidationError(problems=[f"{src_where}: {f}: chunk has no source.file, so there is nothing to read "
                                        "(describe the files with `shardstream import`)" for f in missing[:20]])
    if opts.format == "zarr":
        return _convert_zarr(src, dst, out, opts, comm=comm, src_where=src_where, dst_where=dst_where, t0=t0)
    if opts.format != "safetensors":
        raise UsageError(f"--format {opts.format}: expected safetensors or zarr")
    plan = _checked_plan(src, dst, opts, rank, comm, src_where, dst_where)
    filled, jobs = plan_files(cast_manifest(dst, opts.cast) if opts.cast else dst, max_shard_size=opts.max_shard_size)
    src_dtypes = ({(r, n): ts.data_type for r in dst.ranks_holding() for n, ts in dst.local_tensors(r).items()}
                  if opts.cast else {})
    src_dtypes.update(_moved_in_source_dtype(src, dst))

    # ---- from here on we write; bad input has been ruled out
    lock = _open_output(out, opts, jobs) if rank == 0 else None
    if comm is not None:
        comm.barrier()
    try:
        report = _run_jobs(src, filled, plan, out, jobs, opts, rank, size, comm, src_dtypes)
        if rank == 0:
            arrays = {}
            for fqn, a in filled.arrays.items():
                chunks = tuple(Chunk(c.region, c.holders, replace(c.source, checksum=report_checksums(
                    report, fqn, ci))) for ci, c in enumerate(a.chunks))
                arrays[fqn] = ArraySpec(a.shape, a.data_type, chunks)
            final = replace(filled, arrays=arrays)
            if dst.world_size == 1 and opts.max_shard_size:
                _write_index(out, final, jobs)
            save_manifest(final, out / "manifest.json")
        if comm is not None:
            comm.barrier()
    finally:
        if lock is not None:
            lock.release()
    rep = report.report
    rep.seconds = time.perf_counter() - t0
    rep.plan_stats = plan.stats()
    return rep


@dataclass
class _RunResult:
    report: ConvertReport
    checksums: dict[str, str]


def report_checksums(r: _RunResult, fqn: str, ci: int) -> str | None:
    return r.checksums.get(f"{fqn}|{ci}")


def _moved_in_source_dtype(src: Manifest, dst: Manifest) -> dict[tuple[int, str], str]:
    """Destination local tensors whose arrays are stored in another float type in the source
    (Megatron's float32 norms next to bfloat16 weights): slabs are read in the source dtype and
    cast while writing. The planner only allows casts between floating-point types."""
    out: dict[tuple[int, str], str] = {}
    for fqn, d in dst.arrays.items():
        s = src.arrays.get(fqn)
        if s is None or s.data_type == d.data_type:
            continue
        for c in d.chunks:
            for r in c.holders:
                out[(r, c.tensor(fqn))] = s.data_type
    return out


def _run_jobs(src: Manifest, filled: Manifest, plan: Plan, out: Path, jobs: list[FileJob],
              opts: ConvertOptions, rank: int, size: int, comm: Any,
              src_dtypes: dict[tuple[int, str], str] | None = None) -> _RunResult:
    mine = _assign(jobs, size)[rank]
    rep = ConvertReport(workers=size)
    checksums: dict[str, str] = {}
    state = out / STATE_DIR
    total = sum(j.nbytes for j in mine)
    progress = Progress(total, "convert", enabled=opts.progress if rank == 0 else False)
    error: str | None = None
    store = SourceStore(src)
    try:
        writer = _Writer(src, store, plan, filled, opts, progress)
        writer.src_dtypes = dict(src_dtypes or {})
        for job in mine:
            rec_path = state / (job.rel.replace("/", "__") + ".done.json")
            if opts.resume and rec_path.exists() and (out / job.rel).exists():
                try:
                    record = json.loads(rec_path.read_text())
                except (OSError, ValueError):
                    record = {}
                if _verify_existing(out, job, record, opts, filled):
                    checksums.update(record["checksums"])
                    rep.files_skipped += 1
                    progress.update(job.nbytes)
                    continue
            try:
                rec_path.unlink()
            except FileNotFoundError:
                pass
            cs = writer.write_file(out, job)
            checksums.update(cs)
            from formats.safetensors_io import layout_file

            specs = [(n, by_name(ts.data_type), tuple(ts.shape)) for n, ts, _ in job.tensors]
            prefix, _ = layout_file(specs)
            atomic_write_bytes(rec_path, json.dumps({"file": job.rel, "prefix_sha": _sha(prefix),
                                                     "checksums": cs}).encode())
            rep.files_written += 1
            rep.bytes_written += job.nbytes
    except ShardstreamError as e:
        if comm is None:
            raise
        error = "; ".join(e.problems or [str(e)])
    finally:
        if "writer" in locals():
            writer.close()
        store.close()
        progress.close()
    rep.bytes_read = store.stats.bytes_read
    rep.reads = store.stats.reads
    return _gather_results(comm, error, rep, checksums, size)


def _gather_results(comm: Any, error: str | None, rep: ConvertReport, checksums: dict[str, str],
                    size: int) -> _RunResult:
    """Under mpiexec: every worker learns every failure, and the reports and checksums add up."""
    if comm is None:
        return _RunResult(rep, checksums)
    results = comm.allgather((error, rep.to_dict(), checksums))
    errs = [f"worker {i}: {e}" for i, (e, _, _) in enumerate(results) if e]
    if errs:
        raise FormatError(problems=errs)
    total = ConvertReport(workers=size)
    for _, d, cs in results:
        for k in ("files_written", "files_skipped", "bytes_written", "bytes_read", "reads"):
            setattr(total, k, getattr(total, k) + d[k])
        checksums.update(cs)
    return _RunResult(total, checksums)


def _write_index(out: Path, m: Manifest, jobs: Sequence[FileJob]) -> None:
    weight_map: dict[str, str] = {}
    total = 0
    for job in jobs:  # every stored tensor, empty arrays included
        for name, _, _ in job.tensors:
            weight_map[name] = job.rel
    total = sum(ts.nbytes for ts in m.local_tensors(0).values())
    data = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_bytes(out / "model.safetensors.index.json", (json.dumps(data, indent=2) + "\n").encode())


# ------------------------------------------------------------------ zarr output (design §7)

@dataclass
class _ZarrJob:
    """One output array of a zarr conversion."""

    fqn: str
    shape: tuple[int, ...]
    data_type: str  # as stored (after --cast)
    src_dtype: str  # as the plan moves it
    regions: list[tuple[int, Box]]  # (destination chunk index, region)
    layout: Any  # formats.zarr_io.ZarrLayout

    @property
    def nbytes(self) -> int:
        return sum(r.volume for _, r in self.regions) * by_name(self.data_type).itemsize

    def record_key(self, compressor: str) -> dict[str, Any]:
        """What a completion record must match for ``--resume`` to reuse the array."""
        return {"shape": list(self.shape), "data_type": self.data_type, "chunks": list(self.layout.chunks),
                "shards": list(self.layout.shards) if self.layout.shards is not None else None,
                "compressor": compressor,
                "regions": [[list(r.offsets), list(r.sizes)] for _, r in self.regions]}


def _logical_manifest(dst: Manifest) -> Manifest:
    """``dst``'s regions on one rank, each at its own place in its array: for zarr output the
    destination of every region is the global array, not a local tensor."""
    arrays = {fqn: ArraySpec(a.shape, a.data_type, tuple(
        Chunk(c.region, (0,), Source(tensor=fqn, offsets=c.region.offsets)) for c in a.chunks))
        for fqn, a in dst.arrays.items()}
    return Manifest(world_size=1, arrays=arrays, name=dst.name, partial=dst.partial)


def _zarr_manifest(target: Manifest, checksums: dict[str, str]) -> Manifest:
    """The output manifest: ``target``'s regions and holders, each in the group (``file: "."``) at
    its array (``tensor: fqn``) at the region's own offsets."""
    arrays = {fqn: ArraySpec(a.shape, a.data_type, tuple(
        Chunk(c.region, c.holders, Source(tensor=fqn, offsets=c.region.offsets, file=".",
                                          checksum=checksums.get(f"{fqn}|{ci}")))
        for ci, c in enumerate(a.chunks))) for fqn, a in target.arrays.items()}
    return replace(target, arrays=arrays, tensors={}, base_dir=None)


def _convert_zarr(src: Manifest, dst: Manifest, out: Path, opts: ConvertOptions, *, comm: Any, src_where: str,
                  dst_where: str, t0: float) -> ConvertReport:
    """``convert --format zarr``: ``out`` becomes a zarr v3 group, one array per logical array
    (chunk grid from ``zarr_io.choose_layout``), ``manifest.json`` beside it, written last."""
    from formats import zarr_io

    rank = comm.Get_rank() if comm is not None else 0
    size = comm.Get_size() if comm is not None else 1
    if opts.max_shard_size:
        raise UsageError("--max-shard-size splits safetensors files; it does not apply to --format zarr")
    if opts.zarr_compressor not in zarr_io.COMPRESSORS:
        raise UsageError(f"--zarr-compressor {opts.zarr_compressor}: expected one of "
                         f"{', '.join(zarr_io.COMPRESSORS)}")
    bad = [f"{dst_where}: {fqn}: cannot be a zarr array name ({p})" for fqn in dst.arrays
           if (p := zarr_io.check_array_name(fqn) or ("it contains '/'" if "/" in fqn else None))]
    if bad:
        raise ValidationError(problems=bad)
    logical = _logical_manifest(dst)
    plan = _checked_plan(src, logical, opts, rank, comm, src_where, dst_where)
    target = cast_manifest(dst, opts.cast) if opts.cast else dst
    unit_limit = max(1 << 16, opts.memory_limit // 4)
    jobs = []
    for fqn, a in target.arrays.items():
        regions = [(ci, c.region) for ci, c in enumerate(a.chunks)]
        layout = zarr_io.choose_layout(a.shape, [r for _, r in regions], by_name(a.data_type).itemsize,
                                       max_unit_bytes=unit_limit)
        jobs.append(_ZarrJob(fqn, tuple(a.shape), a.data_type, dst.arrays[fqn].data_type, regions, layout))

    # ---- from here on we write; bad input has been ruled out
    lock = None
    if rank == 0:
        lock = _open_output(out, opts, [])
        zarr_io.create_group(out)
    if comm is not None:
        comm.barrier()
    try:
        result = _run_zarr_jobs(src, plan, out, jobs, opts, rank, size, comm, unit_limit)
        if rank == 0:
            zarr_io.consolidate(out)
            save_manifest(_zarr_manifest(target, result.checksums), out / "manifest.json")
        if comm is not None:
            comm.barrier()
    finally:
        if lock is not None:
            lock.release()
    rep = result.report
    rep.seconds = time.perf_counter() - t0
    rep.plan_stats = plan.stats()
    return rep


def _run_zarr_jobs(src: Manifest, plan: Plan, out: Path, jobs: list[_ZarrJob], opts: ConvertOptions, rank: int,
                   size: int, comm: Any, unit_limit: int) -> _RunResult:
    import hashlib

    mine = _assign(jobs, size, lambda j: j.fqn)[rank]
    rep = ConvertReport(workers=size)
    checksums: dict[str, str] = {}
    state = out / STATE_DIR
    progress = Progress(sum(j.nbytes for j in mine), "convert", enabled=opts.progress if rank == 0 else False)
    by_fqn: dict[str, list[Transfer]] = defaultdict(list)
    for t in plan.transfers:
        by_fqn[t.fqn].append(t)
    error: str | None = None
    store = SourceStore(src)
    store.read_budget = unit_limit
    filler = _ZarrFiller(src, store)
    try:
        for job in mine:
            rec_path = state / f"zarr-{hashlib.sha256(job.fqn.encode()).hexdigest()[:32]}.done.json"
            key = job.record_key(opts.zarr_compressor)
            if opts.resume and rec_path.exists():
                try:
                    record = json.loads(rec_path.read_text())
                except (OSError, ValueError):
                    record = {}
                if _zarr_array_intact(out, job, record, key):
                    checksums.update(record["checksums"])
                    rep.files_skipped += 1
                    progress.update(job.nbytes)
                    continue
            try:
                rec_path.unlink()
            except FileNotFoundError:
                pass
            cs = _write_zarr_array(out, job, by_fqn.get(job.fqn, []), filler, opts, unit_limit, progress)
            checksums.update(cs)
            atomic_write_bytes(rec_path, json.dumps({"array": job.fqn, "layout": key, "checksums": cs}).encode())
            rep.files_written += 1
            rep.bytes_written += job.nbytes
    except ShardstreamError as e:
        if comm is None:
            raise
        error = "; ".join(e.problems or [str(e)])
    finally:
        store.close()
        progress.close()
    rep.bytes_read = store.stats.bytes_read
    rep.reads = store.stats.reads
    return _gather_results(comm, error, rep, checksums, size)


class _ZarrFiller:
    """Fills one box of a logical array from the plan's transfers (ranged source reads)."""

    def __init__(self, src: Manifest, store: SourceStore) -> None:
        self.src = src
        self.store = store
        self._buf = np.empty(0, dtype=np.uint8)
        self._scratch = np.empty(0, dtype=np.uint8)
        self._resolved: dict[tuple[str, int, int], Any] = {}

    def _resolve(self, t: Transfer) -> Any:
        key = (t.fqn, t.src_chunk, t.src_rank)
        rt = self._resolved.get(key)
        if rt is None:
            rt = self.store.resolve(t.fqn, self.src.arrays[t.fqn].chunks[t.src_chunk], t.src_rank)
            self._resolved[key] = rt
        return rt

    def fill(self, box: Box, transfers: Sequence[Transfer], isz: int) -> np.ndarray:
        n = box.volume * isz
        if self._buf.size < n:
            self._buf = np.empty(n, dtype=np.uint8)
        buf = self._buf[:n]
        parts = [(t, sub) for t in transfers if (sub := box.intersect(t.dst_box)) is not None and not sub.empty]
        if sum(sub.volume for _, sub in parts) < box.volume:
            buf[:] = 0  # a partial destination: what no region covers reads as the fill value
        view = buf.reshape(box.sizes + (isz,))
        for t, sub in parts:
            rt = self._resolve(t)
            sbox = sub.shift(tuple(so - do for so, do in zip(t.src_offsets, t.dst_offsets)))
            if sub == box:
                self.store.read(rt, sbox, buf)
            else:
                m = sbox.volume * isz
                if self._scratch.size < m:
                    self._scratch = np.empty(m, dtype=np.uint8)
                tmp = self.store.read(rt, sbox, self._scratch[:m])
                view[sub.relative_to(box.offsets).slices] = tmp.reshape(sub.sizes + (isz,))
        return buf


def _write_zarr_array(out: Path, job: _ZarrJob, transfers: Sequence[Transfer], filler: _ZarrFiller,
                      opts: ConvertOptions, unit_limit: int, progress: Progress) -> dict[str, str]:
    """Create one array and write it unit by unit (a unit: one chunk, or one shard); returns the
    checksum of every destination region, hashed while writing when the units stream each
    region in row-major order, else read back from the store."""
    from formats import zarr_io

    arr = zarr_io.create_array(out, job.fqn, job.shape, job.data_type, job.layout, compressor=opts.zarr_compressor)
    isz = by_name(job.src_dtype).itemsize
    unit = job.layout.unit
    cast = job.src_dtype != job.data_type
    regions = [r for _, r in job.regions]

    def put(u: Box) -> np.ndarray:
        data = filler.fill(u, transfers, isz)
        if cast:
            data = cast_bytes(data, job.src_dtype, job.data_type)
        zarr_io._zarr_call(f"{out}: array {job.fqn!r}", f"writing region {u}",
                           zarr_io.write_box, arr, u, data, job.data_type)
        progress.update(u.volume * by_name(job.data_type).itemsize)
        return data

    sums: dict[str, str] = {}
    if zarr_io.streamable(job.shape, regions, unit):
        for ci, r in job.regions:
            h = new_hasher(opts.checksum)
            for u in zarr_io.iter_units(job.shape, unit, within=r):
                h.update(put(u))
            sums[f"{job.fqn}|{ci}"] = h.result()
        return sums
    done: set[tuple[int, ...]] = set()
    for _, r in job.regions:
        for u in zarr_io.iter_units(job.shape, unit, within=r):
            if u.offsets not in done:
                done.add(u.offsets)
                put(u)
    reader = zarr_io.ZarrReader()
    za = reader.open(out, job.fqn)
    for ci, r in job.regions:
        sums[f"{job.fqn}|{ci}"] = zarr_io.region_checksum(za, r, opts.checksum, unit_limit)
    return sums


def _zarr_array_intact(out: Path, job: _ZarrJob, record: dict[str, Any], key: dict[str, Any]) -> bool:
    """A finished array of an earlier run is reused only if its layout matches and every region
    checksum recomputed from the store matches its completion record."""
    from formats import zarr_io

    if record.get("layout") != key or not isinstance(record.get("checksums"), dict):
        return False
    try:
        za = zarr_io.ZarrReader().open(out, job.fqn)
        info = za.info
        if (list(info.shape) != key["shape"] or info.data_type != job.data_type
                or list(info.chunk_shape) != list(job.layout.unit)):
            return False
        for ci, r in job.regions:
            want = record["checksums"].get(f"{job.fqn}|{ci}")
            if not isinstance(want, str) or zarr_io.region_checksum(za, r, want) != want:
                return False
        return True
    except (OSError, ShardstreamError, ValueError):
        return False
