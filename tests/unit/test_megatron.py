"""Megatron-LM checkpoints: torch_dist import (stored keys, skipped entries, a view of the
.distcp bytes), ``--to hf`` + ``convert`` loading in transformers with Megatron's own logits,
and hostile pickles refused.

The fixtures in ``tests/data/megatron`` were written by megatron-core 0.16 on CPU
(``make_fixtures.py``, ``VERSIONS``); megatron-core is not needed here.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from formats.errors import FormatError
from formats.megatron.dist import read_megatron_dist, resolve_iteration_dir
from streamer.cli.app import main

DATA = Path(__file__).resolve().parents[1] / "data" / "megatron"
CONFIG = DATA / "config.json"
FIXTURES = ["torch_dist/tp1", "torch_dist/tp2pp2"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _copy(fixture: str, tmp_path: Path) -> Path:
    """A writable copy (manifests live in or above the checkpoint directory)."""
    d = tmp_path / fixture.replace("/", "-")
    shutil.copytree(DATA / fixture, d)
    return d


def _read_arrays(path: Path) -> dict[str, np.ndarray]:
    """Every model array of a torch_dist save, read through the manifest's byte ranges (uint8,
    one trailing dim of itemsize bytes)."""
    m, _ = read_megatron_dist(path)
    assert m.base_dir is not None
    out = {}
    for fqn, a in m.arrays.items():
        isz = 4 if a.data_type == "float32" else 2
        buf = np.zeros(a.shape + (isz,), np.uint8)
        for c in a.chunks:
            assert c.source is not None and c.source.byte_range is not None and c.source.file is not None
            lo, hi = c.source.byte_range
            with open(m.base_dir / c.source.file, "rb") as f:
                f.seek(lo)
                raw = np.frombuffer(f.read(hi - lo), np.uint8)
            buf[c.region.slices] = raw.reshape(c.region.sizes + (isz,))
        out[fqn] = buf
    return out


# ------------------------------------------------------------------ torch_dist under the stored keys


@pytest.mark.parametrize("fixture", FIXTURES)
def test_import_keeps_stored_keys_and_skips_non_weights(fixture: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy(fixture, tmp_path)
    rc, out, err = run_cli(capsys, "import", str(d), "-o", str(d / "raw.json"), "--json")
    assert rc == 0, err
    rep = json.loads(out)
    ranks = 4 if "pp2" in fixture else 1
    assert rep["skipped"] == {"optimizer": 18, "rng": ranks, "extra_state": 8, "other": 0}
    assert "skipped 18 optimizer-state arrays" in err and "8 _extra_state entries" in err
    m = json.loads((d / "raw.json").read_text())
    arrays = m["arrays"]
    assert sorted(arrays) == sorted([
        "embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight",
        "decoder.layers.self_attention.linear_qkv.weight", "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.self_attention.linear_proj.weight", "decoder.layers.mlp.linear_fc1.weight",
        "decoder.layers.mlp.linear_fc1.layer_norm_weight", "decoder.layers.mlp.linear_fc2.weight"])
    assert arrays["decoder.layers.self_attention.linear_qkv.weight"]["shape"] == [2, 64, 32]  # stacked, as stored
    assert arrays["embedding.word_embeddings.weight"]["shape"] == [256, 32]  # vocab 200, padded
    for a in arrays.values():  # a view: every chunk is a byte range of a .distcp file
        for c in a["chunks"]:
            src = c["source"]
            assert src["file"].startswith("iter_0000001/__") and src["file"].endswith(".distcp")
            lo, hi = src["byte_range"]
            assert 0 < lo < hi <= (d / src["file"]).stat().st_size
    rc, _, err = run_cli(capsys, "validate", str(d / "raw.json"), "--data")
    assert rc == 0, err


@pytest.mark.parametrize("pair", [("torch_dist/tp1", "torch_dist/tp2pp2"), ("moe/ep1", "moe/ep2")])
def test_stored_bytes_equal_after_megatrons_resharding(pair: tuple[str, str]) -> None:
    """Megatron resharded TP1 into TP2xPP2 (EP1 into EP2): the global arrays read through the byte ranges agree."""
    a, b = _read_arrays(DATA / pair[0]), _read_arrays(DATA / pair[1])
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_tracker_file_picks_the_iteration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(DATA / "torch_dist/tp1/iter_0000001", root / "release")
    (root / "latest_checkpointed_iteration.txt").write_text("release\n")
    assert resolve_iteration_dir(root) == root / "release"
    rc, _, err = run_cli(capsys, "import", str(root), "-o", str(root / "m.json"))
    assert rc == 0, err
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    rc, _, err = run_cli(capsys, "import", str(root), "-o", str(root / "m.json"))
    assert rc == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith("names iteration '7', but " + str(root / "iter_0000007")
                                                  + " is not a directory")
    (root / "latest_checkpointed_iteration.txt").write_text("latest please")
    rc, _, err = run_cli(capsys, "import", str(root), "-o", str(root / "m.json"))
    assert rc == 1 and "expected an iteration number or 'release', got 'latest please'" in err


def test_to_hf_needs_model_and_a_megatron_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy("torch_dist/tp1", tmp_path)
    rc, _, err = run_cli(capsys, "import", str(d), "--to", "hf", "-o", str(d / "m.json"))
    assert rc == 2 and "--to hf needs --model CFG" in err
    (tmp_path / "x.safetensors").write_bytes(b"")
    rc, _, err = run_cli(capsys, "import", str(tmp_path), "--model", str(CONFIG), "--to", "hf", "-o",
                         str(tmp_path / "m.json"))
    assert rc == 2 and "--to hf reads Megatron checkpoints" in err


def test_to_hf_with_the_wrong_config_says_which_array(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy("torch_dist/tp1", tmp_path)
    cfg = json.loads(CONFIG.read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run_cli(capsys, "import", str(d), "--model", str(tmp_path / "config.json"), "--to", "hf", "-o",
                         str(tmp_path / "m.json"))
    assert rc == 1 and "Traceback" not in err
    assert ("model.layers.0.mlp.gate_proj.weight: needs decoder.layers.mlp.linear_fc1.weight of 1 stacked dim(s) "
            "+ [192, 32]") in err
    assert "does --model match the checkpoint?" in err


# ------------------------------------------------------------------ Megatron -> HF, checked by logits


@pytest.mark.parametrize("fixture", [*FIXTURES, "moe/ep1", "moe/ep2"])
def test_to_hf_convert_loads_in_transformers_with_megatrons_logits(
        fixture: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """GQA, swiglu, untied, padded vocab (TP1, TP2xPP2); Qwen3-MoE with q/k norms and
    SequentialMLP experts (EP1, EP2). Logits: Megatron's own forward, recorded by make_fixtures.py."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    moe = fixture.startswith("moe")
    config = DATA / "moe" / "config.json" if moe else CONFIG
    logits = DATA / "moe" / "logits.json" if moe else DATA / "logits.json"
    d = _copy(fixture, tmp_path)
    hf, dst, out = tmp_path / "hf.json", tmp_path / "dst.json", tmp_path / "out"
    rc, _, err = run_cli(capsys, "import", str(d), "--model", str(config), "--to", "hf", "-o", str(hf))
    assert rc == 0, err
    m = json.loads(hf.read_text())
    assert m["arrays"]["model.embed_tokens.weight"]["shape"] == [200, 32]  # padding dropped
    assert m["arrays"]["model.layers.1.self_attn.k_proj.weight"]["shape"] == [16, 32]
    for a in m["arrays"].values():  # still a view of the checkpoint's own files
        assert all(c["source"]["file"].endswith(".distcp") and "byte_range" in c["source"] for c in a["chunks"])
    if moe:
        assert m["arrays"]["model.layers.1.mlp.experts.3.down_proj.weight"]["shape"] == [32, 16]
    rc, _, err = run_cli(capsys, "layout", "--model", str(config), "--preset", "hf", "-o", str(dst))
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "convert", str(hf), str(dst), "--out", str(out))
    assert rc == 0, err
    shutil.copy(config, out / "config.json")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    assert type(model).__name__ == ("Qwen3MoeForCausalLM" if moe else "LlamaForCausalLM")
    ref = json.loads(logits.read_text())
    with torch.no_grad():
        got = model(torch.tensor(ref["tokens"])).logits.float()
    want = torch.tensor(ref["logits"])
    assert got.shape == want.shape
    # bf16 noise: Megatron's torch RMSNorm/attention vs HF's fp32 norm, logits up to ~4
    assert (got - want).abs().max().item() < 0.1
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# ------------------------------------------------------------------ hostile pickles


class _Pwn:
    """Unpickling this would run a shell command."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.target}",))


def test_hostile_pickle_in_megatron_metadata_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    d = _copy("torch_dist/tp1", tmp_path)
    it = d / "iter_0000001"
    with open(it / ".metadata", "rb") as f:
        md = pickle.load(f)  # test-only: the committed fixture, read with the trusting unpickler
    pwned = tmp_path / "PWNED"
    from dataclasses import replace

    plan = md.all_local_plans[0]  # deep inside Megatron's save plans (frozen dataclasses)
    items = [replace(plan.items[0], bytes_io_data=_Pwn(pwned)), *plan.items[1:]]
    md.all_local_plans[0] = replace(plan, items=items)
    with open(it / ".metadata", "wb") as f:
        pickle.dump(md, f)
    rc, _, err = run_cli(capsys, "import", str(d), "--model", str(CONFIG), "--to", "hf", "-o", str(d / "m.json"))
    assert rc == 1
    assert "Traceback" not in err
    assert "posix.system" in err or "os.system" in err
    assert "refusing to load it" in err
    assert not pwned.exists() and not (d / "m.json").exists()
    with pytest.raises(FormatError):
        read_megatron_dist(d)
    assert not pwned.exists()


def test_write_item_type_must_be_a_plain_value(tmp_path: Path) -> None:
    """WriteItemType is rebuilt from its value; the call takes an int and nothing else."""
    from formats.dcp import unpickle

    assert unpickle.write_item_type(2) == unpickle.WriteItemType(2)
    with pytest.raises(TypeError):
        unpickle.write_item_type("SHARD")


def test_to_hf_view_of_a_large_moe_layout_is_valid_and_quick() -> None:
    """A Qwen3-MoE-shaped stored layout (16 layers x 64 experts, every array in two row halves as
    at TP2): the view tiles every HF array and each piece stays inside its stored chunk's bytes."""
    import bisect
    import time
    from math import prod

    from formats.layouts.megatron_hf import _stacked, megatron_to_hf
    from formats.layouts.mesh import Mesh
    from formats.layouts.presets import preset_manifest
    from formats.manifest.box import Box
    from formats.manifest.wire import ArraySpec, Chunk, Manifest, Source
    from formats.validate.manifest import validate_manifest

    cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
           "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16, "num_attention_heads": 8,
           "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 1000, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16"}
    loc = preset_manifest(cfg, "megatron", Mesh(("tp",), (1,))).local_tensors(0)
    groups: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}
    for n, ts in loc.items():
        name, lead = _stacked(n.replace("mlp.experts.local_experts.", "mlp.experts.experts."))
        groups.setdefault(name, {})[lead] = ts.shape
    arrays, pos = {}, 0
    for name, leads in groups.items():
        inner = next(iter(leads.values()))
        k = len(next(iter(leads)))
        shape = tuple(max(lead[i] for lead in leads) + 1 for i in range(k)) + inner
        chunks = []
        for lead in sorted(leads):
            half = inner[0] // 2
            for h in range(2):
                sz = (1,) * k + (half,) + inner[1:]
                nb = 2 * half * prod(inner[1:])
                chunks.append(Chunk(Box(offsets=lead + (h * half,) + (0,) * (len(inner) - 1), sizes=sz), (0,),
                                    Source(tensor=name, offsets=(0,) * len(sz), file="__0_0.distcp",
                                           byte_range=(pos, pos + nb), stored_shape=sz)))
                pos += nb
        arrays[name] = ArraySpec(shape, "bfloat16", tuple(chunks))
    stored = Manifest(world_size=1, arrays=arrays)
    t = time.perf_counter()
    hf = megatron_to_hf(stored, cfg)
    assert time.perf_counter() - t < 20  # linear: ~0.2 s; a scan of every chunk per region took minutes
    assert validate_manifest(hf, where="hf") == []
    ranges = sorted(c.source.byte_range for a in stored.arrays.values() for c in a.chunks if c.source and c.source.byte_range)
    for a in hf.arrays.values():
        for c in a.chunks:
            assert c.source is not None and c.source.byte_range is not None
            lo, hi = c.source.byte_range
            i = bisect.bisect_right(ranges, (lo, float("inf"))) - 1
            assert ranges[i][0] <= lo < hi <= ranges[i][1]


@pytest.mark.parametrize("fixture,spec", [("torch_dist/tp1", "te"), ("torch_dist/tp1", "local"), ("moe/ep1", "local")])
def test_hf_to_torch_dist_matches_megatrons_own_save(fixture: str, spec: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """HF -> torch_dist (``convert --format torch_dist``) writes the keys, shapes and
    ``_extra_state`` entries Megatron's own save has (dense under either spec; MoE under the
    local spec the fixture used), with the same weights. (That ``dist_checkpointing.load`` takes
    it at TP1/TP2 and EP1/EP2 with Megatron's logits is checked by ``make_fixtures.py
    check-load``, which needs megatron-core.)"""
    torch = pytest.importorskip("torch")
    d = _copy(fixture, tmp_path)
    config = DATA / "moe" / "config.json" if fixture.startswith("moe") else CONFIG
    hfv, dst, hf, mg = tmp_path / "hfv.json", tmp_path / "dst.json", tmp_path / "hf", tmp_path / "mg.json"
    assert run_cli(capsys, "import", str(d), "--model", str(config), "--to", "hf", "-o", str(hfv))[0] == 0
    assert run_cli(capsys, "layout", "--model", str(config), "--preset", "hf", "-o", str(dst))[0] == 0
    assert run_cli(capsys, "convert", str(hfv), str(dst), "--out", str(hf))[0] == 0
    assert run_cli(capsys, "layout", "--model", str(config), "--preset", "megatron", "--megatron-spec", spec,
                   "-o", str(mg))[0] == 0
    out = tmp_path / "megatron"
    rc, _, err = run_cli(capsys, "convert", str(hf), str(mg), "--out", str(out), "--format", "torch_dist")
    assert rc == 0, err
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert sorted(p.name for p in out.iterdir()) == ["latest_checkpointed_iteration.txt", "release"]  # no temp left
    assert not (out / ".staging").exists()
    ours, _ = read_megatron_dist(out)
    theirs, skipped = read_megatron_dist(d)
    assert {k: a.shape for k, a in ours.arrays.items()} == {k: a.shape for k, a in theirs.arrays.items()}
    _, ours_skipped = read_megatron_dist(out)
    assert sorted(ours_skipped.extra_state) == sorted(skipped.extra_state)
    a, b = _read_arrays(out), _read_arrays(d / "iter_0000001")
    assert a.keys() == b.keys()
    for k in a:
        x = torch.from_numpy(a[k].reshape(-1).copy()).view(getattr(torch, ours.arrays[k].data_type))
        y = torch.from_numpy(b[k].reshape(-1).copy()).view(getattr(torch, theirs.arrays[k].data_type))
        x, y = x.float().reshape(ours.arrays[k].shape), y.float().reshape(theirs.arrays[k].shape)
        if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            x, y = x[:200], y[:200]  # the padding rows: zeros in ours, Megatron's init in theirs
        assert torch.equal(x, y), k
    if fixture == "torch_dist/tp1" and spec == "te":  # a tp 4 loader pads 200 to 512 rows: zeros past 256
        out4 = tmp_path / "megatron-tp4"
        rc, _, err = run_cli(capsys, "convert", str(hf), str(mg), "--out", str(out4), "--format", "torch_dist",
                             "--megatron-tp", "4")
        assert rc == 0, err
        emb = _read_arrays(out4)["embedding.word_embeddings.weight"]
        assert emb.shape[:2] == (512, 32) and not emb[256:].any()
        assert np.array_equal(emb[:256], a["embedding.word_embeddings.weight"])
    # only into the one-rank megatron layout, checked before anything is written
    rc, _, err = run_cli(capsys, "convert", str(hf), str(dst), "--out", str(tmp_path / "bad"), "--format", "torch_dist")
    assert rc == 2 and "needs Megatron local tensor names (layout --preset megatron); lm_head.weight" in err
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow  # the scale tier
def test_bench_convert_source_megatron_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torch_dist save of a synthetic Qwen3 -> import --to hf + convert, timed against the copy
    floor; the HF output is checked byte for byte against the synthetic source."""
    pytest.importorskip("torch")
    rc, out, err = run_cli(capsys, "bench", "convert", "--source", "megatron", "--preset", "qwen3-tiny",
                           "--repeats", "1", "--work", str(tmp_path), "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert r["source"] == "megatron" and r["bytes"] > 0 and r["ratio_to_floor"] > 0
    assert r["convert_peak_rss_bytes"] > 0 and r["import_s"] > 0
    rc, _, err = run_cli(capsys, "bench", "refit", "--source", "megatron")
    assert rc == 2 and "--source megatron goes with bench convert" in err
