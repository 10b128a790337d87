"""scripts/validate_manifests.py, run as users' CI runs it: a subprocess, on good and bad manifests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from formats.manifest.wire import save_manifest
from formats.safetensors.io import read_header
from streamer.cli.app import main
from streamer.convert.importer import import_checkpoint
from streamer.tools.synth import write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "validate_manifests.py"


def script(*args: Any, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: Any) -> Path:
    """root/hf (checkpoint + manifest), root/tp2 (convert output), root/bad/manifest.json (two problems),
    root/trunc.json (not JSON), root/flipped (convert output with one corrupted byte)."""
    root = tmp_path_factory.mktemp("vm")
    write_checkpoint(root / "hf", {"a.weight": ((6, 4), "float32"), "b.bias": ((5,), "bfloat16")}, seed=1)
    save_manifest(import_checkpoint([root / "hf"]), root / "hf" / "manifest.json")
    assert main(["layout", "--like", str(root / "hf"), "--mesh", "tp=2", "--rule", "a.weight=S(0)",
                 "-o", str(root / "tp2.json")]) == 0
    for out in ("tp2", "flipped"):
        assert main(["convert", str(root / "hf"), str(root / "tp2.json"), "--out", str(root / out)]) == 0
    f = root / "flipped" / "rank-00001.safetensors"
    st = read_header(f).tensors["a.weight"]
    data = bytearray(f.read_bytes())
    data[st.start + 3] ^= 0x01
    f.write_bytes(bytes(data))
    (root / "bad").mkdir()
    obj = json.loads((root / "hf" / "manifest.json").read_text())
    obj["arrays"]["a.weight"]["chunks"][0]["holders"] = [4]
    obj["arrays"]["b.bias"]["chunks"][0]["region"]["sizes"] = [3]
    (root / "bad" / "manifest.json").write_text(json.dumps(obj))
    (root / "trunc.json").write_text(json.dumps(obj)[:40])
    return root


def test_good_manifests_ok(tree: Path) -> None:
    r = script("hf", "tp2", "tp2.json", cwd=tree)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "ok hf/manifest.json: 2 arrays, 2 chunks",
        "ok tp2/manifest.json: 2 arrays, 3 chunks",
        "ok tp2.json: 2 arrays, 3 chunks",
    ]
    assert r.stderr == ""


def test_data_checks_files_and_checksums(tree: Path) -> None:
    r = script("--data", "hf", "tp2", "flipped", cwd=tree)
    assert r.returncode == 1
    out = r.stdout.splitlines()
    assert out[:2] == ["ok hf/manifest.json: 2 arrays, 2 chunks", "ok tp2/manifest.json: 2 arrays, 3 chunks"]
    assert out[2] == "FAIL flipped/manifest.json: 1 problems"
    assert len(out) == 4 and out[3].startswith("    flipped/manifest.json: a.weight: ")
    assert "checksum mismatch" in out[3] and "rank-00001.safetensors" in out[3]
    # without --data the corrupted output is structurally fine; a layout with no files yet too
    r = script("flipped", "tp2.json", cwd=tree)
    assert r.returncode == 0, r.stdout
    # with --data a layout whose files do not exist fails, naming them
    r = script("--data", "tp2.json", cwd=tree)
    assert r.returncode == 1 and "rank-00000.safetensors" in r.stdout and "not found" in r.stdout


def test_bad_manifests_fail_with_indented_problems(tree: Path) -> None:
    r = script("bad", "trunc.json", "hf/manifest.json", cwd=tree)
    assert r.returncode == 1
    out = r.stdout.splitlines()
    assert out[0] == "FAIL bad/manifest.json: 2 problems"
    assert out[1].startswith("    bad/manifest.json: a.weight: ") and "holder rank 4" in out[1]
    assert out[2].startswith("    bad/manifest.json: b.bias: ") and "gap" in out[2]
    assert out[3] == "FAIL trunc.json: 1 problems"
    assert out[4].startswith("    trunc.json: not valid JSON")
    assert out[5] == "ok hf/manifest.json: 2 arrays, 2 chunks"
    assert len(out) == 6
    assert "Traceback" not in r.stderr


def test_globs_and_duplicates(tree: Path) -> None:
    r = script("*/manifest.json", "hf", cwd=tree)  # hf named twice: validated once
    assert r.returncode == 1
    heads = [ln for ln in r.stdout.splitlines() if not ln.startswith("    ")]
    assert heads == ["FAIL bad/manifest.json: 2 problems", "ok flipped/manifest.json: 2 arrays, 3 chunks",
                     "ok hf/manifest.json: 2 arrays, 2 chunks", "ok tp2/manifest.json: 2 arrays, 3 chunks"]
    r = script(str(tree / "**" / "manifest.json"), "--data", cwd=ROOT)  # absolute, recursive, other cwd
    assert r.returncode == 1
    assert sum(ln.startswith(("ok ", "FAIL ")) for ln in r.stdout.splitlines()) == 4


def test_pattern_matching_nothing_exits_2(tree: Path) -> None:
    r = script("hf", "nothing-*.json", "missing/dir", cwd=tree)
    assert r.returncode == 2
    assert r.stdout.splitlines() == ["ok hf/manifest.json: 2 arrays, 2 chunks"]  # what matched is still checked
    err = r.stderr.splitlines()
    assert len(err) == 2 and "nothing-*.json" in err[0] and "missing/dir" in err[1]
    assert all("matches no file" in ln for ln in err)
    # a directory without manifest.json matches, and fails
    (tree / "empty").mkdir(exist_ok=True)
    r = script("empty", cwd=tree)
    assert r.returncode == 1 and r.stdout.startswith("FAIL empty/manifest.json: 1 problems")


def test_json_output(tree: Path) -> None:
    r = script("--json", "hf", "bad", cwd=tree)
    assert r.returncode == 1
    obj = json.loads(r.stdout)
    assert obj["ok"] is False and obj["failed"] == 1 and obj["unmatched"] == []
    good, bad = obj["manifests"]
    assert good == {"manifest": "hf/manifest.json", "arrays": 2, "chunks": 2, "world_size": 1, "ok": True,
                    "problems": []}
    assert bad["ok"] is False and len(bad["problems"]) == 2
    assert r.stderr.splitlines()[0] == "ok hf/manifest.json: 2 arrays, 2 chunks"  # human lines on stderr
    r = script("--json", "tp2", "none-*.json", cwd=tree)
    assert r.returncode == 2
    obj = json.loads(r.stdout)
    assert obj["unmatched"] == ["none-*.json"] and obj["ok"] is False and obj["manifests"][0]["ok"] is True


def test_usage(tree: Path) -> None:
    r = script(cwd=tree)
    assert r.returncode == 2 and "PATTERN" in r.stderr


def test_never_imported_by_the_package() -> None:
    for pkg in ("formats", "streamer"):
        for f in (ROOT / pkg).rglob("*.py"):
            assert "validate_manifests" not in f.read_text(), f
    assert "validate_manifests" not in sys.modules
