"""``fsdp2``: HF names; every array ``S(0)`` over ``fsdp`` (uneven, torch.chunk), optionally × ``tp``
with the generic tensor-parallel rules (FSDP2 then shards the TP-local tensor: the ``_StridedShard``
order); ``dp`` replicates (HSDP), ``pp`` pins by stage. Mesh axes in any order of
``pp, dp, fsdp, cp, tp``. Tied embeddings: the state dict's one array is ``model.embed_tokens.weight``
(HF's name for the shared parameter), as in every preset.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from itertools import product

from ..mesh import Mesh, Placement, Shard
from ..rules import parse_rule, pp_stage
from .builder import Builder
from .engine import Framework, ModelInfo, Options
from .geometry import piece

__all__ = ["FRAMEWORK"]


def _tp_placements(info: ModelInfo) -> dict[str, Placement]:
    from ..models import generic_rules

    one = Mesh(("tp",), (1,))
    rules = [parse_rule(r, one) for r in generic_rules(("tp",))]
    out: dict[str, Placement] = {}
    for fqn in info.arrays:
        for r in rules:
            if fnmatchcase(fqn, r.pattern):
                out[fqn] = r.placements[0]
                break
    return out


def place(b: Builder, info: ModelInfo, opts: Options) -> None:
    T, P, F = b.size("tp"), b.size("pp"), b.size("fsdp")
    tp_pl = _tp_placements(info) if T > 1 else {}
    for fqn, (shape, _dt) in info.arrays.items():
        stage = pp_stage(fqn, num_layers=info.layers, pp=P) if P > 1 else 0
        # TP first, then FSDP2 chunks dim 0 of the TP-local tensor (the _StridedShard order)
        splits: list[tuple[str, int, int]] = []
        pl = tp_pl.get(fqn)
        if isinstance(pl, Shard) and pl.dim < len(shape):
            splits.append(("tp", pl.dim, T))
        if len(shape) >= 1:
            splits.append(("fsdp", 0, F))
        if b.sharded(fqn, {"pp": stage}, [(axis, d) for axis, d, _ in splits]):
            continue
        for coords in product(*(range(n) for _, _, n in splits)):
            offs = [0] * len(shape)
            sizes = list(shape)
            for (_axis, d, n), c in zip(splits, coords):
                lo, hi = piece(sizes[d], n, c)
                offs[d] += lo
                sizes[d] = hi - lo
            fixed = {axis: c for (axis, _, _), c in zip(splits, coords)}
            b.put(fqn, offs, sizes, fqn, (0,) * len(shape), b.ranks(pp=stage, **fixed))


FRAMEWORK = Framework("fsdp2", ("pp", "dp", "fsdp", "cp", "tp"), ordered=False, place=place)
