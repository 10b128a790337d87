"""``vllm`` / ``sglang``: vLLM's (and SGLang's) parallel layers (see the package docstring for the
names and layouts). Mesh axes, slowest first: a subsequence of ``dp, ep, pp, tp``. SGLang is vLLM
with three differences: its pipeline split, its MLA fused tensor name, and experts split evenly.

Tied embeddings: vLLM's ``lm_head`` *is* ``model.embed_tokens`` (the same parameter), so there is
no ``lm_head.weight``: the one array is ``model.embed_tokens.weight``, held by the first stage and,
with pp > 1, by the last stage as well (where vLLM's lm_head needs it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from . import engine
from .builder import Builder
from .engine import Framework, LayerContext, ModelInfo, Options, Rule, Site
from .geometry import PresetError, ceil_to, divide, pp_partition

__all__ = ["SGLANG", "VLLM", "VLLM_VOCAB_PADDING", "vllm_expert_range", "vllm_padded_vocab"]

#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE`` (SGLang uses the same)
VLLM_VOCAB_PADDING = 64

AXES = ("dp", "ep", "pp", "tp")

#: MLA attention (vLLM's ``DeepseekV2MLAAttention``); see :data:`.engine.MlaTable`
MLA_VLLM: dict[str, tuple[str, str, str | None]] = {
    "q_proj.weight": ("q_proj.weight", "S0", None),
    "q_a_proj.weight": ("fused_qkv_a_proj.weight", "R", None),  # [q_a; kv_a], replicated
    "q_a_layernorm.weight": ("q_a_layernorm.weight", "R", None),
    "q_b_proj.weight": ("q_b_proj.weight", "S0", None),
    # without q_lora_rank there is no fused_qkv_a_proj: kv_a_proj_with_mqa stays (ReplicatedLinear)
    "kv_a_proj_with_mqa.weight": ("fused_qkv_a_proj.weight", "R", "q_a_proj.weight"),
    "kv_a_layernorm.weight": ("kv_a_layernorm.weight", "R", None),
    "kv_b_proj.weight": ("kv_b_proj.weight", "S0", None),
    "o_proj.weight": ("o_proj.weight", "S1", None),
}
MLA_SGLANG = {k: (v[0].replace("fused_qkv_a_proj.", "fused_qkv_a_proj_with_mqa."), *v[1:])
              for k, v in MLA_VLLM.items()}


def vllm_padded_vocab(vocab: int, padding: int = VLLM_VOCAB_PADDING) -> int:
    """vLLM's ``pad_vocab_size``: a multiple of 64.

    >>> vllm_padded_vocab(1000)
    1024
    """
    return ceil_to(vocab, padding)


def vllm_expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the experts of one EP rank in vLLM's "linear" placement
    (``determine_expert_map``): the first ``E % ep`` ranks get one expert more.

    >>> [vllm_expert_range(10, 4, r) for r in range(4)]
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    base, rem = divmod(num_experts, ep_size)
    n = base + 1 if ep_rank < rem else base
    start = ep_rank * base + min(ep_rank, rem)
    return start, start + n


@dataclass
class _Ctx(LayerContext):
    replicas: int  # TP ranks per kv head (1 unless tp > num_kv_heads)
    q_loc: int  # q rows per TP rank
    kv_loc: int  # k (and v) rows per TP rank
    vper: int  # padded vocab rows per TP rank
    ep_on: bool  # experts whole over the EP ranks
    ep_size: int
    h_blocks: int  # FP8 scale rows per stacked w2 expert (ceil(H / block))
    #: MoE layers seen -> their expert count (for the empty expert tensors of expert-less ranks)
    moe_layers: dict[int, int] = field(default_factory=dict)
    #: expert count -> (EP rank, its first expert) per expert
    owner: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def expert_owner(self, E: int, e: int) -> tuple[int, int]:
        if E not in self.owner:
            self.owner[E] = [(r, e0) for r in range(self.ep_size)
                             for e0 in [vllm_expert_range(E, self.ep_size, r)[0]]
                             for _ in range(*vllm_expert_range(E, self.ep_size, r))]
        return self.owner[E][e]


# ---------------------------------------------------------------- arrays outside the layers


def _embed_tokens(c: _Ctx, fqn: str) -> None:
    last = c.b.size("pp") - 1
    c.b.vocab_parallel(fqn, fqn, sorted({0, last}) if c.info.tie else [0], c.vper)


def _lm_head(c: _Ctx, fqn: str) -> None:
    c.b.vocab_parallel(fqn, fqn, [c.b.size("pp") - 1], c.vper)


def _norm(c: _Ctx, fqn: str) -> None:
    c.b.whole(fqn, fqn, pp=c.b.size("pp") - 1)


TOP = {"model.embed_tokens.weight": _embed_tokens, "lm_head.weight": _lm_head, "model.norm.weight": _norm}


# ---------------------------------------------------------------- arrays of a layer


def _qkv(c: _Ctx, s: Site, m: re.Match[str]) -> None:
    """``qkv_proj`` = ``[q_shard; k_shard; v_shard]``; kv heads replicated when tp > num_kv_heads."""
    which = m.group(1)
    tensor = s.prefix + "self_attn.qkv_proj." + s.kind
    if which == "q":
        c.b.spread(s.fqn, tensor, {"pp": s.stage}, split=("tp", 0))
    else:  # TP rank t holds kv shard t // replicas (vLLM's shard_id)
        c.b.spread(s.fqn, tensor, {"pp": s.stage}, split=("tp", 0), replicas=c.replicas,
                   l0=c.q_loc + (0 if which == "k" else c.kv_loc))


def _o_proj(c: _Ctx, s: Site, m: re.Match[str]) -> None:
    c.b.row_parallel(s.fqn, c.tp, s.stage, s.fqn, f"{c.preset}: o_proj input dim {s.shape[1]} must be divisible "
                                                  f"by tp ({c.tp})")


def _gate_up(c: _Ctx, s: Site, m: re.Match[str]) -> None:
    """A dense MLP's (or the shared experts') gate / up into ``gate_up_proj`` = ``[gate; up]``."""
    c.b.gate_up(s.fqn, c.tp, s.stage, s.prefix + m.group(1) + "gate_up_proj." + s.kind, c.preset)


def _down(c: _Ctx, s: Site, m: re.Match[str]) -> None:
    c.b.down(s.fqn, c.tp, s.stage, s.fqn, c.preset)


def _expert(c: _Ctx, s: Site, m: re.Match[str]) -> None:
    """Routed experts into the stacked ``w13_weight`` ``[E_local·2·I, H]`` / ``w2_weight``
    ``[E_local·H, I]``: whole experts over the EP ranks, or every expert TP-split."""
    b, T = c.b, c.tp
    e, proj = int(m.group(1)), m.group(2)
    E = c.info.num_experts(s.layer)
    c.moe_layers[s.layer] = E
    w13, w2 = s.prefix + "mlp.experts.w13_weight", s.prefix + "mlp.experts.w2_weight"
    fqn, H = s.fqn, c.info.hidden
    inter = s.shape[1] if proj == "down_proj" else s.shape[0]
    if c.ep_on:
        if c.preset == "sglang" and E % c.ep_size:
            raise PresetError(f"sglang: num_experts ({E}) must be divisible by the expert-parallel size "
                              f"({c.ep_size}) (SGLang's FusedMoE splits experts evenly)")
        r, start = c.expert_owner(E, e)
        le = e - start
        ep_c, t = divmod(r, T)
        fixed = {"pp": s.stage, "ep": ep_c, "tp": t}
        if proj == "down_proj":
            b.spread(fqn, w2, fixed, l0=le * H, scale_row=le * c.h_blocks)
        else:
            b.spread(fqn, w13, fixed, l0=le * 2 * inter + (0 if proj == "gate_proj" else inter))
        return
    n = divide(inter, T, f"{c.preset}: moe_intermediate_size ({inter}) must be divisible by tp ({T}) "
                         f"(or enable expert parallelism)")
    if proj == "down_proj":
        b.spread(fqn, w2, {"pp": s.stage}, split=("tp", 1), l0=e * H, scale_row=e * c.h_blocks)
    else:
        b.spread(fqn, w13, {"pp": s.stage}, split=("tp", 0), l0=e * 2 * n + (0 if proj == "gate_proj" else n))


def _rules(mla: dict[str, tuple[str, str, str | None]]) -> list[Rule[_Ctx]]:
    return [
        # replicated, same name (o_proj / down_proj biases are full on every rank)
        Rule(r"input_layernorm\.weight|post_attention_layernorm\.weight|self_attn\.[qk]_norm\.weight"
             r"|self_attn\.o_proj\.bias|mlp\.down_proj\.bias|mlp\.gate\.weight|mlp\.gate\.e_score_correction_bias",
             engine.replicated()),
        engine.mla_rule(mla, lambda c, s: s.prefix + "self_attn."),
        Rule(r"self_attn\.([qkv])_proj\.(?:weight|bias)", _qkv),
        Rule(r"self_attn\.o_proj\.weight", _o_proj),
        Rule(r"(mlp\.(?:shared_experts\.)?)(?:gate|up)_proj\.(?:weight|bias)", _gate_up),
        Rule(r"mlp\.(?:shared_experts\.)?down_proj\.weight", _down),
        Rule(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", _expert),
    ]


RULES = {"vllm": _rules(MLA_VLLM), "sglang": _rules(MLA_SGLANG)}


def _declare_expert_tensors(c: _Ctx) -> None:
    """Ranks with no expert (an EP group larger than the experts) still hold empty w13 / w2."""
    if not c.ep_on:
        return
    b, T, H = c.b, c.tp, c.info.hidden
    for i, E in c.moe_layers.items():
        p = f"model.layers.{i}."
        down = p + "mlp.experts.0.down_proj.weight"
        inter = c.info.arrays[down][0][1]
        dt = c.info.arrays[down][1]
        for r in range(c.ep_size):
            lo, hi = vllm_expert_range(E, c.ep_size, r)
            ep_c, t = divmod(r, T)
            hs = b.ranks(pp=c.stage_of[i], ep=ep_c, tp=t)
            b.declare(hs, p + "mlp.experts.w13_weight", ((hi - lo) * 2 * inter, H), dt)
            b.declare(hs, p + "mlp.experts.w2_weight", ((hi - lo) * H, inter), dt)
            if b.block is not None and down in b.scale_of:  # [E_local, 2·ceil(I/b0), ceil(H/b1)], [E_local, ...]
                b0, b1 = b.block
                b.declare(hs, p + "mlp.experts.w13_weight_scale_inv",
                          ((hi - lo) * 2 * -(-inter // b0), -(-H // b1)), "float32")
                b.declare(hs, p + "mlp.experts.w2_weight_scale_inv", ((hi - lo) * c.h_blocks, -(-inter // b1)),
                          "float32")


def _context(b: Builder, info: ModelInfo, preset: str, expert_parallel: bool | None) -> _Ctx:
    """The derived sizes, with the checks vLLM (SGLang) makes, in its order."""
    T, P = b.size("tp"), b.size("pp")
    engine.attention_checks(preset, info, T)
    nkv, hd, V = info.kv_heads, info.head_dim, info.vocab
    if info.mla:
        replicas, kv_loc = 1, 0  # no q/k/v heads (MLA)
    elif T >= nkv:
        replicas = divide(T, nkv, f"{preset}: tp ({T}) must be a multiple of num_key_value_heads ({nkv}) when "
                                  f"tp >= num_key_value_heads (kv heads are replicated tp/num_kv_heads times)")
        kv_loc = hd
    else:
        replicas = 1
        kv_loc = divide(nkv, T, f"{preset}: num_key_value_heads ({nkv}) must be divisible by tp ({T})") * hd
    vpad = vllm_padded_vocab(V)
    vper = divide(vpad, T, f"{preset}: the padded vocab ({V} -> {vpad}, a multiple of {VLLM_VOCAB_PADDING}) must be "
                           f"divisible by tp ({T}), as VocabParallelEmbedding requires")
    ep_on = ("ep" in b.sizes) if expert_parallel is None else expert_parallel
    if not ep_on and "ep" in b.sizes:
        raise PresetError(f"{preset}: an 'ep' mesh axis means expert parallelism; drop it or use "
                          f"expert_parallel=None/True")
    parts = pp_partition(info.layers, P, "sglang" if preset == "sglang" else "vllm")
    # w2 stacks whole [H, I] experts: its scale stacks [ceil(H/b), ...] blocks per expert
    h_blocks = -(-info.hidden // b.block[0]) if b.block is not None else 0
    return _Ctx(preset, b, info, [s for s, n in enumerate(parts) for _ in range(n)], replicas=replicas,
                q_loc=info.heads // T * hd, kv_loc=kv_loc, vper=vper, ep_on=ep_on, ep_size=b.size("ep") * T,
                h_blocks=h_blocks)


def _placer(preset: str) -> Framework:
    def place(b: Builder, info: ModelInfo, opts: Options) -> None:
        ctx = _context(b, info, preset, opts.expert_parallel)
        engine.walk(ctx, TOP, RULES[preset])
        _declare_expert_tensors(ctx)

    return Framework(preset, AXES, ordered=True, place=place, fused_scales=True)


VLLM = _placer("vllm")
SGLANG = _placer("sglang")
