"""``formats.megatron.live``: the manifest of a live Megatron job from its ranks' reports (pure).

The reports here list the parameters megatron-core's local spec gives a Llama-like GPTModel
(names and shapes written out by hand, as ``named_parameters()`` lists them); the real framework
runs in tests/vllm/test_megatron_live.py. Checked: holders come from each rank's own coordinates
(any rank order), virtual pipeline chunks, per-array dtypes, the tied embedding at pp > 1, and a
refusal by name for everything the layout does not know.
"""

from __future__ import annotations

from typing import Any

import pytest

from formats.errors import FormatError
from formats.megatron.live import MegatronConfig, RankReport, hf_config, live_manifest

H, FFN, HEADS, GROUPS, HD, VOCAB, PADDED = 64, 128, 4, 2, 16, 250, 256
FIELDS: dict[str, Any] = {"num_layers": 4, "hidden_size": H, "ffn_hidden_size": FFN, "num_attention_heads": HEADS,
                          "num_query_groups": GROUPS, "kv_channels": HD, "normalization": "RMSNorm",
                          "gated_linear_unit": True, "activation": "silu", "add_bias_linear": False,
                          "add_qkv_bias": False, "qk_layernorm": False, "position_embedding_type": "rope"}


def _params(tp: int, layers: list[int], first: bool, last: bool, tied: bool = False,
            norm_dtype: str = "float32", prefix: str = "") -> dict[str, tuple[tuple[int, ...], str]]:
    """What ``named_parameters()`` gives on one rank of a local-spec GPTModel (bf16, fp32 norms)."""
    bf = "bfloat16"
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    if first:
        out["embedding.word_embeddings.weight"] = ((PADDED // tp, H), bf)
    for i in range(len(layers)):
        p = f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = ((H,), norm_dtype)
        out[p + "self_attention.linear_qkv.weight"] = (((HEADS + 2 * GROUPS) * HD // tp, H), bf)
        out[p + "self_attention.linear_proj.weight"] = ((H, HEADS * HD // tp), bf)
        out[p + "pre_mlp_layernorm.weight"] = ((H,), norm_dtype)
        out[p + "mlp.linear_fc1.weight"] = ((2 * FFN // tp, H), bf)
        out[p + "mlp.linear_fc2.weight"] = ((H, FFN // tp), bf)
    if last:
        out["decoder.final_layernorm.weight"] = ((H,), norm_dtype)
        if not tied or not first:
            out["output_layer.weight"] = ((PADDED // tp, H), bf)
    return {prefix + k: v for k, v in out.items()}


def _job(tp: int, pp: int, dp: int = 1, *, order: str = "tp-dp-pp", tied: bool = False,
         vpp: int = 1) -> tuple[MegatronConfig, list[RankReport]]:
    """Reports of a tp × pp × dp job; ``order``: megatron-core's rank order (fastest first)."""
    sizes = {"tp": tp, "dp": dp, "pp": pp}
    axes = order.split("-")
    per = FIELDS["num_layers"] // (pp * vpp)
    reports = []
    for rank in range(tp * pp * dp):
        c, r = {}, rank
        for a in axes:
            r, c[a] = divmod(r, sizes[a])
        chunks = [list(range((v * pp + c["pp"]) * per, (v * pp + c["pp"] + 1) * per)) for v in range(vpp)]
        params: dict[str, tuple[tuple[int, ...], str]] = {}
        for v, ls in enumerate(chunks):
            params.update(_params(tp, ls, c["pp"] == 0 and v == 0, c["pp"] == pp - 1 and v == vpp - 1, tied,
                                  prefix=f"model{v}." if vpp > 1 else ""))
        reports.append(RankReport(rank, c["pp"], c["tp"], c["dp"], layers=tuple(tuple(ls) for ls in chunks),
                                  params=params))
    return MegatronConfig(FIELDS, PADDED, tied, tp=tp, pp=pp, vpp=vpp), reports


def test_tp2_pp2_holders_follow_each_ranks_coordinates() -> None:
    """Two rank orders give the same regions, each held by the ranks whose coordinates hold them."""
    for order in ("tp-dp-pp", "pp-dp-tp"):
        cfg, reports = _job(2, 2, 2, order=order)
        m = live_manifest(cfg, reports, VOCAB)
        where = {(r.pp, r.tp): set() for r in reports}
        for r in reports:
            where[(r.pp, r.tp)].add(r.rank)
        q = m.arrays["model.layers.3.self_attn.q_proj.weight"]
        assert q.shape == (HEADS * HD, H) and q.data_type == "bfloat16"
        # layer 3 is stage 1's local layer 1; each TP rank holds one query group: q rows of 2 heads
        got = {(c.region.offsets[0], c.tensor("")): set(c.holders) for c in q.chunks}
        assert got == {(0, "decoder.layers.1.self_attention.linear_qkv.weight"): where[(1, 0)],
                       (2 * HD, "decoder.layers.1.self_attention.linear_qkv.weight"): where[(1, 1)]}, order
        k = m.arrays["model.layers.3.self_attn.k_proj.weight"]
        assert sorted((c.region.offsets[0], c.local_offsets[0]) for c in k.chunks) == [(0, 2 * HD), (HD, 2 * HD)]
        emb = m.arrays["model.embed_tokens.weight"]
        assert emb.shape == (VOCAB, H)
        assert {c.region.offsets[0]: (c.region.sizes[0], set(c.holders)) for c in emb.chunks} == {
            0: (128, where[(0, 0)]), 128: (VOCAB - 128, where[(0, 1)])}  # the padding rows are not sent
        assert m.arrays["model.layers.0.input_layernorm.weight"].data_type == "float32"  # the parameter's dtype
        assert m.world_size == 8


def test_virtual_pipeline_chunks_are_named_and_staged() -> None:
    cfg, reports = _job(1, 2, vpp=2)  # 4 layers: chunk 0 of rank 0 = layer 0, rank 1 = 1, chunk 1: 2, 3
    m = live_manifest(cfg, reports, VOCAB)
    tensors = {(a, c.tensor(a)): c.holders for a, _, c in m.iter_chunks() if "layers" in a and "q_proj" in a}
    assert tensors == {
        ("model.layers.0.self_attn.q_proj.weight", "model0.decoder.layers.0.self_attention.linear_qkv.weight"): (0,),
        ("model.layers.1.self_attn.q_proj.weight", "model0.decoder.layers.0.self_attention.linear_qkv.weight"): (1,),
        ("model.layers.2.self_attn.q_proj.weight", "model1.decoder.layers.0.self_attention.linear_qkv.weight"): (0,),
        ("model.layers.3.self_attn.q_proj.weight", "model1.decoder.layers.0.self_attention.linear_qkv.weight"): (1,)}
    assert m.arrays["lm_head.weight"].chunks[0].tensor("") == "model1.output_layer.weight"
    assert m.arrays["lm_head.weight"].chunks[0].holders == (1,)


def test_tied_embedding_at_pp2_is_listed_once_from_the_first_stage() -> None:
    cfg, reports = _job(1, 2, tied=True)
    assert "output_layer.weight" in reports[1].params  # Megatron's copy on the last stage
    m = live_manifest(cfg, reports, VOCAB)
    assert "lm_head.weight" not in m.arrays
    (c,) = m.arrays["model.embed_tokens.weight"].chunks
    assert c.holders == (0,) and c.tensor("") == "embedding.word_embeddings.weight"


def _problems(cfg: MegatronConfig, reports: list[RankReport], vocab: int = VOCAB) -> list[str]:
    with pytest.raises(FormatError) as e:
        live_manifest(cfg, reports, vocab)
    return e.value.problems


def test_what_it_does_not_know_is_refused_by_name() -> None:
    cfg, reports = _job(2, 1)
    extra = dict(reports[0].params, **{"decoder.layers.0.self_attention.linear_qkv.lora_A.weight": ((4, H), "bfloat16")})
    p = _problems(cfg, [RankReport(0, 0, 0, 0, layers=reports[0].layers, params=extra), reports[1]])
    assert p == ["megatron: rank 0: parameter decoder.layers.0.self_attention.linear_qkv.lora_A.weight [4, 64] is not one "
                 "the llama/qwen layout maps to a Hugging Face array (an architecture manifest_from_megatron does "
                 "not know)"]
    short = {k: v for k, v in reports[1].params.items() if k != "decoder.final_layernorm.weight"}
    p = _problems(cfg, [reports[0], RankReport(1, 0, 1, 0, layers=reports[1].layers, params=short)])
    assert p == ["megatron: rank 1: has no parameter decoder.final_layernorm.weight (the layout expects [64])"]
    wrong = dict(reports[1].params, **{"decoder.layers.0.mlp.linear_fc2.weight": ((H, FFN), "bfloat16")})
    p = _problems(cfg, [reports[0], RankReport(1, 0, 1, 0, layers=reports[1].layers, params=wrong)])
    assert p == ["megatron: rank 1: decoder.layers.0.mlp.linear_fc2.weight has shape [64, 128], the layout expects "
                 "[64, 64]"]
    assert "does not fit the model's padded vocabulary 256" in _problems(cfg, reports, vocab=300)[0]
    dup = [reports[0], RankReport(1, 0, 0, 0, layers=reports[1].layers, params=reports[1].params)]
    assert "ranks 0 and 1 have the same coordinates" in _problems(cfg, dup)[0]


@pytest.mark.parametrize("field,value,needle", [
    ("normalization", "LayerNorm", "normalization 'LayerNorm'"),
    ("multi_latent_attention", True, "multi_latent_attention"),
    ("gated_linear_unit", False, "gated_linear_unit=False"),
    ("activation", "gelu", "activation_func 'gelu'"),
    ("moe_shared_expert_intermediate_size", 64, "shared experts"),
])
def test_configs_without_an_hf_layout_are_refused(field: str, value: Any, needle: str) -> None:
    cfg = MegatronConfig({**FIELDS, field: value}, PADDED, False)
    with pytest.raises(FormatError) as e:
        hf_config(cfg, VOCAB)
    assert needle in e.value.problems[0] and "is not supported" in e.value.problems[0]


def test_grouped_mlp_and_custom_stage_splits_are_refused() -> None:
    cfg, reports = _job(1, 1)
    grouped = dict(reports[0].params, **{"decoder.layers.0.mlp.experts.weight1": ((H, 4 * FFN), "bfloat16")})
    p = _problems(cfg, [RankReport(0, 0, 0, 0, layers=reports[0].layers, params=grouped)])
    assert "GroupedMLP's weight1/weight2" in p[0]
    cfg, reports = _job(1, 2)
    odd = [RankReport(0, 0, 0, 0, layers=((0, 1, 3),), params=reports[0].params), reports[1]]
    assert "virtual stage 0 holds layers [0, 1, 3]" in _problems(cfg, odd)[0]


def test_qwen_families_map_from_the_config() -> None:
    assert hf_config(MegatronConfig({**FIELDS, "qk_layernorm": True}, PADDED, False), VOCAB)["model_type"] == "qwen3"
    assert hf_config(MegatronConfig({**FIELDS, "add_qkv_bias": True}, PADDED, True), VOCAB)["model_type"] == "qwen2"
    moe = hf_config(MegatronConfig({**FIELDS, "qk_layernorm": True, "num_moe_experts": 8, "moe_ffn_hidden_size": 32,
                                    "moe_router_topk": 2}, PADDED, False), VOCAB)
    assert (moe["model_type"], moe["num_experts"], moe["moe_intermediate_size"]) == ("qwen3_moe", 8, 32)


@pytest.mark.parametrize("parts", [[3, 1], [1, 3], [2, 1, 1], [1, 2, 1]])
def test_uneven_first_and_last_stages(parts: list[int]) -> None:
    cfg, reports = _job(1, len(parts))
    starts = [sum(parts[:k]) for k in range(len(parts))]
    reports = [RankReport(r.rank, r.pp, r.tp, r.dp, layers=(tuple(range(starts[r.pp], starts[r.pp] + parts[r.pp])),),
                          params=_params(1, list(range(parts[r.pp])), r.pp == 0, r.pp == len(parts) - 1))
               for r in reports]
    m = live_manifest(cfg, reports, VOCAB)
    for layer in range(4):
        stage = max(k for k in range(len(parts)) if starts[k] <= layer)
        (c,) = [c for c in m.arrays[f"model.layers.{layer}.input_layernorm.weight"].chunks]
        assert c.holders == (stage,) and c.tensor("") == f"decoder.layers.{layer - starts[stage]}.input_layernorm.weight"


def test_vocab_left_to_the_receivers_is_cut_to_their_rows() -> None:
    """``vocab_size`` None: the vocabulary arrays travel as ``open_rows`` (both wire forms) and a
    refit cuts them to the receivers' rows; receivers with more rows than the padding are refused."""
    from formats.errors import PlanError
    from formats.layouts.mesh import Mesh
    from formats.layouts.presets import preset_manifest
    from formats.manifest.wire import COMPACT_FORMAT_VERSION, dumps_manifest, loads_manifest
    from streamer.plan.open_rows import bind_open_rows

    cfg, reports = _job(2, 2)
    m = live_manifest(cfg, reports, None)
    assert m.open_rows == ("model.embed_tokens.weight", "lm_head.weight")
    assert m.arrays["model.embed_tokens.weight"].shape == (PADDED, H)
    for version in (1, COMPACT_FORMAT_VERSION):
        back = loads_manifest(dumps_manifest(m, format_version=version))
        assert back.open_rows == m.open_rows and back.tensors == m.tensors
    hf = hf_config(cfg, VOCAB)
    bound = bind_open_rows(m, preset_manifest(hf, "hf", Mesh(("tp",), (1,)), dtype="bfloat16"))
    assert not bound.open_rows
    emb = bound.arrays["model.embed_tokens.weight"]
    assert emb.shape == (VOCAB, H)
    assert sorted((c.region.offsets[0], c.region.sizes[0]) for c in emb.chunks) == [(0, 128), (128, VOCAB - 128)]
    # the local tensors keep their padded shapes: what push() checks the parameters against
    assert bound.local_tensors(0)["embedding.word_embeddings.weight"].shape == (PADDED // 2, H)
    big = preset_manifest(dict(hf, vocab_size=300), "hf", Mesh(("tp",), (1,)), dtype="bfloat16")
    with pytest.raises(PlanError) as e:
        bind_open_rows(m, big)
    assert e.value.problems[0].startswith("model.embed_tokens.weight: the receivers hold [300, 64], the sender [256, 64]")
    with pytest.raises(Exception, match="open_rows"):
        loads_manifest(dumps_manifest(m).replace('"open_rows":["model.embed_tokens.weight"', '"open_rows":["nope"'))
