"""Destination files of a safetensors output: which file every chunk lands in (rank files, or
Hugging Face names for a one-rank output), the jobs that write them, and the HF index."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from formats.manifest.limits import RANK_FILE_PATTERN
from formats.manifest.wire import ArraySpec, Chunk, Manifest, Source, TensorSpec, atomic_write_bytes

__all__ = ["DEFAULT_PATTERN", "FileJob", "INDEX_NAME", "plan_files", "write_index"]


@dataclass
class FileJob:
    """One destination file: its local tensors, in file order, each filled from ``rank``'s plan."""

    rel: str
    tensors: list[tuple[str, TensorSpec, int]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.rel

    @property
    def nbytes(self) -> int:
        return sum(ts.nbytes for _, ts, _ in self.tensors)



DEFAULT_PATTERN = RANK_FILE_PATTERN
HF_SINGLE = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


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
        return {t: HF_SINGLE for t in tensors}
    groups: list[list[str]] = [[]]
    size = 0
    for t, ts in tensors.items():
        if groups[-1] and size + ts.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += ts.nbytes
    return {t: f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i, g in enumerate(groups) for t in g}


def _with_files(dst: Manifest, hf: dict[str, str]) -> Manifest:
    """``dst`` with every chunk's ``source`` naming its file and its place in the local tensor."""
    arrays: dict[str, ArraySpec] = {}
    for fqn, a in dst.arrays.items():
        chunks = []
        for c in a.chunks:
            src = c.source or Source()
            if src.file is None:
                f = hf.get(c.tensor(fqn), HF_SINGLE) if dst.world_size == 1 else DEFAULT_PATTERN
                src = replace(src, file=f)
            # a tensor named as its array and zero offsets are left implicit (None), as layouts
            # expand them: the output manifest then fits the compact form (expert runs too),
            # checksums in its sidecar
            tensor, offsets = c.tensor(fqn), c.local_offsets
            src = replace(src, tensor=None if tensor == fqn else tensor, offsets=offsets if any(offsets) else None,
                          byte_range=None, stored_shape=None, checksum=None)
            chunks.append(Chunk(c.region, c.holders, src))
        arrays[fqn] = ArraySpec(a.shape, a.data_type, tuple(chunks))
    return replace(dst, arrays=arrays, base_dir=None)


def _chunks_and_empties(m: Manifest, empty: dict[str, TensorSpec]) -> Iterator[tuple[str, Chunk | None]]:
    """``iter_chunks`` in array order, with ``(fqn, None)`` where an empty array stands."""
    for fqn, a in m.arrays.items():
        if fqn in empty:
            yield fqn, None
        for c in a.chunks:
            yield fqn, c


class _Jobs:
    """Destination files being listed: each (file, local tensor) is stored once."""

    def __init__(self) -> None:
        self.jobs: dict[str, FileJob] = {}
        self.seen: set[tuple[str, str]] = set()

    def add(self, rel: str, name: str, spec: TensorSpec, rank: int) -> None:
        if (rel, name) not in self.seen:
            self.seen.add((rel, name))
            self.jobs.setdefault(rel, FileJob(rel)).tensors.append((name, spec, rank))


def _rank_file(filled: Manifest, rank: int) -> str:
    """The file of ``rank``'s local tensors that no chunk names."""
    files = sorted(f for _, _, c in filled.iter_chunks() if rank in c.holders if (f := c.file_for(rank)))
    if files:
        return files[0]
    pattern = next((c.source.file for _, _, c in filled.iter_chunks() if c.source and c.source.file), None)
    if pattern and "{" in pattern:
        return pattern.format(rank=rank)
    return pattern or (HF_SINGLE if filled.world_size == 1 else DEFAULT_PATTERN.format(rank=rank))


def plan_files(dst: Manifest, *, max_shard_size: int | None = None) -> tuple[Manifest, list[FileJob]]:
    """Assign every destination chunk a file and list the files to write.

    Chunks that name a ``source.file`` keep it; others get ``rank-{rank:05d}.safetensors`` (or HF
    names for a one-rank destination). Returns the destination manifest with files filled in,
    and one job per distinct output file.
    """
    hf = _hf_files(dst, max_shard_size) if dst.world_size == 1 else {}
    filled = _with_files(dst, hf)
    jobs = _Jobs()
    local = {r: filled.local_tensors(r) for r in filled.ranks_holding()}
    empty = _empty_arrays(filled)
    named = {c.file_for(0) for _, _, c in dst.iter_chunks() if c.source is not None and c.source.file}
    for fqn, chunk in _chunks_and_empties(filled, empty):
        if chunk is None:  # with one file named by the destination, empty arrays go there too
            rel = next(iter(named)) if len(named) == 1 else hf.get(fqn, HF_SINGLE)
            assert rel is not None
            jobs.add(rel, fqn, empty[fqn], 0)
            continue
        for h in chunk.holders:
            rel = chunk.file_for(h)
            assert rel is not None
            jobs.add(rel, chunk.tensor(fqn), local[h][chunk.tensor(fqn)], h)
    # local tensors declared in `tensors` that no chunk names (a rank holding only vocab padding,
    # a vLLM EP rank with no experts) are still part of that rank's file, zero-filled
    named_tensors = {(h, c.tensor(fqn)) for fqn, _, c in filled.iter_chunks() for h in c.holders}
    for r, ts in sorted(filled.tensors.items()):
        rel = _rank_file(filled, r)
        for name, spec in ts.items():
            if (r, name) not in named_tensors:
                jobs.add(rel, name, spec, r)
    return filled, sorted(jobs.jobs.values(), key=lambda j: j.rel)


def write_index(out: Path, m: Manifest, jobs: Sequence[FileJob]) -> None:
    """``model.safetensors.index.json`` of a sharded one-rank (HF) output."""
    weight_map = {name: job.rel for job in jobs for name, _, _ in job.tensors}  # empty arrays included
    total = sum(ts.nbytes for ts in m.local_tensors(0).values())
    data = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_bytes(out / INDEX_NAME, (json.dumps(data, indent=2) + "\n").encode())
