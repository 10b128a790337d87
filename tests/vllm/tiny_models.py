"""Tiny Qwen3 and Qwen3-MoE checkpoints made from a config (seeded random weights, nothing
downloaded), written with ``save_pretrained`` in bf16: what a fresh vLLM engine loads.

head_dim is 32 (vLLM's CPU attention needs at least 32). The MoE model keeps layer 0 dense
(``mlp_only_layers``), so one model has fused q/k/v, a dense ``gate_up_proj`` and routed experts;
one kv head makes TP 2 replicate it.
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


def config(kind: str) -> Any:
    from transformers import Qwen3Config, Qwen3MoeConfig

    return Qwen3MoeConfig(**MOE) if kind == "moe" else Qwen3Config(**DENSE)


def make_model(kind: str, out: Path, seed: int = 0) -> Path:
    """Write the ``kind`` ("dense" or "moe") model's bf16 checkpoint to ``out``; returns ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(kind)).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out
