"""formats.layouts.presets: the manifests Megatron-core, vLLM / SGLang, FSDP2 and HF really hold.

Oracle: the local tensors each framework builds from full HF weights, written here from the
frameworks' documented layouts with torch (independently of presets.py):

* Megatron (Megatron-Bridge's QKV / gated-MLP mappings): ``linear_qkv`` = per query group
  ``cat([q heads of the group, k head, v head])`` then ``torch.chunk(tp)``; ``linear_fc1`` =
  ``cat([gate.chunk(tp)[t], up.chunk(tp)[t]])``; row-parallel ``chunk(tp, dim=1)``; the vocab
  zero-padded to a multiple of 128·tp, then ``chunk(tp)``; stage-local layer numbers.
* vLLM (``QKVParallelLinear.weight_loader``, ``MergedColumnParallelLinear``,
  ``VocabParallelEmbedding``, ``FusedMoE``): ``qkv_proj`` = ``cat([q.narrow(t), k.narrow(shard_id),
  v.narrow(shard_id)])`` with ``shard_id = t // (tp / num_kv_heads)``; vocab padded to 64;
  ``w13`` = ``stack([cat([gate_e, up_e])])``; EP by ``determine_expert_map`` ("linear").
* FSDP2: ``torch.chunk(torch.chunk(w, tp, dim)[t], fsdp, 0)[f]`` (TP first, then FSDP2).
* DeepSeek-V3 (MLA): Megatron-core's MLA TE spec (``MLASelfAttention``: ``linear_q_down_proj`` /
  ``linear_kv_down_proj`` duplicated, ``linear_q_up_proj`` / ``linear_kv_up_proj`` column-parallel
  with the q_a / kv_a norms fused as ``layer_norm_weight``, a separate ``input_layernorm``;
  ``SharedExpertMLP``; the router's ``expert_bias``), vLLM's ``DeepseekV2MLAAttention``
  (``fused_qkv_a_proj = cat([q_a_proj, kv_a_proj_with_mqa])`` replicated, SGLang's
  ``fused_qkv_a_proj_with_mqa``; ``q_b_proj`` / ``kv_b_proj`` ``chunk(tp)``).
* Block FP8: every framework loads a ``weight_scale_inv`` with its weight's own loader in block
  units (vLLM's ``BlockQuantScaleParameter``): the same narrow / cat / stack applied to the scale
  grid. :func:`with_fp8_scales` therefore runs a writer a second time with each FP8 weight replaced
  by its scale.

Every manifest must name exactly the framework's local tensors (names and shapes), each chunk
must point at exactly the bytes of its HF region, and every byte a framework holds must be
described, except the vocabulary padding rows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from formats.errors import ShardstreamError
from formats.layouts import LayoutError, Mesh, parse_mesh
from formats.layouts.models import arrays_from_config
from formats.layouts.presets import (
    PRESETS,
    TIED_EMBEDDING,
    megatron_padded_vocab,
    pp_partition,
    preset_dtype,
    preset_manifest,
    vllm_expert_range,
    vllm_padded_vocab,
)
from formats.manifest.wire import Manifest, TensorSpec, load_manifest, save_manifest
from formats.validate.manifest import validate_manifest
from streamer.cli.app import main

# ------------------------------------------------------------------ tiny configs

QWEN3: dict[str, Any] = {
    "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
#: odd head counts: 6 heads in 3 groups (2 per group), tp = 3 divides both
LLAMA_ODD: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 3,
    "num_attention_heads": 6, "num_key_value_heads": 3, "vocab_size": 1000, "torch_dtype": "bfloat16",
}
#: qkv biases, 3 heads per group
QWEN2_BIAS: dict[str, Any] = {
    "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
    "torch_dtype": "bfloat16",
}
#: llama with every bias (attention_bias: q/k/v/o, mlp_bias: gate/up/down)
LLAMA_BIAS: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 520, "attention_bias": True,
    "mlp_bias": True, "torch_dtype": "bfloat16",
}
QWEN3_TIED: dict[str, Any] = dict(QWEN3, tie_word_embeddings=True)
#: DeepSeek-V3 in miniature: MLA (q_lora_rank set), layer 0 dense, layers 1-3 MoE with 4 routed
#: experts + 1 shared expert and the router's e_score_correction_bias
DSV3: dict[str, Any] = {
    "model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 500,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
#: DeepSeek-V2-Lite style: no q_lora_rank (q_proj column-parallel, kv_a_proj_with_mqa unfused)
DSV3_NOQ: dict[str, Any] = {k: v for k, v in DSV3.items() if k != "q_lora_rank"}
#: FP8 with 16x16 scale blocks, so that tp=2 shards are whole blocks (kv_a_proj: 24 rows, 2 blocks)
DSV3_FP8: dict[str, Any] = dict(DSV3, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                           "weight_block_size": [16, 16]})
#: 24-row blocks: hidden (64) is not a multiple, so vLLM's stacked w2 scales are 3 blocks per expert
DSV3_FP8_ODD: dict[str, Any] = dict(DSV3, q_lora_rank=48, moe_intermediate_size=48,
                                    quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                         "weight_block_size": [24, 16]})
#: layer 0 dense, layers 1-2 MoE with 6 experts
MOE: dict[str, Any] = {
    "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 1000, "num_experts": 6, "num_experts_per_tok": 2, "mlp_only_layers": [0],
    "decoder_sparse_step": 1, "torch_dtype": "bfloat16",
}


# ------------------------------------------------------------------ HF weights


def hf_weights(cfg: Mapping[str, Any], seed: int = 0, fp8: bool = False) -> dict[str, torch.Tensor]:
    """Full HF weights of ``cfg``: seeded normal values (never exactly 0); ``fp8``: block-FP8
    linear weights (``float8_e4m3fn``) and positive float32 ``weight_scale_inv`` siblings."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, (shape, dt) in arrays_from_config(cfg, fp8=fp8).items():
        x = torch.randn(shape, generator=g)
        if dt == "float8_e4m3fn":
            x = torch.where(x.to(torch.float8_e4m3fn).float() == 0, torch.full_like(x, 0.5), x)
        elif n.endswith("_scale_inv"):
            x = x.abs() + 1e-3
        else:
            x = x * 0.05
            x = torch.where(x == 0, torch.full_like(x, 1e-3), x)
        out[n] = x.to(_TORCH[dt])
    return out


_TORCH = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float8_e4m3fn": torch.float8_e4m3fn}
_BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float8_e4m3fn: torch.uint8}
_NAMES = {v: k for k, v in _TORCH.items()}


def _geom(cfg: Mapping[str, Any]) -> tuple[int, int, int, int, int, int]:
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim") or h // nh
    return h, cfg["vocab_size"], cfg["num_hidden_layers"], nh, nkv, hd


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros((rows, *w.shape[1:]), dtype=w.dtype)
    out[: w.shape[0]] = w
    return out


def _coords(mesh: Mesh, r: int) -> dict[str, int]:
    return dict(zip(mesh.axes, mesh.coords(r)))


def _size(mesh: Mesh, a: str) -> int:
    return mesh.size_of(a) if a in mesh.axes else 1


def _finish(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: x.contiguous().clone() for n, x in t.items()}


def _mla(cfg: Mapping[str, Any]) -> bool:
    return cfg["model_type"] in ("deepseek_v3", "deepseek_v2")


def _experts_of(cfg: Mapping[str, Any], i: int) -> int | None:
    if _mla(cfg):
        moe = i >= cfg.get("first_k_dense_replace", 0) and i % cfg.get("moe_layer_freq", 1) == 0
        return int(cfg["n_routed_experts"]) if moe else None
    if cfg["model_type"] != "qwen3_moe" or i in (cfg.get("mlp_only_layers") or []):
        return None
    return int(cfg["num_experts"])


def _scale_name(local: str) -> str:
    """The local scale tensor of a local FP8 weight: the last ``weight`` -> ``weight_scale_inv``."""
    i = local.rindex("weight")
    return local[:i] + "weight_scale_inv" + local[i + len("weight"):]


def with_fp8_scales(writer: Any, cfg: Mapping[str, Any], W: Mapping[str, torch.Tensor], mesh: Mesh,
                    **kw: Any) -> dict[int, dict[str, torch.Tensor]]:
    """``writer``'s local tensors plus, for block-FP8 weights, their scales: the writer run again
    on the HF weights with each FP8 weight replaced by its ``weight_scale_inv``; a local tensor that
    is float8 in the first run is a scale tensor in the second."""
    out = writer(cfg, W, mesh, **kw)
    if not any(n.endswith("_scale_inv") for n in W):
        return out
    Ws = {n: W.get(n + "_scale_inv", x) for n, x in W.items() if not n.endswith("_scale_inv")}
    sc = writer(cfg, Ws, mesh, **kw)
    for r, ts in out.items():
        for n in [n for n, x in ts.items() if x.dtype == torch.float8_e4m3fn]:
            assert sc[r][n].dtype == torch.float32, (r, n)
            ts[_scale_name(n)] = sc[r][n]
    return out


# ------------------------------------------------------------------ framework writers


def megatron_tensors(cfg: Mapping[str, Any], W: Mapping[str, torch.Tensor], mesh: Mesh, *,
                     etp: int | None = None, grouped: bool = False, first: int | None = None,
                     last: int | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """Every rank's Megatron-core (TE spec) state dict, built from the HF weights."""
    _, V, L, nh, nkv, hd = _geom(cfg)
    T, P, EP = _size(mesh, "tp"), _size(mesh, "pp"), _size(mesh, "ep")
    etp = T if etp is None else etp
    hpg = nh // nkv
    # Megatron-core: decoder_first/last_pipeline_num_layers, the rest even over the middle stages
    ends = (first or 0) + (last or 0)
    inner = P - (first is not None) - (last is not None)
    per = [(L - ends) // inner] * P
    if first is not None:
        per[0] = first
    if last is not None:
        per[-1] = last
    vpad = -(-V // (128 * T)) * 128 * T
    out: dict[int, dict[str, torch.Tensor]] = {}
    for r in range(mesh.size):
        c = _coords(mesh, r)
        s, t, e_c = c.get("pp", 0), c.get("tp", 0), c.get("ep", 0)
        d: dict[str, torch.Tensor] = {}
        if s == 0:
            d["embedding.word_embeddings.weight"] = _pad_rows(W["model.embed_tokens.weight"], vpad).chunk(T)[t]
        if s == P - 1:
            d["decoder.final_layernorm.weight"] = W["model.norm.weight"]
            if "lm_head.weight" in W:
                d["output_layer.weight"] = _pad_rows(W["lm_head.weight"], vpad).chunk(T)[t]
        for li in range(per[s]):
            i = sum(per[:s]) + li
            hp, mp = f"model.layers.{i}.", f"decoder.layers.{li}."
            if _mla(cfg):  # MLASelfAttention (TE spec, qk_layernorm=True); input_layernorm is a TENorm
                a, ma = hp + "self_attn.", mp + "self_attention."
                d[mp + "input_layernorm.weight"] = W[hp + "input_layernorm.weight"]
                if a + "q_a_proj.weight" in W:
                    d[ma + "linear_q_down_proj.weight"] = W[a + "q_a_proj.weight"]
                    d[ma + "linear_q_up_proj.layer_norm_weight"] = W[a + "q_a_layernorm.weight"]
                    d[ma + "linear_q_up_proj.weight"] = W[a + "q_b_proj.weight"].chunk(T)[t]
                else:
                    d[ma + "linear_q_proj.weight"] = W[a + "q_proj.weight"].chunk(T)[t]
                d[ma + "linear_kv_down_proj.weight"] = W[a + "kv_a_proj_with_mqa.weight"]
                d[ma + "linear_kv_up_proj.layer_norm_weight"] = W[a + "kv_a_layernorm.weight"]
                d[ma + "linear_kv_up_proj.weight"] = W[a + "kv_b_proj.weight"].chunk(T)[t]
            for kind in ("weight", "bias"):
                if hp + f"self_attn.k_proj.{kind}" not in W:
                    continue
                q = W[hp + f"self_attn.q_proj.{kind}"]
                k = W[hp + f"self_attn.k_proj.{kind}"]
                v = W[hp + f"self_attn.v_proj.{kind}"]
                rest = q.shape[1:]
                qkv = torch.cat([q.reshape(nkv, hpg * hd, *rest), k.reshape(nkv, hd, *rest),
                                 v.reshape(nkv, hd, *rest)], dim=1).reshape(-1, *rest)
                d[mp + f"self_attention.linear_qkv.{kind}"] = qkv.chunk(T)[t]
            if not _mla(cfg):
                d[mp + "self_attention.linear_qkv.layer_norm_weight"] = W[hp + "input_layernorm.weight"]
            if hp + "self_attn.q_norm.weight" in W:
                d[mp + "self_attention.q_layernorm.weight"] = W[hp + "self_attn.q_norm.weight"]
                d[mp + "self_attention.k_layernorm.weight"] = W[hp + "self_attn.k_norm.weight"]
            d[mp + "self_attention.linear_proj.weight"] = W[hp + "self_attn.o_proj.weight"].chunk(T, dim=1)[t]
            if hp + "self_attn.o_proj.bias" in W:
                d[mp + "self_attention.linear_proj.bias"] = W[hp + "self_attn.o_proj.bias"]
            E = _experts_of(cfg, i)
            if E is None:
                d[mp + "mlp.linear_fc1.layer_norm_weight"] = W[hp + "post_attention_layernorm.weight"]
                for kind in ("weight", "bias"):
                    if hp + f"mlp.gate_proj.{kind}" in W:
                        d[mp + f"mlp.linear_fc1.{kind}"] = torch.cat(
                            [W[hp + f"mlp.gate_proj.{kind}"].chunk(T)[t], W[hp + f"mlp.up_proj.{kind}"].chunk(T)[t]])
                d[mp + "mlp.linear_fc2.weight"] = W[hp + "mlp.down_proj.weight"].chunk(T, dim=1)[t]
                if hp + "mlp.down_proj.bias" in W:
                    d[mp + "mlp.linear_fc2.bias"] = W[hp + "mlp.down_proj.bias"]
                continue
            d[mp + "pre_mlp_layernorm.weight"] = W[hp + "post_attention_layernorm.weight"]
            d[mp + "mlp.router.weight"] = W[hp + "mlp.gate.weight"]
            if hp + "mlp.gate.e_score_correction_bias" in W:
                d[mp + "mlp.router.expert_bias"] = W[hp + "mlp.gate.e_score_correction_bias"]
            sh = hp + "mlp.shared_experts."
            if sh + "gate_proj.weight" in W:  # SharedExpertMLP: TP-split like the dense MLP
                d[mp + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                    [W[sh + "gate_proj.weight"].chunk(T)[t], W[sh + "up_proj.weight"].chunk(T)[t]])
                d[mp + "mlp.shared_experts.linear_fc2.weight"] = W[sh + "down_proj.weight"].chunk(T, dim=1)[t]
            group = EP * (T if etp == 1 else 1)
            nloc = E // group
            erank = e_c * T + t if etp == 1 else e_c
            for le in range(nloc):
                ge = erank * nloc + le
                ep_ = f"{hp}mlp.experts.{ge}."
                gate, up, down = (W[ep_ + "gate_proj.weight"], W[ep_ + "up_proj.weight"], W[ep_ + "down_proj.weight"])
                if etp == 1 and T > 1:
                    fc1, fc2 = torch.cat([gate, up]), down
                else:
                    fc1 = torch.cat([gate.chunk(T)[t], up.chunk(T)[t]])
                    fc2 = down.chunk(T, dim=1)[t]
                if grouped:
                    d[mp + f"mlp.experts.linear_fc1.weight{le}"] = fc1
                    d[mp + f"mlp.experts.linear_fc2.weight{le}"] = fc2
                else:
                    d[mp + f"mlp.experts.local_experts.{le}.linear_fc1.weight"] = fc1
                    d[mp + f"mlp.experts.local_experts.{le}.linear_fc2.weight"] = fc2
        out[r] = _finish(d)
    return out


def vllm_pp_layers(L: int, P: int, sglang: bool = False) -> list[range]:
    """vLLM ``get_pp_indices`` (SGLang: the extra layers go to the last stages)."""
    parts = [L // P] * P
    rem = L % P
    if sglang:
        for i in range(P - rem, P):
            parts[i] += 1
    else:
        for i in range(2, rem + 2):
            parts[-i] += 1
    out, start = [], 0
    for n in parts:
        out.append(range(start, start + n))
        start += n
    return out


def vllm_tensors(cfg: Mapping[str, Any], W: Mapping[str, torch.Tensor], mesh: Mesh, *,
                 ep: bool | None = None, sglang: bool = False, flat_experts: bool = True
                 ) -> dict[int, dict[str, torch.Tensor]]:
    """Every rank's vLLM ``named_parameters()`` after ``load_weights`` of the HF weights.
    ``flat_experts``: w13 / w2 as their row-major 2-D views (how the manifest describes them)."""
    _, V, L, nh, nkv, hd = _geom(cfg)
    T, P, EPX = _size(mesh, "tp"), _size(mesh, "pp"), _size(mesh, "ep")
    ep = ("ep" in mesh.axes) if ep is None else ep
    tie = bool(cfg.get("tie_word_embeddings", False))
    vpad = -(-V // 64) * 64
    vper = vpad // T
    q_loc = nh // T * hd
    if T >= nkv:
        replicas, kv_loc = T // nkv, hd
    else:
        replicas, kv_loc = 1, nkv // T * hd
    stages = vllm_pp_layers(L, P, sglang)
    out: dict[int, dict[str, torch.Tensor]] = {}
    for r in range(mesh.size):
        c = _coords(mesh, r)
        s, t, e_c = c.get("pp", 0), c.get("tp", 0), c.get("ep", 0)
        d: dict[str, torch.Tensor] = {}
        if s == 0 or (tie and s == P - 1):
            d["model.embed_tokens.weight"] = _pad_rows(W["model.embed_tokens.weight"], vpad).narrow(0, t * vper, vper)
        if s == P - 1:
            d["model.norm.weight"] = W["model.norm.weight"]
            if not tie:
                d["lm_head.weight"] = _pad_rows(W["lm_head.weight"], vpad).narrow(0, t * vper, vper)
        for i in stages[s]:
            p = f"model.layers.{i}."
            for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                      "self_attn.k_norm.weight", "self_attn.o_proj.bias", "mlp.down_proj.bias", "mlp.gate.weight",
                      "mlp.gate.e_score_correction_bias", "self_attn.q_a_layernorm.weight",
                      "self_attn.kv_a_layernorm.weight"):
                if p + n in W:
                    d[p + n] = W[p + n]
            if _mla(cfg):  # DeepseekV2MLAAttention
                a = p + "self_attn."
                if a + "q_a_proj.weight" in W:  # DeepSeekV2FusedQkvAProjLinear (disable_tp)
                    fused = "fused_qkv_a_proj_with_mqa" if sglang else "fused_qkv_a_proj"
                    d[a + fused + ".weight"] = torch.cat([W[a + "q_a_proj.weight"], W[a + "kv_a_proj_with_mqa.weight"]])
                    d[a + "q_b_proj.weight"] = W[a + "q_b_proj.weight"].chunk(T)[t]
                else:
                    d[a + "kv_a_proj_with_mqa.weight"] = W[a + "kv_a_proj_with_mqa.weight"]
                    d[a + "q_proj.weight"] = W[a + "q_proj.weight"].chunk(T)[t]
                d[a + "kv_b_proj.weight"] = W[a + "kv_b_proj.weight"].chunk(T)[t]
                d[a + "o_proj.weight"] = W[a + "o_proj.weight"].chunk(T, dim=1)[t]
            shard_id = t // replicas
            for kind in ("weight", "bias"):
                if p + f"self_attn.k_proj.{kind}" in W:
                    d[p + f"self_attn.qkv_proj.{kind}"] = torch.cat([
                        W[p + f"self_attn.q_proj.{kind}"].narrow(0, t * q_loc, q_loc),
                        W[p + f"self_attn.k_proj.{kind}"].narrow(0, shard_id * kv_loc, kv_loc),
                        W[p + f"self_attn.v_proj.{kind}"].narrow(0, shard_id * kv_loc, kv_loc)])
            if not _mla(cfg):
                d[p + "self_attn.o_proj.weight"] = W[p + "self_attn.o_proj.weight"].narrow(1, t * q_loc, q_loc)
            sh = p + "mlp.shared_experts."
            if sh + "gate_proj.weight" in W:  # DeepseekV2MLP: MergedColumnParallelLinear + RowParallelLinear
                d[sh + "gate_up_proj.weight"] = torch.cat([W[sh + "gate_proj.weight"].chunk(T)[t],
                                                           W[sh + "up_proj.weight"].chunk(T)[t]])
                d[sh + "down_proj.weight"] = W[sh + "down_proj.weight"].chunk(T, dim=1)[t]
            E = _experts_of(cfg, i)
            if E is None:
                for kind in ("weight", "bias"):
                    if p + f"mlp.gate_proj.{kind}" in W:
                        d[p + f"mlp.gate_up_proj.{kind}"] = torch.cat([
                            W[p + f"mlp.gate_proj.{kind}"].chunk(T)[t], W[p + f"mlp.up_proj.{kind}"].chunk(T)[t]])
                d[p + "mlp.down_proj.weight"] = W[p + "mlp.down_proj.weight"].chunk(T, dim=1)[t]
                continue
            if ep:  # whole experts over the EP ranks
                ep_size, ep_rank = EPX * T, e_c * T + t
                base, rem = divmod(E, ep_size)
                n_loc = base + 1 if ep_rank < rem else base
                start = ep_rank * base + min(ep_rank, rem)
                experts, tp_k, tp_i = range(start, start + n_loc), 1, 0
            else:  # every expert, TP-split
                experts, tp_k, tp_i = range(E), T, t
            w13 = [torch.cat([W[f"{p}mlp.experts.{e}.gate_proj.weight"].chunk(tp_k)[tp_i],
                              W[f"{p}mlp.experts.{e}.up_proj.weight"].chunk(tp_k)[tp_i]]) for e in experts]
            w2 = [W[f"{p}mlp.experts.{e}.down_proj.weight"].chunk(tp_k, dim=1)[tp_i] for e in experts]
            g0, d0 = W[f"{p}mlp.experts.0.gate_proj.weight"], W[f"{p}mlp.experts.0.down_proj.weight"]
            # empty ranks: shapes and dtype from the arrays (so FP8 scales get theirs too)
            w13_t = (torch.stack(w13) if w13
                     else torch.zeros((0, 2 * g0.shape[0] // tp_k, g0.shape[1]), dtype=g0.dtype))
            w2_t = torch.stack(w2) if w2 else torch.zeros((0, d0.shape[0], d0.shape[1] // tp_k), dtype=d0.dtype)
            if flat_experts:
                w13_t, w2_t = w13_t.reshape(-1, w13_t.shape[-1]), w2_t.reshape(-1, w2_t.shape[-1])
            d[p + "mlp.experts.w13_weight"] = w13_t
            d[p + "mlp.experts.w2_weight"] = w2_t
        out[r] = _finish(d)
    return out


_COLWISE = ("embed_tokens.weight", "lm_head.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight",
            "q_proj.bias", "k_proj.bias", "v_proj.bias", "gate_proj.weight", "up_proj.weight",
            "gate_proj.bias", "up_proj.bias")
_ROWWISE = ("o_proj.weight", "down_proj.weight")


def fsdp2_tensors(cfg: Mapping[str, Any], W: Mapping[str, torch.Tensor], mesh: Mesh
                  ) -> dict[int, dict[str, torch.Tensor]]:
    """Every rank's FSDP2 (× torchtitan-style TP) DTensor local tensors: TP colwise ``Shard(0)`` /
    rowwise ``Shard(1)``, then FSDP2 ``torch.chunk`` of the TP-local tensor on dim 0. Empty
    local shards are left out."""
    T, F = _size(mesh, "tp"), _size(mesh, "fsdp")
    out: dict[int, dict[str, torch.Tensor]] = {}
    for r in range(mesh.size):
        c = _coords(mesh, r)
        t, f = c.get("tp", 0), c.get("fsdp", 0)
        d = {}
        for n, w in W.items():
            x = w
            if T > 1 and n.endswith(_COLWISE):
                parts = x.chunk(T, dim=0)
                x = parts[t] if t < len(parts) else x[:0]
            elif T > 1 and n.endswith(_ROWWISE):
                parts = x.chunk(T, dim=1)
                x = parts[t] if t < len(parts) else x[:, :0]
            parts = x.chunk(F, dim=0) if x.shape[0] else ()
            x = parts[f] if f < len(parts) else x[:0]
            if x.numel():
                d[n] = x
        out[r] = _finish(d)
    return out


def preset_tensors(preset: str, cfg: Mapping[str, Any], W: Mapping[str, torch.Tensor], mesh: Mesh,
                   **kw: Any) -> dict[int, dict[str, torch.Tensor]]:
    """The local tensors of ``preset`` built from ``W`` (``kw``: :func:`preset_manifest`'s; FP8
    weights in ``W`` bring their scales)."""
    if preset == "megatron":
        return with_fp8_scales(megatron_tensors, cfg, W, mesh, etp=kw.get("expert_tensor_parallel"),
                               grouped=kw.get("moe_grouped_gemm", False), first=kw.get("first_stage_layers"),
                               last=kw.get("last_stage_layers"))
    if preset in ("vllm", "sglang"):
        return with_fp8_scales(vllm_tensors, cfg, W, mesh, ep=kw.get("expert_parallel"), sglang=preset == "sglang")
    if preset == "fsdp2":
        return fsdp2_tensors(cfg, W, mesh)
    assert preset == "hf" and mesh.size == 1
    return {0: _finish(dict(W))}


# ------------------------------------------------------------------ the check


def _sl(offsets: Any, sizes: Any) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(_BITS[x.dtype])


def check_manifest(m: Manifest, tensors: Mapping[int, Mapping[str, torch.Tensor]],
                   W: Mapping[str, torch.Tensor]) -> int:
    """``m`` describes exactly ``tensors`` (the framework's local tensors built from ``W``).
    Returns the number of padding elements (held, described by no chunk; all zero)."""
    assert validate_manifest(m, check_paths=False) == []
    assert set(m.arrays) == set(W)
    for r in range(m.world_size):
        want = {n: tuple(x.shape) for n, x in tensors.get(r, {}).items()}
        got = {n: ts.shape for n, ts in m.local_tensors(r).items() if any(ts.shape) or n in want}
        assert got == want, f"rank {r}: local tensors differ"
        for n, x in tensors.get(r, {}).items():
            assert m.local_tensors(r)[n].data_type == _NAMES[x.dtype], (r, n)
    covered = {(r, n): torch.zeros(x.shape, dtype=torch.bool) for r, ts in tensors.items() for n, x in ts.items()}
    for fqn, spec, c in m.iter_chunks():
        assert spec.shape == tuple(W[fqn].shape)
        want = _bits(W[fqn][_sl(c.region.offsets, c.region.sizes)])
        for h in c.holders:
            t = c.tensor(fqn)
            box = _sl(c.local_offsets, c.region.sizes)
            got = _bits(tensors[h][t][box])
            assert torch.equal(got, want), f"{fqn} {c.region} on rank {h} ({t} at {c.local_offsets})"
            assert not covered[h, t][box].any(), f"{t} on rank {h}: two chunks write one range"
            covered[h, t][box] = True
    pad = 0
    for (r, n), cov in covered.items():
        rest = _bits(tensors[r][n])[~cov]
        assert (rest == 0).all(), f"rank {r} {n}: held bytes no chunk describes"
        pad += int(rest.numel())
    return pad


# ------------------------------------------------------------------ every preset vs its framework

CASES = [
    # (id, cfg, preset, mesh, kwargs)
    ("megatron-qwen3-pp2dp2tp2", QWEN3, "megatron", "pp=2,dp=2,tp=2", {}),
    ("megatron-qwen3-tp1", QWEN3, "megatron", "tp=1", {}),
    ("megatron-llama-odd-tp3", LLAMA_ODD, "megatron", "tp=3", {}),
    ("megatron-llama-odd-pp3-cp2", LLAMA_ODD, "megatron", "pp=3,cp=2", {}),
    ("megatron-qwen2-bias-pp2tp2", QWEN2_BIAS, "megatron", "pp=2,tp=2", {}),
    ("megatron-llama-bias-tp2", LLAMA_BIAS, "megatron", "dp=2,tp=2", {}),
    ("megatron-tied-tp2", QWEN3_TIED, "megatron", "tp=2", {}),
    ("megatron-moe-ep2tp2", MOE, "megatron", "ep=2,tp=2", {}),
    ("megatron-moe-pp3-ep3", MOE, "megatron", "pp=3,ep=3", {}),
    ("megatron-moe-etp1", MOE, "megatron", "dp=2,ep=3,tp=2", {"expert_tensor_parallel": 1}),
    ("megatron-moe-grouped", MOE, "megatron", "ep=2,tp=2", {"moe_grouped_gemm": True}),
    ("megatron-dsv3-tp2", DSV3, "megatron", "tp=2", {}),
    ("megatron-llama-odd-pp2-uneven-first", LLAMA_ODD, "megatron", "pp=2", {"first_stage_layers": 1}),
    ("megatron-qwen3-pp3-first1-last1", dict(QWEN3, num_hidden_layers=5), "megatron", "pp=3",
     {"first_stage_layers": 1, "last_stage_layers": 1}),
    ("megatron-dsv3-pp2-last1-ep2", DSV3, "megatron", "pp=2,ep=2", {"last_stage_layers": 1}),
    ("megatron-dsv3-pp2ep2tp2", DSV3, "megatron", "pp=2,ep=2,tp=2", {}),
    ("megatron-dsv3-etp1-grouped", DSV3, "megatron", "dp=2,ep=2,tp=2",
     {"expert_tensor_parallel": 1, "moe_grouped_gemm": True}),
    ("megatron-dsv3-no-q-lora-tp4", DSV3_NOQ, "megatron", "tp=4", {}),
    ("megatron-dsv3-fp8-pp2tp2", DSV3_FP8, "megatron", "pp=2,tp=2", {"fp8": True}),
    ("megatron-dsv3-fp8-pp2ep2tp2", DSV3_FP8, "megatron", "pp=2,ep=2,tp=2", {"fp8": True}),
    ("megatron-dsv3-fp8-ep2tp2-etp1-grouped", DSV3_FP8, "megatron", "ep=2,tp=2",
     {"fp8": True, "expert_tensor_parallel": 1, "moe_grouped_gemm": True}),
    ("vllm-qwen3-tp4-kv-replicated", QWEN3, "vllm", "tp=4", {}),
    ("vllm-qwen3-tp1", QWEN3, "vllm", "tp=1", {}),
    ("vllm-qwen3-dp2tp2", QWEN3, "vllm", "dp=2,tp=2", {}),
    ("vllm-qwen3-pp3tp2-uneven", QWEN3, "vllm", "pp=3,tp=2", {}),
    ("vllm-llama-odd-tp3", dict(LLAMA_ODD, vocab_size=960), "vllm", "tp=3", {}),
    ("vllm-qwen2-bias-tp2", QWEN2_BIAS, "vllm", "tp=2", {}),
    ("vllm-llama-bias-tp4", LLAMA_BIAS, "vllm", "tp=4", {}),
    ("vllm-tied-pp2tp2", QWEN3_TIED, "vllm", "pp=2,tp=2", {}),
    ("vllm-moe-tp2", MOE, "vllm", "tp=2", {}),
    ("vllm-moe-dp-ep2tp2", MOE, "vllm", "ep=2,tp=2", {}),
    ("vllm-moe-tp4-ep", MOE, "vllm", "tp=4", {"expert_parallel": True}),
    ("vllm-moe-ep8-more-ranks-than-experts", MOE, "vllm", "ep=4,tp=2", {}),
    ("vllm-dsv3-tp2", DSV3, "vllm", "tp=2", {}),
    ("vllm-dsv3-tp2-ep", DSV3, "vllm", "tp=2", {"expert_parallel": True}),
    ("vllm-dsv3-dp-ep2tp2", DSV3, "vllm", "ep=2,tp=2", {}),
    ("vllm-dsv3-no-q-lora-pp3tp2", DSV3_NOQ, "vllm", "pp=3,tp=2", {}),
    ("vllm-dsv3-fp8-tp2", DSV3_FP8, "vllm", "tp=2", {"fp8": True}),
    ("vllm-dsv3-fp8-pp2tp2-ep", DSV3_FP8, "vllm", "pp=2,tp=2", {"fp8": True, "expert_parallel": True}),
    ("vllm-dsv3-fp8-ep6-more-ranks-than-experts", DSV3_FP8, "vllm", "ep=3,tp=2", {"fp8": True}),
    ("vllm-dsv3-fp8-ep2-hidden-not-a-block-multiple", DSV3_FP8_ODD, "vllm", "ep=2", {"fp8": True}),
    ("sglang-qwen3-pp3tp2", QWEN3, "sglang", "pp=3,tp=2", {}),
    ("sglang-moe-tp2-ep", MOE, "sglang", "tp=2", {"expert_parallel": True}),
    ("sglang-dsv3-tp2", DSV3, "sglang", "tp=2", {}),
    ("sglang-dsv3-fp8-ep2", DSV3_FP8_ODD, "sglang", "ep=2", {"fp8": True}),
    ("fsdp2-qwen3-fsdp3", QWEN3, "fsdp2", "fsdp=3", {}),
    ("fsdp2-qwen3-dp2fsdp2tp2", QWEN3, "fsdp2", "dp=2,fsdp=2,tp=2", {}),
    ("fsdp2-llama-odd-fsdp4tp3", LLAMA_ODD, "fsdp2", "fsdp=4,tp=3", {}),
    ("fsdp2-moe-tp2fsdp3", MOE, "fsdp2", "tp=2,fsdp=3", {}),
    ("hf-qwen3", QWEN3, "hf", "tp=1", {}),
    ("hf-moe", MOE, "hf", "tp=1", {}),
    ("hf-dsv3-fp8", DSV3_FP8, "hf", "tp=1", {"fp8": True}),
    ("fsdp2-dsv3-fp8-fsdp3", DSV3_FP8, "fsdp2", "fsdp=3", {"fp8": True}),
]


@pytest.mark.parametrize("cfg,preset,mesh,kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_preset_matches_framework_tensors(cfg: dict[str, Any], preset: str, mesh: str, kw: dict[str, Any]) -> None:
    W = hf_weights(cfg, fp8=kw.get("fp8", False))
    ms = parse_mesh(mesh)
    m = preset_manifest(cfg, preset, ms, **kw)
    pad = check_manifest(m, preset_tensors(preset, cfg, W, ms, **kw), W)
    # padding: (padded vocab - vocab) rows of embedding and lm_head on every holder
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    T = _size(ms, "tp")
    vpad = (megatron_padded_vocab(V, T) if preset == "megatron"
            else vllm_padded_vocab(V) if preset in ("vllm", "sglang") else V)
    copies = 0
    for r in range(ms.size):
        lt = m.local_tensors(r)
        copies += sum(n in lt for n in ("embedding.word_embeddings.weight", "output_layer.weight",
                                        "model.embed_tokens.weight", "lm_head.weight"))
    assert pad == copies * (vpad - V) // T * H
    # on disk: the same manifest with files, through JSON
    disk = preset_manifest(cfg, preset, ms, file_pattern="rank-{rank:05d}.safetensors", **kw)
    assert validate_manifest(disk, check_paths=False) == []
    assert all(c.source is not None and c.source.file == "rank-{rank:05d}.safetensors"
               for _, _, c in disk.iter_chunks())
    assert {r: disk.local_tensors(r) for r in range(ms.size)} == {r: m.local_tensors(r) for r in range(ms.size)}


def test_manifest_json_round_trip(tmp_path: Path) -> None:
    ms = parse_mesh("pp=2,tp=2")
    m = preset_manifest(QWEN3, "megatron", ms, file_pattern="rank-{rank:05d}.safetensors", domain_size=2)
    save_manifest(m, tmp_path / "m.json")
    back = load_manifest(tmp_path / "m.json")
    assert back.to_dict() == m.to_dict()
    assert back.tensors[1]["embedding.word_embeddings.weight"].shape == (512, 64)
    assert back.domain_size == 2


# ------------------------------------------------------------------ specific facts


def test_megatron_qkv_interleave_splits_one_array_into_group_chunks() -> None:
    # 6 heads, 2 kv heads: groups of 3 q heads; tp=1 holds both groups
    m = preset_manifest(QWEN2_BIAS, "megatron", Mesh(("tp",), (1,)))
    q = m.arrays["model.layers.0.self_attn.q_proj.weight"].chunks
    k = m.arrays["model.layers.0.self_attn.k_proj.weight"].chunks
    v = m.arrays["model.layers.0.self_attn.v_proj.weight"].chunks
    blk = (3 + 2) * 16
    assert [(c.region.offsets[0], c.region.sizes[0], c.local_offsets[0]) for c in q] == [(0, 48, 0), (48, 48, blk)]
    assert [(c.region.offsets[0], c.local_offsets[0]) for c in k] == [(0, 48), (16, blk + 48)]
    assert [(c.region.offsets[0], c.local_offsets[0]) for c in v] == [(0, 64), (16, blk + 64)]
    assert {c.tensor("x") for c in q + k + v} == {"decoder.layers.0.self_attention.linear_qkv.weight"}
    bias = m.arrays["model.layers.0.self_attn.k_proj.bias"].chunks
    assert [c.tensor("x") for c in bias] == ["decoder.layers.0.self_attention.linear_qkv.bias"] * 2


def test_megatron_stage_local_layer_numbers_and_vocab_padding() -> None:
    ms = parse_mesh("pp=2,tp=3")
    m = preset_manifest(LLAMA_ODD, "megatron", Mesh(("tp",), (3,)))
    assert megatron_padded_vocab(1000, 3) == 1152
    emb = m.arrays["model.embed_tokens.weight"].chunks
    assert [(c.region.offsets[0], c.region.sizes[0], c.holders) for c in emb] == [
        (0, 384, (0,)), (384, 384, (1,)), (768, 232, (2,))]
    assert m.tensors[2]["embedding.word_embeddings.weight"].shape == (384, 96)
    m2 = preset_manifest(dict(LLAMA_ODD, num_hidden_layers=4), "megatron", ms)
    (c,) = [c for c in m2.arrays["model.layers.3.input_layernorm.weight"].chunks]
    assert c.tensor("") == "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"
    assert c.holders == (3, 4, 5)
    assert m2.arrays["model.embed_tokens.weight"].chunks[0].holders == (0,)
    assert m2.arrays["lm_head.weight"].chunks[0].holders == (3,)
    assert m2.arrays["model.norm.weight"].chunks[0].source.tensor == "decoder.final_layernorm.weight"


def test_megatron_moe_names() -> None:
    m = preset_manifest(MOE, "megatron", parse_mesh("ep=2,tp=1"))
    c = m.arrays["model.layers.1.mlp.experts.4.up_proj.weight"].chunks
    assert [(x.tensor(""), x.local_offsets, x.holders) for x in c] == [
        ("decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight", (32, 0), (1,))]
    assert m.arrays["model.layers.1.mlp.gate.weight"].chunks[0].tensor("") == "decoder.layers.1.mlp.router.weight"
    assert (m.arrays["model.layers.1.post_attention_layernorm.weight"].chunks[0].tensor("")
            == "decoder.layers.1.pre_mlp_layernorm.weight")
    assert (m.arrays["model.layers.0.post_attention_layernorm.weight"].chunks[0].tensor("")
            == "decoder.layers.0.mlp.linear_fc1.layer_norm_weight")


def test_vllm_kv_heads_replicated_when_tp_exceeds_them() -> None:
    m = preset_manifest(QWEN3, "vllm", parse_mesh("dp=2,tp=4"))
    k = m.arrays["model.layers.0.self_attn.k_proj.weight"].chunks
    # kv head 0 on tp ranks 0,1; kv head 1 on tp ranks 2,3; each at row q_loc = 16 of qkv_proj
    assert [(c.region.offsets[0], c.region.sizes[0], c.holders, c.local_offsets) for c in k] == [
        (0, 16, (0, 1, 4, 5), (16, 0)), (16, 16, (2, 3, 6, 7), (16, 0))]
    assert m.local_tensors(3)["model.layers.0.self_attn.qkv_proj.weight"].shape == (48, 64)


def test_vllm_tied_embeddings_and_vocab_padding() -> None:
    m = preset_manifest(QWEN3_TIED, "vllm", parse_mesh("pp=2,tp=2"))
    assert "lm_head.weight" not in m.arrays
    emb = m.arrays["model.embed_tokens.weight"].chunks
    assert [(c.region.sizes[0], c.holders) for c in emb] == [(512, (0, 2)), (488, (1, 3))]
    assert m.tensors[3]["model.embed_tokens.weight"].shape == (512, 64)
    mg = preset_manifest(QWEN3_TIED, "megatron", parse_mesh("tp=2"))
    assert "output_layer.weight" not in {n for r in range(2) for n in mg.local_tensors(r)}


def test_pp_partitions_and_expert_ranges() -> None:
    assert pp_partition(4, 3, "vllm") == [1, 2, 1]
    assert pp_partition(7, 4, "vllm") == [2, 2, 2, 1]
    assert pp_partition(4, 3, "sglang") == [1, 1, 2]
    assert pp_partition(8, 4, "megatron") == [2, 2, 2, 2]
    assert pp_partition(61, 16, "megatron", first=3, last=2) == [3] + [4] * 14 + [2]
    assert pp_partition(5, 2, "megatron", first=1) == [1, 4]
    for n, bad in ((4, {"first": 2, "last": 2}), (6, {"first": 0}), (6, {"first": 5, "last": 1})):
        with pytest.raises(LayoutError):
            pp_partition(n, 3, "megatron", **bad)
    with pytest.raises(LayoutError):
        pp_partition(6, 3, "vllm", first=1)
    assert [vllm_expert_range(6, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert [vllm_expert_range(6, 8, r) for r in range(8)][-2:] == [(6, 6), (6, 6)]


def test_vllm_experts_flattened_views() -> None:
    m = preset_manifest(MOE, "vllm", parse_mesh("tp=2"))
    lt = m.local_tensors(1)
    assert lt["model.layers.1.mlp.experts.w13_weight"].shape == (6 * 2 * 16, 64)
    assert lt["model.layers.1.mlp.experts.w2_weight"].shape == (6 * 64, 16)
    (c,) = [c for c in m.arrays["model.layers.1.mlp.experts.2.up_proj.weight"].chunks if c.holders == (1,)]
    assert c.region.offsets == (16, 0) and c.local_offsets == (2 * 32 + 16, 0)


def test_fsdp2_nests_fsdp_inside_tp() -> None:
    m = preset_manifest(QWEN3, "fsdp2", parse_mesh("fsdp=2,tp=2"))
    q = m.arrays["model.layers.0.self_attn.q_proj.weight"].chunks  # [64, 64], tp S(0) then fsdp S(0)
    assert [(c.region.offsets[0], c.holders) for c in q] == [(0, (0,)), (16, (2,)), (32, (1,)), (48, (3,))]
    emb = m.arrays["model.embed_tokens.weight"].chunks  # 1000 -> tp 500 | 500 -> fsdp 250 each
    assert [(c.region.offsets[0], c.region.sizes[0]) for c in emb] == [(0, 250), (250, 250), (500, 250), (750, 250)]
    assert all(c.source is None for _, _, c in m.iter_chunks())


# ------------------------------------------------------------------ errors


ERROR_CASES: list[tuple[dict[str, Any], str, str, dict[str, Any], str | None]] = [
    (QWEN3, "megatron", "tp=4", {}, r"num_query_groups \(num_key_value_heads = 2\) must be divisible by tp \(4\)"),
    (dict(LLAMA_ODD, num_attention_heads=3, num_key_value_heads=1), "megatron", "tp=2", {},
     r"num_attention_heads \(3\) must be divisible by tp \(2\)"),
    (QWEN3_TIED, "megatron", "pp=2", {}, r"tie_word_embeddings with pp > 1"),
    (LLAMA_ODD, "megatron", "pp=2", {}, r"num_hidden_layers \(3\) must be divisible by pp \(2\)"),
    (MOE, "megatron", "ep=4", {}, r"num_experts \(6\) must be divisible by the expert-parallel size \(4\)"),
    (MOE, "megatron", "ep=2,tp=2", {"expert_tensor_parallel": 3}, r"expert_tensor_parallel must be 1 or tp"),
    (MOE, "megatron", "ep=2,cp=2", {}, r"cp > 1"),
    (QWEN3, "megatron", "tp=2,pp=2", {}, r"not in the framework's rank order.*write the mesh as pp=2,tp=2"),
    (QWEN3, "megatron", "fsdp=2", {}, r"mesh axis 'fsdp' is not one of"),
    (LLAMA_ODD, "vllm", "tp=3", {}, r"padded vocab \(1000 -> 1024, a multiple of 64\) must be divisible by tp \(3\)"),
    (dict(LLAMA_ODD, num_attention_heads=3, num_key_value_heads=1), "vllm", "tp=2", {},
     r"num_attention_heads \(3\) must be divisible by tp \(2\)"),
    (LLAMA_ODD, "vllm", "tp=2", {}, r"num_key_value_heads \(3\) must be divisible by tp \(2\)"),
    (dict(QWEN3, num_key_value_heads=4, num_attention_heads=8), "vllm", "tp=8",
     {}, None),  # 8 heads, 4 kv, tp 8: fine (replicas 2)
    (dict(QWEN2_BIAS, num_attention_heads=12, num_key_value_heads=3), "vllm", "tp=2", {},
     r"num_key_value_heads \(3\) must be divisible by tp \(2\)"),
    (dict(QWEN2_BIAS, num_attention_heads=12, num_key_value_heads=3), "vllm", "tp=4", {},
     r"tp \(4\) must be a multiple of num_key_value_heads \(3\)"),
    (QWEN3, "vllm", "tp=2,dp=2", {}, r"rank order"),
    (MOE, "vllm", "ep=2,tp=2", {"expert_parallel": False}, r"'ep' mesh axis means expert parallelism"),
    (QWEN3, "hf", "tp=2", {}, r"preset hf: one rank"),
    (MOE, "sglang", "tp=4", {"expert_parallel": True}, (r"sglang: num_experts \(6\) must be divisible by the "
                                                        r"expert-parallel size \(4\)")),
    (QWEN3, "fsdp2", "ep=2", {}, r"mesh axis 'ep' is not one of"),
    (DSV3, "megatron", "tp=3", {}, r"num_attention_heads \(4\) must be divisible by tp \(3\)"),
    (DSV3, "vllm", "tp=8", {}, r"num_attention_heads \(4\) must be divisible by tp \(8\)"),
    (dict(DSV3, n_routed_experts=6), "megatron", "ep=4", {},
     r"num_experts \(6\) must be divisible by the expert-parallel size \(4\)"),
    # FP8: a TP shard that is not whole 16-row blocks (96 rows / 4 = 24), in megatron and vllm alike
    (DSV3_FP8, "vllm", "tp=4", {"fp8": True},
     (r"vllm: model\.layers\.0\.self_attn\.q_b_proj\.weight: its shard \[0, 24\) of dim 0 \(size 96\) does not "
      r"start and end on FP8 block boundaries \(multiples of 16\), so "
      r"model\.layers\.0\.self_attn\.q_b_proj\.weight_scale_inv cannot be split")),
    (DSV3_FP8, "megatron", "tp=4", {"fp8": True},
     r"megatron: model\.layers\.0\.self_attn\.q_b_proj\.weight: its shard \[0, 24\)"),
    # the default 128x128 blocks: q_b_proj's 48-row shards are not whole blocks
    (DSV3, "megatron", "tp=2", {"fp8": True},
     r"q_b_proj\.weight: its shard \[0, 48\) of dim 0 \(size 96\).*multiples of 128"),
    # a fused part that does not start on a block: kv_a_proj after the 32 rows of q_a_proj
    (DSV3, "vllm", "tp=1", {"fp8": True},
     (r"kv_a_proj_with_mqa\.weight: it sits at offset 32 of dim 0 of the fused local tensor "
      r"model\.layers\.0\.self_attn\.fused_qkv_a_proj\.weight, not on an FP8 block boundary")),
    # the dense MLP: 80 rows over tp 2 = 40, not whole 16-row blocks
    (dict(DSV3_FP8, intermediate_size=80), "vllm", "tp=2", {"fp8": True},
     r"model\.layers\.0\.mlp\.gate_proj\.weight: its shard \[0, 40\)"),
    (DSV3_FP8, "vllm", "tp=2", {"fp8": True, "expert_parallel": False}, None),
    (QWEN3, "tpu", "tp=1", {}, r"unknown preset 'tpu'"),
]


@pytest.mark.parametrize("cfg,preset,mesh,kw,match", ERROR_CASES)
def test_preset_errors(cfg: dict[str, Any], preset: str, mesh: str, kw: dict[str, Any], match: str | None) -> None:
    if match is None:
        m = preset_manifest(cfg, preset, parse_mesh(mesh), **kw)
        assert validate_manifest(m, check_paths=False) == []
        return
    with pytest.raises(LayoutError, match=match):
        preset_manifest(cfg, preset, parse_mesh(mesh), **kw)


def test_dsv3_megatron_names_and_splits() -> None:
    m = preset_manifest(DSV3, "megatron", parse_mesh("pp=2,tp=2"))

    def where(fqn: str) -> list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        return [(c.tensor(fqn), c.region.offsets, c.local_offsets, c.holders) for c in m.arrays[fqn].chunks]

    a = "model.layers.3.self_attn."  # stage 1, local layer 1: ranks 2, 3
    assert where(a + "q_a_proj.weight") == [("decoder.layers.1.self_attention.linear_q_down_proj.weight",
                                             (0, 0), (0, 0), (2, 3))]
    assert where(a + "kv_b_proj.weight") == [  # 4 heads x (16 + 16) rows, 2 heads per rank
        ("decoder.layers.1.self_attention.linear_kv_up_proj.weight", (0, 0), (0, 0), (2,)),
        ("decoder.layers.1.self_attention.linear_kv_up_proj.weight", (64, 0), (0, 0), (3,))]
    assert where(a + "o_proj.weight")[1] == ("decoder.layers.1.self_attention.linear_proj.weight", (0, 32), (0, 0),
                                             (3,))
    assert where(a + "q_a_layernorm.weight")[0][0] == "decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight"
    assert where(a + "kv_a_layernorm.weight")[0][0] == (
        "decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight")
    # with MLA the input layernorm is its own TENorm; dense layer 0 fuses the MLP norm, MoE layers do not
    assert where("model.layers.0.input_layernorm.weight")[0][0] == "decoder.layers.0.input_layernorm.weight"
    assert where("model.layers.0.post_attention_layernorm.weight")[0][0] == "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert where("model.layers.1.post_attention_layernorm.weight")[0][0] == "decoder.layers.1.pre_mlp_layernorm.weight"
    assert where("model.layers.1.mlp.gate.e_score_correction_bias") == [
        ("decoder.layers.1.mlp.router.expert_bias", (0,), (0,), (0, 1))]
    assert m.arrays["model.layers.1.mlp.gate.e_score_correction_bias"].data_type == "float32"
    assert where("model.layers.1.mlp.shared_experts.up_proj.weight") == [
        ("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", (0, 0), (16, 0), (0,)),
        ("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", (16, 0), (16, 0), (1,))]
    lt = m.local_tensors(0)
    assert "decoder.layers.0.self_attention.linear_qkv.weight" not in lt
    assert lt["decoder.layers.0.self_attention.linear_kv_down_proj.weight"].shape == (16 + 8, 64)
    assert lt["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"].shape == (64, 16)


def test_dsv3_vllm_fused_qkv_a_proj_and_fp8_scales() -> None:
    m = preset_manifest(DSV3_FP8, "vllm", parse_mesh("tp=2"), fp8=True, expert_parallel=True)
    a = "model.layers.1.self_attn."
    kv = m.arrays[a + "kv_a_proj_with_mqa.weight"].chunks
    assert [(c.tensor(""), c.local_offsets, c.holders) for c in kv] == [(a + "fused_qkv_a_proj.weight", (32, 0), (0, 1))]
    assert m.arrays[a + "kv_a_proj_with_mqa.weight"].data_type == "float8_e4m3fn"
    # scales: kv_a 24 rows = 2 blocks of 16 at block row 32 / 16 = 2 of the fused scale tensor
    sc = m.arrays[a + "kv_a_proj_with_mqa.weight_scale_inv"]
    assert sc.shape == (2, 4) and sc.data_type == "float32"
    assert [(c.tensor(""), c.local_offsets) for c in sc.chunks] == [(a + "fused_qkv_a_proj.weight_scale_inv", (2, 0))]
    lt = m.local_tensors(1)
    assert lt[a + "fused_qkv_a_proj.weight_scale_inv"].shape == (4, 4)  # ceil(56 / 16): 2 + 2 blocks
    assert lt[a + "q_b_proj.weight_scale_inv"].shape == (3, 2)  # 48 rows, 32 cols
    # experts: 4 experts over 2 EP ranks; w13 [2, 2*32, 64] -> scales [2, 2*2, 4]
    assert lt["model.layers.1.mlp.experts.w13_weight"].shape == (2 * 64, 64)
    assert lt["model.layers.1.mlp.experts.w13_weight_scale_inv"].shape == (2 * 4, 4)
    up = m.arrays["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"].chunks
    assert [(c.local_offsets, c.holders) for c in up] == [((4 + 2, 0), (1,))]
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in m.arrays  # the router stays in bf16
    sg = preset_manifest(DSV3, "sglang", parse_mesh("tp=2"))
    assert sg.arrays[a + "q_a_proj.weight"].chunks[0].tensor("") == a + "fused_qkv_a_proj_with_mqa.weight"
    noq = preset_manifest(DSV3_NOQ, "vllm", parse_mesh("tp=2"))
    assert noq.arrays[a + "kv_a_proj_with_mqa.weight"].chunks[0].source is None  # ReplicatedLinear, HF name


def test_dsv3_generic_presets_still_work() -> None:
    W = hf_weights(DSV3)
    assert W["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    for preset, mesh in (("fsdp2", "fsdp=3"), ("fsdp2", "dp=2,fsdp=2"), ("hf", "tp=1")):
        ms = parse_mesh(mesh)
        m = preset_manifest(DSV3, preset, ms)
        assert check_manifest(m, preset_tensors(preset, DSV3, W, ms), W) == 0


@pytest.mark.slow
def test_real_deepseek_v3_config() -> None:
    """The published config (61 layers, 256 experts, FP8 128x128 blocks): vLLM TP8 with EP and
    Megatron TP8 x EP8 lay out, with the local shapes the frameworks allocate."""
    cfg = Path(__file__).resolve().parents[2] / "workloads" / "models" / "deepseek-v3.config.json"
    v = preset_manifest(cfg, "vllm", parse_mesh("tp=8"), fp8=True, expert_parallel=True)
    lt = v.local_tensors(5)
    a = "model.layers.3.self_attn."
    assert lt[a + "fused_qkv_a_proj.weight"] == TensorSpec((1536 + 576, 7168), "float8_e4m3fn")
    assert lt[a + "fused_qkv_a_proj.weight_scale_inv"].shape == (12 + 5, 56)
    assert lt[a + "q_b_proj.weight"].shape == (16 * 192, 1536)
    assert lt[a + "kv_b_proj.weight_scale_inv"].shape == (16 * 256 // 128, 4)
    assert lt[a + "o_proj.weight_scale_inv"].shape == (56, 16)
    assert lt["model.layers.3.mlp.experts.w13_weight"].shape == (32 * 2 * 2048, 7168)  # 256 / 8 experts
    assert lt["model.layers.3.mlp.experts.w2_weight_scale_inv"].shape == (32 * 56, 16)
    assert lt["model.layers.3.mlp.shared_experts.gate_up_proj.weight_scale_inv"].shape == (2 * 2, 56)
    assert lt["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 18432 // 8, 7168)
    assert validate_manifest(v, check_paths=False) == []
    # DeepSeek-V3's Megatron recipe: ETP 1, experts whole over ep x tp = 16 ranks (16 each)
    g = preset_manifest(cfg, "megatron", parse_mesh("ep=8,tp=2"), fp8=True, moe_grouped_gemm=True,
                        expert_tensor_parallel=1)
    lt = g.local_tensors(15)
    assert lt["decoder.layers.60.mlp.experts.linear_fc1.weight15"].shape == (2 * 2048, 7168)
    assert lt["decoder.layers.60.mlp.experts.linear_fc1.weight_scale_inv15"].shape == (2 * 16, 56)
    assert lt["decoder.layers.60.mlp.shared_experts.linear_fc2.weight_scale_inv"].shape == (56, 8)
    assert lt["decoder.layers.60.self_attention.linear_q_down_proj.weight"].shape == (1536, 7168)
    assert lt["embedding.word_embeddings.weight"].shape == (129280 // 2, 7168)  # a multiple of 128 x 2


def test_dtype_override_and_presets_list(tmp_path: Path) -> None:
    assert PRESETS == ("megatron", "vllm", "sglang", "fsdp2", "hf")
    fp32 = dict(QWEN3, torch_dtype="float32")
    for preset in PRESETS:  # no dtype: the config's (fp32 masters stay float32)
        m = preset_manifest(fp32, preset, parse_mesh("tp=1"))
        assert {a.data_type for a in m.arrays.values()} == {"float32"}, preset
        assert {t.data_type for r in m.tensors for t in m.tensors[r].values()} <= {"float32"}
    m = preset_manifest(fp32, "vllm", parse_mesh("tp=2"), dtype="bfloat16")
    assert {a.data_type for a in m.arrays.values()} == {"bfloat16"}
    assert {t.data_type for t in m.tensors[0].values()} == {"bfloat16"}  # padded vocab tensors too
    no_dtype = {k: v for k, v in QWEN3.items() if k != "torch_dtype"}
    assert preset_dtype(no_dtype) == "bfloat16"
    assert preset_dtype(dict(no_dtype, dtype="float16")) == "float16"  # newer transformers' key
    assert preset_dtype(fp32) == "float32" and preset_dtype(fp32, "float16") == "float16"
    with pytest.raises(LayoutError, match=r"dtype 'int8' is not a weight dtype a preset writes"):
        preset_manifest(QWEN3, "vllm", parse_mesh("tp=1"), dtype="int8")
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    a = preset_manifest(tmp_path, "megatron", parse_mesh("tp=2"))
    b = preset_manifest(QWEN3, "megatron", parse_mesh("tp=2"))
    assert a.to_dict() == b.to_dict()


# ------------------------------------------------------------------ CLI


def test_cli_layout_preset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfgp = tmp_path / "config.json"
    cfgp.write_text(json.dumps(MOE))
    out = tmp_path / "vllm.json"
    assert main(["layout", "--model", str(cfgp), "--preset", "vllm", "--mesh", "ep=2,tp=2", "-o", str(out)]) == 0
    got = load_manifest(out)
    want = preset_manifest(MOE, "vllm", parse_mesh("ep=2,tp=2"), file_pattern="rank-{rank:05d}.safetensors",
                           name=got.name)
    assert got.to_dict() == want.to_dict()
    out2 = tmp_path / "mg.json"
    assert main(["layout", "--model", str(cfgp), "--preset", "megatron", "--mesh", "pp=3,tp=2", "--no-files",
                 "--name", "mg", "-o", str(out2)]) == 0
    assert load_manifest(out2).to_dict() == preset_manifest(MOE, "megatron", parse_mesh("pp=3,tp=2"),
                                                              name="mg").to_dict()
    out3 = tmp_path / "hf.json"
    assert main(["layout", "--model", str(cfgp), "--preset", "hf", "-o", str(out3)]) == 0
    assert all(c.source is None for _, _, c in load_manifest(out3).iter_chunks())
    capsys.readouterr()
    # errors: exit 1 with the precise message; --preset needs --model; no --rule with it
    assert main(["layout", "--model", str(cfgp), "--preset", "megatron", "--mesh", "tp=4", "-o", str(out)]) == 1
    assert "num_query_groups" in capsys.readouterr().err
    assert main(["layout", "--like", str(out2), "--preset", "vllm", "-o", str(out)]) != 0
    assert "--preset" in capsys.readouterr().err
    assert main(["layout", "--model", str(cfgp), "--preset", "vllm", "--rule", "*=R", "-o", str(out)]) != 0
    assert "--rule" in capsys.readouterr().err


def test_cli_layout_preset_dtype(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``layout --preset`` takes the config's dtype, or ``--dtype``, and says which it used."""
    cfgp = tmp_path / "config.json"
    cfgp.write_text(json.dumps(dict(QWEN3, torch_dtype="float32")))
    out = tmp_path / "m.json"
    capsys.readouterr()
    assert main(["layout", "--model", str(cfgp), "--preset", "megatron", "--mesh", "tp=2", "-o", str(out)]) == 0
    assert ": megatron, float32, world_size 2" in capsys.readouterr().out
    assert {a.data_type for a in load_manifest(out).arrays.values()} == {"float32"}
    assert main(["layout", "--model", str(cfgp), "--preset", "vllm", "--mesh", "tp=2", "--dtype", "bfloat16",
                 "--json", "-o", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "bfloat16"
    assert {a.data_type for a in load_manifest(out).arrays.values()} == {"bfloat16"}
    assert main(["layout", "--model", str(cfgp), "--mesh", "tp=2", "--dtype", "float32", "-o", str(out)]) == 2
    assert "--dtype goes with --preset" in capsys.readouterr().err


TIED_FP32 = dict(QWEN3_TIED, torch_dtype="float32")


def test_tied_embeddings_one_name_in_every_preset() -> None:
    """With tie_word_embeddings every preset names the shared weight model.embed_tokens.weight
    (as HF checkpoints store it) and none has lm_head.weight; Megatron has no output_layer."""
    meshes = {"megatron": "tp=2", "vllm": "pp=2,tp=2", "sglang": "pp=2,tp=2", "fsdp2": "fsdp=2,tp=2", "hf": "tp=1"}
    names = set(arrays_from_config(QWEN3_TIED))
    assert TIED_EMBEDDING in names and "lm_head.weight" not in names
    for preset, mesh in meshes.items():
        m = preset_manifest(QWEN3_TIED, preset, parse_mesh(mesh))
        assert set(m.arrays) == names, preset
        local = {n for r in range(m.world_size) for n in m.local_tensors(r)}
        assert not local & {"lm_head.weight", "output_layer.weight"}, preset
    # vLLM: the last stage holds the shared weight too (its lm_head)
    v = preset_manifest(QWEN3_TIED, "vllm", parse_mesh("pp=2,tp=2"))
    assert {h for c in v.arrays[TIED_EMBEDDING].chunks for h in c.holders} == {0, 1, 2, 3}


@pytest.mark.parametrize("cfg,preset,mesh", [
    (dict(QWEN3, torch_dtype="float32"), "megatron", "pp=2,tp=2"),
    (TIED_FP32, "vllm", "pp=2,tp=2"),
    (QWEN3_TIED, "megatron", "tp=2"),
    (TIED_FP32, "fsdp2", "fsdp=3"),
], ids=["fp32-megatron", "fp32-tied-vllm", "tied-megatron", "fp32-tied-fsdp2"])
def test_cli_convert_hf_to_preset_and_back_with_no_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         cfg: dict[str, Any], preset: str, mesh: str) -> None:
    """An HF checkpoint in the config's dtype (fp32 masters; tied: embed_tokens only, as HF stores
    it) converts to a preset's layout and back, byte for byte, with no dtype or tie flags."""
    from formats.safetensors.io import SafetensorsReader
    from streamer.tools.synth import write_checkpoint

    cfgp = tmp_path / "config.json"
    cfgp.write_text(json.dumps(cfg))
    hf = tmp_path / "hf"
    write_checkpoint(hf, arrays_from_config(cfg), seed=3)
    run = [["import", str(hf), "-o", str(hf / "manifest.json")],
           ["layout", "--model", str(cfgp), "--preset", preset, "--mesh", mesh, "-o", str(tmp_path / "p.json")],
           ["layout", "--model", str(cfgp), "--preset", "hf", "-o", str(tmp_path / "hf1.json")],
           ["convert", str(hf / "manifest.json"), str(tmp_path / "p.json"), "--out", str(tmp_path / "p")],
           ["convert", str(tmp_path / "p"), str(tmp_path / "hf1.json"), "--out", str(tmp_path / "back")]]
    for argv in run:
        assert main(argv) == 0, (argv, capsys.readouterr().err)

    def tensors(p: Path) -> dict[str, tuple[str, bytes]]:
        with SafetensorsReader(p) as r:
            return {n: (r.tensor(n).dtype.name, r.read(n).tobytes()) for n in r.names()}

    a, b = tensors(hf / "model.safetensors"), tensors(tmp_path / "back" / "model.safetensors")
    assert a == b
    want = cfg.get("torch_dtype", "bfloat16")
    assert {d for d, _ in a.values()} == {want}


def test_preset_errors_are_shardstream_errors() -> None:
    with pytest.raises(ShardstreamError):
        preset_manifest(QWEN3, "megatron", parse_mesh("tp=4"))


def test_cli_layout_preset_fp8_then_plan_moves_pairs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``layout --preset … --fp8`` writes the preset's block-FP8 manifest; ``plan`` between two of
    them reports every weight + scale pair moved as one."""
    cfgp = tmp_path / "config.json"
    cfgp.write_text(json.dumps(DSV3_FP8))
    mg, vl = tmp_path / "mg.json", tmp_path / "vllm.json"
    assert main(["layout", "--model", str(cfgp), "--preset", "megatron", "--mesh", "pp=2,tp=2", "--fp8",
                 "--no-files", "-o", str(mg)]) == 0
    assert load_manifest(mg).to_dict() == preset_manifest(DSV3_FP8, "megatron", parse_mesh("pp=2,tp=2"), fp8=True,
                                                          name=load_manifest(mg).name).to_dict()
    assert main(["layout", "--model", str(cfgp), "--preset", "vllm", "--mesh", "tp=2", "--fp8", "--no-files",
                 "-o", str(vl)]) == 0
    capsys.readouterr()
    assert main(["plan", str(mg), str(vl), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    scales = [n for n in load_manifest(vl).arrays if n.endswith("weight_scale_inv")]
    assert scales and st["fp8_pairs"] == len(scales) and st["unpaired_scales"] == []
