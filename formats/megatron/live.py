"""A live Megatron-core model as regions of Hugging Face arrays (pure: no torch, no MPI).

``streamer.refit.megatron.manifest_from_megatron`` reads what each rank of a Megatron job holds
(its coordinates in megatron-core's parallel groups, the global layers of each model chunk, its
parameters' names, shapes and dtypes) and gathers it once. This module turns those reports into
the manifest: the ``megatron`` preset (:mod:`formats.layouts.presets.megatron`: ``linear_qkv``
de-interleaved per query group, ``linear_fc1`` = ``[gate; up]``, the vocabulary padding left in the
local tensors) laid out on a mesh built from the reports, then

* holders renumbered from the preset's mesh to the job's global ranks, read from each rank's own
  coordinates (so the manifest does not depend on megatron-core's rank order);
* virtual pipeline chunks: the preset runs on ``pp × vpp`` virtual stages (virtual stage
  ``v·pp + p`` is chunk ``v`` of pipeline rank ``p``, Megatron's interleaved assignment), and the
  local tensors of chunk ``v`` are named ``model{v}.<name>`` (Megatron-LM's checkpoint keys);
* each array takes the dtype of the parameters that hold it (RMSNorm weights stay float32 in a
  bf16 model unless it was cast as a whole);
* every parameter of every rank is accounted for: one the layout does not name is refused by name
  (an architecture this module does not know is never guessed).

Tied embeddings with pp > 1: Megatron keeps a second copy of the embedding as the last stage's
``output_layer.weight``; the one array ``model.embed_tokens.weight`` is described once, from the
first stage's ``embedding.word_embeddings.weight``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import FormatError
from ..layouts.mesh import LayoutError, Mesh
from ..manifest.spec import ArraySpec, Chunk, Manifest, Source, TensorSpec

__all__ = ["MegatronConfig", "RankReport", "hf_config", "live_manifest"]

#: parameters a chunk may hold that carry no HF array (Megatron's copy of a tied embedding)
_TIED_COPY = "output_layer.weight"


@dataclass(frozen=True)
class MegatronConfig:
    """The model-wide facts every rank agrees on: TransformerConfig fields (plain values), the
    padded vocabulary the GPTModel was built with, and the parallel sizes."""

    fields: Mapping[str, Any]
    padded_vocab: int
    tied: bool
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1


@dataclass(frozen=True)
class RankReport:
    """What one rank holds: its coordinates, the global layer indices (0-based) of each of its
    model chunks, and its parameters (``model{v}.`` prefixed when there are virtual chunks)."""

    rank: int
    pp: int
    tp: int
    dp: int  # the expert-data-parallel rank with ep > 1, else the data-parallel rank
    ep: int = 0
    etp: int = 0
    cp: int = 0
    layers: tuple[tuple[int, ...], ...] = ()
    params: Mapping[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)


def _refusals(f: Mapping[str, Any]) -> list[str]:
    """What of a TransformerConfig has no Hugging Face llama / qwen2 / qwen3 / qwen3_moe array layout."""
    out = []
    checks = [
        (f.get("normalization") != "RMSNorm", f"normalization {f.get('normalization')!r} (only RMSNorm)"),
        (not f.get("gated_linear_unit"), "gated_linear_unit=False (only the gated SwiGLU MLP)"),
        (f.get("activation") not in (None, "silu"), f"activation_func {f.get('activation')!r} (only silu)"),
        (bool(f.get("add_bias_linear")), "add_bias_linear=True (biases on the linear layers)"),
        (bool(f.get("multi_latent_attention")), "multi_latent_attention (MLA is not mapped from a live model yet)"),
        (f.get("position_embedding_type", "rope") != "rope",
         f"position_embedding_type {f.get('position_embedding_type')!r} (only rope)"),
        (bool(f.get("moe_shared_expert_intermediate_size")), "moe_shared_expert_intermediate_size (shared experts)"),
        (f.get("moe_layer_freq", 1) != 1, f"moe_layer_freq {f.get('moe_layer_freq')!r} (only every layer MoE)"),
        (bool(f.get("add_qkv_bias")) and bool(f.get("qk_layernorm")), "add_qkv_bias with qk_layernorm"),
        (bool(f.get("num_moe_experts")) and not f.get("qk_layernorm"),
         "MoE without qk_layernorm (only the Qwen3-MoE layout)"),
    ]
    for bad, what in checks:
        if bad:
            out.append(f"megatron: {what} is not supported")
    return out


def hf_config(cfg: MegatronConfig, vocab_size: int) -> dict[str, Any]:
    """The Hugging Face ``config.json`` whose arrays the model holds (llama, qwen2, qwen3 or
    qwen3_moe). Raises ``FormatError`` naming every setting it cannot map."""
    f = cfg.fields
    problems = _refusals(f)
    if problems:
        raise FormatError(problems=problems)
    heads = int(f["num_attention_heads"])
    moe = bool(f.get("num_moe_experts"))
    mt = "qwen3_moe" if moe else "qwen3" if f.get("qk_layernorm") else "qwen2" if f.get("add_qkv_bias") else "llama"
    out: dict[str, Any] = {
        "model_type": mt, "hidden_size": int(f["hidden_size"]), "intermediate_size": int(f["ffn_hidden_size"]),
        "num_hidden_layers": int(f["num_layers"]), "num_attention_heads": heads,
        "num_key_value_heads": int(f.get("num_query_groups") or heads),
        "head_dim": int(f.get("kv_channels") or int(f["hidden_size"]) // heads), "vocab_size": vocab_size,
        "tie_word_embeddings": cfg.tied,
    }
    if moe:
        out.update(num_experts=int(f["num_moe_experts"]), num_experts_per_tok=int(f.get("moe_router_topk") or 2),
                   moe_intermediate_size=int(f.get("moe_ffn_hidden_size") or f["ffn_hidden_size"]),
                   decoder_sparse_step=1, mlp_only_layers=[])
    return out


def _partition(cfg: MegatronConfig, reports: Sequence[RankReport], layers: int) -> list[int]:
    """Layers per virtual stage (``v·pp + p``), read from the ranks' own layer numbers."""
    P, V = cfg.pp, cfg.vpp
    seen: dict[int, tuple[int, ...]] = {}
    problems = []
    for r in reports:
        if len(r.layers) != V:
            problems.append(f"megatron: rank {r.rank} holds {len(r.layers)} model chunks, expected {V} "
                            "(virtual pipeline size)")
            continue
        for v, ls in enumerate(r.layers):
            s = v * P + r.pp
            if seen.setdefault(s, ls) != ls:
                problems.append(f"megatron: ranks of pipeline stage {r.pp} disagree on the layers of chunk {v}")
    if problems:
        raise FormatError(problems=problems)
    parts, nxt = [], 0
    for s in range(P * V):
        ls = seen.get(s, ())
        if not ls or ls != tuple(range(nxt, nxt + len(ls))):
            raise FormatError(f"megatron: virtual stage {s} holds layers {list(ls)}, expected a non-empty run "
                              f"from layer {nxt} (a custom pipeline layout is not supported)")
        parts.append(len(ls))
        nxt += len(ls)
    if nxt != layers:
        raise FormatError(f"megatron: the stages hold {nxt} layers, the config says num_layers = {layers}")
    return parts


def _uneven(parts: list[int], layers: int) -> tuple[int | None, int | None]:
    """The ``first_stage_layers`` / ``last_stage_layers`` that give ``parts`` (Megatron-core's
    ``num_layers_in_first/last_pipeline_stage``); refused when no such pair does."""
    from ..layouts.presets import PresetError, pp_partition

    if len(set(parts)) == 1:
        return None, None
    for first, last in ((parts[0], None), (None, parts[-1]), (parts[0], parts[-1])):
        try:
            if pp_partition(layers, len(parts), "megatron", first=first, last=last) == parts:
                return first, last
        except PresetError:
            continue
    raise FormatError(f"megatron: layers per stage {parts}: only uneven first and last stages are supported")


def _mesh_and_ranks(cfg: MegatronConfig, reports: Sequence[RankReport]) -> tuple[Mesh, list[int], int]:
    """The preset's mesh (virtual stages on ``pp``), each flat mesh index's global rank (every
    virtual stage of one pipeline rank maps to the same ranks), and the mesh's stride of ``pp``."""
    P, V, T, E, C = cfg.pp, cfg.vpp, cfg.tp, cfg.ep, cfg.cp
    if E > 1 and cfg.etp != T:
        raise FormatError(f"megatron: expert_tensor_parallel_size {cfg.etp} with tensor_model_parallel_size {T} "
                          "is not supported (only expert TP = TP)")
    if E > 1 and C > 1:
        raise FormatError("megatron: expert parallelism with context parallelism is not supported")
    world = len(reports)
    D, rem = divmod(world, P * E * C * T)
    if rem or D < 1:
        raise FormatError(f"megatron: {world} ranks do not fill pp {P} × ep {E} × cp {C} × tp {T}")
    sizes = {"pp": P * V, "dp": D, "ep": E, "cp": C, "tp": T}
    axes = tuple(a for a in ("pp", "dp", "ep", "cp", "tp") if a == "pp" or a == "tp" or sizes[a] > 1)
    mesh = Mesh(axes, tuple(sizes[a] for a in axes))
    base: dict[tuple[int, ...], int] = {}
    problems = []
    for r in reports:
        if E > 1 and r.etp != r.tp:
            problems.append(f"megatron: rank {r.rank} has expert TP rank {r.etp} but TP rank {r.tp}")
        coord = {"pp": r.pp, "dp": r.dp, "ep": r.ep, "cp": r.cp, "tp": r.tp}
        key = tuple(coord[a] for a in axes)
        if any(not 0 <= coord[a] < (P if a == "pp" else sizes[a]) for a in axes):
            problems.append(f"megatron: rank {r.rank} has coordinates {coord} outside pp {P} × dp {D} × ep {E} × "
                            f"cp {C} × tp {T}")
        elif key in base:
            problems.append(f"megatron: ranks {base[key]} and {r.rank} have the same coordinates {coord}")
        else:
            base[key] = r.rank
    if problems:
        raise FormatError(problems=problems)
    stride_pp = mesh.size // (P * V)
    ranks = []
    for flat in range(mesh.size):
        s, rest = divmod(flat, stride_pp)
        ranks.append(base[(s % P,) + _unflatten(rest, mesh.shape[1:])])
    return mesh, ranks, stride_pp


def _unflatten(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        flat, c = divmod(flat, n)
        out.append(c)
    return tuple(reversed(out))


def live_manifest(cfg: MegatronConfig, reports: Sequence[RankReport], vocab_size: int | None, *,
                  name: str | None = None) -> Manifest:
    """The manifest of a live Megatron job (see the module docstring): every rank computes the
    same one from the same reports. ``vocab_size`` None: the embedding and output head are
    described at the padded size, as ``open_rows`` that a refit cuts to the receivers' rows.
    Raises ``FormatError`` with one line per problem."""
    from ..layouts.presets import PresetError, preset_manifest

    open_rows = vocab_size is None
    vocab_size = cfg.padded_vocab if vocab_size is None else vocab_size
    if not 1 <= vocab_size <= cfg.padded_vocab:
        raise FormatError(f"megatron: vocab_size {vocab_size} does not fit the model's padded vocabulary "
                          f"{cfg.padded_vocab} (the GPTModel's vocab_size)")
    hf = hf_config(cfg, vocab_size)
    reports = sorted(reports, key=lambda r: r.rank)
    parts = _partition(cfg, reports, hf["num_hidden_layers"])
    mesh, ranks, stride_pp = _mesh_and_ranks(cfg, reports)
    params = {r.rank: r.params for r in reports}
    names = {n for p in params.values() for n in p}
    te = any(n.endswith("linear_qkv.layer_norm_weight") for n in names)
    grouped = any(".mlp.experts.linear_fc1.weight" in n for n in names)
    legacy_grouped = sorted(n for n in names if n.endswith((".mlp.experts.weight1", ".mlp.experts.weight2")))
    if legacy_grouped:
        raise FormatError(f"megatron: {legacy_grouped[0]}: GroupedMLP's weight1/weight2 hold the experts "
                          "transposed and side by side, which is not a region of the HF arrays; use "
                          "SequentialMLP or TEGroupedMLP")
    split_tie = cfg.tied and len(parts) > 1
    first, last = _uneven(parts, hf["num_hidden_layers"])
    try:
        m = preset_manifest(dict(hf, tie_word_embeddings=cfg.tied and not split_tie), "megatron", mesh,
                            megatron_spec="te" if te else "local", megatron_padded_vocab=cfg.padded_vocab,
                            moe_grouped_gemm=grouped, compact=False, first_stage_layers=first, last_stage_layers=last)
    except (PresetError, LayoutError) as e:
        raise FormatError(f"megatron: {e}") from None
    out = _renumber(m, cfg, params, ranks, stride_pp, split_tie, name or f"megatron-{hf['model_type']}")
    return _with_open_rows(out, params) if open_rows else out


def _with_open_rows(m: Manifest, params: Mapping[int, Mapping[str, tuple[tuple[int, ...], str]]]) -> Manifest:
    """The vocabulary arrays as ``open_rows``, each local tensor declared (once cut to the
    receivers' rows, the chunks no longer reach the padding)."""
    rows = tuple(n for n in ("model.embed_tokens.weight", "lm_head.weight") if n in m.arrays)
    tensors = {r: dict(ts) for r, ts in m.tensors.items()}
    for fqn in rows:
        for c in m.arrays[fqn].chunks:
            for r in c.holders:
                shape, dt = params[r][c.tensor(fqn)]
                tensors.setdefault(r, {})[c.tensor(fqn)] = TensorSpec(shape, dt)
    return replace(m, tensors=tensors, open_rows=rows)


def _renumber(m: Manifest, cfg: MegatronConfig, params: Mapping[int, Mapping[str, tuple[tuple[int, ...], str]]],
              ranks: Sequence[int], stride_pp: int, split_tie: bool, name: str) -> Manifest:
    """Holders as global ranks, chunk ``v``'s tensors prefixed, dtypes from the parameters; then
    every rank's parameters checked against what the manifest names."""
    P, V = cfg.pp, cfg.vpp

    def local(tensor: str, flat: int) -> str:
        return f"model{(flat // stride_pp) // P}.{tensor}" if V > 1 else tensor

    problems: list[str] = []
    arrays: dict[str, ArraySpec] = {}
    for fqn, spec in m.arrays.items():
        if split_tie and fqn == "lm_head.weight":
            continue  # the last stage's copy of the tied embedding
        chunks, dtypes = [], set()
        for c in spec.chunks:
            by_name: dict[str, list[int]] = {}
            for h in c.holders:
                by_name.setdefault(local(c.tensor(fqn), h), []).append(ranks[h])
            for t, hs in by_name.items():
                for r in hs:
                    got = params.get(r, {}).get(t)
                    if got is not None:
                        dtypes.add(got[1])
                src = c.source
                chunks.append(Chunk(c.region, tuple(sorted(set(hs))), Source(tensor=t, offsets=src.offsets if src else None)))
        if len(dtypes) > 1:
            problems.append(f"megatron: {fqn}: held by parameters of several dtypes {sorted(dtypes)}")
        arrays[fqn] = ArraySpec(spec.shape, dtypes.pop() if len(dtypes) == 1 else spec.data_type, tuple(chunks))
    tensors: dict[int, dict[str, TensorSpec]] = {}
    for flat, ts in m.tensors.items():
        for t, ts_spec in ts.items():
            if split_tie and t == _TIED_COPY:
                continue
            r, lt = ranks[flat], local(t, flat)
            got = params.get(r, {}).get(lt)
            tensors.setdefault(r, {})[lt] = TensorSpec(ts_spec.shape, got[1] if got else ts_spec.data_type)
    out = Manifest(world_size=len(params), arrays=arrays, name=name,
                   mesh={"axes": list(m.mesh["axes"]) if m.mesh else ["tp"], "shape": _real_shape(m, cfg)},
                   tensors=tensors)
    for r in sorted(params):
        want = out.local_tensors(r)
        for t, (shape, dt) in sorted(params[r].items()):
            if t in want:
                if tuple(want[t].shape) != tuple(shape):
                    problems.append(f"megatron: rank {r}: {t} has shape {list(shape)}, the layout expects "
                                    f"{list(want[t].shape)}")
            elif not (split_tie and t.endswith(_TIED_COPY)):
                problems.append(f"megatron: rank {r}: parameter {t} {list(shape)} is not one the llama/qwen layout "
                                "maps to a Hugging Face array (an architecture manifest_from_megatron does not know)")
        for t in sorted(set(want) - set(params[r])):
            problems.append(f"megatron: rank {r}: has no parameter {t} (the layout expects {list(want[t].shape)})")
    if problems:
        raise FormatError(problems=problems)
    return out


def _real_shape(m: Manifest, cfg: MegatronConfig) -> list[int]:
    shape = list(m.mesh["shape"]) if m.mesh else [1]
    shape[0] = cfg.pp  # the preset ran on pp × vpp virtual stages
    return shape
