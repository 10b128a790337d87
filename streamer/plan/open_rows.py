"""Arrays whose rows the receivers decide (``Manifest.open_rows``): a trainer that holds its
vocabulary padded, and does not know the real size, describes the embedding and output head at
the padded length; the receivers' manifest (an HF checkpoint, vLLM) knows the real one. Before
planning, both jobs clip the sender's chunks to the receivers' rows, the same way on every rank.
Pure planning code.
"""

from __future__ import annotations

from dataclasses import replace

from formats.errors import PlanError
from formats.manifest.box import Box
from formats.manifest.spec import ArraySpec, Chunk, Manifest

__all__ = ["bind_open_rows"]


def bind_open_rows(src: Manifest, dst: Manifest) -> Manifest:
    """``src`` with every ``open_rows`` array cut to the rows ``dst`` holds. Refuses, naming the
    array, receivers that hold more rows than the sender or other trailing dims."""
    if not src.open_rows:
        return src
    arrays = dict(src.arrays)
    problems = []
    for fqn in src.open_rows:
        s, d = src.arrays[fqn], dst.arrays.get(fqn)
        if d is None:
            continue  # not received: the planner's own rules apply
        n = d.shape[0] if d.shape else 0
        if d.shape[1:] != s.shape[1:] or n > s.shape[0]:
            problems.append(f"{fqn}: the receivers hold {list(d.shape)}, the sender {list(s.shape)} with padded rows "
                            f"(a vocabulary of {n} rows does not fit the sender's {s.shape[0]}; is it the same model?)")
            continue
        chunks = []
        for c in s.chunks:
            stop = min(c.region.offsets[0] + c.region.sizes[0], n)
            if stop > c.region.offsets[0]:
                sizes = (stop - c.region.offsets[0],) + c.region.sizes[1:]
                chunks.append(Chunk(Box(c.region.offsets, sizes), c.holders, c.source))
        arrays[fqn] = ArraySpec((n,) + s.shape[1:], s.data_type, tuple(chunks))
    if problems:
        raise PlanError(problems=problems)
    return replace(src, arrays=arrays, open_rows=())
