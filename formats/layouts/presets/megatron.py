"""``megatron``: Megatron-core with the Transformer Engine layer specs (see the package docstring
for the names and layouts). Mesh axes in Megatron's rank order, slowest first: a subsequence of
``pp, dp, ep, cp, tp``. ``megatron_spec="local"``: Megatron-core's local (non-TE) module spec,
whose norms are separate modules (``input_layernorm.weight``, ``pre_mlp_layernorm.weight``) where
TE fuses them into ``linear_qkv`` / ``linear_fc1`` as ``layer_norm_weight``; legacy
``model_optim_rng.pt`` files of a local-spec run store those names (torch_dist files map them
back to the TE names).

Tied embeddings: Megatron (``share_embeddings_and_output_weights``) has no ``output_layer`` at
pp = 1: the output layer reads ``embedding.word_embeddings.weight``, which holds the one array,
``model.embed_tokens.weight``. With pp > 1 it keeps a second copy as the last stage's
``output_layer.weight``; two local tensors for one region cannot be one chunk, so that is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import engine
from .builder import Builder
from .engine import Framework, LayerContext, ModelInfo, Options, Rule, Site
from .geometry import PresetError, ceil_to, divide, pp_partition

__all__ = ["FRAMEWORK", "MEGATRON_VOCAB_DIVISOR", "megatron_padded_vocab"]

#: Megatron's ``make_vocab_size_divisible_by`` default
MEGATRON_VOCAB_DIVISOR = 128

AXES = ("pp", "dp", "ep", "cp", "tp")

#: MLA attention (Megatron-core's ``MLASelfAttention``, TE spec, ``qk_layernorm=True``)
MLA = {
    "q_proj.weight": ("linear_q_proj.weight", "S0", None),  # q_lora_rank None
    "q_a_proj.weight": ("linear_q_down_proj.weight", "R", None),  # TELinear, parallel_mode "duplicated"
    "q_a_layernorm.weight": ("linear_q_up_proj.layer_norm_weight", "R", None),  # qk_layernorm=True
    "q_b_proj.weight": ("linear_q_up_proj.weight", "S0", None),
    "kv_a_proj_with_mqa.weight": ("linear_kv_down_proj.weight", "R", None),
    "kv_a_layernorm.weight": ("linear_kv_up_proj.layer_norm_weight", "R", None),
    "kv_b_proj.weight": ("linear_kv_up_proj.weight", "S0", None),
    "o_proj.weight": ("linear_proj.weight", "S1", None),
}


def megatron_padded_vocab(vocab: int, tp: int, divisor: int = MEGATRON_VOCAB_DIVISOR) -> int:
    """Megatron's ``_vocab_size_with_padding``: a multiple of ``divisor × tp``.

    >>> megatron_padded_vocab(1000, 3)
    1152
    """
    return ceil_to(vocab, divisor * tp)


def _padded_vocab(vocab: int, tp: int, padded: int | None) -> int:
    if padded is None:
        return megatron_padded_vocab(vocab, tp)
    if padded < vocab or padded % tp:
        raise PresetError(f"megatron: vocab_size ({vocab}) does not fit the padded vocabulary ({padded}): it must "
                          f"be at least vocab_size and a multiple of tp ({tp})")
    return padded


@dataclass
class _Ctx(LayerContext):
    starts: list[int]
    etp: int
    grouped_gemm: bool
    vper: int  # padded vocab rows per TP rank
    local_spec: bool  # Megatron-core's local module spec: separate norm modules

    def prefix(self, layer: int, stage: int) -> str:
        return f"decoder.layers.{layer - self.starts[stage]}."  # numbered within the stage


# ---------------------------------------------------------------- arrays outside the layers


def _embedding(c: _Ctx, fqn: str) -> None:
    c.b.vocab_parallel(fqn, "embedding.word_embeddings.weight", [0], c.vper)


def _output_layer(c: _Ctx, fqn: str) -> None:
    c.b.vocab_parallel(fqn, "output_layer.weight", [c.b.size("pp") - 1], c.vper)


def _final_norm(c: _Ctx, fqn: str) -> None:
    c.b.whole(fqn, "decoder.final_layernorm.weight", pp=c.b.size("pp") - 1)


TOP = {"model.embed_tokens.weight": _embedding, "lm_head.weight": _output_layer, "model.norm.weight": _final_norm}


# ---------------------------------------------------------------- arrays of a layer


def _input_layernorm(c: _Ctx, s: Site, m: re.Match[str]) -> None:
    # MLA or the local spec: a separate norm module; else fused into TE's linear_qkv
    local = ("input_layernorm.weight" if c.info.mla or c.local_spec
             else "self_attention.linear_qkv.layer_norm_weight")
    c.b.whole(s.fqn, s.prefix + local, pp=s.stage)


def _pre_mlp_layernorm(c: _Ctx, s: Site, m: re.Match[str]) -> None:
    local = ("pre_mlp_layernorm.weight" if c.info.is_moe_layer(s.layer) or c.local_spec
             else "mlp.linear_fc1.layer_norm_weight")
    c.b.whole(s.fqn, s.prefix + local, pp=s.stage)


def _qkv(c: _Ctx, s: Site, m: re.Match[str]) -> None:
    """``linear_qkv``: for each local query group ``[q rows of its heads; k rows; v rows]``."""
    info, T = c.info, c.tp
    hd, hpg = info.head_dim, info.heads // info.kv_heads
    G = info.kv_heads // T  # local query groups
    blk = (hpg + 2) * hd
    which = m.group(1)
    tensor = s.prefix + "self_attention.linear_qkv." + s.kind
    for t in range(T):
        hs = c.b.ranks(pp=s.stage, tp=t)
        for j in range(G):
            g = t * G + j
            base = j * blk
            if which == "q":
                c.b.rows(s.fqn, g * hpg * hd, hpg * hd, tensor, base, hs)
            elif which == "k":
                c.b.rows(s.fqn, g * hd, hd, tensor, base + hpg * hd, hs)
            else:
                c.b.rows(s.fqn, g * hd, hd, tensor, base + (hpg + 1) * hd, hs)


def _linear_proj(c: _Ctx, s: Site, m: re.Match[str]) -> None:
    c.b.row_parallel(s.fqn, c.tp, s.stage, s.prefix + "self_attention.linear_proj.weight",
                     f"megatron: o_proj input dim {s.shape[1]} must be divisible by tp ({c.tp})")


def _mlp(c: _Ctx, s: Site, m: re.Match[str]) -> None:
    """A dense MLP, or the MoE layer's shared experts: ``linear_fc1`` = ``[gate; up]``, ``linear_fc2``."""
    mod, proj = s.prefix + m.group(1), m.group(2)
    if proj != "down":
        c.b.gate_up(s.fqn, c.tp, s.stage, mod + "linear_fc1." + s.kind, "megatron")
    elif s.kind == "weight":
        c.b.down(s.fqn, c.tp, s.stage, mod + "linear_fc2.weight", "megatron")
    else:
        c.b.whole(s.fqn, mod + "linear_fc2.bias", pp=s.stage)


def _expert(c: _Ctx, s: Site, m: re.Match[str]) -> None:
    """Routed experts, numbered within the EP rank; TP-split like the dense MLP (``etp = tp``) or
    whole over the flattened ``ep × tp`` ranks (``etp = 1``)."""
    b, T, etp = c.b, c.tp, c.etp
    e, proj = int(m.group(1)), m.group(2)
    E = c.info.num_experts(s.layer)
    group = b.size("ep") * (T if etp == 1 else 1)  # expert-parallel ranks
    if b.size("cp") > 1 and group > 1:
        raise PresetError("megatron: expert parallelism with cp > 1 is not supported (Megatron folds the "
                          "expert-parallel group over context-parallel ranks)")
    nloc = divide(E, group, f"megatron: num_experts ({E}) must be divisible by the expert-parallel size ({group})")
    r, le = divmod(e, nloc)
    fc = "linear_fc2" if proj == "down_proj" else "linear_fc1"
    tensor = (s.prefix + f"mlp.experts.{fc}.weight{le}" if c.grouped_gemm
              else s.prefix + f"mlp.experts.local_experts.{le}.{fc}.weight")
    fqn, shape = s.fqn, s.shape
    if etp == 1:
        ep_c, t0 = divmod(r, T)
        b.spread(fqn, tensor, {"pp": s.stage, "ep": ep_c, "tp": t0},
                 l0=0 if proj != "up_proj" else shape[0])
        return
    dim = 1 if proj == "down_proj" else 0
    n = divide(shape[dim], T, f"megatron: moe_intermediate_size ({shape[dim]}) must be divisible by the "
                              f"expert tensor-parallel size ({T})")
    b.spread(fqn, tensor, {"pp": s.stage, "ep": r}, split=("tp", dim), l0=n if proj == "up_proj" else 0)


RULES: list[Rule[_Ctx]] = [
    Rule(r"input_layernorm\.weight", _input_layernorm),
    engine.mla_rule(MLA, lambda c, s: s.prefix + "self_attention."),
    Rule(r"post_attention_layernorm\.weight", _pre_mlp_layernorm),
    Rule(r"self_attn\.([qk])_norm\.weight", engine.replicated("self_attention.{0}_layernorm.weight")),
    Rule(r"self_attn\.([qkv])_proj\.(?:weight|bias)", _qkv),
    Rule(r"self_attn\.o_proj\.weight", _linear_proj),
    Rule(r"self_attn\.o_proj\.bias", engine.replicated("self_attention.linear_proj.bias")),
    Rule(r"(mlp\.(?:shared_experts\.)?)(gate|up|down)_proj\.(?:weight|bias)", _mlp),
    Rule(r"mlp\.gate\.weight", engine.replicated("mlp.router.weight")),
    Rule(r"mlp\.gate\.e_score_correction_bias", engine.replicated("mlp.router.expert_bias")),  # float32 in Megatron too
    Rule(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", _expert),
]


def place(b: Builder, info: ModelInfo, opts: Options) -> None:
    T, P = b.size("tp"), b.size("pp")
    engine.attention_checks("megatron", info, T)
    if not info.mla and info.kv_heads % T:
        raise PresetError(f"megatron: num_query_groups (num_key_value_heads = {info.kv_heads}) must be divisible "
                          f"by tp ({T}); Megatron-core splits whole query groups over tensor-parallel ranks "
                          f"(use tp <= {info.kv_heads} dividing it, or the vllm preset, which replicates kv heads)")
    if info.tie and P > 1:
        raise PresetError("megatron: tie_word_embeddings with pp > 1 is not supported: Megatron keeps a copy of "
                          "the embedding as output_layer.weight on the last stage, a second local tensor for "
                          "the same array, which a manifest cannot describe; use pp = 1")
    if opts.megatron_spec not in ("te", "local"):
        raise PresetError(f"megatron: module spec must be 'te' or 'local', got {opts.megatron_spec!r}")
    etp = T if opts.expert_tensor_parallel is None else opts.expert_tensor_parallel
    if etp not in (1, T):
        raise PresetError(f"megatron: expert_tensor_parallel must be 1 or tp ({T}), got {etp}")
    parts = pp_partition(info.layers, P, "megatron", first=opts.first_stage_layers, last=opts.last_stage_layers)
    ctx = _Ctx("megatron", b, info, [k for k, n in enumerate(parts) for _ in range(n)],
               starts=[sum(parts[:k]) for k in range(P)], etp=etp, grouped_gemm=opts.moe_grouped_gemm,
               vper=_padded_vocab(info.vocab, T, opts.megatron_padded_vocab) // T,
               local_spec=opts.megatron_spec == "local")
    engine.walk(ctx, TOP, RULES)


FRAMEWORK = Framework("megatron", AXES, ordered=True, place=place, fused_scales=True, stage_layers=True)
