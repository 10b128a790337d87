"""Local tensors <-> files for the live path: ``refit send`` loads a rank's tensors from the
files its manifest names; ``refit recv --save`` writes the received ones (atomic, manifest last)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from formats.integrity.checksum import DEFAULT_ALGO, new_hasher
from formats.manifest.box import Box, contiguous_slabs
from formats.manifest.dtypes import by_name, np_storage
from formats.manifest.wire import COMPACT_FORMAT_VERSION, ArraySpec, Chunk, Manifest, Source, save_manifest
from formats.safetensors.rankfiles import plan_files
from formats.store import SourceStore

__all__ = ["alloc_local", "load_local", "save_local", "finish_save"]


#: each local tensor of ``alloc_local`` starts on its own page of the rank's one buffer
_ALIGN = 4096


def alloc_local(m: Manifest, rank: int) -> dict[str, np.ndarray]:
    """Zeroed local tensors of ``rank`` (storage dtypes: bf16 as uint16, fp8 as uint8), resident
    as an engine's weights are: written once here, so the first pull into them takes no page faults.

    They are views of one buffer (each page-aligned), as the ``MPI_Alltoallv`` floor's are: numpy
    asks for transparent huge pages on large allocations, and MPI's single-copy read between
    processes (``process_vm_readv``) moves huge-page memory 2-5x faster than the small pages of
    one allocation per tensor (issue 23: the steady push read 4 KiB pages, the floor huge ones)."""
    specs = [(name, ts.shape, np.dtype(np_storage(by_name(ts.data_type)))) for name, ts in m.local_tensors(rank).items()]
    offsets, total = [], 0
    for _, shape, dt in specs:
        offsets.append(total)
        total += -(-int(np.prod(shape, dtype=np.int64)) * dt.itemsize // _ALIGN) * _ALIGN
    raw = np.empty(total + _ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGN
    arena = raw[start:start + total]
    arena.fill(0)
    return {name: arena[off:off + int(np.prod(shape, dtype=np.int64)) * dt.itemsize].view(dt).reshape(shape)
            for (name, shape, dt), off in zip(specs, offsets)}


def load_local(m: Manifest, rank: int) -> dict[str, np.ndarray]:
    """``rank``'s local tensors, filled from the files its chunks name (ranged reads)."""
    out = alloc_local(m, rank)
    with SourceStore(m) as store:
        for fqn, a, c in m.iter_chunks():
            if rank not in c.holders:
                continue
            rt = store.resolve(fqn, c, rank)
            view = out[c.tensor(fqn)]
            isz = a.dtype.itemsize
            bview = view.reshape(-1).view(np.uint8).reshape(view.shape + (isz,))
            lb = c.local_box
            for piece in contiguous_slabs(lb.sizes, isz, 64 << 20):
                box = piece.shift(lb.offsets)
                data = store.read(rt, box)
                sl = box.slices
                bview[sl] = data.reshape(box.sizes + (isz,))
    return out


def _chunk_checksum(view: np.ndarray, box: Box) -> str:
    h = new_hasher(DEFAULT_ALGO)
    sl = box.slices
    h.update(np.ascontiguousarray(view[sl]).reshape(-1).view(np.uint8))
    return h.result()


def save_local(out_dir: str | os.PathLike[str], m: Manifest, rank: int, tensors: dict[str, Any]) -> dict[str, str]:
    """Write ``rank``'s files under ``out_dir`` (temp + fsync + rename); return chunk checksums."""
    from formats.safetensors.io import SafetensorsWriter
    from streamer.execute.executor import byte_view

    out = Path(out_dir)
    filled, jobs = plan_files(m)
    views = {n: byte_view(t) for n, t in tensors.items()}
    for job in jobs:
        if job.tensors[0][2] != rank:
            continue
        path = out / job.rel
        path.parent.mkdir(parents=True, exist_ok=True)
        specs = [(n, by_name(ts.data_type), tuple(ts.shape)) for n, ts, _ in job.tensors]
        w = SafetensorsWriter(path, specs)
        try:
            for n, _, _ in job.tensors:
                w.write(n, 0, np.ascontiguousarray(views[n]).reshape(-1))
            w.commit()
        except BaseException:
            w.abort()
            raise
    sums = {}
    for fqn, a in m.arrays.items():
        for ci, c in enumerate(a.chunks):
            if c.holders[0] == rank:
                sums[f"{fqn}|{ci}"] = _chunk_checksum(views[c.tensor(fqn)], c.local_box)
    return sums


def finish_save(out_dir: str | os.PathLike[str], m: Manifest, checksums: dict[str, str]) -> Manifest:
    """Write ``manifest.json`` last, with files and checksums filled in."""
    filled, _ = plan_files(m)
    arrays = {}
    for fqn, a in filled.arrays.items():
        chunks = tuple(Chunk(c.region, c.holders, replace(c.source or Source(), checksum=checksums.get(f"{fqn}|{ci}")))
                       for ci, c in enumerate(a.chunks))
        arrays[fqn] = ArraySpec(a.shape, a.data_type, chunks)
    final = replace(filled, arrays=arrays)
    save_manifest(final, Path(out_dir) / "manifest.json", format_version=COMPACT_FORMAT_VERSION)  # + sidecar
    return final
