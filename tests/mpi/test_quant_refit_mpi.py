"""Quantize on refit through the ``shardstream refit`` CLI under ``mpiexec``: a DeepSeek-V3-shaped
bf16 Megatron TP4 trainer pushes into a vLLM TP2 block-FP8 server (``layout --preset vllm
--fp8``). TP4 cuts some 128x128 blocks (o_proj, the experts: quantized by the receivers) and not
others (quantized by the senders). What the server saves equals, byte for byte, what ``convert``
writes from the same checkpoint (itself checked against the torch reference in
tests/unit/test_quant_convert.py), and the report says where each array was quantized."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from mpi_helpers import ok, run, safetensors_files, same_files

pytestmark = pytest.mark.mpi

#: DeepSeek-V3 in miniature (MLA, shared and routed experts), dims that TP2 cuts into whole blocks
DSV3_SMALL = {
    "model_type": "deepseek_v3", "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512,
    "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64,
    "n_routed_experts": 2, "n_shared_experts": 1, "num_experts_per_tok": 1, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


@dataclass(frozen=True)
class Dsv3:
    hf: Path
    train: Path  # the trainer's bf16 rank files (Megatron TP4) + manifest.json
    serve: Path  # the vLLM TP2 block-FP8 layout
    offline: Path  # convert's output for serve


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory: pytest.TempPathFactory) -> Dsv3:
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from formats.layouts.models import arrays_from_config

    tmp = tmp_path_factory.mktemp("dsv3")
    (tmp / "cfg.json").write_text(json.dumps(DSV3_SMALL))
    g = torch.Generator().manual_seed(0)
    weights = {n: (torch.randn(s, generator=g) * 0.05).to(getattr(torch, dt))
               for n, (s, dt) in arrays_from_config(DSV3_SMALL).items()}
    weights["model.layers.1.mlp.experts.0.up_proj.weight"][:128, :128] = 0  # an all-zero block
    (tmp / "hf").mkdir()
    safetensors_torch.save_file(weights, str(tmp / "hf" / "model.safetensors"))
    cfg, train, serve = tmp / "cfg.json", tmp / "train.json", tmp / "serve.json"
    ok(["shardstream", "layout", "--model", cfg, "--preset", "megatron", "--mesh", "tp=4", "-o", train])
    ok(["shardstream", "layout", "--model", cfg, "--preset", "vllm", "--fp8", "--mesh", "tp=2", "-o", serve])
    ok(["shardstream", "convert", tmp / "hf", train, "--out", tmp / "train"], timeout=120)
    ok(["shardstream", "convert", tmp / "hf", serve, "--out", tmp / "offline"], timeout=120)
    return Dsv3(tmp / "hf", tmp / "train", serve, tmp / "offline")


@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_refit_quantizes_like_convert(dsv3: Dsv3, tmp_path: Path, transport: str) -> None:
    saved = tmp_path / "saved"
    rc, out, err = run(["mpiexec", "-n", "4", "shardstream", "refit", "send", "--manifest", dsv3.train,
                        "--transport", transport, "--timeout", "60", "--steps", "2", "--json", ":",
                        "-n", "2", "shardstream", "refit", "recv", "--manifest", dsv3.serve, "--save", saved,
                        "--transport", transport, "--verify", "--timeout", "60", "--steps", "2", "--json"],
                       timeout=180)
    assert rc == 0, f"refit exited {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    reports = {r["role"]: r for r in map(json.loads, out.strip().splitlines())}
    q = reports["recv"]["quantized"]
    where = {f: a["where"] for f, a in q["arrays"].items()}
    assert where["model.layers.0.mlp.gate_proj.weight"] == "sender"  # 512 rows / 4: whole blocks
    assert where["model.layers.0.self_attn.o_proj.weight"] == "receiver"  # 256 columns / 4 cut blocks
    assert q["on_sender"] > 0 and q["on_receiver"] > 0 and q["wire_bytes_saved"] > 0
    assert reports["send"]["quantized"]["wire_bytes_saved"] == q["wire_bytes_saved"]
    assert len(q["quantize_seconds"]) == 2 and reports["recv"]["verified"]
    # receivers stage o_proj and the experts in bf16: each holds half of every one
    staged = sum(a["bytes_unquantized"] for a in q["arrays"].values() if a["where"] == "receiver")
    assert q["staging_bytes"] == staged and reports["send"]["quantized"]["staging_bytes"] == 0
    assert safetensors_files(saved) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    assert same_files(saved, dsv3.offline) == []
    ok(["shardstream", "validate", "--data", saved])
