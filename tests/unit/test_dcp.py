"""DCP import (design §3 byte ranges, §7; issue 5 item 6, issue 7 item 2).

Real checkpoints are written by ``torch.distributed.checkpoint.save``: a single-process one with
many dtypes and ranks (0-D..4-D, non-tensor entries) and a 2-rank gloo job that saves DTensor
``Shard(0)`` shards of uneven arrays (FSDP2 style), so the chunks are real shards in two
``.distcp`` files. Each is imported, validated with ``--data``, converted to an HF one-rank
layout and to a TP2 layout, and compared byte for byte with DCP's own ``dcp.load``.

Hostile checkpoints: ``.metadata`` pickles that would run a command or call ``eval``, truncated
or mutated metadata, an item whose ``data.pkl`` names a forbidden global, a byte range past EOF,
a compressed storage entry, paths that leave the directory, stream transforms, non-contiguous
tensors. Each is refused with exit 1 and one line naming the problem; nothing is executed.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
import random
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from formats.dcp.io import read_dcp
from formats.errors import FormatError, ShardstreamError
from formats.manifest.wire import load_manifest
from formats.safetensors.io import SafetensorsReader
from formats.store import SourceStore
from streamer.cli.app import main

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ------------------------------------------------------------------ helpers


def _save(sd: dict[str, Any], d: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp.save(sd, checkpoint_id=str(d))
    return d


def _dcp_load_full(d: Path, like: dict[str, Any]) -> dict[str, Any]:
    """DCP's own load into plain full tensors shaped like ``like``."""
    sd = {k: torch.empty_like(v) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(d))
    return sd


def tbytes(t: Any) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def st_tensors(d: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor of every safetensors file in ``d``: name -> (dtype, shape, bytes)."""
    out: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for f in sorted(d.glob("*.safetensors")):
        with SafetensorsReader(f) as r:
            for n in r.names():
                t = r.tensor(n)
                out[n] = (t.dtype.name, tuple(t.shape), r.read(n).tobytes())
    return out


def rank_tensors(d: Path, rank: int) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    f = d / f"rank-{rank:05d}.safetensors"
    with SafetensorsReader(f) as r:
        return {n: (r.tensor(n).dtype.name, tuple(r.tensor(n).shape), r.read(n).tobytes()) for n in r.names()}


def import_validate(capsys: pytest.CaptureFixture[str], d: Path) -> tuple[Path, str]:
    mf = d / "manifest.json"
    rc, _, note = run_cli(capsys, "import", str(d), "-o", str(mf))
    assert rc == 0, note
    rc, out, err = run_cli(capsys, "validate", "--data", str(mf))
    assert rc == 0, err + out
    return mf, note


def convert_hf(capsys: pytest.CaptureFixture[str], mf: Path, work: Path) -> Path:
    hf = work / "hf.json"
    rc, _, err = run_cli(capsys, "layout", "--like", str(mf), "-o", str(hf))
    assert rc == 0, err
    out = work / "hf-out"
    rc, _, err = run_cli(capsys, "convert", str(mf), str(hf), "--out", str(out))
    assert rc == 0, err
    rc, o, err = run_cli(capsys, "validate", "--data", str(out / "manifest.json"))
    assert rc == 0, err + o
    return out


def expect_refused(capsys: pytest.CaptureFixture[str], d: Path, *needles: str) -> str:
    rc, _, err = run_cli(capsys, "import", str(d), "-o", str(d / "manifest.json"))
    assert rc == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err
    assert not (d / "manifest.json").exists()
    with pytest.raises(FormatError):
        read_dcp(d)
    return err


def _trusted_metadata(d: Path) -> Any:
    """The real Metadata object (test-only: we wrote this file, so the plain pickle is fine)."""
    with open(d / ".metadata", "rb") as f:
        return pickle.load(f)


def _write_metadata(d: Path, md: Any) -> None:
    with open(d / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _item(md: Any, fqn: str) -> tuple[Any, Any]:
    for k, v in md.storage_data.items():
        if k.fqn == fqn:
            return k, v
    raise KeyError(fqn)


def _item_bytes(d: Path, info: Any) -> bytes:
    with open(d / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def rewrite_item(d: Path, fqn: str, edit: Callable[[dict[str, bytes]], dict[str, bytes]],
                 compress: Callable[[str], int] = lambda name: zipfile.ZIP_STORED) -> None:
    """Replace ``fqn``'s first item by a re-zipped, edited copy in a new file ``evil.distcp``."""
    md = _trusted_metadata(d)
    _, info = _item(md, fqn)
    zin = zipfile.ZipFile(io.BytesIO(_item_bytes(d, info)))
    members = edit({n: zin.read(n) for n in zin.namelist()})
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zout:
        for n, data in members.items():
            zout.writestr(zipfile.ZipInfo(n), data, compress_type=compress(n))
    (d / "evil.distcp").write_bytes(buf.getvalue())
    info.relative_path, info.offset, info.length = "evil.distcp", 0, len(buf.getvalue())
    _write_metadata(d, md)


class _Pwn:
    """Unpickling this would run a shell command."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.target}",))


# ------------------------------------------------------------------ checkpoints

PLAIN_SHAPES: dict[str, tuple[tuple[int, ...], Any]] = {
    "scalar.f32": ((), torch.float32),
    "scalar.bf16": ((), torch.bfloat16),
    "vec.i64": ((11,), torch.int64),
    "vec.bool": ((9,), torch.bool),
    "mat.bf16": ((5, 7), torch.bfloat16),
    "mat.f16": ((3, 4), torch.float16),
    "cube.f32": ((2, 3, 4), torch.float32),
    "hyper.bf16": ((2, 3, 2, 5), torch.bfloat16),
    "fp8.e4m3": ((4, 4), torch.float8_e4m3fn),
    "u8": ((6,), torch.uint8),
}


def _plain_tensors(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for name, (shape, dt) in PLAIN_SHAPES.items():
        if dt == torch.bool:
            out[name] = torch.rand(shape, generator=g) > 0.5
        elif dt in (torch.int64, torch.uint8):
            out[name] = torch.randint(0, 200, shape, generator=g).to(dt)
        else:
            out[name] = torch.randn(shape, generator=g).to(dt)
    out["empty.f32"] = torch.zeros(0, 3)
    return out


@pytest.fixture()
def plain_ckpt(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    full = _plain_tensors()
    sd: dict[str, Any] = dict(full)
    sd["step"] = 7  # non-tensor entries: skipped with a note
    sd["config"] = {"lr": 0.1, "name": "x"}
    _save(sd, tmp_path / "ckpt")
    return tmp_path / "ckpt", full


SHARDED_FULL_SHAPES: dict[str, tuple[tuple[int, ...], Any]] = {
    "model.embed.weight": ((7, 4), torch.float32),  # uneven: 4 + 3 rows
    "model.norm.weight": ((3,), torch.bfloat16),  # 2 + 1
    "model.layers.0.w": ((5, 2, 3), torch.bfloat16),  # 3 + 2
    "model.tiny": ((1, 5), torch.float32),  # 1 + 0: rank 1's shard is empty
    "model.ids": ((9,), torch.int64),
    "model.mask": ((6, 2), torch.bool),
}


def _sharded_full() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    out = {}
    for name, (shape, dt) in SHARDED_FULL_SHAPES.items():
        if dt == torch.bool:
            out[name] = torch.rand(shape, generator=g) > 0.5
        elif dt == torch.int64:
            out[name] = torch.randint(-1000, 1000, shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g).to(dt)
    return out


def _sharded_worker(rank: int, d: str) -> None:  # runs in a forked child
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        store = dist.FileStore(os.path.join(d, "store"), 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        full = _sharded_full()
        sd: dict[str, Any] = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
        sd["model.replicated"] = distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Replicate()])
        sd["step"] = 3
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, checkpoint_id=os.path.join(d, "ckpt"))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        print(f"rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)


@pytest.fixture(scope="module")
def sharded_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A 2-rank gloo job saving FSDP2-style DTensor Shard(0) state (forked: torch is imported once)."""
    work = tmp_path_factory.mktemp("sharded")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_sharded_worker, args=(r, str(work))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0, 0], "the 2-rank DCP save failed"
    full = _sharded_full()
    full["model.replicated"] = torch.arange(6.0).reshape(2, 3)
    return work / "ckpt", full


# ------------------------------------------------------------------ real checkpoints


def test_plain_checkpoint_imports_validates_and_converts_like_dcp_load(
        plain_ckpt: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    d, full = plain_ckpt

    def no_torch_load(*a: Any, **k: Any) -> None:
        raise AssertionError("import must never call torch.load")

    expected = _dcp_load_full(d, full)  # DCP's own load, before torch.load is blocked
    monkeypatch.setattr(torch, "load", no_torch_load)
    mf, err = import_validate(capsys, d)
    assert "skipped 3 non-tensor entries" in err and "step" in err and "config.lr" in err
    m = load_manifest(mf)
    assert m.world_size == 1
    assert set(m.arrays) == set(full)
    for name, t in full.items():
        a = m.arrays[name]
        assert a.shape == tuple(t.shape)
        assert a.data_type == str(t.dtype).removeprefix("torch.")
        if t.numel() == 0:
            assert a.chunks == ()
            continue
        (c,) = a.chunks
        assert c.source is not None and c.source.byte_range is not None
        assert c.source.stored_shape == tuple(t.shape) and c.source.file == "__0_0.distcp"
        # the byte range is exactly the tensor's row-major bytes
        a0, b0 = c.source.byte_range
        with open(d / c.source.file, "rb") as f:
            f.seek(a0)
            assert f.read(b0 - a0) == tbytes(t)
    monkeypatch.undo()

    out = convert_hf(capsys, mf, tmp_path)
    got = st_tensors(out)
    for name, t in expected.items():
        dt, shape, data = got[name]
        assert (dt, shape) == (str(t.dtype).removeprefix("torch."), tuple(t.shape)), name
        assert data == tbytes(t) == tbytes(full[name]), name


def test_sharded_fsdp2_checkpoint_converts_like_dcp_load(
        sharded_ckpt: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d, full = sharded_ckpt
    assert sorted(p.name for p in d.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    expected = _dcp_load_full(d, full)
    # import writes its manifest outside the checkpoint directory too (paths get a prefix)
    mf = d.parent / "dcp.json"
    rc, _, err = run_cli(capsys, "import", str(d), "-o", str(mf))
    assert rc == 0, err
    assert "skipped 1 non-tensor entries: step" in err
    rc, o, err = run_cli(capsys, "validate", "--data", str(mf))
    assert rc == 0, err + o
    m = load_manifest(mf)
    w = m.arrays["model.embed.weight"]
    assert [(c.region.offsets, c.region.sizes) for c in w.chunks] == [((0, 0), (4, 4)), ((4, 0), (3, 4))]
    assert [c.source.file for c in w.chunks] == ["ckpt/__0_0.distcp", "ckpt/__1_0.distcp"]  # type: ignore[union-attr]
    assert len(m.arrays["model.tiny"].chunks) == 1  # rank 1's empty shard is not listed
    assert len(m.arrays["model.replicated"].chunks) == 1  # replicated: saved once

    out = convert_hf(capsys, mf, tmp_path)
    got = st_tensors(out)
    assert set(got) == set(full)
    for name, t in expected.items():
        assert got[name][2] == tbytes(t) == tbytes(full[name]), name

    # TP2: every array S(0) over tp (torch.chunk), compared shard by shard with DCP's load
    tp2 = tmp_path / "tp2.json"
    rc, _, err = run_cli(capsys, "layout", "--like", str(mf), "--mesh", "tp=2", "--rule", "*=S(0)",
                         "-o", str(tp2))
    assert rc == 0, err
    out2 = tmp_path / "tp2-out"
    rc, _, err = run_cli(capsys, "convert", str(mf), str(tp2), "--out", str(out2))
    assert rc == 0, err
    rc, o, err = run_cli(capsys, "validate", "--data", str(out2 / "manifest.json"))
    assert rc == 0, err + o
    for r in range(2):
        rt = rank_tensors(out2, r)
        for name, t in expected.items():
            shards = torch.chunk(t, 2, dim=0)
            if r >= len(shards) or shards[r].numel() == 0:
                assert name not in rt or rt[name][1][0] == 0, (name, r)
                continue
            assert rt[name][1] == tuple(shards[r].shape), (name, r)
            assert rt[name][2] == tbytes(shards[r]), (name, r)

    # and straight from the DCP directory (imported on the fly) into TP2 again: same bytes
    out3 = tmp_path / "tp2-direct"
    rc, _, err = run_cli(capsys, "convert", str(d), str(tp2), "--out", str(out3))
    assert rc == 0, err
    for r in range(2):
        assert rank_tensors(out3, r) == rank_tensors(out2, r)


def test_reader_reads_chunks_through_source_store(sharded_ckpt: tuple[Path, dict[str, Any]],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    d, full = sharded_ckpt
    import formats.dcp.io

    monkeypatch.setattr(formats.dcp.io._Files, "MAX_OPEN", 1)  # items interleave the two files
    m, skipped = read_dcp(d)
    assert skipped == ["step"]
    assert m.base_dir == d.resolve()
    with SourceStore(m) as store:
        for fqn, spec, c in m.iter_chunks():
            rt = store.resolve(fqn, c, 0)
            data = store.read(rt, c.local_box)
            sl = tuple(slice(o, o + s) for o, s in zip(c.region.offsets, c.region.sizes))
            assert data.tobytes() == tbytes(full[fqn][sl]), fqn


def test_reader_needs_no_torch(plain_ckpt: tuple[Path, dict[str, Any]]) -> None:
    """formats.dcp.io builds nothing from torch: it works with torch made unimportable."""
    d, full = plain_ckpt
    code = ("import sys; sys.modules['torch'] = None\n"
            "from formats.dcp.io import read_dcp\n"
            f"m, skipped = read_dcp({str(d)!r})\n"
            "print(len(m.arrays), sorted(skipped))\n")
    r = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split(maxsplit=1)[0] == str(len(full))


def test_non_contiguous_tensor_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _save({"ok": torch.ones(2, 2), "tr": torch.arange(12.0).reshape(3, 4).t()}, tmp_path / "ckpt")
    expect_refused(capsys, d, "tr: chunk 0", "not contiguous row-major")


# ------------------------------------------------------------------ hostile checkpoints


def test_metadata_that_would_run_a_command_is_refused(
        plain_ckpt: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    d, _ = plain_ckpt
    pwned = tmp_path / "PWNED"
    md = _trusted_metadata(d)
    md.planner_data = {"evil": _Pwn(pwned)}  # hidden inside an otherwise real Metadata
    _write_metadata(d, md)
    monkeypatch.chdir(tmp_path)
    err = expect_refused(capsys, d, "refusing", "not a DCP metadata class", "system")
    assert "/.metadata: .metadata pickle refers to" in err
    assert not pwned.exists()


def test_metadata_calling_builtins_eval_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    pwned = tmp_path / "PWNED"
    (d / ".metadata").write_bytes(
        b"cbuiltins\neval\n(V__import__('os').system('touch " + str(pwned).encode() + b"')\ntR.")
    expect_refused(capsys, d, "refers to builtins.eval", "refusing to load it")
    assert not pwned.exists()
    # the same through protocol 4 STACK_GLOBAL, and a harmless-looking builtins.getattr
    (d / ".metadata").write_bytes(pickle.dumps(_Pwn(pwned), protocol=4))
    expect_refused(capsys, d, "refusing")
    (d / ".metadata").write_bytes(b"\x80\x04cbuiltins\ngetattr\n.")
    expect_refused(capsys, d, "builtins.getattr")
    assert not pwned.exists()


def test_pickle_opcode_tricks_are_refused_before_unpickling(plain_ckpt: tuple[Path, dict[str, Any]],
                                                             tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A 5-byte LONG_BINPUT would make the C unpickler allocate and zero a 32 GiB memo table; protocol 0
    INST and the extension registry would instantiate without STACK_GLOBAL. All refused by the pre-scan."""
    d, _ = plain_ckpt
    good_md = (d / ".metadata").read_bytes()
    pwned = tmp_path / "PWNED"
    monkeypatch.chdir(tmp_path)
    for bad, needle in [
        (b"\x80\x04Nr\xff\xff\xff\x7f.", "stores memo index 2147483647"),
        (b"\x80\x02Np99999999\n.", "stores memo index 99999999"),
        (b"(S'touch " + str(pwned).encode() + b"'\nios\nsystem\n.", "opcode INST is not allowed"),
        (b"\x80\x02\x82\x01.", "opcode EXT1 is not allowed"),
        (b"\x80\x02(X\x01\x00\x00\x00xQ.", "opcode BINPERSID is not allowed"),
    ]:
        (d / ".metadata").write_bytes(bad)
        expect_refused(capsys, d, needle, "refusing to load it")
    assert not pwned.exists()

    (d / ".metadata").write_bytes(good_md)

    def bomb(members: dict[str, bytes]) -> dict[str, bytes]:
        pkl = next(n for n in members if n.endswith("/data.pkl"))
        members[pkl] = b"\x80\x02Nr\xff\xff\xff\x7f."
        return members

    rewrite_item(d, "vec.i64", bomb)
    expect_refused(capsys, d, "vec.i64: chunk 0", "data.pkl is not one torch.save writes", "memo index")


def test_pickle_cannot_alter_the_allow_list(plain_ckpt: tuple[Path, dict[str, Any]],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """BUILD onto an allowed global (torch.float32 -> 'bool') must not leak into later loads."""
    d, _ = plain_ckpt
    good_md = (d / ".metadata").read_bytes()
    (d / ".metadata").write_bytes(b"\x80\x02ctorch\nfloat32\nX\x04\x00\x00\x00bool\x85b.")
    expect_refused(capsys, d, "does not hold a DCP Metadata object")
    (d / ".metadata").write_bytes(good_md)
    m, _ = read_dcp(d)
    assert m.arrays["cube.f32"].data_type == "float32"


def test_truncated_and_mutated_metadata_fail_cleanly(plain_ckpt: tuple[Path, dict[str, Any]],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    d, _ = plain_ckpt
    good = (d / ".metadata").read_bytes()
    (d / ".metadata").write_bytes(good[: len(good) // 2])
    expect_refused(capsys, d, ".metadata is not a valid DCP metadata pickle")
    (d / ".metadata").write_bytes(b"")
    expect_refused(capsys, d, ".metadata")
    (d / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    expect_refused(capsys, d, "does not hold a DCP Metadata object")
    # mutation fuzz: every outcome is success or a ShardstreamError, never another exception
    rng = random.Random(0)
    outcomes = {"ok": 0, "refused": 0}
    for i in range(300):
        b = bytearray(good)
        kind = i % 3
        if kind == 0:
            b = b[: rng.randrange(len(b))]
        elif kind == 1:
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        else:
            p = rng.randrange(len(b))
            b[p:p] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        (d / ".metadata").write_bytes(bytes(b))
        try:
            read_dcp(d)
            outcomes["ok"] += 1
        except ShardstreamError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0


def test_data_pkl_with_forbidden_global_is_refused(plain_ckpt: tuple[Path, dict[str, Any]], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    d, _ = plain_ckpt
    pwned = tmp_path / "PWNED"

    def evil(members: dict[str, bytes]) -> dict[str, bytes]:
        pkl = next(n for n in members if n.endswith("/data.pkl"))
        members[pkl] = pickle.dumps(_Pwn(pwned), protocol=2)
        return members

    rewrite_item(d, "mat.bf16", evil)
    monkeypatch.chdir(tmp_path)
    err = expect_refused(capsys, d, "evil.distcp: mat.bf16: chunk 0", "data.pkl refers to",
                         "not a tensor rebuild function or storage class")
    assert "system" in err
    assert not pwned.exists()


def test_item_variants_refused(plain_ckpt: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    d, _ = plain_ckpt
    good_md = (d / ".metadata").read_bytes()

    # the storage entry deflated: it cannot be read by byte range
    rewrite_item(d, "cube.f32", lambda m: m,
                 compress=lambda n: zipfile.ZIP_DEFLATED if "/data/" in n else zipfile.ZIP_STORED)
    expect_refused(capsys, d, "cube.f32: chunk 0", "is compressed")

    # the re-zipped item, stored: accepted (the reader does not depend on torch's alignment padding)
    (d / ".metadata").write_bytes(good_md)
    rewrite_item(d, "cube.f32", lambda m: m)
    m, _ = read_dcp(d)
    assert m.arrays["cube.f32"].chunks[0].source.file == "evil.distcp"  # type: ignore[union-attr]

    # wrong shape in data.pkl
    (d / ".metadata").write_bytes(good_md)

    def reshape(members: dict[str, bytes]) -> dict[str, bytes]:
        pkl = next(n for n in members if n.endswith("/data.pkl"))
        t = members[pkl]
        assert b"K\x02K\x03K\x04\x87" in t  # size tuple (2, 3, 4) in protocol 2
        members[pkl] = t.replace(b"K\x02K\x03K\x04\x87", b"K\x03K\x02K\x04\x87", 1)
        return members

    rewrite_item(d, "cube.f32", reshape)
    expect_refused(capsys, d, "cube.f32: chunk 0", "shape [3, 2, 4]")

    # storage entry missing from the archive
    (d / ".metadata").write_bytes(good_md)
    rewrite_item(d, "cube.f32", lambda m: {k: v for k, v in m.items() if "/data/" not in k})
    expect_refused(capsys, d, "has no entry")

    # not a zip at all (a SAFETENSORS-serialized or garbage item)
    (d / ".metadata").write_bytes(good_md)
    md = _trusted_metadata(d)
    _, info = _item(md, "vec.i64")
    (d / "junk.distcp").write_bytes(b"\0" * info.length)
    info.relative_path, info.offset = "junk.distcp", 0
    _write_metadata(d, md)
    expect_refused(capsys, d, "vec.i64: chunk 0", "not a torch.save zip archive")


def test_byte_range_past_eof_is_refused(plain_ckpt: tuple[Path, dict[str, Any]],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    d, _ = plain_ckpt
    f = d / "__0_0.distcp"
    good = f.read_bytes()
    f.write_bytes(good[: len(good) // 2])
    expect_refused(capsys, d, "past the end of the file")
    f.write_bytes(good)
    md = _trusted_metadata(d)
    _, info = _item(md, "u8")
    info.offset = len(good) + 10
    _write_metadata(d, md)
    expect_refused(capsys, d, "u8: chunk 0", "past the end of the file")


def test_paths_transforms_and_missing_items_are_refused(plain_ckpt: tuple[Path, dict[str, Any]], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    d, _ = plain_ckpt
    good_md = (d / ".metadata").read_bytes()
    for bad in ("../outside.distcp", "/etc/passwd", "a//b", "rank-{rank}.distcp"):
        md = _trusted_metadata(d)
        _, info = _item(md, "u8")
        info.relative_path = bad
        _write_metadata(d, md)
        expect_refused(capsys, d, "u8: chunk 0", "not a plain relative path")
    # a symlink leaving the directory
    outside = tmp_path / "outside.distcp"
    outside.write_bytes((d / "__0_0.distcp").read_bytes())
    (d / "link.distcp").symlink_to(outside)
    md = pickle.loads(good_md)
    _, info = _item(md, "u8")
    info.relative_path = "link.distcp"
    _write_metadata(d, md)
    expect_refused(capsys, d, "outside the checkpoint directory")
    # stream transforms (e.g. DCP's zstd extension)
    md = pickle.loads(good_md)
    _, info = _item(md, "u8")
    info.transform_descriptors = ["stream.zstd/1"]
    _write_metadata(d, md)
    expect_refused(capsys, d, "u8: chunk 0", "stream transforms")
    # a chunk with no storage_data entry, and a missing .distcp file
    md = pickle.loads(good_md)
    k, _ = _item(md, "u8")
    del md.storage_data[k]
    _write_metadata(d, md)
    expect_refused(capsys, d, "u8: chunk 0", "no storage_data entry")
    (d / ".metadata").write_bytes(good_md)
    (d / "__0_0.distcp").rename(d / "moved.distcp")
    expect_refused(capsys, d, "no such file")


def test_chunks_that_do_not_tile_are_refused(plain_ckpt: tuple[Path, dict[str, Any]],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    d, _ = plain_ckpt
    md = _trusted_metadata(d)
    md.state_dict_metadata["mat.bf16"].size = torch.Size([6, 7])  # one row not covered by any chunk
    _write_metadata(d, md)
    expect_refused(capsys, d, "mat.bf16")


def test_item_mutation_fuzz_never_escapes(plain_ckpt: tuple[Path, dict[str, Any]]) -> None:
    """Random byte flips / truncation of a .distcp: success (payload bytes changed) or FormatError."""
    d, _ = plain_ckpt
    f = d / "__0_0.distcp"
    good = f.read_bytes()
    rng = random.Random(1)
    refused = 0
    for i in range(200):
        b = bytearray(good)
        if i % 4 == 0:
            b = b[: rng.randrange(len(b))]
        else:
            for _ in range(rng.randint(1, 6)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        f.write_bytes(bytes(b))
        try:
            read_dcp(d)
        except ShardstreamError:
            refused += 1
    assert refused > 0
    f.write_bytes(good)
    m, _ = read_dcp(d)
    assert np.all([len(a.chunks) <= 1 for a in m.arrays.values()])
