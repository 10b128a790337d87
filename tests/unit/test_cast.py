"""convert --cast: fp32 master weights -> bf16 (and other float casts) match torch's rounding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from streamer.cli.app import main


def _ckpt(d: Path) -> dict[str, np.ndarray]:
    from formats.safetensors.io import save_tensors

    rng = np.random.default_rng(3)
    t = {"w": (rng.standard_normal((37, 20)) * 3).astype(np.float32),
         "b": np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 3.4e38, 1.00390625], np.float32),
         "i": np.arange(10, dtype=np.int64)}
    d.mkdir()
    save_tensors(d / "model.safetensors", t)
    return t


@pytest.mark.parametrize("to", ["bfloat16", "float16"])
def test_cast_matches_torch(tmp_path: Path, to: str) -> None:
    import torch
    from safetensors.torch import load_file

    t = _ckpt(tmp_path / "hf")
    assert main(["import", str(tmp_path / "hf"), "-o", str(tmp_path / "hf/manifest.json")]) == 0
    assert main(["layout", "--like", str(tmp_path / "hf/manifest.json"), "--mesh", "tp=3", "--rule", "w=S(1)",
                 "-o", str(tmp_path / "tp3.json")]) == 0
    assert main(["convert", str(tmp_path / "hf/manifest.json"), str(tmp_path / "tp3.json"), "--out",
                 str(tmp_path / "tp3"), "--cast", to, "--memory-limit", "64KiB"]) == 0
    assert main(["validate", "--data", str(tmp_path / "tp3")]) == 0
    assert main(["layout", "--like", str(tmp_path / "tp3"), "-o", str(tmp_path / "hf1.json")]) == 0
    assert main(["convert", str(tmp_path / "tp3"), str(tmp_path / "hf1.json"), "--out", str(tmp_path / "back")]) == 0
    got = load_file(str(tmp_path / "back/model.safetensors"))
    for name, arr in t.items():
        want = torch.from_numpy(arr)
        if arr.dtype == np.float32:
            want = want.to(getattr(torch, to))
        assert got[name].dtype == want.dtype, name
        g, w = got[name].view(torch.uint8) if got[name].dim() else got[name], want.view(torch.uint8)
        nan = torch.isnan(want.float())
        assert torch.equal(torch.isnan(got[name].float()), nan), name
        assert torch.equal(got[name][~nan].view(torch.uint8) if nan.any() else g, want[~nan].view(torch.uint8)
                           if nan.any() else w), name


def test_cast_to_int_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "a", "b", "--out", str(tmp_path / "o"), "--cast", "int8"]) == 2


@pytest.mark.parametrize("fmt", ["safetensors", "zarr"])
def test_destination_manifest_asks_for_the_cast(tmp_path: Path, fmt: str) -> None:
    """No --cast: the destination manifest itself says bfloat16 for w (fp32 in the source). The
    bytes are cast, never reinterpreted; b (float32 in both) and i (int64) are copied."""
    import json

    import torch
    from safetensors.torch import load_file

    t = _ckpt(tmp_path / "hf")
    assert main(["import", str(tmp_path / "hf"), "-o", str(tmp_path / "hf/manifest.json")]) == 0
    assert main(["layout", "--like", str(tmp_path / "hf/manifest.json"), "--mesh", "tp=3", "--rule", "w=S(1)",
                 "--format-version", "1", "-o", str(tmp_path / "tp3.json")]) == 0
    m = json.loads((tmp_path / "tp3.json").read_text())
    m["arrays"]["w"]["data_type"] = "bfloat16"
    (tmp_path / "tp3.json").write_text(json.dumps(m))
    assert main(["convert", str(tmp_path / "hf/manifest.json"), str(tmp_path / "tp3.json"), "--out",
                 str(tmp_path / "tp3"), "--memory-limit", "64KiB", "--format", fmt]) == 0
    assert main(["validate", "--data", str(tmp_path / "tp3")]) == 0
    assert main(["layout", "--like", str(tmp_path / "tp3"), "-o", str(tmp_path / "hf1.json")]) == 0
    assert main(["convert", str(tmp_path / "tp3"), str(tmp_path / "hf1.json"), "--out", str(tmp_path / "back")]) == 0
    got = load_file(str(tmp_path / "back/model.safetensors"))
    assert got["w"].dtype == torch.bfloat16 and got["b"].dtype == torch.float32 and got["i"].dtype == torch.int64
    assert torch.equal(got["w"].view(torch.int16), torch.from_numpy(t["w"]).to(torch.bfloat16).view(torch.int16))
    assert got["b"].numpy().tobytes() == t["b"].tobytes() and torch.equal(got["i"], torch.from_numpy(t["i"]))


@pytest.mark.parametrize("src,dst", [("float32", "bfloat16"), ("float32", "float16"), ("bfloat16", "float32"),
                                     ("float16", "bfloat16"), ("bfloat16", "float16")])
def test_torch_fast_path_equals_the_numpy_path(src: str, dst: str) -> None:
    """cast_bytes/cast_into take torch's one-pass cast when torch is around; the bits equal the
    numpy implementation's (NaNs compared as NaNs), so convert and refit agree either way."""
    import torch

    from streamer.ops.cast import _cast, cast_bytes, cast_into

    rng = np.random.default_rng(5)
    f = np.concatenate([(rng.standard_normal(5000) * 10.0 ** rng.integers(-40, 39, 5000)).astype(np.float32),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 1e-8], np.float32)])
    raw = torch.from_numpy(f).to(getattr(torch, src)).view(torch.uint8).numpy().copy()
    with np.errstate(over="ignore", invalid="ignore"):
        want = _cast(raw, src, dst)
    got = cast_bytes(raw, src, dst)
    into = np.empty_like(want).reshape(-1, want.size // f.size)
    cast_into(into, raw.reshape(f.size, -1), src, dst)
    as_t = {n: torch.from_numpy(a.copy()).view(getattr(torch, dst)).float() for n, a in
            (("want", want), ("got", got), ("into", into.reshape(-1)))}
    nan = torch.isnan(as_t["want"])
    for k in ("got", "into"):
        assert torch.equal(torch.isnan(as_t[k]), nan), k
        assert torch.equal(as_t[k][~nan], as_t["want"][~nan]), k
