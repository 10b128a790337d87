"""Replica consistency: every holder of a replicated source region must hold the same bytes.

Data-parallel replicas of a trainer can diverge (a missed all-reduce, a non-deterministic
kernel on one rank). A refit reads each region from one holder only, so a diverged replica
would be mixed in silently. With ``verify``, every holder hashes each replicated region it
holds (xxh64, 8 bytes per region) and the push's agreement round compares them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from formats.manifest.wire import Manifest

__all__ = ["replica_digests", "replica_problems"]


def _key(fqn: str, ci: int) -> str:
    return f"{fqn}|{ci}"


def replica_digests(src: Manifest, rank: int, tensors: Mapping[str, Any]) -> dict[str, int]:
    """xxh64 of every chunk with two or more holders that ``rank`` holds, keyed ``fqn|chunk``."""
    import xxhash

    from streamer.ops.buffers import host_bytes, region_view

    out: dict[str, int] = {}
    for fqn, a in src.arrays.items():
        for ci, c in enumerate(a.chunks):
            if len(c.holders) < 2 or rank not in c.holders:
                continue
            region = region_view(tensors[c.tensor(fqn)], c.local_box)
            out[_key(fqn, ci)] = xxhash.xxh64_intdigest(host_bytes(region).data)
    return out


def replica_problems(src: Manifest, per_rank: Sequence[Mapping[str, int]],
                     name: Callable[[int], str]) -> list[str]:
    """One line per replicated region whose holders disagree, naming the array, region and ranks."""
    problems = []
    for fqn, a in src.arrays.items():
        for ci, c in enumerate(a.chunks):
            if len(c.holders) < 2:
                continue
            k = _key(fqn, ci)
            by_digest: dict[int, list[int]] = {}
            for r in c.holders:
                d = per_rank[r].get(k) if r < len(per_rank) else None
                if d is not None:
                    by_digest.setdefault(d, []).append(r)
            if len(by_digest) > 1:
                groups = sorted(by_digest.items(), key=lambda kv: (-len(kv[1]), kv[1]))
                parts = "; ".join(f"{', '.join(name(r) for r in rs)} hold xxh64 {d:016x}" for d, rs in groups)
                problems.append(f"{fqn}: region {c.region} differs between its replicas: {parts} "
                                "(diverged data-parallel replicas; refusing to mix them)")
    return problems
