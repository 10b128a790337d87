"""Refit and convert between framework presets, byte for byte against the HF weights.

Source ranks hold the local tensors their framework builds from the HF weights (the writers of
``tests/unit/test_presets.py``, which follow each framework's documented layout); the plan from
one preset's manifest to another's runs over the loopback transport (every rank a thread) or
through files with ``streamer.convert.convert``; the destination must then hold exactly what its
framework would have built from the same HF weights (vocabulary padding rows stay zero).
"""

from __future__ import annotations

import filecmp
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run_plan_loopback

from formats.layouts import Mesh, parse_mesh
from formats.layouts.presets import preset_manifest
from formats.manifest.wire import Manifest, load_manifest, save_manifest
from formats.safetensors.io import save_tensors
from formats.validate.manifest import validate_data
from streamer.convert import ConvertOptions, convert, plan_files
from streamer.plan.check import validate_plan
from streamer.plan.planner import plan_transfers


def _load_writers() -> Any:
    path = Path(__file__).resolve().parents[1] / "unit" / "test_presets.py"
    name = "_preset_writers"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


P = _load_writers()
QWEN3, QWEN3_TIED, LLAMA_ODD, QWEN2_BIAS, MOE = P.QWEN3, P.QWEN3_TIED, P.LLAMA_ODD, P.QWEN2_BIAS, P.MOE
DSV3, DSV3_FP8, DSV3_FP8_ODD = P.DSV3, P.DSV3_FP8, P.DSV3_FP8_ODD

_TORCH = P._TORCH


def _zeros_like_manifest(m: Manifest) -> dict[int, dict[str, torch.Tensor]]:
    return {r: {n: torch.zeros(ts.shape, dtype=_TORCH[ts.data_type]) for n, ts in m.local_tensors(r).items()}
            for r in range(m.world_size)}


def _same(got: Mapping[int, Mapping[str, torch.Tensor]], want: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
    """Every rank holds the same tensors, byte for byte (zero-size tensors ignored)."""
    for r in sorted(set(got) | set(want)):
        g = {n: x for n, x in got.get(r, {}).items() if x.numel()}
        w = {n: x for n, x in want.get(r, {}).items() if x.numel()}
        assert set(g) == set(w), f"rank {r}: tensors differ: {sorted(set(g) ^ set(w))[:5]}"
        for n, x in w.items():
            assert g[n].dtype == x.dtype and g[n].shape == x.shape, (r, n)
            assert torch.equal(P._bits(g[n]), P._bits(x)), f"rank {r}: {n} differs"


# ------------------------------------------------------------------ live refit (loopback)

REFITS = [
    # (id, cfg, (src preset, mesh, kw), (dst preset, mesh, kw))
    ("megatron-pp2tp2-to-vllm-tp4", QWEN3, ("megatron", "pp=2,tp=2", {}), ("vllm", "tp=4", {})),
    ("vllm-dp2tp2-to-megatron-pp2dp1tp2", QWEN3, ("vllm", "dp=2,tp=2", {}), ("megatron", "pp=2,tp=2", {})),
    ("megatron-tp3-uneven-vocab-to-fsdp2-fsdp4", LLAMA_ODD, ("megatron", "tp=3", {}), ("fsdp2", "fsdp=4", {})),
    ("fsdp2-fsdp3tp2-to-vllm-tp2", QWEN3, ("fsdp2", "fsdp=3,tp=2", {}), ("vllm", "tp=2", {})),
    ("megatron-qwen2-bias-to-sglang-pp3", QWEN2_BIAS, ("megatron", "pp=2,tp=2", {}), ("sglang", "pp=3,tp=2", {})),
    ("vllm-tied-pp2-to-megatron-tied-tp2", QWEN3_TIED, ("vllm", "pp=2,tp=2", {}), ("megatron", "tp=2", {})),
    # fp32 master weights (the config's torch_dtype, no dtype flag), tied embeddings from FSDP2
    ("fp32-fsdp2-fsdp2tp2-to-megatron-pp2tp2", dict(QWEN3, torch_dtype="float32"), ("fsdp2", "fsdp=2,tp=2", {}),
     ("megatron", "pp=2,tp=2", {})),
    ("fp32-tied-fsdp2-fsdp3-to-vllm-pp2tp2", dict(QWEN3_TIED, torch_dtype="float32"), ("fsdp2", "fsdp=3", {}),
     ("vllm", "pp=2,tp=2", {})),
    ("moe-megatron-ep2tp2-to-vllm-tp4", MOE, ("megatron", "ep=2,tp=2", {}), ("vllm", "tp=4", {})),
    ("moe-megatron-ep3-to-vllm-ep4-uneven", MOE, ("megatron", "pp=3,ep=3", {}),
     ("vllm", "tp=4", {"expert_parallel": True})),
    ("moe-vllm-dp-ep-to-megatron-grouped-etp1", MOE, ("vllm", "ep=2,tp=2", {}),
     ("megatron", "dp=2,ep=3,tp=2", {"expert_tensor_parallel": 1, "moe_grouped_gemm": True})),
    ("moe-megatron-etp1-to-megatron-ep2tp2", MOE, ("megatron", "ep=3,tp=2", {"expert_tensor_parallel": 1}),
     ("megatron", "ep=2,tp=2", {})),
    # DeepSeek-V3 (MLA, dense layer 0, routed + shared experts, router bias)
    ("dsv3-megatron-pp2ep2tp2-to-vllm-tp2", DSV3, ("megatron", "pp=2,ep=2,tp=2", {}), ("vllm", "tp=2", {})),
    ("dsv3-vllm-dp-ep2tp2-to-megatron-tp2-grouped", DSV3, ("vllm", "ep=2,tp=2", {}),
     ("megatron", "tp=2", {"moe_grouped_gemm": True})),
    ("dsv3-megatron-etp1-to-sglang-tp2", DSV3, ("megatron", "ep=2,tp=2", {"expert_tensor_parallel": 1}),
     ("sglang", "tp=2", {})),
    ("dsv3-fp8-megatron-pp2tp2-to-vllm-tp2-ep", DSV3_FP8, ("megatron", "pp=2,tp=2", {"fp8": True}),
     ("vllm", "tp=2", {"fp8": True, "expert_parallel": True})),
    ("dsv3-fp8-vllm-ep3tp2-to-megatron-pp2ep2tp2", DSV3_FP8, ("vllm", "ep=3,tp=2", {"fp8": True}),
     ("megatron", "pp=2,ep=2,tp=2", {"fp8": True})),
    ("dsv3-fp8-odd-blocks-vllm-ep2-to-megatron-ep2", DSV3_FP8_ODD, ("vllm", "ep=2", {"fp8": True}),
     ("megatron", "ep=2", {"fp8": True})),
]


@pytest.mark.parametrize("cfg,src,dst", [r[1:] for r in REFITS], ids=[r[0] for r in REFITS])
def test_refit_between_presets(cfg: dict[str, Any], src: tuple[str, str, dict[str, Any]],
                               dst: tuple[str, str, dict[str, Any]]) -> None:
    sp, smesh, skw = src
    dp, dmesh, dkw = dst
    assert skw.get("fp8", False) == dkw.get("fp8", False)
    W = P.hf_weights(cfg, seed=1, fp8=skw.get("fp8", False))
    sm, dm = parse_mesh(smesh), parse_mesh(dmesh)
    s_man = preset_manifest(cfg, sp, sm, **skw)
    d_man = preset_manifest(cfg, dp, dm, **dkw)
    s_t = P.preset_tensors(sp, cfg, W, sm, **skw)
    d_t = _zeros_like_manifest(d_man)
    plan = plan_transfers(s_man, d_man)
    assert validate_plan(plan, s_man, d_man) == []
    if skw.get("fp8"):  # presets lay every scale out block for block with its weight: moved as pairs
        scales = [n for n in d_man.arrays if n.endswith("_scale_inv")]
        assert scales and plan.stats().fp8_pairs == len(scales)
        assert plan.stats().unpaired_scales == ()
    res = run_plan_loopback(plan, s_man, d_man, s_t, d_t, bucket=1 << 16, timeout=20.0)
    res.raise_first()
    _same(d_t, P.preset_tensors(dp, cfg, W, dm, **dkw))
    # the sources are untouched
    _same(s_t, P.preset_tensors(sp, cfg, W, sm, **skw))


def test_refit_kv_replicas_need_no_extra_sends() -> None:
    """vLLM tp=4 with 2 kv heads: each kv head lands on two ranks; the plan moves the k/v bytes
    once per destination holder, no more (the replicas are distinct destinations)."""
    cfg = QWEN3
    s_man = preset_manifest(cfg, "megatron", Mesh(("tp",), (2,)))
    d_man = preset_manifest(cfg, "vllm", Mesh(("tp",), (4,)))
    plan = plan_transfers(s_man, d_man)
    kv = [t for t in plan.transfers if ".k_proj." in t.fqn or ".v_proj." in t.fqn]
    H, hd, L = 64, 16, cfg["num_hidden_layers"]
    assert {t.phase for t in kv} == {1}
    assert sum(t.region.volume for t in kv) == L * 2 * 4 * hd * H  # k and v: 4 ranks x 1 head each


# ------------------------------------------------------------------ convert through files


def _write_rank_files(d: Path, m: Manifest, tensors: Mapping[int, Mapping[str, torch.Tensor]]) -> Manifest:
    """Each rank's tensors in its own file, in the order ``convert`` writes them (so that a
    conversion back can be compared file for file)."""
    d.mkdir(parents=True)
    _, jobs = plan_files(m)
    for job in jobs:
        r = int(job.rel.split("-")[1].split(".")[0])
        save_tensors(d / job.rel, {n: tensors[r][n] for n, _, _ in job.tensors})
    save_manifest(m, d / "manifest.json")
    return load_manifest(d / "manifest.json")


def _read_file(p: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(p))


def _read_rank_files(d: Path, world: int) -> dict[int, dict[str, torch.Tensor]]:
    return {r: _read_file(d / f"rank-{r:05d}.safetensors") for r in range(world)}


PATTERN = "rank-{rank:05d}.safetensors"


@pytest.mark.parametrize("cfg,preset,mesh,kw", [
    (QWEN3, "megatron", "pp=2,tp=2", {}),
    (LLAMA_ODD, "megatron", "tp=3", {}),  # vocab 1000 padded to 1152 over 3 ranks
    (MOE, "megatron", "ep=3,tp=2", {"expert_tensor_parallel": 1}),
    (DSV3, "megatron", "pp=2,ep=2,tp=2", {}),
    (DSV3_FP8, "megatron", "tp=2", {"fp8": True}),
    (DSV3, "vllm", "ep=2,tp=2", {}),
    (DSV3_FP8, "vllm", "tp=2", {"fp8": True}),
    (DSV3_FP8_ODD, "vllm", "ep=3", {"fp8": True}),  # 4 experts over 3 ranks: 2, 1, 1
], ids=["qwen3-pp2tp2", "llama-odd-tp3", "moe-ep3tp2-etp1", "dsv3-pp2ep2tp2", "dsv3-fp8-tp2",
        "vllm-dsv3-ep2tp2", "vllm-dsv3-fp8-tp2", "vllm-dsv3-fp8-odd-blocks-ep3"])
def test_convert_framework_to_hf_and_back_identical(tmp_path: Path, cfg: dict[str, Any], preset: str, mesh: str,
                                                    kw: dict[str, Any]) -> None:
    fp8 = kw.get("fp8", False)
    W = P.hf_weights(cfg, seed=2, fp8=fp8)
    ms = parse_mesh(mesh)
    mg = preset_manifest(cfg, preset, ms, file_pattern=PATTERN, **kw)
    mg_t = P.preset_tensors(preset, cfg, W, ms, **kw)
    src = _write_rank_files(tmp_path / "mg", mg, mg_t)
    assert validate_data(src) == []
    opts = ConvertOptions(progress=False, max_shard_size=200_000)
    convert(src, preset_manifest(cfg, "hf", Mesh(("tp",), (1,)), fp8=fp8), tmp_path / "hf", opts)
    hf = {}
    for f in sorted((tmp_path / "hf").glob("model-*.safetensors")):
        hf.update(_read_file(f))
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    _same({0: hf}, {0: dict(W)})
    back = load_manifest(tmp_path / "hf" / "manifest.json")
    convert(back, preset_manifest(cfg, preset, ms, file_pattern=PATTERN, **kw), tmp_path / "mg2",
            ConvertOptions(progress=False))
    _same(_read_rank_files(tmp_path / "mg2", ms.size), mg_t)
    assert validate_data(load_manifest(tmp_path / "mg2" / "manifest.json")) == []
    for r in range(ms.size):  # identical files
        assert filecmp.cmp(tmp_path / "mg" / f"rank-{r:05d}.safetensors", tmp_path / "mg2" / f"rank-{r:05d}.safetensors",
                           shallow=False), r


def test_convert_megatron_files_to_vllm_files(tmp_path: Path) -> None:
    cfg = MOE
    W = P.hf_weights(cfg, seed=3)
    sm, dm = parse_mesh("pp=3,ep=2,tp=1"), parse_mesh("ep=2,tp=2")
    src = _write_rank_files(tmp_path / "mg", preset_manifest(cfg, "megatron", sm, file_pattern=PATTERN),
                            P.megatron_tensors(cfg, W, sm))
    rep = convert(src, preset_manifest(cfg, "vllm", dm, file_pattern=PATTERN), tmp_path / "vllm",
                  ConvertOptions(progress=False, memory_limit=1 << 20))
    assert rep.files_written == dm.size
    _same(_read_rank_files(tmp_path / "vllm", dm.size), P.vllm_tensors(cfg, W, dm))


def test_convert_fsdp2_to_megatron_uneven(tmp_path: Path) -> None:
    cfg = LLAMA_ODD
    W = P.hf_weights(cfg, seed=4)
    sm, dm = parse_mesh("dp=2,fsdp=3,tp=3"), parse_mesh("pp=3,tp=3")
    src = _write_rank_files(tmp_path / "fsdp", preset_manifest(cfg, "fsdp2", sm, file_pattern=PATTERN),
                            P.fsdp2_tensors(cfg, W, sm))
    convert(src, preset_manifest(cfg, "megatron", dm, file_pattern=PATTERN), tmp_path / "mg",
            ConvertOptions(progress=False))
    _same(_read_rank_files(tmp_path / "mg", dm.size), P.megatron_tensors(cfg, W, dm))
