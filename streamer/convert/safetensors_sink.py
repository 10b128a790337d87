"""The safetensors sink: one file per destination file, each laid out first (its header follows
from the destination manifest), then streamed in file order through bounded slabs."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from formats.errors import ShardstreamError
from formats.integrity.checksum import Hasher, new_hasher
from formats.manifest.box import Box, contiguous_slabs
from formats.manifest.dtypes import DType, by_name
from formats.manifest.wire import ArraySpec, Chunk, Manifest, Source, TensorSpec
from formats.safetensors.io import SafetensorsWriter, layout_file, read_header
from formats.safetensors.rankfiles import INDEX_NAME, plan_files, write_index
from formats.store import SourceStore
from streamer.convert.fill import U8, Buffer, Filler
from streamer.convert.options import ConvertOptions, FileJob
from streamer.convert.progress import Progress
from streamer.convert.quantize import Quantizer
from streamer.ops.cast import cast_bytes, cast_manifest, with_dtypes
from streamer.ops.quant import STEP_ELEMENTS, QuantTarget
from streamer.plan.model import Plan, Transfer

__all__ = ["PACK_BYTES", "SafetensorsSink"]

#: a write buffer packs consecutive slabs of a file up to this many bytes (_PackedStream.buffer)
PACK_BYTES = 64 << 20

#: a chunk of a file: (array, chunk index, its place in the local tensor)
_ChunkRef = tuple[str, int, Box]


class _PackedStream:
    """One file's data section as one sequential stream, through two write buffers.

    A background thread writes one buffer while the next is filled. A file's tensors are packed
    back to back and filled in file order, so consecutive slabs, across tensors, are packed into
    the current buffer and written with one pwrite when it is full. (One pwrite per slab made the
    writer wait on the filler: a 4 KiB norm between two 64 MiB slabs left it idle for the whole
    next fill, ~1 s of a 2.3 GB convert, in 480 pwrites where ~40 now do.)"""

    def __init__(self, slab_budget: int) -> None:
        self.slab_budget = slab_budget
        self._bufs: list[U8] = [np.empty(0, dtype=np.uint8), np.empty(0, dtype=np.uint8)]
        self._turn = 0
        self._fill = 0  # bytes of the current buffer filled, not yet queued
        self._fill_at = 0  # absolute file offset of the current buffer's first byte
        self._w: SafetensorsWriter | None = None
        self._pending: Future[None] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardstream-write")

    @property
    def position(self) -> int:
        """Absolute file offset of the next byte ``buffer`` hands out."""
        return self._fill_at + self._fill

    def begin(self, w: SafetensorsWriter) -> None:
        self._w, self._fill, self._fill_at = w, 0, w.data_start

    def buffer(self, n: int) -> U8:
        """The next ``n`` bytes of the file's stream, in the current write buffer (n <= slab_budget)."""
        if self._fill + n > self._bufs[self._turn].size:
            self.flush()
            if self._bufs[self._turn].size < n:
                # room to pack small slabs, capped: a pwrite past tens of MB saves nothing more,
                # and full 1/4-limit buffers would double the RSS of a default (1 GiB) convert
                self._bufs[self._turn] = np.empty(max(n, min(self.slab_budget, PACK_BYTES)), dtype=np.uint8)
        return self._bufs[self._turn][self._fill:self._fill + n]

    def advance(self, n: int) -> None:
        """The ``n`` bytes last handed out are filled: flush() writes them with the slabs around."""
        self._fill += n

    def flush(self) -> None:
        """Queue the filled part of the current buffer and turn to the other one."""
        if not self._fill:
            return
        assert self._w is not None
        buf = self._bufs[self._turn][:self._fill]
        self.drain()  # the other buffer's write: it is filled next, and writes stay in file order
        self._pending = self._pool.submit(self._w.write_at, self._fill_at, buf)
        self._fill_at += self._fill
        self._fill = 0
        self._turn ^= 1

    def drain(self) -> None:
        if self._pending is not None:
            p, self._pending = self._pending, None
            p.result()

    def end(self, ok: bool) -> None:
        """Done with the file: everything written (``ok``), or nothing more queued."""
        try:
            if ok:
                self.flush()
                self.drain()
                return
            self._fill = 0  # what was filled belongs to this file: never queue it
            try:
                self.drain()
            except BaseException:  # noqa: BLE001 - the caller re-raises the first error
                pass
        finally:
            self._w = None

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)


def _specs(job: FileJob) -> list[tuple[str, DType, tuple[int, ...]]]:
    return [(name, by_name(ts.data_type), tuple(ts.shape)) for name, ts, _ in job.tensors]


def _prefix_sha(job: FileJob) -> str:
    return hashlib.sha256(layout_file(_specs(job))[0]).hexdigest()


class SafetensorsSink:
    """Writes the destination's local tensors into safetensors files (``plan_files``)."""

    def __init__(self, dst: Manifest, opts: ConvertOptions, stored: Manifest | None = None,
                 quantize: Mapping[str, QuantTarget] | None = None) -> None:
        self.target = dst  # what the plan moves
        self.stored_base = stored if stored is not None else dst  # how to store it (before --cast)
        self.opts = opts
        self.quant_targets = dict(quantize or {})
        self.quantizer: Quantizer | None = None  # set by layout() when weights are quantized on write
        # set by layout(), once the plan is known
        self.filled = dst  # the destination as stored (after --cast), every chunk naming its file
        self.jobs: list[FileJob] = []
        #: (rank, local tensor) -> dtype the plan moves (differs from the output with --cast)
        self.src_dtypes: dict[tuple[int, str], str] = {}
        self.chunks_in: dict[tuple[int, str], list[_ChunkRef]] = defaultdict(list)
        self.by_target: dict[tuple[int, str], list[Transfer]] = defaultdict(list)
        self._stream: _PackedStream | None = None
        self._cast_src = Buffer()  # --cast: a slab in the source dtype

    # ---- what the pipeline asks before writing

    def layout(self, plan: Plan) -> list[FileJob]:
        dst, opts = self.target, self.opts
        base = self.stored_base
        if opts.cast:  # --cast leaves the scales of quantized weights float32
            base = with_dtypes(cast_manifest(base, opts.cast), {t.scale: base.arrays[t.scale].data_type
                                                                for t in self.quant_targets.values()})
        self.filled, self.jobs = plan_files(base, max_shard_size=opts.max_shard_size)
        if opts.cast or base is not dst:
            self.src_dtypes = {(r, n): ts.data_type for r in dst.ranks_holding()
                               for n, ts in dst.local_tensors(r).items()}
        for fqn, a in self.filled.arrays.items():
            for ci, c in enumerate(a.chunks):
                for h in c.holders:
                    self.chunks_in[(h, c.tensor(fqn))].append((fqn, ci, c.local_box))
        for t in plan.transfers:
            self.by_target[(plan.dst_local(t.dst_rank), t.dst_tensor)].append(t)
        if self.quant_targets:
            self.quantizer = Quantizer(self.filled, self.quant_targets, lambda r, n: self.by_target.get((r, n), []))
        return self.jobs

    def record_name(self, job: FileJob) -> str:
        return job.rel.replace("/", "__") + ".done.json"

    def record_key(self, job: FileJob) -> dict[str, Any]:
        return {"file": job.rel, "prefix_sha": _prefix_sha(job)}

    def chunk_keys(self, job: FileJob) -> list[str]:
        return [f"{fqn}|{ci}" for name, _, rank in job.tensors for fqn, ci, _ in self.chunks_in.get((rank, name), [])]

    def temp_paths(self, jobs: Sequence[FileJob]) -> list[str]:
        return [j.rel for j in jobs] + [INDEX_NAME]

    def prepare(self, out: Path) -> None:
        pass

    # ---- writing

    def write(self, out: Path, job: FileJob, filler: Filler, progress: Progress) -> dict[str, str]:
        path = out / job.rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if self._stream is None:
            self._stream = _PackedStream(self.opts.buffer_bytes)
        stream = self._stream
        w = SafetensorsWriter(path, _specs(job))
        ranges = w.tensor_ranges
        stream.begin(w)
        checksums: dict[str, str] = {}
        try:
            for name, ts, rank in job.tensors:
                # the stream invariant buffer() relies on: tensors are filled in file order
                assert ranges[name][0] == stream.position, (job.rel, name)
                checksums.update(self._fill_tensor(name, ts, rank, filler, progress))
            stream.end(ok=True)
            w.commit()
        except BaseException:
            stream.end(ok=False)
            w.abort()
            raise
        finally:
            if self.quantizer is not None:
                self.quantizer.forget()
        return checksums

    def _fill_tensor(self, name: str, ts: TensorSpec, rank: int, filler: Filler,
                     progress: Progress) -> dict[str, str]:
        assert self._stream is not None
        transfers = self.by_target.get((rank, name), [])
        chunks = self.chunks_in.get((rank, name), [])
        hashers = {(fqn, ci): new_hasher(self.opts.checksum) for fqn, ci, _ in chunks}
        if self.quantizer is not None and self.quantizer.holds(rank, name):
            return self._fill_quantized(name, ts, rank, filler, progress, chunks, hashers)
        src_dt = self.src_dtypes.get((rank, name), ts.data_type)
        isz, out_isz = by_name(src_dt).itemsize, by_name(ts.data_type).itemsize
        cast = src_dt != ts.data_type  # slabs are filled in the source dtype, cast before writing
        for slab in contiguous_slabs(tuple(ts.shape), max(isz, out_isz), self.opts.buffer_bytes):
            out = self._stream.buffer(slab.volume * out_isz)
            buf = self._cast_src.take(slab.volume * isz) if cast else out
            filler.fill(slab, transfers, isz, buf)
            if cast:
                out[:] = cast_bytes(buf, src_dt, ts.data_type)
            _hash_chunks(slab, out, out_isz, chunks, hashers)
            self._stream.advance(out.size)
            progress.update(out.size)
        return {f"{fqn}|{ci}": h.result() for (fqn, ci), h in hashers.items()}

    def _fill_quantized(self, name: str, ts: TensorSpec, rank: int, filler: Filler, progress: Progress,
                        chunks: Sequence[_ChunkRef], hashers: dict[tuple[str, int], Hasher]) -> dict[str, str]:
        """An FP8 or scale local tensor of weights quantized on write (``Quantizer``)."""
        assert self._stream is not None and self.quantizer is not None
        isz = by_name(ts.data_type).itemsize
        # slabs small enough for the quantizer's float32 temporaries of them to fit the budget
        budget = max(isz, min(self.opts.buffer_bytes // 4, STEP_ELEMENTS * isz))
        for slab in contiguous_slabs(tuple(ts.shape), isz, budget):
            out = self._stream.buffer(slab.volume * isz)
            self.quantizer.fill(rank, name, slab, out, filler)
            _hash_chunks(slab, out, isz, chunks, hashers)
            self._stream.advance(out.size)
            progress.update(out.size)
        return {f"{fqn}|{ci}": h.result() for (fqn, ci), h in hashers.items()}

    # ---- resume

    def intact(self, out: Path, job: FileJob, checksums: Mapping[str, str]) -> bool:
        """A finished file is reused only if its header, its size and every chunk checksum
        still match."""
        path = out / job.rel
        try:
            prefix, ranges = layout_file(_specs(job))
            size = max((e for _, e in ranges.values()), default=len(prefix))
            if path.stat().st_size != size:
                return False
            with open(path, "rb") as f:
                if f.read(len(prefix)) != prefix:
                    return False
            read_header(path)
            return self._chunks_match(out, job, checksums)
        except (OSError, ShardstreamError, ValueError):
            return False

    def _chunks_match(self, out: Path, job: FileJob, checksums: Mapping[str, str]) -> bool:
        """Re-hash every chunk of ``job`` from the file itself."""
        store = SourceStore(Manifest(world_size=self.filled.world_size, arrays=self.filled.arrays, base_dir=out))
        try:
            for name, _, rank in job.tensors:
                for fqn, ci, _ in self.chunks_in.get((rank, name), []):
                    want = checksums[f"{fqn}|{ci}"]
                    c = self.filled.arrays[fqn].chunks[ci]
                    rt = store.resolve(fqn, c, rank)
                    h = new_hasher(want)
                    for piece in contiguous_slabs(c.region.sizes, rt.dtype.itemsize, 64 << 20):
                        h.update(store.read(rt, piece.shift(c.local_offsets)))
                    if h.result() != want:
                        return False
            return True
        finally:
            store.close()

    # ---- the end

    def manifest(self, checksums: Mapping[str, str]) -> Manifest:
        arrays = {fqn: ArraySpec(a.shape, a.data_type, tuple(
            Chunk(c.region, c.holders, replace(c.source or Source(), checksum=checksums.get(f"{fqn}|{ci}")))
            for ci, c in enumerate(a.chunks))) for fqn, a in self.filled.arrays.items()}
        return replace(self.filled, arrays=arrays)

    def finish(self, out: Path, final: Manifest, jobs: Sequence[FileJob]) -> None:
        if self.target.world_size == 1 and self.opts.max_shard_size:
            write_index(out, final, jobs)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()


def _hash_chunks(slab: Box, data: U8, isz: int, chunks: Sequence[_ChunkRef], hashers: dict[tuple[str, int], Hasher]
                 ) -> None:
    """Feed each chunk's part of ``slab`` (its bytes ``data``) to the chunk's hasher."""
    view = data.reshape(slab.sizes + (isz,))
    for fqn, ci, lbox in chunks:
        inter = slab.intersect(lbox)
        if inter is not None and not inter.empty:
            hashers[(fqn, ci)].update(np.ascontiguousarray(view[inter.relative_to(slab.offsets).slices]))
