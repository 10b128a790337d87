"""``shardstream convert`` under ``mpiexec``: the ranks share the work and the output is the
same bytes as a single-process convert of the same inputs (design §7, §8)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mpi_helpers import Ckpt, ok, run, safetensors_files, same_files

pytestmark = pytest.mark.mpi

CASES = {
    # HF checkpoint -> TP2xDP2 rank files
    "hf-to-tp2dp2": ("hf", "serve_dp", 2),
    # TP2xPP2 rank files (a convert output dir) -> TP4 rank files
    "tp2pp2-to-tp4": ("train", "serve", 2),
    # more workers than make an even split
    "tp2pp2-to-tp4-n3": ("train", "serve", 3),
    # rank files -> one HF file written by several workers
    "tp2pp2-to-hf": ("train", "hf1", 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mpi_convert_matches_single_process(ckpt: Ckpt, tmp_path: Path, case: str) -> None:
    src_attr, dst_attr, n = CASES[case]
    src, dst = getattr(ckpt, src_attr), getattr(ckpt, dst_attr)
    single = tmp_path / "single"
    ok(["shardstream", "convert", src, dst, "--out", single])
    par = tmp_path / "mpi"
    rc, so, se = run(["mpiexec", "-n", n, "shardstream", "convert", src, dst, "--out", par], timeout=60)
    assert rc == 0, f"rc {rc}\nstdout:\n{so}\nstderr:\n{se}"
    assert f"{n} worker(s)" in so, so
    assert (par / "manifest.json").exists()
    assert safetensors_files(par), "no files written"
    assert same_files(par, single) == []
    # the state directory goes once every rank is done: both outputs hold the same files
    assert sorted(p.name for p in par.iterdir()) == sorted(p.name for p in single.iterdir())
    assert not (par / ".shardstream").exists()
    ok(["shardstream", "validate", "--data", par])
    if dst_attr == "hf1":
        assert (par / "model.safetensors").read_bytes() == (ckpt.hf / "model.safetensors").read_bytes()


def test_mpi_quantize_on_convert_matches_single_process(ckpt: Ckpt, tmp_path: Path) -> None:
    """HF bf16 -> vLLM block-FP8 TP2 (quantized on write) under mpiexec -n 2: the same bytes."""
    import json

    cfg = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    dst = tmp_path / "serve_fp8.json"
    ok(["shardstream", "layout", "--model", tmp_path / "cfg.json", "--preset", "vllm", "--fp8", "--mesh", "tp=2",
        "-o", dst])
    single, par = tmp_path / "single", tmp_path / "mpi"
    ok(["shardstream", "convert", ckpt.hf, dst, "--out", single, "--fp8-block", "16,16"])
    rc, so, se = run(["mpiexec", "-n", 2, "shardstream", "convert", ckpt.hf, dst, "--out", par, "--fp8-block",
                      "16,16", "--memory-limit", "64KiB"], timeout=60)
    assert rc == 0, f"rc {rc}\nstdout:\n{so}\nstderr:\n{se}"
    assert "2 worker(s)" in so and "quantized on write" in so, so
    assert same_files(par, single) == []
    ok(["shardstream", "validate", "--data", par])
