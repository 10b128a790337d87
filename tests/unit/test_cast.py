"""convert --cast: fp32 master weights -> bf16 (and other float casts) match torch's rounding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from streamer.cli import main


def _ckpt(d: Path) -> dict[str, np.ndarray]:
    from formats.safetensors_io import save_tensors

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
