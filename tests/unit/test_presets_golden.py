"""Every preset's manifest, byte for byte: digests of the JSON that :func:`preset_manifest` gave
before the presets became table-driven (``python tests/unit/test_presets_golden.py`` prints them
afresh). A change that alters a preset's output on purpose updates ``GOLDEN`` in the same commit.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import pytest
from test_presets import CASES, ERROR_CASES, QWEN3_TIED

from formats.layouts import LayoutError, parse_mesh
from formats.layouts.presets import preset_manifest


def _cases() -> dict[str, tuple[dict[str, Any], str, str, dict[str, Any]]]:
    out = {c[0]: (c[1], c[2], c[3], c[4]) for c in CASES}
    for i, (cfg, preset, mesh, kw, _match) in enumerate(ERROR_CASES):
        out[f"error-{i}-{preset}-{mesh}"] = (cfg, preset, mesh, kw)
    for preset in ("megatron", "vllm", "sglang", "fsdp2", "hf"):
        out[f"tied-{preset}"] = (QWEN3_TIED, preset, "fsdp=2" if preset == "fsdp2" else "tp=1", {})
    return out


def digest(cfg: dict[str, Any], preset: str, mesh: str, kw: dict[str, Any]) -> str:
    """The manifest's JSON, live and on disk (per-rank files, a domain size), or the error's text."""
    h = hashlib.sha256()
    for extra in ({}, {"file_pattern": "rank-{rank:05d}.safetensors", "domain_size": 2, "name": "n"}):
        try:
            m = preset_manifest(cfg, preset, parse_mesh(mesh), **kw, **extra)
        except LayoutError as e:
            h.update(f"error: {e}".encode())
            continue
        h.update(json.dumps(m.to_dict(), sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()[:16]


GOLDEN: dict[str, str] = {
    "error-0-megatron-tp=4": "d6640827a33be6e3",
    "error-1-megatron-tp=2": "272451128b6c3844",
    "error-10-vllm-tp=2": "323ade37a8a5a248",
    "error-11-vllm-tp=2": "aba6dbac200c51cc",
    "error-12-vllm-tp=8": "02511f630cf6c1da",
    "error-13-vllm-tp=2": "aba6dbac200c51cc",
    "error-14-vllm-tp=4": "74ec6d68b635681a",
    "error-15-vllm-tp=2,dp=2": "f65abbd81a8b0339",
    "error-16-vllm-ep=2,tp=2": "0783f315b7ad7caf",
    "error-17-hf-tp=2": "9a47aaa12943bb40",
    "error-18-sglang-tp=4": "8b8e6c21b7c55c75",
    "error-19-fsdp2-ep=2": "873e9f4a78441ba1",
    "error-2-megatron-pp=2": "84b99e29a2d1759f",
    "error-20-megatron-tp=3": "df2eaa3dd78c6746",
    "error-21-vllm-tp=8": "09ed8ac6a976eadf",
    "error-22-megatron-ep=4": "e74429c5d95e349a",
    "error-23-vllm-tp=4": "1236e7b3cdf87203",
    "error-24-megatron-tp=4": "ad2c49daa3ab03fd",
    "error-25-megatron-tp=2": "8b9cf938c02b1d36",
    "error-26-vllm-tp=1": "a177352481e2c5ea",
    "error-27-vllm-tp=2": "4a5a8b4025c5aadc",
    "error-28-vllm-tp=2": "660e7160492f86f0",
    "error-29-tpu-tp=1": "fa094d7f99b32c62",
    "error-3-megatron-pp=2": "b10a874be206285d",
    "error-4-megatron-ep=4": "e74429c5d95e349a",
    "error-5-megatron-ep=2,tp=2": "ac00b09af594a7b0",
    "error-6-megatron-ep=2,cp=2": "55fbc76994f4fa83",
    "error-7-megatron-tp=2,pp=2": "b945f8e127bf7e9d",
    "error-8-megatron-fsdp=2": "f65c458786936c43",
    "error-9-vllm-tp=3": "b1bf3fea6a0838da",
    "fsdp2-dsv3-fp8-fsdp3": "ac4aaa8af707a63b",
    "fsdp2-llama-odd-fsdp4tp3": "82028faf16589ca3",
    "fsdp2-moe-tp2fsdp3": "0c4eb8c9def59b6d",
    "fsdp2-qwen3-dp2fsdp2tp2": "4049ff0a0911f56d",
    "fsdp2-qwen3-fsdp3": "ca7409bd70a5241a",
    "hf-dsv3-fp8": "ba99a5e566e6e853",
    "hf-moe": "5d12f6ef16d4e128",
    "hf-qwen3": "efc5d278e2da1d03",
    "megatron-dsv3-etp1-grouped": "c295de493cade399",
    "megatron-dsv3-fp8-ep2tp2-etp1-grouped": "a6822368562cf559",
    "megatron-dsv3-fp8-pp2ep2tp2": "dd5a087502f5dfee",
    "megatron-dsv3-fp8-pp2tp2": "125a6b60ccf0f19d",
    "megatron-dsv3-no-q-lora-tp4": "871578cbd356aa81",
    "megatron-dsv3-pp2-last1-ep2": "4fbbd1cac1c376ed",
    "megatron-dsv3-pp2ep2tp2": "61f7938418dae62b",
    "megatron-dsv3-tp2": "d18bee1c2c6c5498",
    "megatron-llama-bias-tp2": "36ce3bc05284cd69",
    "megatron-llama-odd-pp2-uneven-first": "b621872cc9b1b11f",
    "megatron-llama-odd-pp3-cp2": "c1690af56ee0ac7f",
    "megatron-llama-odd-tp3": "306a23fcfb3419f2",
    "megatron-moe-ep2tp2": "bd9d79d568fe0c00",
    "megatron-moe-etp1": "a81c03f45c9107bb",
    "megatron-moe-grouped": "adff59cc75ca3f48",
    "megatron-moe-pp3-ep3": "e49c7a8884820560",
    "megatron-qwen2-bias-pp2tp2": "9046463483c1133b",
    "megatron-qwen3-pp2dp2tp2": "41d247cf8abab180",
    "megatron-qwen3-pp3-first1-last1": "7cd10fde70f1380c",
    "megatron-qwen3-tp1": "de5d20c3a133b5f3",
    "megatron-tied-tp2": "eb1943983bdd3226",
    "sglang-dsv3-fp8-ep2": "9e9fd61f62e2fb60",
    "sglang-dsv3-tp2": "e59d3b955846af06",
    "sglang-moe-tp2-ep": "d4f19c67171c1a7e",
    "sglang-qwen3-pp3tp2": "56debd507f0744c8",
    "tied-fsdp2": "a2b83f2e4aba973b",
    "tied-hf": "a763758b790e58f2",
    "tied-megatron": "c96ac3b34659fb6e",
    "tied-sglang": "acc0206e20f28d3a",
    "tied-vllm": "5fde6ba8a95cabc2",
    "vllm-dsv3-dp-ep2tp2": "69ea0c7ecaaaab31",
    "vllm-dsv3-fp8-ep2-hidden-not-a-block-multiple": "9e151a13177c747d",
    "vllm-dsv3-fp8-ep6-more-ranks-than-experts": "ba48a3734cbacc02",
    "vllm-dsv3-fp8-pp2tp2-ep": "be5761083cd3d565",
    "vllm-dsv3-fp8-tp2": "660e7160492f86f0",
    "vllm-dsv3-no-q-lora-pp3tp2": "bf50a11493055f7f",
    "vllm-dsv3-tp2": "b9d1b3c00db51ea8",
    "vllm-dsv3-tp2-ep": "049aa3874450c90d",
    "vllm-llama-bias-tp4": "83307e961ee3689d",
    "vllm-llama-odd-tp3": "a7b378bab472d3b8",
    "vllm-moe-dp-ep2tp2": "bba82d968c5e79a8",
    "vllm-moe-ep8-more-ranks-than-experts": "9b27149037303634",
    "vllm-moe-tp2": "807e167e1571fcdc",
    "vllm-moe-tp4-ep": "d6a02b4ec2416809",
    "vllm-qwen2-bias-tp2": "0a4248aecdc03de8",
    "vllm-qwen3-dp2tp2": "a9701d7bd8bb390e",
    "vllm-qwen3-pp3tp2-uneven": "c437bbf6e2e5022c",
    "vllm-qwen3-tp1": "3c900508ac4bc1a0",
    "vllm-qwen3-tp4-kv-replicated": "12ea5443e9089b7c",
    "vllm-tied-pp2tp2": "06b1383426ae3f77",
}


@pytest.mark.parametrize("case", sorted(_cases()))
def test_preset_output_unchanged(case: str) -> None:
    assert digest(*_cases()[case]) == GOLDEN[case]


if __name__ == "__main__":
    for k, v in sorted(_cases().items()):
        sys.stdout.write(f'    "{k}": "{digest(*v)}",\n')
