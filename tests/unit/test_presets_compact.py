"""Presets emit compact layouts directly (``Builder.spread`` / ``Builder.sharded``).

Oracle: the v1 builder (``compact=False``), which lists every chunk one by one as it always did.
For every preset over meshes and options beyond ``test_compact``'s, the directly emitted manifest
has the same arrays and chunks (v1 JSON byte for byte), the same compact JSON as fitting layouts
to the v1 chunks, validates, and plans to the same digest in both directions, parsed back or not.
Then: the regular arrays really are placed without a chunk each, and at DeepSeek-V3 / Qwen3-235B
scale ``layout`` stays small in memory (it expanded 1.44M chunks to 1.6 GB before).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_presets import DSV3, DSV3_FP8, DSV3_FP8_ODD, LLAMA_BIAS, MOE, QWEN3

from formats.layouts import parse_mesh
from formats.layouts.presets import preset_manifest
from formats.layouts.presets.builder import Builder
from formats.manifest.wire import Manifest, dumps_manifest, loads_manifest
from formats.validate.manifest import validate_manifest
from streamer.plan.planner import plan_transfers

CONFIGS = {"qwen3": QWEN3, "llama_bias": LLAMA_BIAS, "moe": MOE, "dsv3": DSV3, "dsv3_fp8": DSV3_FP8,
           "dsv3_fp8_odd": DSV3_FP8_ODD}
#: meshes (and options) beyond test_compact's: several pinned axes at once, uneven expert
#: splits, kv heads replicated over tp, the TP-first mesh order of fsdp2, Megatron's expert options
MESHES: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "megatron": [("pp=2,ep=2,tp=2", {}), ("pp=2,dp=2,ep=2,tp=1", {}), ("ep=2,tp=2", {"expert_tensor_parallel": 1}),
                 ("pp=2,tp=2", {"moe_grouped_gemm": True})],
    "vllm": [("tp=8", {}), ("ep=2", {}), ("pp=2,ep=2,tp=2", {}), ("ep=4,tp=1", {}), ("dp=3,tp=4", {}), ("tp=2", {"expert_parallel": True})],
    "sglang": [("pp=3,tp=2", {}), ("ep=2,tp=4", {})],
    "fsdp2": [("tp=2,fsdp=3", {}), ("pp=2,fsdp=2,tp=2", {}), ("fsdp=4,tp=3", {}), ("cp=2,fsdp=2", {})],
    "hf": [("tp=1", {})],
}
FILES = "rank-{rank:05d}.safetensors"


def _build(cname: str, preset: str, mesh: str, kw: dict[str, Any], compact: bool) -> Manifest | None:
    try:
        return preset_manifest(CONFIGS[cname], preset, parse_mesh(mesh), fp8="fp8" in cname, compact=compact,
                               file_pattern=FILES if preset != "hf" else None, **kw)
    except Exception as e:  # noqa: BLE001 - a combination the preset refuses is not this test's business
        if type(e).__name__ in ("PresetError", "LayoutError"):
            return None
        raise


def _cases() -> list[Any]:
    return [pytest.param(preset, mesh, kw, cname, id=f"{preset}-{mesh}-{cname}{'-' + '-'.join(kw) if kw else ''}")
            for preset, meshes in MESHES.items() for mesh, kw in meshes for cname in CONFIGS]


@pytest.mark.parametrize("preset,mesh,kw,cname", _cases())
def test_direct_layouts_equal_the_v1_chunks_and_plan_the_same(preset: str, mesh: str, kw: dict[str, Any],
                                                              cname: str) -> None:
    v1 = _build(cname, preset, mesh, kw, compact=False)
    if v1 is None:
        pytest.skip("the preset refuses this model / mesh")
    direct = _build(cname, preset, mesh, kw, compact=True)
    assert direct is not None and list(direct.arrays) == list(v1.arrays)
    assert any(a.ref is not None for a in direct.arrays.values())
    text = dumps_manifest(direct, format_version=2)
    assert text == dumps_manifest(v1, format_version=2)  # the layouts fitting v1's chunks finds
    assert dumps_manifest(direct) == dumps_manifest(v1)  # every chunk, byte for byte
    back = loads_manifest(text)
    assert validate_manifest(back) == []
    hf = preset_manifest(CONFIGS[cname], "hf", parse_mesh("tp=1"), fp8="fp8" in cname, compact=False)
    for m in (direct, back):
        assert plan_transfers(m, hf).digest() == plan_transfers(v1, hf).digest()
        assert plan_transfers(hf, m).digest() == plan_transfers(hf, v1).digest()


#: (preset, mesh, config) -> the arrays still placed chunk by chunk: padded vocab pieces (not
#: torch.chunk pieces), Megatron's per-query-group QKV interleave
EXPLICIT: list[tuple[str, str, str, set[str]]] = [
    ("vllm", "dp=2,tp=4", "moe", {"model.embed_tokens.weight", "lm_head.weight"}),
    ("vllm", "ep=2,tp=2", "dsv3_fp8", {"model.embed_tokens.weight", "lm_head.weight"}),
    ("vllm", "ep=2", "dsv3_fp8_odd", {"model.embed_tokens.weight", "lm_head.weight"}),
    ("megatron", "pp=2,ep=2,tp=2", "dsv3_fp8", {"model.embed_tokens.weight", "lm_head.weight"}),
    ("megatron", "tp=2", "qwen3", {"model.embed_tokens.weight", "lm_head.weight"}
     | {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(4) for p in "qkv"}),
    ("fsdp2", "fsdp=2,tp=2", "moe", set()),
    ("hf", "tp=1", "dsv3_fp8", set()),
]


@pytest.mark.parametrize("preset,mesh,cname,explicit", [pytest.param(*c, id=f"{c[0]}-{c[1]}-{c[2]}") for c in EXPLICIT])
def test_regular_arrays_are_placed_as_layouts_not_chunk_by_chunk(monkeypatch: Any, preset: str, mesh: str,
                                                                 cname: str, explicit: set[str]) -> None:
    put: set[str] = set()
    orig = Builder.put

    def counting_put(self: Builder, fqn: str, *args: Any, **kwargs: Any) -> None:
        put.add(fqn)
        orig(self, fqn, *args, **kwargs)

    monkeypatch.setattr(Builder, "put", counting_put)
    m = _build(cname, preset, mesh, {}, compact=True)
    assert m is not None
    scales = {n + "_scale_inv" for n in explicit if n + "_scale_inv" in m.arrays}
    assert put == explicit | scales
    assert all(not a.expanded for a in m.arrays.values() if a.ref is not None)
    put.clear()
    v1 = _build(cname, preset, mesh, {}, compact=False)  # the v1 builder still puts every chunk
    assert v1 is not None and put == set(v1.arrays)


def test_a_scale_that_does_not_follow_its_weight_layout_is_placed_chunk_by_chunk() -> None:
    """An FP8 scale whose own torch.chunk split is not its weight's split in block units (here a
    scale array with a row more than ``ceil(rows / block)``) is not given the weight's layout:
    both go chunk by chunk, exactly as the v1 builder places them."""
    arrays = {"w.weight": ((32, 16), "float8_e4m3fn"), "w.weight_scale_inv": ((3, 1), "float32"),
              "v.weight": ((32, 16), "float8_e4m3fn"), "v.weight_scale_inv": ((2, 1), "float32")}
    built = []
    for compact in (True, False):
        b = Builder(parse_mesh("tp=2"), arrays, None, fp8_block=(16, 16), compact=compact)
        for w in ("w.weight", "v.weight"):
            b.spread(w, w, {}, split=("tp", 0))
        built.append((b.build(name="m", domain_size=None), set(b.refs)))
    (direct, refs), (v1, _) = built
    assert refs == {"v.weight", "v.weight_scale_inv"}  # the regular pair still goes by layout
    assert dumps_manifest(direct) == dumps_manifest(v1)
    assert [str(c.region) for c in direct.arrays["w.weight_scale_inv"].chunks] == ["[0:1, 0:1]", "[1:2, 0:1]"]


WORKLOADS = Path(__file__).resolve().parents[2] / "workloads" / "models"
SCALE = [
    ("dsv3-vllm", "deepseek-v3", "vllm --mesh dp=8,tp=32"),
    ("dsv3-megatron", "deepseek-v3", "megatron --mesh pp=16,ep=8,tp=2 --first-stage-layers 3 --last-stage-layers 2"),
    ("qwen3-235b-megatron", "qwen3-235b-a22b",
     "megatron --mesh pp=8,ep=8,tp=2 --first-stage-layers 10 --last-stage-layers 12"),
    ("qwen3-235b-vllm", "qwen3-235b-a22b", "vllm --mesh dp=16,tp=8"),
]


@pytest.mark.slow
@pytest.mark.parametrize("model,preset", [pytest.param(m, p, id=i) for i, m, p in SCALE])
def test_layout_at_scale_writes_a_small_manifest_in_little_memory(tmp_path: Any, model: str, preset: str) -> None:
    """Issue 14's ``layout`` targets: under 1 MB written, by a fresh process that peaks under
    300 MB (placing and fitting every chunk took 1.6 GB for DeepSeek-V3 on vLLM DP8×TP32); the
    command validates what it writes."""
    out = tmp_path / "m.json"
    argv = ["layout", "--model", str(WORKLOADS / f"{model}.config.json"), "--preset", *preset.split(),
            "--no-files", "-o", str(out)]
    # peak RSS of the fresh process: VmHWM (ru_maxrss of a child carries the forking parent's peak over)
    code = ("import sys\n"
            "from streamer.cli.app import main\n"
            "assert main(sys.argv[1:]) == 0\n"
            "print(next(ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('VmHWM')))\n")
    res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True)
    assert out.stat().st_size < 1_000_000
    assert int(res.stdout.split()[-1]) < 300 * 1024  # kB
