"""formats.manifest.compact: the compact manifest form (format_version 2).

Oracle: the v1 writer. For every preset and a few meshes, the compact form expands to exactly
the v1 JSON (byte for byte after ``dumps_manifest``), plans to the same digest, and validation
of the compact form sees the same manifest as valid without expanding a single array.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from test_presets import DSV3, DSV3_FP8, LLAMA_BIAS, MOE, QWEN3, QWEN3_TIED

from formats.errors import ManifestError
from formats.layouts import Mesh, Rule, Shard, apply_layout, manifest_from_arrays, parse_mesh
from formats.layouts.presets import PRESETS, preset_manifest
from formats.manifest.wire import Manifest, dumps_manifest, loads_manifest
from formats.validate.manifest import validate_manifest
from streamer.plan.planner import plan_transfers

#: (preset, mesh) pairs each preset accepts; megatron / vllm axes in their rank order
MESHES: dict[str, list[str]] = {
    "megatron": ["tp=2", "pp=2,tp=2", "pp=2,ep=2,tp=1", "dp=2,tp=2"],
    "vllm": ["tp=2", "dp=2,tp=2", "pp=2,tp=2", "ep=2,tp=2", "dp=2,tp=4"],
    "sglang": ["tp=2", "dp=2,tp=2", "ep=2,tp=2", "tp=4"],
    "fsdp2": ["fsdp=3", "dp=2,fsdp=2", "fsdp=2,tp=2"],
    "hf": ["tp=1"],
}
CONFIGS = {"qwen3": QWEN3, "tied": QWEN3_TIED, "llama_bias": LLAMA_BIAS, "moe": MOE, "dsv3": DSV3,
           "dsv3_fp8": DSV3_FP8}


def _cases() -> list[Any]:
    out = []
    for preset in PRESETS:
        for mesh in MESHES[preset]:
            for cname in CONFIGS:
                if "ep=" in mesh and cname not in ("moe", "dsv3"):
                    continue
                out.append(pytest.param(preset, mesh, cname, id=f"{preset}-{mesh}-{cname}"))
    return out


def _preset(preset: str, mesh: str, cname: str, files: bool = True, compact: bool = False) -> Manifest | None:
    """The preset's manifest; by default as the v1 writer builds it (every chunk listed)."""
    cfg = CONFIGS[cname]
    try:
        return preset_manifest(cfg, preset, parse_mesh(mesh), fp8=cname.endswith("fp8"), compact=compact,
                               file_pattern="rank-{rank:05d}.safetensors" if files and preset != "hf" else None)
    except Exception as e:  # noqa: BLE001 - a combination the preset refuses is not this test's business
        if type(e).__name__ in ("PresetError", "LayoutError"):
            return None
        raise


@pytest.mark.parametrize("preset,mesh,cname", _cases())
def test_compact_expands_to_the_v1_json(preset: str, mesh: str, cname: str) -> None:
    m = _preset(preset, mesh, cname)
    if m is None:
        pytest.skip("the preset refuses this model / mesh")
    v1 = dumps_manifest(m)
    v2 = dumps_manifest(m, format_version=2)
    back = loads_manifest(v2)
    assert not any(a.expanded for a in back.arrays.values() if a.ref is not None)
    assert validate_manifest(back) == []
    assert not any(a.expanded for a in back.arrays.values() if a.ref is not None), "validate expanded an array"
    assert dumps_manifest(back) == v1
    # writing the compact form again gives the same bytes (layouts are kept, not refitted)
    assert dumps_manifest(back, format_version=2) == v2
    # the preset's own compact (lazy) manifest: the same chunks, the same wire forms
    lazy = _preset(preset, mesh, cname, compact=True)
    assert lazy is not None and any(a.ref is not None for a in lazy.arrays.values())
    assert dumps_manifest(lazy, format_version=2) == v2
    fresh = loads_manifest(v2)
    assert fresh.ranks_holding() == m.ranks_holding()
    for r in range(m.world_size):  # answered from the layouts, without expanding
        assert fresh.local_tensors(r) == m.local_tensors(r)
    assert not any(a.expanded for a in fresh.arrays.values() if a.ref is not None)
    assert dumps_manifest(lazy) == v1


@pytest.mark.parametrize("cname", ["qwen3", "moe", "dsv3"])
def test_compact_is_smaller_and_plans_the_same(cname: str) -> None:
    src = _preset("megatron", "dp=2,tp=2", cname, files=False)
    dst = _preset("vllm", "tp=4", cname, files=False)
    assert src is not None and dst is not None
    c_src, c_dst = (loads_manifest(dumps_manifest(x, format_version=2)) for x in (src, dst))
    assert len(dumps_manifest(dst, format_version=2)) < len(dumps_manifest(dst)) / 2
    a, b = plan_transfers(src, dst), plan_transfers(c_src, c_dst)
    assert a.digest() == b.digest()
    assert a.stats() == b.stats()


def test_rule_layouts_compact_with_uneven_and_nested_shards() -> None:
    like = manifest_from_arrays({"w": ((10, 6), "float32"), "b": ((5,), "bfloat16"), "e": ((0, 3), "float32")})
    mesh = Mesh(("dp", "tp"), (2, 3))
    rules = [Rule("w", (Shard(0), Shard(0))), Rule("b", (Shard(0), Shard(0)))]
    m = apply_layout(like, mesh, rules, file_pattern="r{rank}.safetensors")
    v2 = json.loads(dumps_manifest(m, format_version=2))
    assert isinstance(v2["arrays"]["w"], str) and isinstance(v2["arrays"]["b"], str)
    assert v2["layouts"][v2["arrays"]["w"]]["placements"] == ["S(0)", "S(0)"]
    assert v2["meshes"] == {"dp=2,tp=3": {"axes": ["dp", "tp"], "shape": [2, 3], "ranks": {"start": 0, "stop": 6}}}
    assert dumps_manifest(loads_manifest(json.dumps(v2))) == dumps_manifest(m)


def test_fused_blocks_and_layer_patterns_share_layouts() -> None:
    m = _preset("vllm", "tp=2", "qwen3", files=False)
    assert m is not None
    v2 = json.loads(dumps_manifest(m, format_version=2))
    up = v2["arrays"]["model.layers.2.mlp.up_proj.weight"]
    gate = v2["arrays"]["model.layers.3.mlp.gate_proj.weight"]
    assert up["block"] == [48, 0] and gate == up["layout"]  # gate at the origin, up after it
    assert v2["layouts"][gate]["tensor"] == "model.layers.{layer}.mlp.gate_up_proj.weight"
    n_layers = QWEN3["num_hidden_layers"]
    assert len(v2["layouts"]) < len(v2["arrays"]) / n_layers


def test_megatron_stage_local_layers_use_a_shifted_pattern() -> None:
    m = _preset("megatron", "pp=2,tp=2", "dsv3", files=False)
    assert m is not None
    v2 = json.loads(dumps_manifest(m, format_version=2))
    name = v2["arrays"]["model.layers.3.self_attn.q_b_proj.weight"]
    lay = v2["layouts"][name]
    assert lay["tensor"] == "decoder.layers.{layer-2}.self_attention.linear_q_up_proj.weight"
    assert lay["placements"] == ["P(1)", "S(0)"]


# ------------------------------------------------------------------ strict parsing


def _v2() -> dict[str, Any]:
    m = apply_layout(manifest_from_arrays({"a.weight": ((4, 6), "float32"), "b.bias": ((6,), "float32")}),
                     Mesh(("tp",), (2,)), [Rule("a.weight", (Shard(1),))], file_pattern=None)
    d: dict[str, Any] = json.loads(dumps_manifest(m, format_version=2))
    return d


BAD: list[tuple[str, Any, str]] = [
    ("unknown-layout-key", lambda d: d["layouts"]["L0"].update(stride=2),
     "layouts.L0: unknown key 'stride'"),
    ("unknown-mesh-key", lambda d: d["meshes"]["tp=2"].update(devices=[0, 1]),
     "meshes.tp=2: unknown key 'devices'"),
    ("unknown-ref-key", lambda d: d["arrays"].update({"a.weight": {"layout": "L0", "offset": [0, 0]}}),
     "a.weight: unknown key 'offset'"),
    ("undeclared-layout", lambda d: d["arrays"].update({"a.weight": "L9"}),
     "a.weight: layout 'L9' is not declared in 'layouts'"),
    ("undeclared-mesh", lambda d: d["layouts"]["L0"].update(mesh="nope"),
     "layouts.L0: mesh 'nope' is not declared in 'meshes'"),
    ("bad-placement", lambda d: d["layouts"]["L0"].update(placements=["Q(1)"]),
     "layouts.L0: bad placement 'Q(1)'"),
    ("placement-count", lambda d: d["layouts"]["L0"].update(placements=["R", "R"]),
     "layouts.L0: 2 placement(s) for the 1-axis mesh 'tp=2'"),
    ("ranks-count", lambda d: d["meshes"]["tp=2"].update(ranks={"start": 0, "stop": 3}),
     "meshes.tp=2: ranks range(0, 3, 1) has 3 ranks but the mesh tp=2 has 2"),
    ("block-ndim", lambda d: d["arrays"].update({"a.weight": {"layout": "L0", "block": [1]}}),
     "a.weight: block has 1 entries, expected 2"),
    ("lone-brace", lambda d: d["layouts"]["L0"].update(tensor="x{"),
     "layouts.L0: tensor pattern 'x{' has a lone '{'"),
    ("unknown-var", lambda d: d["layouts"]["L0"].update(tensor="x.{rank}"),
     "layouts.L0: tensor pattern 'x.{rank}' uses {rank}"),
    ("v1-with-layout", lambda d: d.update(format_version=1, layouts=None) or d.pop("layouts") and d.pop("meshes"),
     "an array given by a layout needs format_version 2"),
]


@pytest.mark.parametrize("mutate,expect", [pytest.param(f, e, id=i) for i, f, e in BAD])
def test_strict_parse_names_key_and_place(mutate: Any, expect: str) -> None:
    d = _v2()
    mutate(d)
    with pytest.raises(ManifestError) as ei:
        loads_manifest(json.dumps(d), where="m.json")
    assert any(expect in p for p in ei.value.problems), ei.value.problems


def test_validation_of_a_bad_layout_is_once_and_names_the_array() -> None:
    d = _v2()
    d["layouts"]["L0"]["placements"] = ["S(5)"]
    d["layouts"]["L0"]["tensor"] = "t.{layer}"
    m = loads_manifest(json.dumps(d), where="m.json")
    probs = validate_manifest(m, where="m.json")
    first = next(iter(k for k, v in d["arrays"].items() if v == "L0"))
    assert len([p for p in probs if "S(5)" in p]) == 1
    assert probs[0].startswith(f"m.json: {first}: layout 'L0': S(5) on axis 'tp'"), probs
    assert not any(a.expanded for a in m.arrays.values())


def test_pattern_needs_the_array_number() -> None:
    d = _v2()
    d["layouts"]["L1"]["tensor"] = "decoder.layers.{layer}.w"
    m = loads_manifest(json.dumps(d))
    probs = validate_manifest(m)
    who = next(k for k, v in d["arrays"].items() if v == "L1")
    assert any(f"{who}: layout 'L1': tensor pattern 'decoder.layers.{{layer}}.w' needs {{layer}}" in p
               for p in probs), probs


def test_mesh_beyond_world_size_is_reported() -> None:
    d = _v2()
    d["meshes"]["tp=2"]["ranks"] = {"start": 1, "stop": 3}
    probs = validate_manifest(loads_manifest(json.dumps(d)))
    assert any("mesh 'tp=2' reaches rank 2, outside world_size 2" in p for p in probs), probs


def test_local_overlap_between_compact_arrays_is_found() -> None:
    m = _preset("vllm", "tp=2", "qwen3", files=False)
    assert m is not None
    d = json.loads(dumps_manifest(m, format_version=2))
    d["arrays"]["model.layers.0.mlp.up_proj.weight"]["block"] = [10, 0]  # into gate's rows
    probs = validate_manifest(loads_manifest(json.dumps(d)))
    assert any("overlapping ranges of local tensor 'model.layers.0.mlp.gate_up_proj.weight'" in p for p in probs)


def test_explicit_chunks_mix_with_layouts_and_chunks_stay_a_property() -> None:
    d = _v2()
    v1 = json.loads(dumps_manifest(loads_manifest(json.dumps(d))))
    mixed = copy.deepcopy(d)
    mixed["arrays"]["b.bias"] = v1["arrays"]["b.bias"]
    m = loads_manifest(json.dumps(mixed))
    assert m.arrays["b.bias"].ref is None and m.arrays["a.weight"].ref is not None
    assert [str(c.region) for c in m.arrays["a.weight"].chunks] == ["[0:4, 0:3]", "[0:4, 3:6]"]
    assert m.arrays["a.weight"].expanded
    assert m.arrays["a.weight"] == loads_manifest(json.dumps(v1)).arrays["a.weight"]


# ------------------------------------------------------------------ runs of expert arrays


def _moe_v2(mesh: str = "tp=2") -> dict[str, Any]:
    m = _preset("vllm", mesh, "moe", files=False)
    assert m is not None
    d: dict[str, Any] = json.loads(dumps_manifest(m, format_version=2))
    return d


def test_expert_arrays_are_one_run_per_layer() -> None:
    d = _moe_v2()
    run = d["arrays"]["model.layers.1.mlp.experts.{expert}"]
    assert run["experts"] == {"start": 0, "stop": MOE["num_experts"]}
    assert list(run["members"]) == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    up = run["members"]["up_proj.weight"]
    assert len(up) == 1 and up[0]["block"] == [16, 0] and up[0]["step"] == [32, 0]  # [gate_e; up_e] stacked
    m = loads_manifest(json.dumps(d))
    spec = m.arrays["model.layers.1.mlp.experts.4.up_proj.weight"]
    assert spec.ref is not None and spec.ref.block == (4 * 32 + 16, 0)
    assert list(m.arrays).index("model.layers.1.mlp.experts.0.up_proj.weight") == \
        list(m.arrays).index("model.layers.1.mlp.experts.0.gate_proj.weight") + 1


RUN_BAD: list[tuple[str, Any, str]] = [
    ("run-unknown-key", lambda r: r.update(count=3), "unknown key 'count'"),
    ("segment-unknown-key", lambda r: r["members"]["gate_proj.weight"][0].update(stride=[1, 0]),
     "members.gate_proj.weight[0]: unknown key 'stride'"),
    ("segments-short", lambda r: r["members"]["gate_proj.weight"][0].update(stop=3),
     "members.gate_proj.weight: segments end at expert 3, expected experts.stop 6"),
    ("segment-layout", lambda r: r["members"]["gate_proj.weight"][0].update(layout="nope"),
     "layout 'nope' is not declared in 'layouts'"),
    ("run-not-object", lambda r: r.clear(), "a run needs 'experts'"),
]


@pytest.mark.parametrize("mutate,expect", [pytest.param(f, e, id=i) for i, f, e in RUN_BAD])
def test_strict_parse_of_runs(mutate: Any, expect: str) -> None:
    d = _moe_v2()
    mutate(d["arrays"]["model.layers.1.mlp.experts.{expert}"])
    with pytest.raises(ManifestError) as ei:
        loads_manifest(json.dumps(d), where="m.json")
    assert any(expect in p and "model.layers.1.mlp.experts.{expert}" in p for p in ei.value.problems), \
        ei.value.problems


def test_an_array_given_by_a_run_and_on_its_own_is_an_error() -> None:
    d = _moe_v2()
    d["arrays"]["model.layers.1.mlp.experts.2.gate_proj.weight"] = "L0"
    with pytest.raises(ManifestError, match="given twice"):
        loads_manifest(json.dumps(d))


def test_cli_validate_bad_compact_manifest_one_line_per_problem(tmp_path: Any, capsys: Any) -> None:
    from streamer.cli.app import main

    d = _v2()
    d["layouts"]["L0"]["placements"] = ["X"]
    d["arrays"]["a.weight"] = "L7"
    path = tmp_path / "m.json"
    path.write_text(json.dumps(d))
    assert main(["validate", str(path)]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 2 and all(ln.startswith(f"shardstream: {path}: ") or ln.startswith(f"{path}: ") for ln in err)
    assert any("layouts.L0: bad placement 'X'" in ln for ln in err)
    assert any("a.weight: layout 'L7' is not declared" in ln for ln in err)


def test_a_bad_layout_fails_expansion_naming_the_array(tmp_path: Any, capsys: Any) -> None:
    from streamer.cli.app import main

    d = _v2()
    name = next(k for k, v in d["arrays"].items() if v == "L0")
    d["layouts"]["L0"]["placements"] = ["P(5)"]
    m = loads_manifest(json.dumps(d))
    with pytest.raises(ManifestError, match=f"^{name}: layout 'L0': pinned to coordinate 5 of axis 'tp'"):
        _ = m.arrays[name].chunks
    path = tmp_path / "m.json"
    path.write_text(json.dumps(d))
    assert main(["validate", str(path)]) == 1
    assert f"{path}: {name}: layout 'L0': pinned to coordinate 5" in capsys.readouterr().err


@pytest.mark.slow
def test_deepseek_v3_vllm_dp8_tp32_is_small_and_validates_in_little_memory(tmp_path: Any) -> None:
    """Issue 14's targets for the compact form: DeepSeek-V3 on vLLM DP8×TP32 (1.44M chunks) is
    under 1 MB, and a fresh process parses and validates it in under 300 MB, expanding no array."""
    import subprocess
    import sys
    from pathlib import Path

    cfg = Path(__file__).resolve().parents[2] / "workloads" / "models" / "deepseek-v3.config.json"
    m = preset_manifest(cfg, "vllm", parse_mesh("dp=8,tp=32"))
    text = dumps_manifest(m, format_version=2)
    assert len(text) < 1_000_000
    path = tmp_path / "dsv3.json"
    path.write_text(text)
    # peak RSS of the fresh process: VmHWM (ru_maxrss of a child carries the forking parent's peak over)
    code = ("import sys\n"
            "from formats.manifest.wire import load_manifest\n"
            "from formats.validate.manifest import validate_manifest\n"
            "m = load_manifest(sys.argv[1])\n"
            "assert validate_manifest(m) == []\n"
            "assert m.chunk_count() == 1437667 and not any(a.expanded for a in m.arrays.values())\n"
            "print(next(ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('VmHWM')))\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) < 300 * 1024  # kB


def test_fsdp2_over_tp_is_a_strided_shard_order() -> None:
    """FSDP2 shards the TP-local tensor: tp splits first, then fsdp (DTensor's _StridedShard),
    written as ``shard_order``; uneven torch.chunk pieces included (500 rows, 4 ranks)."""
    m = _preset("fsdp2", "fsdp=2,tp=2", "qwen3", files=False, compact=True)
    assert m is not None and all(a.ref is not None for a in m.arrays.values())
    d = json.loads(dumps_manifest(m, format_version=2))
    lay = d["layouts"][d["arrays"]["model.embed_tokens.weight"]]
    assert lay["placements"] == ["S(0)", "S(0)"] and lay["shard_order"] == ["tp", "fsdp"]
    regions = [(str(c.region), c.holders) for c in loads_manifest(json.dumps(d)).arrays["model.embed_tokens.weight"].chunks]
    assert regions == [("[0:250, 0:64]", (0,)), ("[250:500, 0:64]", (2,)), ("[500:750, 0:64]", (1,)),
                       ("[750:1000, 0:64]", (3,))]


def test_shard_order_must_list_the_mesh_axes() -> None:
    d = _v2()
    d["layouts"]["L0"]["shard_order"] = ["tp", "tp"]
    with pytest.raises(ManifestError, match=r"layouts.L0: shard_order must list the axes of mesh 'tp=2' \(tp\) once"):
        loads_manifest(json.dumps(d))


def test_kv_heads_replicated_over_tp_ranks_use_a_split_axis() -> None:
    """vLLM with tp (4) > num_kv_heads (2): TP ranks 2t and 2t+1 hold kv head t, i.e. S(0) over
    ``tp=2`` and R over ``tp_rep=2`` on the same ranks: a second mesh declared next to the first."""
    m = _preset("vllm", "dp=2,tp=4", "qwen3", files=False, compact=True)
    assert m is not None
    d = json.loads(dumps_manifest(m, format_version=2))
    assert d["meshes"]["dp=2,tp=2,tp_rep=2"] == {"axes": ["dp", "tp", "tp_rep"], "shape": [2, 2, 2],
                                                  "ranks": {"start": 0, "stop": 8}}
    k = d["arrays"]["model.layers.1.self_attn.k_proj.weight"]
    assert d["layouts"][k["layout"]]["placements"] == ["R", "S(0)", "R"] and k["block"] == [16, 0]
    chunks = loads_manifest(json.dumps(d)).arrays["model.layers.1.self_attn.k_proj.weight"].chunks
    assert [c.holders for c in chunks] == [(0, 1, 4, 5), (2, 3, 6, 7)]


def test_array_vars_reads_names_as_the_documented_pattern() -> None:
    """``array_vars`` splits names into components; it must read what the regular expression of
    the format (a whole ``layers`` / ``experts`` / ``local_experts`` component, then a whole
    number component; the first occurrence of each wins) reads, on names built to trip it."""
    import random
    import re

    from formats.manifest.compact import array_vars

    pattern = re.compile(r"(?<![^.])(layers|experts|local_experts)\.(\d+)(?![^.])")
    var_of = {"layers": "layer", "experts": "expert", "local_experts": "expert"}
    words = ["layers", "experts", "local_experts", "model", "mlp", "0", "17", "3x", "x3", "", "layers3",
             "١٢", "weight", "blayers", "experts_"]
    rng = random.Random(0)
    for _ in range(5000):
        name = ".".join(rng.choice(words) for _ in range(rng.randint(1, 7)))
        want: dict[str, int] = {}
        for m in pattern.finditer(name):
            want.setdefault(var_of[m.group(1)], int(m.group(2)))
        assert dict(array_vars(name)) == want, name


def test_fill_pattern_equals_the_token_by_token_definition() -> None:
    """``fill_pattern``'s ``str.format`` fast path gives what filling token by token gives (or
    the same error) on patterns with literal braces, shifts and missing or negative numbers."""
    import random

    from formats.manifest.compact_patterns import _tokens, array_vars, fill_pattern

    def reference(pattern: str, fqn: str) -> str:
        vs = array_vars(fqn)
        out = []
        for t in _tokens(pattern):
            if isinstance(t, str):
                out.append(t)
                continue
            if t[1] is None or t[1] not in vs or vs[t[1]] + t[2] < 0:
                raise ValueError(pattern)
            out.append(str(vs[t[1]] + t[2]))
        return "".join(out)

    pieces = ["decoder.", "layers.", "{layer}", "{layer-3}", "{layer+1}", "{expert}", "{expert-32}", "{{", "}}",
              ".w13", "x", "}", "{"]
    names = ["model.layers.5.mlp.experts.40.w", "model.layers.1.w", "lm_head.weight", "a.experts.2.b"]
    rng = random.Random(1)
    for _ in range(3000):
        pattern = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 6)))
        fqn = rng.choice(names)
        try:
            want: str | None = reference(pattern, fqn)
        except ValueError:
            want = None
        if want is None:
            with pytest.raises(ValueError):
                fill_pattern(pattern, fqn)
        else:
            assert fill_pattern(pattern, fqn) == want, (pattern, fqn)
