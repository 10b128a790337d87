"""formats.layouts.models: model descriptions -> arrays, NCCL M2N JSONs, generic rules, and the
Megatron / vLLM parallel layouts built from them.

Oracles: published parameter counts, the NCCL M2N model JSONs shipped in workloads/
(made by NVIDIA from the real checkpoints), and hand-written shapes for tiny configs.
"""

from __future__ import annotations

import json
from math import ceil, prod
from pathlib import Path
from typing import Any

import pytest

from formats.layouts import Mesh, Replicate, Shard, parse_rule, resolve_placements
from formats.layouts.models import (
    ModelConfigError,
    arrays_from_config,
    arrays_from_m2n_model,
    arrays_from_model,
    count_parameters,
    generic_rules,
    manifest_from_parallel,
    parallel_from_dict,
    parse_m2n_system,
)
from formats.manifest.box import Box
from formats.validate.manifest import validate_manifest
from streamer.cli.app import main

WORKLOADS = Path(__file__).resolve().parents[2] / "workloads"  # shipped copy (shapes only)
MODELS = WORKLOADS / "models"
M2N = WORKLOADS / "nccl-m2n"
SYSTEMS = sorted(p for p in M2N.glob("*.json") if not p.name.endswith(".model.json"))

needs_workloads = pytest.mark.skipif(not MODELS.is_dir(), reason="workloads/ missing")

TINY_MOE: dict[str, Any] = {
    "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_experts": 8, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 1000, "mlp_only_layers": [0], "decoder_sparse_step": 1,
}
TINY_DSV3: dict[str, Any] = {
    "model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 160, "moe_intermediate_size": 48,
    "n_routed_experts": 8, "n_shared_experts": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "num_hidden_layers": 3, "num_nextn_predict_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
    "vocab_size": 500, "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}


# ---------------------------------------------------------------- published sizes


@needs_workloads
@pytest.mark.parametrize(("name", "published"), [
    ("qwen3-32b", 32.8e9), ("qwen3-30b-a3b", 30.5e9), ("qwen3-235b-a22b", 235e9), ("deepseek-v3", 671e9),
])
def test_parameter_counts_match_published(name: str, published: float) -> None:
    arrays = arrays_from_config(MODELS / f"{name}.config.json")
    n = count_parameters(arrays)
    assert abs(n - published) / published < 0.01, (name, n)
    # FP8 changes dtypes and adds scales, never the parameter count
    fp8 = arrays_from_config(MODELS / f"{name}.config.json", fp8=True)
    assert count_parameters(fp8) == n


@needs_workloads
def test_deepseek_v3_mtp_is_optional() -> None:
    base = arrays_from_config(MODELS / "deepseek-v3.config.json")
    mtp = arrays_from_config(MODELS / "deepseek-v3.config.json", include_mtp=True)
    assert not any(".layers.61." in n for n in base)
    extra = {n: v for n, v in mtp.items() if n not in base}
    assert extra and all(".layers.61." in n for n in extra)
    assert 684e9 < count_parameters(mtp) < 686e9  # 671B + the 14B MTP module (HF model card: 685B)
    assert extra["model.layers.61.eh_proj.weight"] == ((7168, 14336), "bfloat16")


@needs_workloads
def test_qwen3_32b_config_equals_nccl_m2n_model_json() -> None:
    """NVIDIA's generated Qwen3-32B model JSON is exactly what the config gives."""
    assert arrays_from_config(MODELS / "qwen3-32b.config.json") == arrays_from_m2n_model(M2N / "qwen3-32b.model.json")


@needs_workloads
def test_deepseek_v3_fp8_matches_nccl_m2n_toy() -> None:
    """The dsv3-toy model JSON is one MoE layer of the FP8 checkpoint (its layer 0 = our layer 3)."""
    toy = arrays_from_m2n_model(M2N / "dsv3-toy.model.json")
    ours = arrays_from_config(MODELS / "deepseek-v3.config.json", fp8=True)
    for name, spec in toy.items():
        assert ours[name.replace("layers.0.", "layers.3.")] == spec, name


def test_deepseek_v3_shapes_by_hand() -> None:
    a = arrays_from_config(TINY_DSV3)
    p = "model.layers.0.self_attn."
    assert a[p + "q_a_proj.weight"] == ((24, 64), "bfloat16")
    assert a[p + "q_a_layernorm.weight"] == ((24,), "bfloat16")
    assert a[p + "q_b_proj.weight"] == ((4 * 12, 24), "bfloat16")
    assert a[p + "kv_a_proj_with_mqa.weight"] == ((16 + 4, 64), "bfloat16")
    assert a[p + "kv_a_layernorm.weight"] == ((16,), "bfloat16")
    assert a[p + "kv_b_proj.weight"] == ((4 * (8 + 6), 16), "bfloat16")
    assert a[p + "o_proj.weight"] == ((64, 4 * 6), "bfloat16")
    assert a["model.layers.0.mlp.gate_proj.weight"] == ((160, 64), "bfloat16")  # dense (first_k_dense_replace)
    assert "model.layers.0.mlp.gate.weight" not in a
    m = "model.layers.1.mlp."
    assert a[m + "gate.weight"] == ((8, 64), "bfloat16")
    assert a[m + "gate.e_score_correction_bias"] == ((8,), "float32")
    assert a[m + "experts.7.down_proj.weight"] == ((64, 48), "bfloat16")
    assert a[m + "shared_experts.up_proj.weight"] == ((2 * 48, 64), "bfloat16")  # n_shared_experts × moe_inter
    assert "model.layers.3.self_attn.q_a_proj.weight" not in a  # MTP off by default
    assert a["lm_head.weight"] == ((500, 64), "bfloat16")


def test_fp8_weights_and_scale_siblings() -> None:
    a = arrays_from_config(TINY_DSV3, fp8=True)
    w = "model.layers.1.mlp.experts.0.gate_proj.weight"
    assert a[w] == ((48, 64), "float8_e4m3fn")
    assert a[w + "_scale_inv"] == ((1, 1), "float32")
    cfg = {**TINY_DSV3, "hidden_size": 300, "quantization_config": {"fmt": "e4m3", "weight_block_size": [128, 64]}}
    a = arrays_from_config(cfg, fp8=True)
    assert a["model.layers.0.self_attn.o_proj.weight_scale_inv"] == ((ceil(300 / 128), ceil(24 / 64)), "float32")
    # embeddings, lm_head, norms and the router stay bf16; no scale for them
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
              "model.layers.0.input_layernorm.weight"):
        assert a[n][1] == "bfloat16" and n + "_scale_inv" not in a
    # every scaled weight is fp8 and every fp8 weight has its scale
    for n, (_, dt) in a.items():
        if dt == "float8_e4m3fn":
            assert n + "_scale_inv" in a
    # the default is bf16 weights even when the config is quantized
    assert all(dt != "float8_e4m3fn" for _, dt in arrays_from_config(TINY_DSV3).values())


def test_dense_families() -> None:
    base = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 100}
    llama = arrays_from_config({"model_type": "llama", **base})
    assert llama["model.layers.0.self_attn.k_proj.weight"] == ((16, 32), "bfloat16")  # head_dim = 32/4
    assert "model.layers.0.self_attn.q_norm.weight" not in llama and "model.layers.0.self_attn.q_proj.bias" not in llama
    q2 = arrays_from_config({"model_type": "qwen2", **base, "torch_dtype": "float32"})
    assert q2["model.layers.1.self_attn.v_proj.bias"] == ((16,), "float32")
    assert "model.layers.1.self_attn.o_proj.bias" not in q2
    q3 = arrays_from_config({"model_type": "qwen3", **base, "head_dim": 12, "tie_word_embeddings": True})
    assert q3["model.layers.0.self_attn.q_norm.weight"] == ((12,), "bfloat16")
    assert q3["model.layers.0.self_attn.o_proj.weight"] == ((32, 48), "bfloat16")
    assert "lm_head.weight" not in q3  # tied
    lb = arrays_from_config({"model_type": "llama", **base, "attention_bias": True, "mlp_bias": True})
    assert "model.layers.0.self_attn.o_proj.bias" in lb and "model.layers.0.mlp.down_proj.bias" in lb


def test_qwen3_moe_sparse_layers() -> None:
    a = arrays_from_config(TINY_MOE)
    assert "model.layers.0.mlp.gate_proj.weight" in a  # mlp_only_layers
    assert a["model.layers.1.mlp.gate.weight"] == ((8, 64), "bfloat16")
    assert a["model.layers.3.mlp.experts.7.up_proj.weight"] == ((32, 64), "bfloat16")
    assert "model.layers.1.mlp.gate_proj.weight" not in a
    step2 = arrays_from_config({**TINY_MOE, "mlp_only_layers": [], "decoder_sparse_step": 2})
    assert "model.layers.0.mlp.gate_proj.weight" in step2 and "model.layers.1.mlp.gate.weight" in step2


@pytest.mark.parametrize(("cfg", "msg"), [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"model_type": "llama", "hidden_size": 8}, "needs 'num_hidden_layers'"),
    ({**TINY_MOE, "num_experts": 0}, "num_experts must be an integer >= 1, got 0"),
    ({**TINY_MOE, "torch_dtype": "int8"}, "torch_dtype 'int8' is not supported"),
    ({**TINY_MOE, "mlp_only_layers": "all"}, "mlp_only_layers must be a list"),
])
def test_config_errors(cfg: dict[str, Any], msg: str) -> None:
    with pytest.raises(ModelConfigError, match=msg):
        arrays_from_config(cfg)


def test_fp8_config_errors() -> None:
    with pytest.raises(ModelConfigError, match="fmt 'e5m2'"):
        arrays_from_config({**TINY_DSV3, "quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, fp8=True)
    with pytest.raises(ModelConfigError, match="weight_block_size must be two integers"):
        arrays_from_config({**TINY_DSV3, "quantization_config": {"weight_block_size": [128]}}, fp8=True)
    # a BF16 config asked for FP8 gets the 128x128 block scheme of the published FP8 checkpoints
    a = arrays_from_config(TINY_MOE, fp8=True)
    assert a["model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"] == ((1, 1), "float32")


def test_config_from_file_and_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_MOE))
    assert arrays_from_config(tmp_path) == arrays_from_config(tmp_path / "config.json") == arrays_from_config(TINY_MOE)
    assert arrays_from_model(tmp_path / "config.json") == arrays_from_config(TINY_MOE)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(Exception, match="not valid JSON"):
        arrays_from_config(tmp_path / "bad.json")
    with pytest.raises(ModelConfigError, match="no such"):
        arrays_from_config(tmp_path / "missing.json")


# ---------------------------------------------------------------- NCCL M2N JSONs


def test_m2n_model_json(tmp_path: Path) -> None:
    obj = {"a.weight": {"shape": [4, 2], "dtype": "F8_E4M3", "shard": "x.safetensors"},
           "a.weight_scale_inv": {"shape": [1, 1], "dtype": "F32"}, "b": {"shape": [3]}}
    p = tmp_path / "m.model.json"
    p.write_text(json.dumps(obj))
    assert arrays_from_m2n_model(p) == {"a.weight": ((4, 2), "float8_e4m3fn"), "a.weight_scale_inv": ((1, 1), "float32"),
                                        "b": ((3,), "bfloat16")}
    assert arrays_from_model(p) == arrays_from_m2n_model(p)
    with pytest.raises(ModelConfigError, match="fp8 applies to HF config.json"):
        arrays_from_model(p, fp8=True)


@pytest.mark.parametrize(("obj", "msg"), [
    ({"x": {"shape": [2, -1]}}, "x: shape must be a list of integers >= 0"),
    ({"x": {"shape": [2], "dtype": "Q4"}}, "x: unsupported safetensors dtype 'Q4'"),
    ({"x": {"shape": [2], "stride": [1]}}, r"x: unknown key\(s\) \['stride'\]"),
    ({"x": [2]}, "x: expected an object"),
    ({}, "no arrays"),
])
def test_m2n_model_errors(obj: dict[str, Any], msg: str) -> None:
    with pytest.raises(ModelConfigError, match=msg):
        arrays_from_m2n_model(obj)


@needs_workloads
@pytest.mark.parametrize("path", SYSTEMS, ids=lambda p: p.name)
def test_shipped_system_configs_parse(path: Path) -> None:
    train, gen = parse_m2n_system(path)
    raw = json.loads(path.read_text())
    for side, d in (("train", train), ("generation", gen)):
        assert d["num_gpus"] == raw[side]["num_gpus"]
        assert d["pp"] * d["dp"] * d["fsdp"] * d["cp"] * d["tp"] == d["num_gpus"]
        assert d["ranks_per_stage"] % d["ep"] == 0 and d["edp"] * d["ep"] == d["ranks_per_stage"]


@needs_workloads
def test_parallel_folding_derives_dp() -> None:
    """dsv3-256gpus: EP16 × PP8 on 128 GPUs with dp_size 1 -- the non-expert dp is 16 (M2N's rule)."""
    train, gen = parse_m2n_system(M2N / "dsv3-256gpus-gb200.json")
    assert (train["dp"], train["dp_derived"], train["edp"], train["ranks_per_stage"]) == (16, True, 1, 16)
    assert (gen["tp"], gen["dp"], gen["dp_derived"]) == (8, 16, False)
    q, _ = parse_m2n_system(M2N / "qwen235b-TP2CP2PP4EP16-128gpus-gb200.json")
    assert (q["tp"], q["cp"], q["dp"], q["pp"], q["ep"]) == (2, 2, 4, 4, 16)
    # the README's EP16 x DP2 x PP4 (128 GPUs): dp_size is the expert data parallelism
    t = parallel_from_dict({"num_gpus": 128, "ep_size": 16, "dp_size": 2, "pp_size": 4})
    assert (t["dp"], t["edp"], t["ranks_per_stage"]) == (32, 2, 32)
    # the dense count wins when it matches (EP8 x PP2 with the dense dp given)
    t = parallel_from_dict({"num_gpus": 16, "ep_size": 8, "dp_size": 8, "pp_size": 2})
    assert (t["dp"], t["edp"], t["dp_derived"]) == (8, 1, False)


@pytest.mark.parametrize(("d", "msg"), [
    ({"num_gpus": 10, "tp_size": 2, "dp_size": 2},
     r"pp\(1\)\*dp\(2\)\*fsdp\(1\)\*cp\(1\)\*tp\(2\) = 4 != num_gpus\(10\)"),
    ({"num_gpus": 12, "tp_size": 2, "dp_size": 3, "pp_size": 2, "ep_size": 4},
     r"ep\(4\) must divide the ranks of one pipeline stage num_gpus\(12\) / pp\(2\) = 6"),
    ({"num_gpus": 10, "tp_size": 4, "ep_size": 2}, r"= 4 != num_gpus\(10\); nor does pp\(1\)\*dp\(1\)\*ep\(2\) = 2"),
    ({"num_gpus": 8, "tp_size": 3, "ep_size": 8}, r"tp\(3\) = 3 != num_gpus\(8\)"),
    ({"tp_size": 2}, "num_gpus is required"),
    ({"num_gpus": 2, "tp_size": 0}, "tp_size must be an integer >= 1, got 0"),
    ({"num_gpus": 2, "etp_size": 2}, r"unknown key\(s\) \['etp_size'\]"),
])
def test_parallel_config_errors(d: dict[str, Any], msg: str) -> None:
    with pytest.raises(ModelConfigError, match=msg):
        parallel_from_dict(d, where="sys.json: train")


def test_system_json_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="missing 'generation'"):
        parse_m2n_system({"train": {"num_gpus": 1}})
    with pytest.raises(ModelConfigError, match=r"unknown key\(s\) \['eval'\]"):
        parse_m2n_system({"train": {"num_gpus": 1}, "generation": {"num_gpus": 1}, "eval": {}})
    p = tmp_path / "s.json"
    p.write_text(json.dumps({"_comment": "x", "train": {"num_gpus": 4, "tp_size": 4},
                             "generation": {"num_gpus": 3, "dp_size": 3}}))
    t, g = parse_m2n_system(p)
    assert (t["tp"], g["dp"]) == (4, 3)


# ---------------------------------------------------------------- rules and layouts


def _placements(arrays: dict[str, Any], mesh: Mesh) -> dict[str, Any]:
    rules = [parse_rule(r, mesh) for r in generic_rules(mesh.axes)]
    return resolve_placements({n: s for n, (s, _) in arrays.items()}, mesh, rules)


def test_generic_rules_megatron_placements() -> None:
    a = arrays_from_config(TINY_DSV3, fp8=True)
    pl = _placements(a, Mesh(("dp", "tp"), (2, 4)))
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    expect = {
        "model.embed_tokens.weight": (R, S0), "lm_head.weight": (R, S0), "model.norm.weight": (R, R),
        "model.layers.0.self_attn.q_a_proj.weight": (R, R), "model.layers.0.self_attn.q_a_proj.weight_scale_inv": (R, R),
        "model.layers.0.self_attn.q_b_proj.weight": (R, S0), "model.layers.0.self_attn.kv_b_proj.weight": (R, S0),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (R, R),
        "model.layers.0.self_attn.o_proj.weight": (R, S1), "model.layers.0.self_attn.o_proj.weight_scale_inv": (R, S1),
        "model.layers.0.self_attn.kv_a_layernorm.weight": (R, R), "model.layers.0.mlp.down_proj.weight": (R, S1),
        "model.layers.1.mlp.gate.weight": (R, R), "model.layers.1.mlp.gate.e_score_correction_bias": (R, R),
        "model.layers.1.mlp.experts.3.gate_proj.weight": (R, S0), "model.layers.1.mlp.experts.3.down_proj.weight": (R, S1),
        "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv": (R, S0),
    }
    for n, p in expect.items():
        assert pl[n] == p, n
    q = _placements(arrays_from_config({"model_type": "qwen2", "hidden_size": 8, "intermediate_size": 8,
                                        "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 8}),
                    Mesh(("tp",), (2,)))
    assert q["model.layers.0.self_attn.k_proj.bias"] == (S0,) and q["model.layers.0.self_attn.q_proj.weight"] == (S0,)


def test_generic_rules_other_axes() -> None:
    assert generic_rules(["pp", "dp", "tp"])[0] == "*embed_tokens.weight=R,R,S(0)"
    rules = generic_rules(["fsdp", "tp"])
    assert rules[-1] == "*=S(0),R"  # FSDP shards the arrays no tp rule names
    a = arrays_from_config(TINY_MOE)
    pl = _placements(a, Mesh(("fsdp", "tp"), (2, 2)))
    assert pl["model.norm.weight"] == (Shard(0), Replicate())
    assert pl["model.layers.0.self_attn.o_proj.weight"] == (Shard(0), Shard(1))
    with pytest.raises(Exception, match="at least one mesh axis"):
        generic_rules([])


def test_manifest_from_parallel_megatron_expert_folding() -> None:
    """PP2 × EP4 on 8 ranks (parallel folding, ETP 1): dense arrays replicated over the stage's 4
    ranks, expert e whole on rank stage·4 + e // 2; vocab on stage 0 / last stage."""
    a = arrays_from_config(TINY_MOE)
    par = parallel_from_dict({"num_gpus": 8, "pp_size": 2, "ep_size": 4})
    m = manifest_from_parallel(a, par, domain_size=4, name="t")
    assert validate_manifest(m, check_paths=False) == []
    assert (m.world_size, m.domain_size, m.mesh) == (8, 4, {"axes": ["pp", "dp", "tp"], "shape": [2, 4, 1]})
    assert list(m.arrays) == list(a)

    def holders(n: str) -> list[tuple[int, ...]]:
        return [c.holders for c in m.arrays[n].chunks]

    assert holders("model.embed_tokens.weight") == [(0, 1, 2, 3)]
    assert holders("lm_head.weight") == [(4, 5, 6, 7)]
    assert holders("model.layers.3.self_attn.q_proj.weight") == [(4, 5, 6, 7)]
    for e in range(8):
        assert holders(f"model.layers.1.mlp.experts.{e}.up_proj.weight") == [(e // 2,)]
        assert holders(f"model.layers.2.mlp.experts.{e}.up_proj.weight") == [(4 + e // 2,)]


def test_manifest_from_parallel_tp_cp_and_edp() -> None:
    """TP2 × CP2 with EP2 × EDP4 on 8 ranks: dense dp = 2 (derived); experts replicated over edp."""
    a = arrays_from_config(TINY_MOE)
    par = parallel_from_dict({"num_gpus": 8, "tp_size": 2, "cp_size": 2, "ep_size": 2, "dp_size": 4})
    assert (par["dp"], par["edp"]) == (2, 4)
    m = manifest_from_parallel(a, par)
    assert validate_manifest(m, check_paths=False) == []
    q = m.arrays["model.layers.0.self_attn.q_proj.weight"].chunks
    assert [(c.region, c.holders) for c in q] == [(Box((0, 0), (32, 64)), (0, 2, 4, 6)),
                                                  (Box((32, 0), (32, 64)), (1, 3, 5, 7))]
    ex = m.arrays["model.layers.1.mlp.experts.5.gate_proj.weight"].chunks
    assert [c.holders for c in ex] == [(1, 3, 5, 7)]  # block 1 of ep = odd ranks, whole expert


def test_manifest_from_parallel_vllm_tp_and_fp8() -> None:
    a = arrays_from_config(TINY_DSV3, fp8=True)
    par = parallel_from_dict({"num_gpus": 6, "tp_size": 3, "dp_size": 2})
    m = manifest_from_parallel(a, par, file_pattern="rank-{rank:05d}.safetensors")
    assert validate_manifest(m, check_paths=False) == []
    e = m.arrays["model.layers.2.mlp.experts.0.down_proj.weight"].chunks  # 64 × 48, S(1) over tp 3
    assert [(c.region.sizes, c.holders) for c in e] == [((64, 16), (0, 3)), ((64, 16), (1, 4)), ((64, 16), (2, 5))]
    assert e[0].source is not None and e[0].source.file == "rank-{rank:05d}.safetensors"
    total = sum(c.region.volume * len(c.holders) for c in m.arrays["model.norm.weight"].chunks)
    assert total == 64 * 6
    assert sum(prod(c.region.sizes) for c in m.arrays["lm_head.weight"].chunks) == 500 * 64


def test_pin_to_pp_stage_uses_all_layers() -> None:
    """num_layers comes from every array, so a manifest of one layer keeps the stage of the model."""
    a = arrays_from_config(TINY_MOE)
    sub = {n: v for n, v in a.items() if ".layers.3." in n}
    par = parallel_from_dict({"num_gpus": 4, "pp_size": 2, "dp_size": 2})
    m = manifest_from_parallel(sub, par, num_layers=4)
    assert {c.holders for arr in m.arrays.values() for c in arr.chunks} == {(2, 3)}


# ---------------------------------------------------------------- CLI


def test_cli_layout_model(tmp_path: Path, capsys: Any) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_MOE))
    out = tmp_path / "m.json"
    assert main(["layout", "--model", str(cfg), "--mesh", "pp=2,ep=2,tp=2", "--no-files", "--format-version", "1",
                 "-o", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["world_size"] == 8
    q = m["arrays"]["model.layers.0.self_attn.q_proj.weight"]["chunks"]
    assert [c["holders"] for c in q] == [[0, 2], [1, 3]]  # generic rules: tp S(0), ep replicates dense arrays
    ex = m["arrays"]["model.layers.3.mlp.experts.7.down_proj.weight"]["chunks"]
    assert [(c["region"]["sizes"], c["holders"]) for c in ex] == [([64, 16], [6]), ([64, 16], [7])]
    # explicit rules replace the generic ones; --fp8 adds scales
    assert main(["layout", "--model", str(cfg), "--mesh", "tp=2", "--rule", "*=S(0)", "--fp8", "--no-files",
                 "--format-version", "1", "-o", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["arrays"]["model.layers.1.mlp.experts.0.down_proj.weight"]["data_type"] == "float8_e4m3fn"
    assert len(m["arrays"]["model.norm.weight"]["chunks"]) == 2
    capsys.readouterr()
    assert main(["layout", "--model", str(cfg), "--like", str(out), "-o", str(out)]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["layout", "--model", str(tmp_path / "nope.json"), "-o", str(out)]) == 1
    assert "no such model description file" in capsys.readouterr().err
