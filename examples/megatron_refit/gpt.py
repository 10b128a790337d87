"""A megatron-core GPTModel from a Hugging Face ``config.json`` (llama, qwen3, qwen3_moe), on
GPUs or on a CPU over gloo.

On a machine without CUDA, :func:`patch_cpu` makes megatron-core 0.16 run there: ``torch.cuda``
seeding and ``synchronize`` are no-ops, ``current_device`` is the CPU, the CUDA RNG tracker's
``fork`` is a no-op context (dropout is 0), and ``moe_utils.te_general_gemm`` exists (0.16 names it
unguarded without Transformer Engine). The model then uses ``use_cpu_initialization``, no fusions,
the local layer spec (Transformer Engine does not install on CPU) and the ``allgather`` MoE token
dispatcher. On GPUs none of that is needed: build the model as your trainer does.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["build", "patch_cpu", "setup"]


def patch_cpu() -> None:
    import torch

    torch.cuda.manual_seed = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.manual_seed_all = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def setup(tp: int, pp: int, ep: int = 1, vpp: int | None = None) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not torch.cuda.is_available():
        patch_cpu()
    if not dist.is_initialized():
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp,
                                             expert_model_parallel_size=ep, create_gloo_process_groups=True)
    torch.manual_seed(1234)  # the same on every rank: replicated parameters start equal


def build(hf: dict[str, Any], *, fp32: bool, vpp: int | None = None) -> Any:
    """The GPTModel (or its list of virtual-pipeline chunks) of the HF config ``hf`` (llama,
    qwen3, qwen3_moe), on this rank's pipeline stage."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    hf = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
          "num_key_value_heads": hf["num_attention_heads"], "head_dim": hf["hidden_size"] // hf["num_attention_heads"],
          **hf}
    moe = hf["model_type"] == "qwen3_moe"
    qk_norm = hf["model_type"] in ("qwen3", "qwen3_moe")
    extra = dict(num_moe_experts=hf["num_experts"], moe_router_topk=hf["num_experts_per_tok"],
                 moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_router_load_balancing_type="none",
                 moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                 expert_model_parallel_size=ps.get_expert_model_parallel_world_size()) if moe else {}
    dt = torch.float32 if fp32 else torch.bfloat16
    cfg = TransformerConfig(
        **extra, num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"], num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf["num_key_value_heads"], kv_channels=hf["head_dim"], normalization="RMSNorm",
        layernorm_epsilon=hf["rms_norm_eps"], gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=False, qk_layernorm=qk_norm, bf16=not fp32, params_dtype=dt, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=dt, init_method_std=0.2,
        apply_rope_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False)
    spec = get_gpt_layer_local_spec(num_experts=hf.get("num_experts") if moe else None, moe_grouped_gemm=False,
                                    qk_layernorm=qk_norm, normalization="RMSNorm")
    padded = -(-hf["vocab_size"] // (128 * ps.get_tensor_model_parallel_world_size())) * 128 * \
        ps.get_tensor_model_parallel_world_size()

    def chunk(v: int | None) -> Any:
        return GPTModel(cfg, spec, vocab_size=padded, max_sequence_length=hf["max_position_embeddings"],
                        position_embedding_type="rope", rotary_base=int(hf["rope_theta"]),
                        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings")),
                        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v), vp_stage=v)

    if vpp is None:
        return chunk(None)
    return [chunk(v) for v in range(vpp)]
