"""The CLI contract (design §8): bad input gives exit 1 with one precise line per problem and no
traceback, and leaves no partial output; usage errors give exit 2; the ok paths of validate,
plan, inspect, import and layout; size parsing; and a golden list of subcommands and flags.

Everything runs in-process through ``streamer.cli.app.main``.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from formats.errors import ManifestError
from formats.manifest.wire import load_manifest, save_manifest
from formats.validate.manifest import validate_data
from streamer.cli.app import build_parser, main, parse_size
from streamer.convert.importer import import_checkpoint
from streamer.tools.synth import write_checkpoint

ARRAYS = {"a.weight": ((6, 4), "float32"), "b.bias": ((5,), "bfloat16")}


def run(capsys: Any, *argv: Any) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


@dataclass
class World:
    root: Path

    @property
    def hf(self) -> Path:
        return self.root / "hf"

    @property
    def src(self) -> Path:
        return self.root / "hf" / "manifest.json"

    @property
    def st(self) -> Path:
        return self.root / "hf" / "model.safetensors"

    @property
    def dst(self) -> Path:
        return self.root / "dst.json"

    @property
    def out(self) -> Path:
        return self.root / "out" / "deep"

    def edit(self, path: Path, fn: Callable[[dict[str, Any]], None]) -> None:
        obj = json.loads(path.read_text())
        fn(obj)
        path.write_text(json.dumps(obj))

    def st_header(self) -> tuple[dict[str, Any], bytes]:
        b = self.st.read_bytes()
        n = struct.unpack("<Q", b[:8])[0]
        return json.loads(b[8:8 + n]), b[8 + n:]

    def write_st(self, header: dict[str, Any], data: bytes) -> None:
        t = json.dumps(header).encode()
        t += b" " * (-len(t) % 8)
        self.st.write_bytes(struct.pack("<Q", len(t)) + t + data)


@pytest.fixture()
def world(tmp_path: Path, capsys: Any) -> World:
    w = World(tmp_path)
    write_checkpoint(w.hf, ARRAYS, seed=1)
    save_manifest(import_checkpoint([w.hf]), w.src)
    rc, _, err = run(capsys, "layout", "--like", w.src, "--mesh", "tp=2", "--rule", "a.weight=S(0)", "--format-version", "1",
             "-o", w.dst)  # the bad-input cases edit explicit chunks
    assert rc == 0, err
    return w


# ------------------------------------------------------------------ bad input: one line, exit 1, no output


def _chunk0(o: dict[str, Any]) -> dict[str, Any]:
    return o["arrays"]["a.weight"]["chunks"][0]


def _overlap(o: dict[str, Any]) -> None:
    # two ranks, each holding rows of one shared stored tensor: rows 2:4 are claimed twice
    o["world_size"] = 2
    o["arrays"]["a.weight"]["chunks"] = [
        {"region": {"offsets": [0, 0], "sizes": [4, 4]}, "holders": [0], "source": {"file": "model.safetensors"}},
        {"region": {"offsets": [2, 0], "sizes": [4, 4]}, "holders": [1],
         "source": {"file": "model.safetensors", "offsets": [2, 0]}}]


def _gap(o: dict[str, Any]) -> None:
    _chunk0(o)["region"]["sizes"] = [3, 4]


def _symlink_out(w: World) -> None:
    outside = w.root / "outside.safetensors"
    outside.write_bytes(w.st.read_bytes())
    (w.hf / "link.safetensors").symlink_to(outside)
    w.edit(w.src, lambda o: _chunk0(o)["source"].update(file="link.safetensors"))


def _st_edit(fn: Callable[[dict[str, Any]], None]) -> Callable[[World], None]:
    def go(w: World) -> None:
        h, data = w.st_header()
        fn(h)
        w.write_st(h, data)
    return go


def _truncate(n: int) -> Callable[[World], None]:
    def go(w: World) -> None:
        b = w.st.read_bytes()
        w.st.write_bytes(b[:n])
    return go


def _header_len(extra: int | None = None, absolute: int | None = None) -> Callable[[World], None]:
    def go(w: World) -> None:
        b = w.st.read_bytes()
        n = absolute if absolute is not None else len(b) + (extra or 0)
        w.st.write_bytes(struct.pack("<Q", n) + b[8:])
    return go


def _src(fn: Callable[[dict[str, Any]], None]) -> Callable[[World], None]:
    return lambda w: w.edit(w.src, fn)


def _dst(fn: Callable[[dict[str, Any]], None]) -> Callable[[World], None]:
    return lambda w: w.edit(w.dst, fn)


def _dst_extra_array(o: dict[str, Any]) -> None:
    o["arrays"]["zzz.weight"] = json.loads(json.dumps(o["arrays"]["b.bias"]))


def _dst_shape(o: dict[str, Any]) -> None:
    o["arrays"]["b.bias"]["shape"] = [6]
    o["arrays"]["b.bias"]["chunks"][0]["region"]["sizes"] = [6]


@dataclass(frozen=True)
class Bad:
    id: str
    mutate: Callable[[World], None]
    #: substrings of the one problem line
    expect: tuple[str, ...]
    #: the line must name this array (None: no array to name)
    array: str | None
    #: what the line names as its path: "src" (manifest), "st" (the safetensors file), "dst"
    path: str
    #: the second command that must report the same problem: validate / validate --data / plan
    also: str


BAD = [
    Bad("truncated-json", lambda w: w.src.write_text(w.src.read_text()[:57]), ("not valid JSON",), None,
        "src", "validate"),
    Bad("wrong-format-version", _src(lambda o: o.update(format_version=3)), ("format_version 3",), None,
        "src", "validate"),
    Bad("format-version-as-string", _src(lambda o: o.update(format_version="1")), ("format_version '1'",), None,
        "src", "validate"),
    Bad("unknown-top-key", _src(lambda o: o.update(colour="red")), ("unknown key 'colour'",), None,
        "src", "validate"),
    Bad("unknown-chunk-key", _src(lambda o: _chunk0(o).update(stride=[1, 1])), ("unknown key 'stride'",),
        "a.weight", "src", "validate"),
    Bad("negative-size", _src(lambda o: _chunk0(o)["region"].update(sizes=[-6, 4])), ("non-negative", "-6"),
        "a.weight", "src", "validate"),
    Bad("negative-shape", _src(lambda o: o["arrays"]["b.bias"].update(shape=[-5])), ("-5",),
        "b.bias", "src", "validate"),
    Bad("region-out-of-bounds", _src(lambda o: _chunk0(o)["region"].update(sizes=[7, 4])),
        ("exceeds shape", "stop 7 > 6"), "a.weight", "src", "validate"),
    Bad("gap", _src(_gap), ("gap", "[3:6, 0:4]"), "a.weight", "src", "validate"),
    Bad("overlap", _src(_overlap), ("overlap", "[2:4, 0:4]"), "a.weight", "src", "validate"),
    Bad("holder-ge-world-size", _src(lambda o: _chunk0(o).update(holders=[1])), ("holder rank 1", "world_size 1"),
        "a.weight", "src", "validate"),
    Bad("unknown-dtype", _src(lambda o: o["arrays"]["a.weight"].update(data_type="float128")),
        ("unknown data_type 'float128'",), "a.weight", "src", "validate"),
    Bad("path-traversal", _src(lambda o: _chunk0(o)["source"].update(file="../../etc/passwd")),
        ("'../../etc/passwd'", ".."), "a.weight", "src", "validate"),
    Bad("absolute-path", _src(lambda o: _chunk0(o)["source"].update(file="/etc/passwd")),
        ("'/etc/passwd'",), "a.weight", "src", "validate"),
    Bad("symlink-leaving-dir", _symlink_out, ("link.safetensors",), "a.weight", "src", "validate"),
    Bad("missing-file", lambda w: w.st.unlink(), ("not found",), None, "st", "validate --data"),
    Bad("truncated-safetensors", _truncate(-10), ("past the end",), None, "st", "validate --data"),
    Bad("truncated-to-5-bytes", _truncate(5), ("5 bytes",), None, "st", "validate --data"),
    Bad("header-length-past-eof", _header_len(extra=100), ("header length", "past the end"), None, "st",
        "validate --data"),
    Bad("header-over-100MB", _header_len(absolute=100_000_008), ("100000008", "limit"), None, "st",
        "validate --data"),
    Bad("data-offsets-past-eof", _st_edit(lambda h: h["b.bias"]["data_offsets"].__setitem__(1, 1106)),
        ("'b.bias'", "data_offsets", "past the end"), None, "st", "validate --data"),
    Bad("shape-vs-byte-count", _st_edit(lambda h: h["a.weight"].update(shape=[6, 3])),
        ("'a.weight'", "[6, 3]", "needs 72"), None, "st", "validate --data"),
    Bad("dtype-vs-byte-count", _st_edit(lambda h: h["a.weight"].update(dtype="F64")),
        ("'a.weight'", "needs 192"), None, "st", "validate --data"),
    Bad("dst-array-missing-in-src", _dst(_dst_extra_array), ("missing in source",), "zzz.weight", "dst", "plan"),
    Bad("shape-mismatch", _dst(_dst_shape), ("shape mismatch", "[5]", "[6]"), "b.bias", "dst", "plan"),
    # float pairs are cast on the way; a float/int pair is refused
    Bad("dtype-mismatch", _dst(lambda o: o["arrays"]["b.bias"].update(data_type="int16")),
        ("data_type mismatch", "bfloat16", "int16"), "b.bias", "dst", "plan"),
]


def _check_one_line(rc: int, err: str, case: Bad, path: Path) -> str:
    assert rc == 1, err
    assert "Traceback" not in err, err
    got = lines(err)
    assert len(got) == 1, f"expected one problem line, got:\n{err}"
    line = got[0]
    for s in case.expect:
        assert s in line, (s, line)
    if case.array is not None:
        assert case.array in line, line
    assert str(path) in line, (str(path), line)
    return line


@pytest.mark.parametrize("case", BAD, ids=[c.id for c in BAD])
def test_bad_input_convert(world: World, capsys: Any, case: Bad) -> None:
    case.mutate(world)
    rc, out, err = run(capsys, "convert", world.src, world.dst, "--out", world.out)
    path = {"src": world.src, "st": world.st, "dst": world.dst}[case.path]
    _check_one_line(rc, err, case, path)
    assert out == ""
    assert not (world.root / "out").exists(), "convert left output behind for bad input"


@pytest.mark.parametrize("case", BAD, ids=[c.id for c in BAD])
def test_bad_input_second_command(world: World, capsys: Any, case: Bad) -> None:
    case.mutate(world)
    if case.also == "plan":
        rc, out, err = run(capsys, "plan", world.src, world.dst)
        _check_one_line(rc, err, case, world.dst)
        assert out == ""
        return
    argv = ["validate", world.src] + (["--data"] if case.also == "validate --data" else [])
    rc, out, err = run(capsys, *argv)
    line = _check_one_line(rc, err, case, world.src)
    if case.path == "st":  # validate --data names the manifest, the array and the file
        assert "a.weight" in line and "model.safetensors" in line
    assert lines(out) == [f"FAIL {world.src}: 1 problem(s)"]
    # --json: one object on stdout, the problem on stderr
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 1
    obj = json.loads(out)
    assert obj["ok"] is False and len(obj["manifests"][0]["problems"]) == 1
    assert len(lines(err)) == 1


def test_missing_src_path(world: World, capsys: Any) -> None:
    rc, _, err = run(capsys, "convert", world.root / "nope.json", world.dst, "--out", world.out)
    assert rc == 1 and "nope.json" in err and len(lines(err)) == 1 and "Traceback" not in err
    assert not (world.root / "out").exists()
    rc, _, err = run(capsys, "validate", world.root / "nope.json")
    assert rc == 1 and "nope.json" in err and "Traceback" not in err


def test_several_problems_one_line_each(world: World, capsys: Any) -> None:
    def two(o: dict[str, Any]) -> None:
        _chunk0(o).update(holders=[3])
        o["arrays"]["b.bias"]["chunks"][0]["region"]["sizes"] = [4]
    world.edit(world.src, two)
    rc, _, err = run(capsys, "validate", world.src)
    assert rc == 1
    got = lines(err)
    assert len(got) == 2
    assert any("a.weight" in ln and "holder rank 3" in ln for ln in got)
    assert any("b.bias" in ln and "gap" in ln for ln in got)
    assert all(ln.startswith(f"{world.src}: ") for ln in got)


def test_debug_shows_the_traceback(world: World) -> None:
    world.edit(world.src, lambda o: o.update(format_version=3))
    with pytest.raises(ManifestError):
        main(["--debug", "convert", str(world.src), str(world.dst), "--out", str(world.out)])


# ------------------------------------------------------------------ usage errors: exit 2


@pytest.mark.parametrize("argv", [
    [],
    ["frobnicate"],
    ["convert", "a.json"],
    ["convert", "a.json", "b.json"],
    ["convert", "a.json", "b.json", "--out", "o", "--memory-limit", "abc"],
    ["convert", "a.json", "b.json", "--out", "o", "--memory-limit", "0"],
    ["convert", "a.json", "b.json", "--out", "o", "--max-shard-size", "12 parsecs"],
    ["convert", "a.json", "b.json", "--out", "o", "--format", "hdf5"],
    ["convert", "a.json", "b.json", "--out", "o", "--timeout", "0"],
    ["convert", "a.json", "b.json", "--out", "o", "--timeout", "inf"],
    ["refit", "send", "--manifest", "a.json", "--timeout", "-1"],
    ["layout", "--mesh", "tp=2", "-o", "x.json"],
    ["plan", "a.json", "b.json", "--src-domain-size", "0"],
    ["validate"],
    ["import", "x"],
], ids=lambda a: " ".join(a) or "nothing")
def test_usage_errors_exit_2(tmp_path: Path, capsys: Any, argv: list[str], monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    assert "Traceback" not in err and err.strip()
    assert not (tmp_path / "o").exists() and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["send", "--replica", "a"], "--replica is for refit recv"),
    (["recv", "--replica", "a", "--control", "mpi"], "store control plane only"),
    (["recv", "--replica", "a/b"], "replica name 'a/b'"),
    (["recv", "--replicas"], "--replicas is for refit send"),
    (["send", "--replicas", "--control", "mpi"], "store control plane only"),
    (["send", "--replicas", "--transport", "nccl"], "moves host tensors over gloo"),
])
def test_refit_replica_usage_errors(tmp_path: Path, capsys: Any, monkeypatch: Any, argv: list[str],
                                    message: str) -> None:
    """Refused before any wait (every rank of a job refuses alike): exit 2, one line."""
    import streamer.cli.collective as collective

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(collective, "_announced", [])
    rc, _, err = run(capsys, "refit", *argv, "--manifest", "a.json", "--rendezvous", "r", "--timeout", "5")
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_convert_timeout_reaches_the_workers(world: World, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--timeout`` bounds the workers' waits: it is the agreement round's and the pipeline's."""
    import streamer.convert as conv
    import streamer.ops.agree as agree_mod

    seen: dict[str, float] = {}
    real_convert, real_agreed = conv.convert, agree_mod.agreed

    def spy_convert(*a: Any, **k: Any) -> Any:
        seen["pipeline"] = a[3].timeout
        return real_convert(*a, **k)

    def spy_agreed(control: Any, timeout: float) -> Any:
        seen["agree"] = timeout
        return real_agreed(control, timeout)

    monkeypatch.setattr(conv, "convert", spy_convert)
    monkeypatch.setattr(agree_mod, "agreed", spy_agreed)
    rc, _, err = run(capsys, "convert", world.src, world.dst, "--out", world.out, "--timeout", "7.5")
    assert rc == 0, err
    assert seen == {"pipeline": 7.5, "agree": 7.5}


def test_bench_plot_without_matplotlib_refused_before_the_run(tmp_path: Path, capsys: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from streamer.tools import bench

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))

    def must_not_run(*a: Any, **k: Any) -> Any:
        raise AssertionError("the benchmark ran before --plot was checked")

    monkeypatch.setattr(bench, "bench_refit", must_not_run)
    rc, _, err = run(capsys, "bench", "refit", "--plot", str(tmp_path / "p.png"), "--work", str(tmp_path / "w"))
    assert rc == 2 and lines(err) == ["--plot needs matplotlib: pip install 'shardstream[plot]'"]


def test_zarr_compressor_without_zarr_format_is_a_usage_error(world: World, capsys: Any) -> None:
    rc, _, err = run(capsys, "convert", world.src, world.dst, "--out", world.out, "--zarr-compressor", "zstd")
    assert rc == 2 and "zarr" in err and "Traceback" not in err
    assert not (world.root / "out").exists()


@pytest.mark.parametrize("text,value", [
    ("256MiB", 256 * 1024**2), ("1GB", 10**9), ("1GiB", 1 << 30), ("64KiB", 65536), ("1KB", 1000),
    ("1.5KiB", 1536), ("4096", 4096), ("2 MB", 2_000_000), ("7b", 7), ("3mib", 3 << 20),
])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["abc", "", "MiB", "-1", "1 parsec", "0", "0.1", "1e6", "5 KiBs"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


# ------------------------------------------------------------------ ok paths


def test_validate_ok(world: World, capsys: Any, tmp_path: Path) -> None:
    rc, out, err = run(capsys, "validate", world.src)
    assert rc == 0 and err == ""
    assert lines(out) == [f"ok   {world.src}: 2 arrays, 2 chunks, world_size 1"]
    rc, out, err = run(capsys, "validate", "--data", world.src, world.dst.parent / "hf")
    assert rc == 0 and err == ""
    assert len(lines(out)) == 2 and all(ln.startswith("ok") and "data checked" in ln for ln in lines(out))
    rc, out, _ = run(capsys, "validate", "--json", world.src, world.dst)
    assert rc == 0
    obj = json.loads(out)
    assert obj["ok"] is True and [m["ok"] for m in obj["manifests"]] == [True, True]
    assert obj["manifests"][1]["world_size"] == 2
    # without --data no file is opened: a layout whose files do not exist yet is fine
    assert not (world.root / "rank-00000.safetensors").exists()
    # one bad manifest among good ones fails the whole run
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    rc, out, err = run(capsys, "validate", world.src, bad)
    assert rc == 1 and out.splitlines()[0].startswith("ok") and out.splitlines()[1].startswith("FAIL")


PLAN_KEYS = {"total_bytes", "moved_bytes", "lower_bound_bytes", "network_bytes", "local_bytes", "min_network_bytes",
             "max_send_bytes", "max_recv_bytes", "ideal_max_send_bytes", "transfers", "broadcast_moved_bytes",
             "broadcast_max_recv_bytes"}


def test_plan_json(world: World, capsys: Any) -> None:
    rc, out, err = run(capsys, "plan", world.src, world.dst, "--json", "--dst-domain-size", "2")
    assert rc == 0, err
    assert len(out.strip().splitlines()) == 1
    st = json.loads(out)
    assert isinstance(st, dict)
    assert PLAN_KEYS <= set(st), PLAN_KEYS - set(st)
    assert any(k.startswith("broadcast_") for k in st)
    total = 6 * 4 * 4 + 5 * 2 * 2  # a.weight split, b.bias replicated on both ranks
    assert st["total_bytes"] == total
    assert st["moved_bytes"] == st["lower_bound_bytes"] == total
    assert st["network_bytes"] == st["min_network_bytes"]
    assert st["max_send_bytes"] >= st["ideal_max_send_bytes"] > 0
    assert st["transfers"] >= 3
    assert "moved" in err  # the human table goes to stderr with --json
    rc, out, _ = run(capsys, "plan", world.src, world.dst)
    assert rc == 0 and "lower bound" in out


def test_plan_same_job_moves_nothing_already_held(world: World, capsys: Any) -> None:
    rc, out, _ = run(capsys, "plan", world.src, world.src, "--same-job", "--json")
    assert rc == 0
    st = json.loads(out)
    assert st["moved_bytes"] == st["lower_bound_bytes"] == 0


def test_plan_check(world: World, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan --check`` runs the plan checker: ok on the planner's plan (the figures unchanged),
    and on a plan that lost a transfer, one line per problem on stderr and exit 1."""
    rc, plain, _ = run(capsys, "plan", world.src, world.dst, "--json")
    assert rc == 0
    rc, out, err = run(capsys, "plan", world.src, world.dst, "--json", "--check")
    assert rc == 0, err
    assert "plan check: ok" in err
    assert {k: v for k, v in json.loads(out).items() if k != "plan_seconds"} == {
        k: v for k, v in json.loads(plain).items() if k != "plan_seconds"}

    import streamer.plan.planner as planner

    real = planner.plan_transfers

    class Broken:  # the real plan, one transfer short
        def __init__(self, plan: Any) -> None:
            self._plan = plan
            self.transfers = plan.transfers[1:]

        def __getattr__(self, name: str) -> Any:
            return getattr(self._plan, name)

    monkeypatch.setattr(planner, "plan_transfers", lambda *a, **k: Broken(real(*a, **k)))
    rc, out, err = run(capsys, "plan", world.src, world.dst, "--check")
    assert rc == 1 and out == "" and "Traceback" not in err
    assert lines(err) and all(ln.startswith(f"{world.dst}: plan check: ") for ln in lines(err)), err
    assert any("receives" in ln for ln in lines(err)), err


def test_inspect_safetensors_and_manifest(world: World, capsys: Any) -> None:
    rc, out, err = run(capsys, "inspect", world.st)
    assert rc == 0, err
    assert out.startswith(f"{world.st}: 2 tensors")
    assert "a.weight" in out and "float32" in out and "[6, 4]" in out and "b.bias" in out
    rc, out, _ = run(capsys, "inspect", world.st, "--json")
    obj = json.loads(out)
    assert obj["kind"] == "safetensors"
    assert {t["name"]: (t["data_type"], t["shape"]) for t in obj["tensors"]} == {
        "a.weight": ("float32", [6, 4]), "b.bias": ("bfloat16", [5])}
    rc, out, _ = run(capsys, "inspect", world.dst)
    assert rc == 0 and "world_size 2" in out and "rank     1" in out
    rc, out, _ = run(capsys, "inspect", world.dst, "--json")
    obj = json.loads(out)
    assert obj["kind"] == "manifest" and obj["world_size"] == 2 and obj["arrays"] == 2
    assert obj["bytes_per_rank"] == {"0": 3 * 4 * 4 + 10, "1": 3 * 4 * 4 + 10}
    # a hostile file: exit 1, one line
    world.st.write_bytes(struct.pack("<Q", 1 << 40))
    rc, _, err = run(capsys, "inspect", world.st)
    assert rc == 1 and len(lines(err)) == 1 and "Traceback" not in err


def test_import_single_file(tmp_path: Path, capsys: Any) -> None:
    write_checkpoint(tmp_path / "ck", ARRAYS, seed=4)
    rc, out, err = run(capsys, "import", tmp_path / "ck" / "model.safetensors", "-o", tmp_path / "m.json")
    assert rc == 0, err
    assert "2 arrays, 2 chunks" in out
    m = load_manifest(tmp_path / "m.json")
    assert {f: (a.shape, a.data_type) for f, a in m.arrays.items()} == ARRAYS
    assert [c.source.file for _, _, c in m.iter_chunks()] == ["ck/model.safetensors"] * 2
    assert validate_data(m) == []


def test_import_index_sharded_dir(tmp_path: Path, capsys: Any) -> None:
    arrays = {f"layers.{i}.w": ((8, 8), "float32") for i in range(5)}
    write_checkpoint(tmp_path / "ck", arrays, seed=4, max_shard_size=600)
    assert (tmp_path / "ck" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "ck").glob("model-*.safetensors"))) == 3  # 256-byte arrays, two per shard
    rc, _, err = run(capsys, "import", tmp_path / "ck", "-o", tmp_path / "ck" / "manifest.json", "--json")
    assert rc == 0, err
    m = load_manifest(tmp_path / "ck")
    assert set(m.arrays) == set(arrays)
    assert sorted({c.source.file for _, _, c in m.iter_chunks()}) == [
        f"model-{k:05d}-of-00003.safetensors" for k in (1, 2, 3)]
    assert validate_data(m) == []
    # an index naming a file outside the checkpoint is refused
    idx = tmp_path / "ck" / "model.safetensors.index.json"
    obj = json.loads(idx.read_text())
    obj["weight_map"]["layers.0.w"] = "../evil.safetensors"
    idx.write_text(json.dumps(obj))
    os.unlink(tmp_path / "ck" / "manifest.json")
    rc, _, err = run(capsys, "import", tmp_path / "ck", "-o", tmp_path / "ck" / "again.json")
    assert rc == 1 and "evil" in err and len(lines(err)) == 1
    assert not (tmp_path / "ck" / "again.json").exists()


def test_import_convert_output_dir(world: World, capsys: Any) -> None:
    assert run(capsys, "convert", world.src, world.dst, "--out", world.out)[0] == 0
    rc, _, err = run(capsys, "import", world.out, "-o", world.root / "copy.json")
    assert rc == 0, err
    m = load_manifest(world.root / "copy.json")  # paths rebased onto the manifest's directory
    files = sorted({c.file_for(h) for _, _, c in m.iter_chunks() for h in c.holders})
    assert files == ["out/deep/rank-00000.safetensors", "out/deep/rank-00001.safetensors"]
    assert validate_data(m) == []
    # and the copy is a valid SRC
    assert run(capsys, "layout", "--like", world.root / "copy.json", "-o", world.root / "hf1.json")[0] == 0
    assert run(capsys, "convert", world.root / "copy.json", world.root / "hf1.json", "--out", world.root / "b")[0] == 0
    assert (world.root / "b" / "model.safetensors").read_bytes() == world.st.read_bytes()


@pytest.mark.parametrize("args,expect", [
    (["--mesh", "tp=0"], "size 0"),
    (["--mesh", "tp=2,tp=2"], "appears twice"),
    (["--mesh", "tp"], "bad mesh entry"),
    (["--mesh", "tp=two"], "integer"),
    (["--mesh", "tp=2", "--rule", "a.weight"], "expected GLOB=PLACEMENTS"),
    (["--mesh", "tp=2", "--rule", "a.weight=X(0)"], "bad placement"),
    (["--mesh", "tp=2", "--rule", "a.weight=S(-1)"], "negative"),
    (["--mesh", "tp=2", "--rule", "a.weight=R,S(0)"], "2 placement(s)"),
    (["--mesh", "tp=2", "--rule", "a.weight=S(2)"], "a.weight"),
    (["--mesh", "tp=2", "--file-pattern", "../rank-{rank}.safetensors"], "bad file pattern"),
    (["--mesh", "tp=2", "--file-pattern", "rank-{node}.safetensors"], "bad file pattern"),
])
def test_layout_bad_mesh_or_rule(world: World, capsys: Any, args: list[str], expect: str) -> None:
    out = world.root / "layout.json"
    rc, _, err = run(capsys, "layout", "--like", world.src, *args, "-o", out)
    assert rc == 1, err
    assert len(lines(err)) == 1 and expect in err and "Traceback" not in err
    assert not out.exists()


def test_layout_ok(world: World, capsys: Any) -> None:
    out = world.root / "l.json"
    rc, so, err = run(capsys, "layout", "--like", world.hf, "--mesh", "dp=2,tp=3", "--rule", "a.weight=R,S(1)",
                      "--domain-size", "3", "--json", "-o", out)
    assert rc == 0, err
    assert json.loads(so) == {"manifest": str(out), "world_size": 6, "arrays": 2, "chunks": 3}
    m = load_manifest(out)
    assert m.domain_size == 3 and m.mesh == {"axes": ["dp", "tp"], "shape": [2, 3]}
    assert {c.source.file for _, _, c in m.iter_chunks()} == {"rank-{rank:05d}.safetensors"}
    rc, _, _ = run(capsys, "layout", "--like", world.hf, "--mesh", "tp=2", "--no-files", "-o", out)
    assert rc == 0 and all(c.source is None for _, _, c in load_manifest(out).iter_chunks())


def test_layout_format_versions_convert_and_plan_alike(world: World, capsys: Any) -> None:
    """The compact form (default) and --format-version 1 of one layout: the same plan digest and
    the same converted bytes, and v2 is the one that names layouts."""
    outs = {}
    for fv in ("1", "2"):
        man = world.root / f"l{fv}.json"
        rc, _, err = run(capsys, "layout", "--like", world.hf, "--mesh", "dp=2,tp=3", "--rule", "a.weight=R,S(1)",
                         "--format-version", fv, "-o", man)
        assert rc == 0, err
        assert json.loads(man.read_text())["format_version"] == int(fv)
        rc, so, err = run(capsys, "plan", world.src, man, "--json")
        assert rc == 0, err
        out = world.root / f"out{fv}"
        rc, _, err = run(capsys, "convert", world.src, man, "--out", out)
        assert rc == 0, err
        files = {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}
        outs[fv] = (json.loads(so)["digest"], files)
    assert "layouts" in json.loads((world.root / "l2.json").read_text())
    assert outs["1"][0] == outs["2"][0]
    assert outs["1"][1] == outs["2"][1] and len(outs["1"][1]) == 6


# ------------------------------------------------------------------ golden CLI contract


def _spec(p: argparse.ArgumentParser) -> list[str]:
    out = []
    for a in p._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = "/".join(a.option_strings) if a.option_strings else f"<{a.dest}>"
        if a.required and a.option_strings:
            name += "!"
        if a.choices:
            name += "{" + ",".join(str(c) for c in a.choices) + "}"
        out.append(name)
    return sorted(out)


GOLDEN = {
    '': ['--debug', '--version'],
    'import': ['--json', '--model', '--name', '--to{hf}', '-o/--output!', '<paths>'],
    'layout': ['--domain-size', '--dtype{bfloat16,float16,float32}', '--file-pattern', '--first-stage-layers',
               '--format-version{1,2}', '--fp8', '--include-mtp', '--json',
               '--last-stage-layers', '--like', '--megatron-spec{te,local}',
        '--mesh', '--model', '--name', '--no-files', '--preset{megatron,vllm,sglang,fsdp2,hf}',
        '--rule', '-o/--output!'],
    'validate': ['--data', '--json', '<manifests>'],
    'plan': ['--allow-extra', '--bucket-size', '--check', '--dst-domain-size', '--fp8-block', '--json', '--rank', '--same-job',
        '--src-domain-size', '--ue8m0', '<dst>', '<src>'],
    'convert': ['--allow-extra', '--cast{float16,bfloat16,float32,float64}',
        '--format{safetensors,zarr,torch_dist}', '--format-version{1,2}', '--fp8-block', '--json', '--max-shard-size',
        '--megatron-tp',
        '--memory-limit', '--merge-lora', '--out!', '--resume', '--timeout', '--ue8m0', '--zarr-compressor{zstd,none}', '<dst>', '<src>'],
    'refit': ['--allow-extra', '--bucket-size', '--delta', '--dst-domain-size', '--json', '--link-gbps', '--manifest!',
        '--rendezvous', '--replica', '--replicas', '--save', '--src-domain-size', '--stay', '--steps', '--strategy{reshard,broadcast}',
        '--timeout', '--transport{mpi,gloo,nccl,shm,cuda-ipc}', '--verify', '<role>{send,recv}',
        '--control{auto,mpi,store}', '--fp8-block', '--ue8m0'],
    'bench': ['--against', '--bucket-size', '--chunks', '--codec', '--delta', '--dst-tp', '--json', '--lora', '--lora-ranks', '--lr', '--memory-limit', '--model',
        '--replicas',
        '--no-dcp', '--plot',
        '--preset{qwen3-tiny,qwen3-small,qwen3-2g}', '--receivers', '--repeats', '--senders',
        '--serve-mesh', '--src-tp', '--sweep', '--train-mesh', '--work', '<what>{plan,convert,refit,validate,ipc,vllm}',
        '--source{files,fsdp2,megatron}', '--size', '--transport{shm,cuda-ipc,mpi,gloo,nccl}'],
    'synth': ['--json', '--max-shard-size', '--out!', '--preset{qwen3-tiny,qwen3-small,qwen3-2g}',
        '--seed'],
    'simulate': ['--broadcast-rings', '--bucket-size', '--cluster!{dgx-h100,gb200-nvl72}',
        '--delta-fraction', '--direct', '--encode-gbps', '--fp8', '--generation', '--include-mtp', '--json',
        '--latency-us', '--model!',
        '--nic-gbps', '--nvlink-gbps', '--planning{scaled,per-layer,whole}', '--system', '--train'],
    'inspect': ['--json', '<path>'],
}


def test_golden_cli_contract() -> None:
    """Subcommands and their flags. A deliberate CLI change updates GOLDEN (and design §8)."""
    ap = build_parser()
    got = {"": _spec(ap)}
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        got[name] = _spec(p)
    assert got.keys() == GOLDEN.keys()
    for k, flags in GOLDEN.items():
        assert got[k] == sorted(flags), k
    # SIZE flags take sizes; defaults of the documented ones
    conv = sub.choices["convert"]
    d = {a.dest: a for a in conv._actions}
    assert d["memory_limit"].default == 1 << 30 and d["memory_limit"].type is parse_size
    assert d["format"].default == "safetensors"
    refit = {a.dest: a for a in sub.choices["refit"]._actions}
    assert refit["bucket_size"].default == 256 << 20 and refit["timeout"].default == 300.0
    assert refit["link_gbps"].default is None  # --delta: measured (shared memory on one host)
    bench_p = {a.dest: a for a in sub.choices["bench"]._actions}
    assert bench_p["lr"].default == [1e-6, 1e-5]
    assert refit["transport"].default is None  # mpi on the MPI control plane (as before), gloo on the store plane


@pytest.mark.parametrize("argv, message", [
    (["bench", "vllm", "--lora"], "bench vllm --lora needs --model DIR"),
    (["bench", "vllm", "--lora", "--model", "m", "--lora-ranks", "8,x"], "--lora-ranks takes positive integers"),
])
def test_bench_vllm_lora_refuses_bad_arguments_before_starting_an_engine(capsys: Any, argv: list[str],
                                                                         message: str) -> None:
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and message in err and "Traceback" not in err, err  # a usage error (docs/cli)
