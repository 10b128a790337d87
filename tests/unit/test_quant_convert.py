"""Quantize on convert: FP8 destinations with scale siblings, fed from bf16/fp32 sources, give
the bytes of the torch references (tests/quant_reference.py), and refuse unaligned shards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from quant_reference import ref_block_fp8, ref_mxfp8

from formats.layouts import Mesh, Rule, Shard, apply_layout, manifest_from_arrays
from formats.manifest.wire import load_manifest, save_manifest
from streamer.cli.app import main

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

#: DeepSeek-V3 in miniature, with dims that tp=2 splits into whole 128x128 blocks
DSV3_FP8_SIZES: dict[str, Any] = {
    "model_type": "deepseek_v3", "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512,
    "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64,
    "n_routed_experts": 2, "n_shared_experts": 1, "num_experts_per_tok": 1, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def _hf(d: Path, weights: dict[str, Any]) -> dict[str, Any]:
    d.mkdir(parents=True)
    safetensors_torch.save_file(weights, str(d / "model.safetensors"))
    return weights


def _stored(out: Path, fqn: str) -> dict[int, Any]:
    """Every holder's copy of array ``fqn`` as written under ``out``, assembled whole (uint8 /
    float32 views), keyed by holder; regions a holder lacks stay zero."""
    m = load_manifest(out / "manifest.json")
    a = m.arrays[fqn]
    got: dict[int, Any] = {}
    for c in a.chunks:
        for h in c.holders:
            t = safetensors_torch.load_file(str(out / c.file_for(h)))[c.tensor(fqn)]
            t = t.view(torch.uint8) if t.dtype.itemsize == 1 else t
            whole = got.setdefault(h, torch.zeros(a.shape, dtype=t.dtype))
            whole[c.region.slices] = t[tuple(slice(o, o + n) for o, n in zip(c.local_offsets, c.region.sizes))]
    return got


def _equal_on_holders(out: Path, fqn: str, want: Any) -> None:
    m = load_manifest(out / "manifest.json")
    for h, whole in _stored(out, fqn).items():
        for c in m.arrays[fqn].chunks:
            if h in c.holders:
                got, ref = whole[c.region.slices], want[c.region.slices]
                if got.dtype == torch.float32:
                    got, ref = got.view(torch.int32), ref.contiguous().view(torch.int32)
                assert torch.equal(got, ref), (fqn, h, c.region)


@pytest.mark.parametrize("memory", ["1GiB", "64KiB"])
def test_hf_bf16_to_vllm_fp8_preset_matches_reference(tmp_path: Path, capsys: Any, memory: str) -> None:
    """The user path: `layout --preset vllm --fp8` of an HF bf16 model, `convert hf/ serve.json`."""
    from formats.layouts.models import arrays_from_config

    (tmp_path / "cfg.json").write_text(json.dumps(DSV3_FP8_SIZES))
    g = torch.Generator().manual_seed(0)
    W = _hf(tmp_path / "hf", {n: (torch.randn(s, generator=g) * 0.05).to(getattr(torch, dt))
                              for n, (s, dt) in arrays_from_config(DSV3_FP8_SIZES).items()})
    W["model.layers.1.mlp.experts.0.up_proj.weight"][:128, :128] = 0  # an all-zero block
    safetensors_torch.save_file(W, str(tmp_path / "hf/model.safetensors"))
    assert main(["layout", "--model", str(tmp_path / "cfg.json"), "--preset", "vllm", "--fp8", "--mesh", "tp=2",
                 "-o", str(tmp_path / "serve.json")]) == 0
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "serve.json"), "--out", str(tmp_path / "out"),
                 "--memory-limit", memory, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    dst = load_manifest(tmp_path / "serve.json")
    fp8 = [f for f, a in dst.arrays.items() if a.data_type == "float8_e4m3fn"]
    assert fp8 and sorted(rep["quantized"]["arrays"]) == sorted(fp8)
    for f in fp8:
        q, s = ref_block_fp8(W[f])
        _equal_on_holders(tmp_path / "out", f, q.view(torch.uint8))
        _equal_on_holders(tmp_path / "out", f + "_scale_inv", s)
        n = W[f].numel()
        assert rep["quantized"]["arrays"][f]["bytes_saved"] == n * 2 - n - s.numel() * 4
    for f in set(dst.arrays) - set(fp8) - {f + "_scale_inv" for f in fp8}:  # the rest is copied as is
        _equal_on_holders(tmp_path / "out", f, W[f])
    assert main(["validate", "--data", str(tmp_path / "out")]) == 0


def _like(tmp: Path, arrays: dict[str, tuple[tuple[int, ...], str]], rules: list[Rule], tp: int,
          name: str = "dst.json") -> Path:
    m = apply_layout(manifest_from_arrays(arrays), Mesh(("tp",), (tp,)), rules,
                     file_pattern="rank-{rank:05d}.safetensors")
    save_manifest(m, tmp / name)
    return tmp / name


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("keep_scales", [True, False])
def test_block_fp8_uneven_shards_fp32_source(tmp_path: Path, capsys: Any, monkeypatch: Any, ue8m0: bool,
                                             keep_scales: bool) -> None:
    """16x16 blocks, 48x50 weight: tp=3 rows of 16 (whole blocks), the last column block partial;
    and a 1-D-sharded second weight cut by column boundaries on the grid. Without the scales
    kept from the data, the scale tensor reads the weight again: same bytes."""
    if not keep_scales:
        monkeypatch.setattr("streamer.convert.quantize.SCALE_CACHE_BYTES", 0)
    g = torch.Generator().manual_seed(1)
    a = torch.randn((48, 50), generator=g) * 3
    a[16:32, :16] = 0  # an all-zero block
    W = _hf(tmp_path / "hf", {"a.weight": a, "b.weight": torch.randn((20, 96), generator=g).to(torch.bfloat16)})
    dst = _like(tmp_path, {"a.weight": ((48, 50), "float8_e4m3fn"), "a.weight_scale_inv": ((3, 4), "float32"),
                           "b.weight": ((20, 96), "float8_e4m3fn"), "b.weight_scale_inv": ((2, 6), "float32")},
                [Rule("a.*", (Shard(0),)), Rule("b.*", (Shard(1),))], 3)
    args = ["convert", str(tmp_path / "hf"), str(dst), "--out", str(tmp_path / "out"), "--fp8-block", "16,16",
            "--memory-limit", "64KiB"]
    assert main(args + (["--ue8m0"] if ue8m0 else [])) == 0
    for f in ("a.weight", "b.weight"):
        q, s = ref_block_fp8(W[f], (16, 16), ue8m0)
        _equal_on_holders(tmp_path / "out", f, q.view(torch.uint8))
        _equal_on_holders(tmp_path / "out", f + "_scale_inv", s)
    assert "quantized on write" in capsys.readouterr().out


def test_mxfp8_from_bf16(tmp_path: Path, capsys: Any) -> None:
    g = torch.Generator().manual_seed(2)
    w = (torch.randn((37, 100), generator=g) * 10.0 ** torch.randint(-4, 4, (37, 100), generator=g))
    W = _hf(tmp_path / "hf", {"m.weight": w.to(torch.bfloat16)})
    dst = _like(tmp_path, {"m.weight": ((37, 100), "float8_e4m3fn"), "m.weight_scale_inv": ((37, 4), "float8_e8m0fnu")},
                [Rule("m.*", (Shard(0),))], 3)
    assert main(["convert", str(tmp_path / "hf"), str(dst), "--out", str(tmp_path / "out"),
                 "--memory-limit", "64KiB"]) == 0
    q, s = ref_mxfp8(W["m.weight"])
    _equal_on_holders(tmp_path / "out", "m.weight", q)
    _equal_on_holders(tmp_path / "out", "m.weight_scale_inv", s)
    assert main(["validate", "--data", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "hf"), str(dst), "--out", str(tmp_path / "out"), "--resume", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["files_skipped"] == 3  # a finished output is reused whole


@pytest.mark.parametrize("case", ["block", "mx", "scale-shape"])
def test_unaligned_destination_is_refused_in_one_line(tmp_path: Path, capsys: Any, case: str) -> None:
    _hf(tmp_path / "hf", {"w.weight": torch.ones((300, 256), dtype=torch.bfloat16)})
    scale = {"block": ((3, 2), "float32"), "mx": ((300, 8), "float8_e8m0fnu"),
             "scale-shape": ((2, 2), "float32")}[case]
    rules = [Rule("w.*", (Shard(1) if case == "mx" else Shard(0),))]
    dst = _like(tmp_path, {"w.weight": ((300, 256), "float8_e4m3fn"), "w.weight_scale_inv": scale}, rules,
                3 if case == "mx" else 2)
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "hf"), str(dst), "--out", str(tmp_path / "out")]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "w.weight:" in err[0], err
    assert ("does not match" if case == "scale-shape" else "not aligned") in err[0]
    assert not (tmp_path / "out").exists()


def test_source_shards_cutting_blocks(tmp_path: Path, capsys: Any) -> None:
    """A bf16 TP3 trainer checkpoint whose shards cut 128x128 blocks (rows 100/100/100) -> one
    FP8 rank: each block is assembled from several source files, then quantized."""
    g = torch.Generator().manual_seed(5)
    W = _hf(tmp_path / "hf", {"w.weight": (torch.randn((300, 260), generator=g)).to(torch.bfloat16)})
    tp3 = _like(tmp_path, {"w.weight": ((300, 260), "bfloat16")}, [Rule("w.*", (Shard(0),))], 3, "tp3.json")
    assert main(["convert", str(tmp_path / "hf"), str(tp3), "--out", str(tmp_path / "tp3")]) == 0
    dst = _like(tmp_path, {"w.weight": ((300, 260), "float8_e4m3fn"), "w.weight_scale_inv": ((3, 3), "float32")},
                [], 1)
    capsys.readouterr()
    assert main(["plan", str(tmp_path / "tp3"), str(dst), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert list(st["quantized"]["arrays"]) == ["w.weight"] and st["quantized"]["bytes_saved"] == 300 * 260 - 9 * 4
    assert main(["convert", str(tmp_path / "tp3"), str(dst), "--out", str(tmp_path / "out"),
                 "--memory-limit", "64KiB"]) == 0
    q, s = ref_block_fp8(W["w.weight"])
    _equal_on_holders(tmp_path / "out", "w.weight", q.view(torch.uint8))
    _equal_on_holders(tmp_path / "out", "w.weight_scale_inv", s)


@pytest.mark.parametrize("scheme", ["block", "mx"])
def test_zarr_output_quantizes_too(tmp_path: Path, scheme: str) -> None:
    """--format zarr: the FP8 and scale arrays hold the reference's bytes; a zarr unit that is
    not on the block grid still quantizes whole blocks."""
    zarr = pytest.importorskip("zarr")
    g = torch.Generator().manual_seed(6)
    W = _hf(tmp_path / "hf", {"w.weight": torch.randn((400, 300), generator=g).to(torch.bfloat16)})
    scale = ((25, 19), "float32") if scheme == "block" else ((400, 10), "float8_e8m0fnu")
    dst = _like(tmp_path, {"w.weight": ((400, 300), "float8_e4m3fn"), "w.weight_scale_inv": scale},
                [Rule("w.*", (Shard(0),))], 1)
    extra = ["--fp8-block", "16,16"] if scheme == "block" else []
    assert main(["convert", str(tmp_path / "hf"), str(dst), "--out", str(tmp_path / "out"), "--format", "zarr",
                 "--memory-limit", "64KiB", *extra]) == 0
    q, s = ref_block_fp8(W["w.weight"], (16, 16)) if scheme == "block" else ref_mxfp8(W["w.weight"])
    grp = zarr.open_group(str(tmp_path / "out"), mode="r")
    assert grp["w.weight"].chunks[0] < 400  # several units
    assert (grp["w.weight"][:] == q.view(torch.uint8).numpy()).all()
    got = grp["w.weight_scale_inv"][:]
    assert (got.view("u4") == s.numpy().view("u4")).all() if scheme == "block" else (got == s.numpy()).all()
    assert main(["validate", "--data", str(tmp_path / "out")]) == 0


@pytest.mark.parametrize("case", ["no-scale", "mixed-tensor"])
def test_fp8_destination_it_cannot_quantize_is_refused(tmp_path: Path, capsys: Any, case: str) -> None:
    import dataclasses

    from formats.manifest.wire import ArraySpec, Source

    _hf(tmp_path / "hf", {"w.weight": torch.ones((256, 256), dtype=torch.bfloat16),
                          "e.bias": torch.ones((1, 2), dtype=torch.float32)})
    arrays: dict[str, tuple[tuple[int, ...], str]] = {"w.weight": ((256, 256), "float8_e4m3fn"),
                                                     "e.bias": ((1, 2), "float32")}
    if case == "mixed-tensor":
        arrays["w.weight_scale_inv"] = ((2, 2), "float32")
    m = apply_layout(manifest_from_arrays(arrays), Mesh(("tp",), (1,)), [], file_pattern="rank-{rank:05d}.safetensors")
    if case == "mixed-tensor":  # another array stored in the scales' local tensor, past them
        c = m.arrays["e.bias"].chunks[0]
        src = dataclasses.replace(c.source or Source(), tensor="w.weight_scale_inv", offsets=(2, 0))
        a = m.arrays["e.bias"]
        m = m.with_arrays({**m.arrays, "e.bias": ArraySpec(a.shape, a.data_type, (dataclasses.replace(c, source=src),))})
    save_manifest(m, tmp_path / "dst.json")
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "dst.json"), "--out", str(tmp_path / "out")]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    want = "has no w.weight_scale_inv" if case == "no-scale" else "e.bias: stored in local tensor"
    assert len(err) == 1 and want in err[0], err
