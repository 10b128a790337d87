"""megatron-core on this CPU, for the live-Megatron tests: the example's GPTModel
(examples/megatron_refit/gpt.py: the CPU patches, the parallel state, the model from an HF
config), deterministic optimizer steps, Megatron's own forward, and an independent gather of the
model into HF tensors (the tests' oracle, not shardstream's code).
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "megatron_refit"))
from gpt import build, patch_cpu, setup  # noqa: E402,F401


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
