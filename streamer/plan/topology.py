"""Rank numbering and domains of one plan. Pure planning code."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from formats.manifest.wire import Manifest

__all__ = ["Runs", "Topology", "rank_domains"]

#: destination holder slots of each chunk of a layout, grouped by domain: ``(start, stop)`` runs
Runs = tuple[tuple[tuple[int, int], ...], ...]


@dataclass(frozen=True)
class Topology:
    """Rank numbering and domains of one plan."""

    src_world: int
    dst_world: int
    src_domain_size: int
    dst_domain_size: int
    same_job: bool
    split_bytes: int

    @staticmethod
    def of(src: Manifest, dst: Manifest, src_domain_size: int | None, dst_domain_size: int | None,
           same_job: bool, split_bytes: int) -> Topology:
        sds = src_domain_size or src.domain_size or 1
        dds = dst_domain_size or dst.domain_size or 1
        if same_job:  # one process per rank: one domain numbering for both sides
            sds = dds = (src_domain_size or dst_domain_size or src.domain_size or dst.domain_size or 1)
        return Topology(src.world_size, dst.world_size, sds, dds, same_job, split_bytes)

    @property
    def dst_shift(self) -> int:
        """Global rank of the destination job's rank 0."""
        return 0 if self.same_job else self.src_world

    @property
    def world_size(self) -> int:
        return max(self.src_world, self.dst_world) if self.same_job else self.src_world + self.dst_world

    def domain(self, rank: int) -> int:
        """Domain of a rank of a same-job reshard (both sides share the numbering)."""
        return rank // self.src_domain_size

    def dst_domain(self, rank: int) -> int:
        """Domain of a destination job rank."""
        return rank // (self.src_domain_size if self.same_job else self.dst_domain_size)



def rank_domains(g: np.ndarray, *, S: int, same_job: bool, sds: int, dds: int) -> np.ndarray:
    """Domain id of global ranks; the two jobs of a refit never share a domain."""
    if same_job:
        return g // sds
    big = (S + sds - 1) // sds + 1
    return np.where(g < S, g // sds, big + (g - S) // dds)
