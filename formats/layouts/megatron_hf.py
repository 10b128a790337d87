"""Megatron torch_dist arrays -> Hugging Face arrays, as a view of the stored bytes.

A Megatron ``torch_dist`` checkpoint stores each weight under one global key with the layers
stacked on a leading dim (``decoder.layers.self_attention.linear_qkv.weight [L, ...]``; MoE
experts add a second one, ``decoder.layers.mlp.experts.local_experts.linear_fc1.weight [L, E, ...]``).
Every global tensor is the TP = 1 local tensor of the megatron preset: ``linear_qkv`` interleaved
per query group, ``linear_fc1`` = ``[gate; up]``, the vocab padded. So the mapping is a
composition:

1. the megatron preset at one rank maps each HF array region onto a local tensor
   ``decoder.layers.{l}.<rest>`` at some offsets (de-interleaving, the gate/up split and the
   dropped vocab padding all come from it);
2. ``decoder.layers.{l}.<rest>`` is index ``l`` of the stored ``decoder.layers.<rest>`` (each
   numeric path component becomes one leading index);
3. the region is cut along the stored DCP chunks; each piece addresses the one-layer slab of its
   chunk's ``.distcp`` payload by byte range (layer-major, so the slab is contiguous).

Norm names: torch_dist files of the local module spec store the Transformer Engine names
(``linear_qkv.layer_norm_weight``, and ``mlp.linear_fc1.layer_norm_weight`` even in MoE layers,
where TE has a separate ``pre_mlp_layernorm``); either name is accepted.

No I/O beyond the config file, no MPI, no torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from math import prod
from pathlib import Path
from typing import Any

from ..errors import FormatError
from ..manifest.box import Box
from ..manifest.dtypes import by_name
from ..manifest.wire import ArraySpec, Chunk, Manifest, Source
from .mesh import Mesh

__all__ = ["megatron_to_hf"]

#: per-layer name pairs under which one weight may be stored (``decoder.layers.`` + name): the
#: local spec's separate norms and TE's fused ``layer_norm_weight`` are mapped onto each other by
#: Megatron's ``sharded_state_dict_keys_map`` in one spec and not the other
_ALIASES = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
)
#: SequentialMLP's ``local_experts.{e}`` are stored as one ``experts.experts`` array, experts stacked
_EXPERTS = ("mlp.experts.local_experts.", "mlp.experts.experts.")
_INDEX = re.compile(r"\.(\d+)(?=\.)")


def _stacked(local: str) -> tuple[str, tuple[int, ...]]:
    """``decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.weight`` ->
    (``decoder.layers.mlp.experts.local_experts.linear_fc1.weight``, (3, 1))."""
    idx = tuple(int(x) for x in _INDEX.findall(local))
    return _INDEX.sub("", local), idx


def _stored_name(stored: Mapping[str, ArraySpec], name: str) -> str | None:
    if name in stored:
        return name
    name = name.replace(*_EXPERTS)
    if name in stored:
        return name
    for a, b in _ALIASES:
        if name.endswith("." + a) and name[: -len(a)] + b in stored:
            return name[: -len(a)] + b
    return None


def megatron_to_hf(stored: Manifest, cfg: Mapping[str, Any] | str | os.PathLike[str], *,
                   where: str = "<megatron>") -> Manifest:
    """The HF-named manifest whose chunks address the bytes of ``stored`` (a manifest from
    :func:`formats.megatron.dist.read_megatron_dist`). ``cfg``: the model's HF ``config.json``.

    Each HF array keeps the stored data_type (Megatron keeps norms in float32 next to bfloat16
    weights; ``convert`` casts to the destination's). Raises ``FormatError`` listing every
    stored array that is missing or does not fit the config.
    """
    from .presets import preset_manifest

    view = preset_manifest(cfg, "megatron", Mesh(("tp",), (1,)))
    local_shapes = {n: t.shape for n, t in view.local_tensors(0).items()}
    padded = set(view.tensors.get(0, {}))  # vocab-padded: the stored padding depends on the saving tp
    stacks: dict[str, tuple[int, ...]] = {}  # stored name -> largest leading index + 1 the config needs
    index = _ChunkIndex(stored)
    arrays: dict[str, ArraySpec] = {}
    problems: list[str] = []
    for fqn, spec in view.arrays.items():
        chunks: list[Chunk] = []
        dtypes: set[str] = set()
        for c in spec.chunks:
            local = c.tensor(fqn)
            name, lead = _stacked(local)
            sname = _stored_name(stored.arrays, name)
            if sname is None:
                problems.append(f"{where}: {fqn}: the checkpoint has no array {name} (needed for {local})")
                break
            sa = stored.arrays[sname]
            dtypes.add(sa.data_type)
            off = c.local_offsets
            box = Box(offsets=lead + off, sizes=(1,) * len(lead) + c.region.sizes)
            want = local_shapes[local]
            got = sa.shape[len(lead):]
            if local in padded:
                ok = len(got) == len(want) and got[1:] == want[1:] and got[0] >= spec.shape[0]
            else:
                ok = got == want
            if not ok or len(sa.shape) != box.ndim or not box.fits_in(sa.shape):
                problems.append(f"{where}: {fqn}: needs {sname} of {len(lead)} stacked dim(s) + {list(want)} (from "
                                f"{local}), but the stored array has shape {list(sa.shape)}; does --model match the "
                                "checkpoint?")
                break
            if lead:
                prev = stacks.get(sname, (0,) * len(lead))
                stacks[sname] = tuple(max(p, i + 1) for p, i in zip(prev, lead))
            chunks.extend(_pieces(fqn, c, box, len(lead), sname, sa, index.get(sname, lead), where, problems))
        if len(dtypes) > 1:
            problems.append(f"{where}: {fqn}: maps onto stored arrays of several data_types {sorted(dtypes)}")
        if dtypes and not problems:
            arrays[fqn] = ArraySpec(spec.shape, dtypes.pop(), tuple(chunks))
    for sname, need in sorted(stacks.items()):
        have = stored.arrays[sname].shape[:len(need)]
        if have != need:
            problems.append(f"{where}: {sname}: stacked dims {list(have)} in the checkpoint, the config has "
                            f"{list(need)} (num_hidden_layers / experts); does --model match the checkpoint?")
    if problems:
        raise FormatError(problems=problems)
    base = stored.base_dir if stored.base_dir is not None else Path(".")
    return Manifest(world_size=1, arrays=arrays, name=stored.name, base_dir=base)


class _ChunkIndex:
    """The stored chunks of an array by leading index (layer, expert): each HF region then looks
    at the few chunks of its own layer, not all of them (DeepSeek-V3's stacked experts have
    L × E × tp chunks; a scan per region would be quadratic)."""

    def __init__(self, stored: Manifest) -> None:
        self.stored = stored
        self.by_lead: dict[tuple[str, int], dict[tuple[int, ...], list[Chunk]]] = {}

    def get(self, name: str, lead: tuple[int, ...]) -> list[Chunk]:
        k = len(lead)
        if not k:
            return list(self.stored.arrays[name].chunks)
        idx = self.by_lead.get((name, k))
        if idx is None:
            idx = {}
            for sc in self.stored.arrays[name].chunks:
                o, n = sc.region.offsets[:k], sc.region.sizes[:k]
                for rel in _indices(n):
                    idx.setdefault(tuple(a + b for a, b in zip(o, rel)), []).append(sc)
            self.by_lead[(name, k)] = idx
        return idx.get(lead, [])


def _indices(sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in sizes:
        out = [t + (i,) for t in out for i in range(n)]
    return out


def _pieces(fqn: str, c: Chunk, box: Box, k: int, sname: str, sa: ArraySpec, candidates: list[Chunk],
            where: str, problems: list[str]) -> list[Chunk]:
    """Cut ``box`` (in the stored array, ``k`` leading one-element dims) along the stored chunks."""
    isz = by_name(sa.data_type).itemsize
    out: list[Chunk] = []
    covered = 0
    for sc in candidates:
        part = sc.region.intersect(box)
        if part is None or part.empty:
            continue
        src = sc.source
        if src is None or src.byte_range is None or src.stored_shape is None:
            problems.append(f"{where}: {fqn}: stored chunk {sc.region} of {sname} has no byte range")
            continue
        st_shape = src.stored_shape
        st_off = src.offsets or (0,) * len(st_shape)
        inside = tuple(p - r + s for p, r, s in zip(part.offsets, sc.region.offsets, st_off))
        inner = st_shape[k:]
        slab = 0
        for i, n in zip(inside[:k], st_shape[:k]):
            slab = slab * n + i  # row-major index of the one-layer (one-expert) slab
        nbytes = prod(inner) * isz
        start = src.byte_range[0] + slab * nbytes
        region = Box(offsets=tuple(r + p - b for r, p, b in zip(c.region.offsets, part.offsets[k:], box.offsets[k:])),
                     sizes=part.sizes[k:])
        out.append(Chunk(region, (0,), Source(tensor=c.tensor(fqn), offsets=inside[k:], file=src.file,
                                              byte_range=(start, start + nbytes), stored_shape=inner)))
        covered += part.volume
    if covered != box.volume and not problems:
        problems.append(f"{where}: {fqn}: the stored chunks of {sname} cover {covered} of the {box.volume} elements "
                        f"of region {box}")
    return out
