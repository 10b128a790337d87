"""megatron-core on this CPU, for the live-Megatron tests: the patches, the parallel state, a
GPTModel built from a Hugging Face config, deterministic optimizer steps, Megatron's own forward,
and an independent gather of the model into HF tensors (the tests' oracle, not shardstream's code).

CPU patches (as tests/data/megatron/make_fixtures.py): ``torch.cuda`` seeding and
``synchronize`` are no-ops, ``current_device`` is the CPU, the CUDA RNG tracker's ``fork`` is a
no-op context (dropout is 0), ``moe_utils.te_general_gemm`` exists; the process group is gloo,
``create_gloo_process_groups=True``; the model uses ``use_cpu_initialization``, no fusions, the
local spec (Transformer Engine does not install on CPU) and the ``allgather`` MoE dispatcher.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any

import numpy as np


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

    patch_cpu()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
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


def _identity(name: str, p: Any) -> str:
    """What makes a parameter distinct across ranks: replicas (data parallel, the TP copies of a
    norm or a router) share it, so they take the same steps and stay equal."""
    from megatron.core import parallel_state as ps

    who = f"{name}|pp{ps.get_pipeline_model_parallel_rank()}"
    if getattr(p, "tensor_model_parallel", False):
        who += f"|tp{ps.get_tensor_model_parallel_rank()}"
    if not getattr(p, "allreduce", True):  # an expert: numbered within its EP rank
        who += f"|ep{ps.get_expert_model_parallel_rank()}"
    return who


def optimizer_step(chunks: list[Any], opt: Any, step: int) -> None:
    """One Adam step on seeded gradients (a function of each parameter's identity and the step)."""
    import torch

    for v, c in enumerate(chunks):
        for name, p in c.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(f"{v}|{_identity(name, p)}|{step}".encode()))
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    opt.step()
    opt.zero_grad()


def forward_logits(model: Any, tokens: list[list[int]], vocab: int) -> np.ndarray:
    """Megatron's own forward (pp = 1): float32 logits of the real vocabulary."""
    import torch

    ids = torch.tensor(tokens)
    s = ids.shape[1]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    model.eval()
    with torch.no_grad():
        out = model(ids, torch.arange(s).unsqueeze(0), mask)
    model.train()
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    full = gather_from_tensor_model_parallel_region(out)
    return full[..., :vocab].float().numpy()


# ------------------------------------------------------------------ the oracle: an independent gather


def local_report(chunks: list[Any]) -> dict[str, Any]:
    """This rank's coordinates and parameters (float32 copies) with each chunk's global layers."""
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_rank(), "ep": ps.get_expert_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank(),
            "chunks": [{"layers": [int(layer.layer_number) - 1 for layer in c.decoder.layers],
                        "params": {n: p.detach().float().numpy().copy() for n, p in c.named_parameters()}}
                       for c in chunks]}


def to_hf(reports: list[dict[str, Any]], hf: dict[str, Any]) -> dict[str, np.ndarray]:
    """The HF tensors (float32) of the gathered reports: Megatron's layouts undone by hand."""
    H, nh, nkv, hd, V = (hf[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                         "vocab_size"))
    hpg = nh // nkv
    pieces: dict[tuple[str, int], np.ndarray] = {}  # (HF-ish name, tp rank) -> piece; dp copies collapse
    for r in reports:
        for c in r["chunks"]:
            for name, a in c["params"].items():
                if name.startswith("decoder.layers."):
                    _, _, i, rest = name.split(".", 3)
                    name = f"L{c['layers'][int(i)]}.{rest}"
                    if ".local_experts." in rest:
                        head, tail = rest.split(".local_experts.")
                        le, tail = tail.split(".", 1)
                        nloc = sum(1 for n in c["params"] if n.startswith(f"decoder.layers.{i}.mlp.experts.local_experts.")
                                   and n.endswith("linear_fc1.weight"))
                        name = f"L{c['layers'][int(i)]}.{head}.E{r['ep'] * nloc + int(le)}.{tail}"
                pieces[(name, r["tp"])] = a
    names = sorted({n for n, _ in pieces})
    T = 1 + max(t for _, t in pieces)

    def cat(n: str, dim: int) -> np.ndarray:
        return np.concatenate([pieces[(n, t)] for t in range(T)], axis=dim)

    out: dict[str, np.ndarray] = {}
    for n in names:
        if not n.startswith("L"):
            continue
        layer, rest = n.split(".", 1)
        p = f"model.layers.{layer[1:]}."
        if rest == "self_attention.linear_qkv.weight":
            qkv = cat(n, 0).reshape(nkv, hpg + 2, hd, H)
            out[p + "self_attn.q_proj.weight"] = qkv[:, :hpg].reshape(nkv * hpg * hd, H)
            out[p + "self_attn.k_proj.weight"] = qkv[:, hpg].reshape(nkv * hd, H)
            out[p + "self_attn.v_proj.weight"] = qkv[:, hpg + 1].reshape(nkv * hd, H)
        elif rest == "self_attention.linear_proj.weight":
            out[p + "self_attn.o_proj.weight"] = cat(n, 1)
        elif rest.endswith("linear_fc1.weight"):
            halves = [np.split(pieces[(n, t)], 2, axis=0) for t in range(T)]
            mlp = p + ("mlp." if ".E" not in rest else f"mlp.experts.{rest.split('.E')[1].split('.')[0]}.")
            out[mlp + "gate_proj.weight"] = np.concatenate([h[0] for h in halves])
            out[mlp + "up_proj.weight"] = np.concatenate([h[1] for h in halves])
        elif rest.endswith("linear_fc2.weight"):
            mlp = p + ("mlp." if ".E" not in rest else f"mlp.experts.{rest.split('.E')[1].split('.')[0]}.")
            out[mlp + "down_proj.weight"] = cat(n, 1)
        else:
            hf_rest = {"input_layernorm.weight": "input_layernorm.weight",
                       "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
                       "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
                       "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
                       "mlp.router.weight": "mlp.gate.weight"}[rest]
            out[p + hf_rest] = pieces[(n, 0)]
    out["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight", 0)[:V]
    out["model.norm.weight"] = pieces[("decoder.final_layernorm.weight", 0)]
    if not hf.get("tie_word_embeddings"):
        out["lm_head.weight"] = cat("output_layer.weight", 0)[:V]
    return out
