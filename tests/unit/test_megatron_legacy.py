"""Megatron-LM legacy saves (``--ckpt-format torch``): ``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt``.

The fixtures in ``tests/data/megatron/legacy`` were written by megatron-core 0.16.1 on CPU as
Megatron-LM's ``save_checkpoint`` writes them (``make_fixtures.py legacy-*``): default
``torch.save`` pickle protocol (2), ``args`` with torch dtypes and an enum, Adam state, NumPy's
RNG state (protocol 2 pickles its bytes as ``_codecs.encode(text, "latin1")``), two iterations
and the tracker, ``make_vocab_size_divisible_by`` 16 (vocab 200 padded to 224 at TP2, not 256).
Each is imported with the CLI, converted to HF safetensors, loaded by transformers and checked
against Megatron's own float32 logits of iteration 2. megatron-core is not needed here.

Hostile cases replace a real archive's ``data.pkl`` (the only archives these tests pickle).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from formats.errors import FormatError
from streamer.cli import main

DATA = Path(__file__).resolve().parents[1] / "data" / "megatron"
LEGACY = DATA / "legacy"
CONFIGS = {"tp2": DATA / "config.json", "tp2pp2": DATA / "config.json", "moe-tp2ep2": DATA / "moe" / "config.json"}
LOGITS = {"tp2": LEGACY / "logits.npy", "tp2pp2": LEGACY / "logits.npy", "moe-tp2ep2": LEGACY / "moe-logits.npy"}
PADDED, TP = 224, 2


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _copy(fixture: str, tmp_path: Path) -> Path:
    d = tmp_path / fixture
    shutil.copytree(LEGACY / fixture, d)
    return d


def _hf_logits(save: Path, cfg: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Any:
    """``import SAVE --model CFG --to hf``, ``convert`` to float32 HF safetensors, transformers' logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf, dst, out = tmp_path / "hf.json", tmp_path / "dst.json", tmp_path / "out"
    rc, _, err = run_cli(capsys, "import", str(save), "--model", str(cfg), "--to", "hf", "-o", str(hf))
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "layout", "--model", str(cfg), "--preset", "hf", "--dtype", "float32", "-o", str(dst))
    assert rc == 0, err
    shutil.rmtree(out, ignore_errors=True)
    rc, _, err = run_cli(capsys, "convert", str(hf), str(dst), "--out", str(out))
    assert rc == 0, err
    shutil.copy(cfg, out / "config.json")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tokens = json.loads((LEGACY / "tokens.json").read_text())
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits


# ------------------------------------------------------------------ real saves, checked by logits


@pytest.mark.parametrize("fixture", ["tp2", "tp2pp2", "moe-tp2ep2"])
def test_legacy_save_imports_to_hf_with_megatrons_logits(fixture: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Measured: max |HF - Megatron| = 1.4e-6 (tp2, tp2pp2), 1.2e-6 (moe-tp2ep2); logits up to ~4.6."""
    torch = pytest.importorskip("torch")
    d = _copy(fixture, tmp_path)
    got = _hf_logits(d, CONFIGS[fixture], tmp_path, capsys)
    m = json.loads((tmp_path / "hf.json").read_text())
    emb = m["arrays"]["model.embed_tokens.weight"]
    assert emb["shape"] == [200, 32]  # the padding (224 rows) dropped
    for a in m["arrays"].values():  # a view of the latest iteration's own files
        assert all("iter_0000002/mp_rank_" in c["source"]["file"] and "byte_range" in c["source"] for c in a["chunks"])
    want = torch.from_numpy(np.load(LOGITS[fixture]))
    assert got.shape == want.shape == (1, 12, 200)
    err = (got - want).abs().max().item()
    assert err < 1e-5, f"max |HF logits - Megatron's| = {err}"


def test_padded_vocab_rows_split_as_the_save_holds_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """224 padded rows at TP2: rank 1 holds HF rows 112..199 (with 128 × tp padding it would be 128..199)."""
    d = _copy("tp2", tmp_path)
    rc, _, err = run_cli(capsys, "import", str(d), "--model", str(CONFIGS["tp2"]), "--to", "hf", "-o",
                         str(tmp_path / "hf.json"))
    assert rc == 0, err
    arrays = json.loads((tmp_path / "hf.json").read_text())["arrays"]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        regions = sorted((c["region"]["offsets"], c["region"]["sizes"], c["source"]["file"].split("/")[-2])
                         for c in arrays[name]["chunks"])
        assert regions == [([0, 0], [112, 32], "mp_rank_00"), ([112, 0], [88, 32], "mp_rank_01")], name


def test_the_tracker_picks_iteration_2_and_iteration_1_differs(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Iteration 2 is one real training step after iteration 1: importing iteration 1 explicitly
    gives other logits, so the logits test above tells which one was read."""
    torch = pytest.importorskip("torch")
    d = _copy("tp2", tmp_path)
    assert (d / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    got = _hf_logits(d / "iter_0000001", CONFIGS["tp2"], tmp_path, capsys)
    want = torch.from_numpy(np.load(LOGITS["tp2"]))
    assert (got - want).abs().max().item() > 1e-2


def test_expert_parallel_directories_are_read_by_the_saves_args(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``mp_rank_TT_EEE`` (pp = 1, ep = 2 in ``args``) is not ``mp_rank_TT_PPP``: expert 3 is local
    expert 1 of EP rank 1, split over TP; a grid the args do not describe is refused in one line."""
    d = _copy("moe-tp2ep2", tmp_path)
    rc, _, err = run_cli(capsys, "import", str(d), "--model", str(CONFIGS["moe-tp2ep2"]), "--to", "hf", "-o",
                         str(tmp_path / "hf.json"))
    assert rc == 0, err
    chunks = json.loads((tmp_path / "hf.json").read_text())["arrays"]["model.layers.1.mlp.experts.3.down_proj.weight"]
    got = sorted((c["region"]["offsets"], c["source"]["file"].split("/")[-2], c["source"]["tensor"])
                 for c in chunks["chunks"])
    name = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"
    assert got == [([0, 0], "mp_rank_00_001", name), ([0, 8], "mp_rank_01_001", name)]
    for t in (0, 1):
        shutil.rmtree(d / "iter_0000002" / f"mp_rank_{t:02d}_001")
    rc, _, err = run_cli(capsys, "import", str(d), "--model", str(CONFIGS["moe-tp2ep2"]), "--to", "hf", "-o",
                         str(tmp_path / "m.json"))
    assert rc == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "args.expert_model_parallel_size is 2, but the mp_rank directories span pp = 1, ep = 1, tp = 2" in err


def test_real_archive_unpickles_to_inert_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a real archive holds, read by the restricted unpickler: args as a record with its
    plain values, NumPy's RNG state as raw bytes (``_codecs`` never called), tensors as references."""
    import _codecs

    from formats.dcp.torch_archive import ArchiveWindow, open_archive, read_data_pkl
    from formats.dcp.unpickle import (
        LegacyUnpickler,
        NumpyArray,
        NumpyDType,
        Record,
        TensorRef,
        restricted_load,
    )
    from formats.megatron.legacy import read_legacy_archive

    def boom(*a: Any, **k: Any) -> Any:
        raise AssertionError("_codecs.encode was called")

    monkeypatch.setattr(_codecs, "encode", boom)
    f = LEGACY / "tp2/iter_0000002/mp_rank_01/model_optim_rng.pt"
    arc = read_legacy_archive(f)
    assert arc.args["padded_vocab_size"] == PADDED and arc.args["make_vocab_size_divisible_by"] == 16
    assert arc.args["tensor_model_parallel_size"] == TP and "params_dtype" not in arc.args  # plain values only
    assert arc.tensors["embedding.word_embeddings.weight"].shape == (PADDED // TP, 32)
    fd = os.open(f, os.O_RDONLY)
    try:
        win = ArchiveWindow(fd, 0, os.fstat(fd).st_size)
        zf = open_archive(win)
        _, pkl = read_data_pkl(zf, {i.filename: i for i in zf.infolist()}, 64 << 20)
    finally:
        os.close(fd)
    assert pkl[:2] == b"\x80\x02"  # torch.save's default protocol
    obj = restricted_load(LegacyUnpickler, pkl, allow_persistent=True)
    assert obj["checkpoint_version"] == 3.0 and obj["iteration"] == 2
    assert isinstance(obj["args"], Record) and obj["args"].get("attention_backend").args == (5,)  # AttnBackend.auto
    rng = obj["rng_state"][0]
    name, key, pos, *_ = rng["np_rng_state"]
    assert name == "MT19937" and isinstance(key, NumpyArray) and type(pos) is int
    version, shape, dtype, fortran, raw = key.state
    assert shape == (624,) and isinstance(dtype, NumpyDType) and dtype.args[0] == "u4" and len(raw) == 624 * 4
    assert isinstance(rng["torch_rng_state"], TensorRef)
    state = obj["optimizer"]["state"]
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(state[0])


# ------------------------------------------------------------------ the padded vocabulary


def _bad_config(tmp_path: Path, **changes: Any) -> Path:
    cfg = json.loads(CONFIGS["tp2"].read_text())
    cfg.update(changes)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


@pytest.mark.parametrize("vocab,expect", [
    (300, "vocab_size 300 does not fit the checkpoint's padded vocabulary of 224 (args.padded_vocab_size "
          "(make_vocab_size_divisible_by 16 × tp 2)); does --model match the checkpoint?"),
    (100, "vocab_size 100 pads to 128 (a multiple of make_vocab_size_divisible_by 16 × tp 2), but the checkpoint "
          "holds a padded vocabulary of 224"),
])
def test_a_config_whose_vocab_does_not_fit_is_refused(vocab: int, expect: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy("tp2", tmp_path)
    cfg = _bad_config(tmp_path, vocab_size=vocab)
    rc, _, err = run_cli(capsys, "import", str(d), "--model", str(cfg), "--to", "hf", "-o", str(tmp_path / "m.json"))
    assert rc == 1 and "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if "vocab" in ln]
    assert len(lines) == 1 and f"{cfg}: {expect}" in lines[0], err
    assert not (tmp_path / "m.json").exists()


def test_padded_vocab_from_args_else_stored_rows_else_the_divisor() -> None:
    from formats.megatron.legacy import find_rank_files, padded_vocab, read_legacy_archive

    files = find_rank_files(LEGACY / "tp2/iter_0000002")
    real = {k: read_legacy_archive(f) for k, f in files.items()}
    assert padded_vocab(real, files, 200, TP) == PADDED  # args.padded_vocab_size
    no_padded = {k: replace(a, args={n: v for n, v in a.args.items() if n != "padded_vocab_size"})
                 for k, a in real.items()}
    assert padded_vocab(no_padded, files, 200, TP) == PADDED  # 112 stored rows × tp 2
    no_args = {k: replace(a, args={}) for k, a in real.items()}
    assert padded_vocab(no_args, files, 200, TP) == PADDED
    with pytest.raises(FormatError, match="args.padded_vocab_size is 256, but embedding.word_embeddings.weight"):
        padded_vocab({k: replace(a, args={**a.args, "padded_vocab_size": 256}) for k, a in real.items()}, files, 200,
                     TP)
    # a middle pipeline stage holds neither embedding nor output layer: the divisor decides
    middle = {k: replace(a, tensors={}) for k, a in no_padded.items()}
    assert padded_vocab(middle, files, 200, TP) == PADDED
    assert padded_vocab({k: replace(a, tensors={}) for k, a in no_args.items()}, files, 200, TP) == 256  # 128 × 2


# ------------------------------------------------------------------ hostile pickles


class _Reduce:
    """Pickles as ``fn(*args)``: what a hostile ``data.pkl`` would ask the unpickler to call."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> Any:
        return (self.fn, self.args)


def _with_data_pkl(f: Path, data: bytes) -> None:
    """Replace the ``data.pkl`` of the real archive ``f`` (every other entry kept, stored)."""
    with zipfile.ZipFile(f) as z:
        entries = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
        for name, blob in entries:
            z.writestr(name, data if name.endswith("/data.pkl") else blob)


def _hostile(kind: str, target: Path) -> bytes:
    import codecs

    if kind == "os.system":
        evil: Any = _Reduce(os.system, f"touch {target}")
    elif kind == "eval":
        evil = _Reduce(eval, f"open({str(target)!r}, 'w')")
    elif kind == "codecs-utf16":
        evil = _Reduce(codecs.encode, "abc", "utf-16")
    elif kind == "bytes-alloc":
        return b"\x80\x02}q\x00X\x04\x00\x00\x00argsq\x01c__builtin__\nbytes\nq\x02J\x00\x00\x00\x40\x85q\x03Rq\x04s."
    else:  # a megatron "class" called with a dict: not an enum member
        return b"\x80\x02}q\x00X\x04\x00\x00\x00argsq\x01cmegatron.core.enums\nModelType\nq\x02}q\x03\x85q\x04Rq\x05s."
    return pickle.dumps({"args": evil, "iteration": 2}, protocol=2)


@pytest.mark.parametrize("kind,named", [
    ("os.system", "refers to posix.system, which is not a tensor, storage, argparse.Namespace or megatron class"),
    ("eval", "refers to builtins.eval, which is not a tensor, storage, argparse.Namespace or megatron class"),
    ("codecs-utf16", "refers to _codecs.encode with encoding 'utf-16', which a legacy save never holds"),
    ("bytes-alloc", "refers to builtins.bytes with arguments, which a legacy save never holds"),
    ("megatron-call", "refers to megatron.core.enums.ModelType called with other than one int or str"),
])
def test_a_forbidden_global_is_refused_by_name_and_nothing_runs(kind: str, named: str, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy("tp2", tmp_path)
    target = tmp_path / "PWNED"
    f = d / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt"
    _with_data_pkl(f, _hostile(kind, target))
    rc, _, err = run_cli(capsys, "import", str(d), "--model", str(CONFIGS["tp2"]), "--to", "hf", "-o",
                         str(tmp_path / "m.json"))
    assert rc == 1 and "Traceback" not in err
    assert f"{f}: data.pkl {named}" in err and err.strip().endswith("refusing to load it"), err
    assert len(err.strip().splitlines()) == 1
    assert not target.exists() and not (tmp_path / "m.json").exists()


def test_legacy_needs_model_and_refuses_hostile_args(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An extra unit case: an archive torch.save wrote with a hostile ``args`` (protocol 2 and 4)."""
    torch = pytest.importorskip("torch")
    d = _copy("tp2", tmp_path)
    rc, _, err = run_cli(capsys, "import", str(d), "-o", str(d / "m.json"))
    assert rc == 2 and "import it with --model CFG --to hf" in err
    pwned = tmp_path / "PWNED"
    f = d / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt"
    for proto in (2, 4):
        torch.save({"args": _Reduce(os.system, f"touch {pwned}"), "model": {"w": torch.ones(2)}}, f,
                   pickle_protocol=proto)
        rc, _, err = run_cli(capsys, "import", str(d), "--model", str(CONFIGS["tp2"]), "--to", "hf", "-o",
                             str(d / "m.json"))
        assert rc == 1 and "Traceback" not in err
        assert f"{f}: data.pkl refers to posix.system" in err and "refusing to load it" in err
        assert not pwned.exists() and not (d / "m.json").exists()


@pytest.mark.parametrize("damage,expect", [
    ("truncate", "mp_rank_00/model_optim_rng.pt: not a readable torch.save archive"),
    ("drop-rank", "the mp_rank directories span tp = 3, pp = 1; missing: mp_rank_01"),
    ("moe-config", "model.layers.0.mlp.gate.weight: no tensor decoder.layers.0.mlp.router.weight"),
])
def test_bad_legacy_checkpoints_fail_in_one_line_each(damage: str, expect: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy("tp2", tmp_path)
    it, cfg = d / "iter_0000002", CONFIGS["tp2"]
    if damage == "truncate":
        f = it / "mp_rank_00" / "model_optim_rng.pt"
        f.write_bytes(f.read_bytes()[:3000])
    elif damage == "drop-rank":
        shutil.move(it / "mp_rank_01", it / "mp_rank_02")
    else:
        cfg = CONFIGS["moe-tp2ep2"]
    rc, _, err = run_cli(capsys, "import", str(d), "--model", str(cfg), "--to", "hf", "-o", str(d / "m.json"))
    assert rc == 1 and "Traceback" not in err
    assert expect in err, err
    assert not (d / "m.json").exists()


@pytest.mark.parametrize("spec", ["te", "local"])
def test_megatron_spec_names_match_real_state_dicts(spec: str) -> None:
    """``layout --preset megatron --megatron-spec local`` names what Megatron's local spec holds in
    memory (the legacy files are its state_dict); ``te`` fuses the norms."""
    from formats.layouts.mesh import Mesh
    from formats.layouts.presets import preset_manifest
    from formats.megatron.legacy import read_legacy_tensors

    m = preset_manifest(CONFIGS["tp2"], "megatron", Mesh(("tp",), (TP,)), megatron_spec=spec,
                        megatron_padded_vocab=PADDED)
    for rank in range(TP):
        local = m.local_tensors(rank)
        stored = read_legacy_tensors(LEGACY / f"tp2/iter_0000002/mp_rank_{rank:02d}/model_optim_rng.pt")
        if spec == "local":
            assert {n: t.shape for n, t in local.items()} == {n: t.shape for n, t in stored.items()}
        else:
            assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in local
            assert "decoder.layers.0.input_layernorm.weight" in stored
