"""The zarr sink (``--format zarr``, design §7): the output directory is a zarr v3 group with one
global array per logical array. The plan runs against the destination regions placed in their
global arrays; every zarr chunk (or shard) is filled from ranged source reads and written whole."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from formats.errors import ShardstreamError, UsageError, ValidationError
from formats.integrity.checksum import new_hasher
from formats.manifest.box import Box
from formats.manifest.dtypes import by_name
from formats.manifest.wire import ArraySpec, Chunk, Manifest, Source
from formats.zarr import io as zarr_io
from streamer.convert.fill import U8, Buffer, Filler
from streamer.convert.options import ConvertOptions
from streamer.convert.progress import Progress
from streamer.convert.quantize import quantized_box
from streamer.ops.cast import cast_bytes, cast_manifest, with_dtypes
from streamer.ops.quant import QuantTarget
from streamer.plan.model import Plan, Transfer

__all__ = ["ArrayJob", "ZarrSink"]


@dataclass
class ArrayJob:
    """One output array of a zarr conversion."""

    fqn: str
    shape: tuple[int, ...]
    data_type: str  # as stored (after --cast)
    src_dtype: str  # as the plan moves it
    regions: list[tuple[int, Box]]  # (destination chunk index, region)
    layout: zarr_io.ZarrLayout

    @property
    def name(self) -> str:
        return self.fqn

    @property
    def nbytes(self) -> int:
        return sum(r.volume for _, r in self.regions) * by_name(self.data_type).itemsize


def _layout_key(info: zarr_io.ZarrArrayInfo) -> dict[str, Any]:
    """The grid and codecs of an array as stored, in ``ZarrSink.record_key``'s terms."""
    sharded = info.inner_chunk_shape is not None
    return {"shape": list(info.shape), "data_type": info.data_type,
            "chunks": list(info.inner_chunk_shape if info.inner_chunk_shape is not None else info.chunk_shape),
            "shards": list(info.chunk_shape) if sharded else None,
            "compressor": "zstd" if "zstd" in info.codecs else "none"}


def _logical_manifest(dst: Manifest) -> Manifest:
    """``dst``'s regions on one rank, each at its own place in its array: for zarr output the
    destination of every region is the global array, not a local tensor."""
    arrays = {fqn: ArraySpec(a.shape, a.data_type, tuple(
        Chunk(c.region, (0,), Source(tensor=fqn, offsets=c.region.offsets)) for c in a.chunks))
        for fqn, a in dst.arrays.items()}
    return Manifest(world_size=1, arrays=arrays, name=dst.name, partial=dst.partial)


def check_zarr_output(dst: Manifest, opts: ConvertOptions, dst_where: str) -> None:
    """Usage and array-name problems, before anything is planned or written."""
    if opts.max_shard_size:
        raise UsageError("--max-shard-size splits safetensors files; it does not apply to --format zarr")
    if opts.zarr_compressor not in zarr_io.COMPRESSORS:
        raise UsageError(f"--zarr-compressor {opts.zarr_compressor}: expected one of "
                         f"{', '.join(zarr_io.COMPRESSORS)}")
    bad = [f"{dst_where}: {fqn}: cannot be a zarr array name ({p})" for fqn in dst.arrays
           if (p := zarr_io.check_array_name(fqn) or ("it contains '/'" if "/" in fqn else None))]
    if bad:
        raise ValidationError(problems=bad)


class ZarrSink:
    """Writes one zarr array per logical array, unit by unit (a unit: one chunk, or one shard)."""

    def __init__(self, dst: Manifest, opts: ConvertOptions, dst_where: str, stored: Manifest | None = None,
                 quantize: Mapping[str, QuantTarget] | None = None) -> None:
        check_zarr_output(dst, opts, dst_where)
        #: weights quantized on write, by weight and by scale array (``quantize``)
        self.quant = dict(quantize or {})
        self.quant_scales = {t.scale: t for t in self.quant.values()}
        self._src = Buffer()
        self.dst = dst  # what the plan moves
        self.stored_base = stored if stored is not None else dst  # how to store it (before --cast)
        self.opts = opts
        self.target = _logical_manifest(dst)
        self.stored = dst  # as stored (after --cast): set by layout()
        self.by_fqn: dict[str, list[Transfer]] = defaultdict(list)
        self._unit = Buffer()

    def layout(self, plan: Plan) -> list[ArrayJob]:
        base = self.stored_base
        if self.opts.cast:  # --cast leaves the scales of quantized weights as they are
            base = with_dtypes(cast_manifest(base, self.opts.cast), {
                f: base.arrays[f].data_type for f in self.quant_scales})
        self.stored = base
        for t in plan.transfers:
            self.by_fqn[t.fqn].append(t)
        jobs = []
        for fqn, a in self.stored.arrays.items():
            regions = [(ci, c.region) for ci, c in enumerate(a.chunks)]
            layout = zarr_io.choose_layout(a.shape, [r for _, r in regions], by_name(a.data_type).itemsize,
                                           max_unit_bytes=self.opts.buffer_bytes)
            # a scale array is not planned: it is computed, in its own type
            src_dt = self.dst.arrays[fqn].data_type if fqn in self.dst.arrays else a.data_type
            jobs.append(ArrayJob(fqn, tuple(a.shape), a.data_type, src_dt, regions, layout))
        return jobs

    def record_name(self, job: ArrayJob) -> str:
        return f"zarr-{hashlib.sha256(job.fqn.encode()).hexdigest()[:32]}.done.json"

    def record_key(self, job: ArrayJob) -> dict[str, Any]:
        layout = {"shape": list(job.shape), "data_type": job.data_type, "chunks": list(job.layout.chunks),
                  "shards": list(job.layout.shards) if job.layout.shards is not None else None,
                  "compressor": self.opts.zarr_compressor,
                  "regions": [[list(r.offsets), list(r.sizes)] for _, r in job.regions]}
        return {"array": job.fqn, "layout": layout}

    def chunk_keys(self, job: ArrayJob) -> list[str]:
        return [f"{job.fqn}|{ci}" for ci, _ in job.regions]

    def temp_paths(self, jobs: Sequence[ArrayJob]) -> list[str]:
        return []  # zarr writes its chunks in place

    def prepare(self, out: Path) -> None:
        zarr_io.create_group(out)

    def write(self, out: Path, job: ArrayJob, filler: Filler, progress: Progress) -> dict[str, str]:
        """Create the array and write it unit by unit; returns the checksum of every destination
        region, hashed while writing when the units stream each region in row-major order, else
        read back from the store."""
        arr = zarr_io.create_array(out, job.fqn, job.shape, job.data_type, job.layout,
                                   compressor=self.opts.zarr_compressor)
        transfers = self.by_fqn.get(job.fqn, [])

        t = self.quant.get(job.fqn) or self.quant_scales.get(job.fqn)

        def put(u: Box) -> U8:
            if t is not None:  # quantized on write: FP8 bits or scales from the weight's whole blocks
                isz = by_name(t.src_dtype).itemsize
                weight = self.by_fqn.get(t.weight, [])
                data = np.ascontiguousarray(quantized_box(
                    t, self.stored.arrays[t.weight].shape, u,
                    lambda step, buf: filler.fill(step, weight, isz, buf), self._src,
                    scales=job.fqn != t.weight)).reshape(-1).view(np.uint8)
            else:
                data = self._unit.take(u.volume * by_name(job.src_dtype).itemsize)
                filler.fill(u, transfers, by_name(job.src_dtype).itemsize, data)
                if job.src_dtype != job.data_type:
                    data = cast_bytes(data, job.src_dtype, job.data_type)
            zarr_io._zarr_call(f"{out}: array {job.fqn!r}", f"writing region {u}",
                               zarr_io.write_box, arr, u, data, job.data_type)
            progress.update(u.volume * by_name(job.data_type).itemsize)
            return data

        unit = job.layout.unit
        if zarr_io.streamable(job.shape, [r for _, r in job.regions], unit):
            sums: dict[str, str] = {}
            for ci, r in job.regions:
                h = new_hasher(self.opts.checksum)
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
        return self._region_checksums(out, job, self.opts.checksum)

    def _region_checksums(self, out: Path, job: ArrayJob, algo: str) -> dict[str, str]:
        za = zarr_io.ZarrReader().open(out, job.fqn)
        return {f"{job.fqn}|{ci}": zarr_io.region_checksum(za, r, algo, self.opts.buffer_bytes)
                for ci, r in job.regions}

    def intact(self, out: Path, job: ArrayJob, checksums: Mapping[str, str]) -> bool:
        """A finished array is reused only if its stored grid and codecs are the ones this run
        would write and every region checksum recomputed from the store matches."""
        try:
            want = self.record_key(job)["layout"]
            stored = _layout_key(zarr_io.read_array_info(out, job.fqn))
            if any(stored[k] != want[k] for k in stored):
                return False
            za = zarr_io.ZarrReader().open(out, job.fqn)
            return all(zarr_io.region_checksum(za, r, checksums[f"{job.fqn}|{ci}"]) == checksums[f"{job.fqn}|{ci}"]
                       for ci, r in job.regions)
        except (OSError, ShardstreamError, ValueError):
            return False

    def manifest(self, checksums: Mapping[str, str]) -> Manifest:
        """``stored``'s regions and holders, each in the group (``file: "."``) at its array
        (``tensor: fqn``) at the region's own offsets."""
        arrays = {fqn: ArraySpec(a.shape, a.data_type, tuple(
            Chunk(c.region, c.holders, Source(tensor=fqn, offsets=c.region.offsets, file=".",
                                              checksum=checksums.get(f"{fqn}|{ci}")))
            for ci, c in enumerate(a.chunks))) for fqn, a in self.stored.arrays.items()}
        return replace(self.stored, arrays=arrays, tensors={}, base_dir=None)

    def finish(self, out: Path, final: Manifest, jobs: Sequence[ArrayJob]) -> None:
        zarr_io.consolidate(out)

    def close(self) -> None:
        pass
