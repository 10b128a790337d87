"""Quantize on refit, the pure part: where each FP8 weight is quantized (senders when every
trainer shard is whole blocks, else receivers), the manifests the plan moves between, and what
``plan`` reports (where, and the bytes saved on the wire)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from formats.layouts import Mesh, Rule, Shard, apply_layout, manifest_from_arrays
from formats.manifest.wire import Manifest, save_manifest
from streamer.cli.app import main
from streamer.execute.quant import STAGE_PREFIX, refit_quant
from streamer.plan.check import validate_plan
from streamer.plan.planner import plan_transfers

#: a: 64 rows, b: 48 rows; 16x16 blocks; scales ceil(rows/16) x ceil(40/16)
WEIGHTS = {"a": ((64, 40), "bfloat16"), "b": ((48, 40), "float32")}
FP8 = {"a": ((64, 40), "float8_e4m3fn"), "a_scale_inv": ((4, 3), "float32"),
       "b": ((48, 40), "float8_e4m3fn"), "b_scale_inv": ((3, 3), "float32")}


def _tp(arrays: dict[str, tuple[tuple[int, ...], str]], n: int) -> Manifest:
    return apply_layout(manifest_from_arrays(arrays), Mesh(("tp",), (n,)), [Rule("*", (Shard(0),))])


def test_where_and_planned_manifests() -> None:
    """TP2 cuts a into 32-row shards (whole 16-row blocks) and b into 24 (cut blocks)."""
    src, dst = _tp(WEIGHTS, 2), _tp(FP8, 1)
    q = refit_quant(src, dst, block=(16, 16))
    assert q is not None and q.sender == {"a"} and q.where("b") == "receiver"
    # senders move a as FP8, with scales from the virtual images of a's trainer shards
    assert q.src.arrays["a"].data_type == "float8_e4m3fn"
    assert [(c.region.offsets, c.region.sizes, c.holders) for c in q.src.arrays["a_scale_inv"].chunks] == [
        ((0, 0), (2, 3), (0,)), ((2, 0), (2, 3), (1,))]
    assert "b_scale_inv" not in q.src.arrays
    # receivers get b in float32, in a staging local tensor; its scales are theirs to compute
    assert q.dst.arrays["b"].data_type == "float32" and "b_scale_inv" not in q.dst.arrays
    assert {c.tensor("b") for c in q.dst.arrays["b"].chunks} == {STAGE_PREFIX + "b"}
    assert q.dst.arrays["a"] is dst.arrays["a"] and q.dst.arrays["a_scale_inv"] is dst.arrays["a_scale_inv"]
    plan = plan_transfers(q.src, q.dst)
    assert validate_plan(plan, q.src, q.dst) == []  # every planned byte has a holder and a place
    moved = plan.moved_bytes_by_array()
    assert moved == {"a": 64 * 40, "a_scale_inv": 4 * 3 * 4, "b": 48 * 40 * 4}
    assert sum(moved.values()) == plan.stats().moved_bytes


def test_nothing_to_quantize() -> None:
    assert refit_quant(_tp(WEIGHTS, 2), _tp(WEIGHTS, 1)) is None


def _save(tmp: Path, m: Manifest, name: str) -> str:
    save_manifest(m, tmp / name)
    return str(tmp / name)


def test_plan_reports_where_and_wire_savings(tmp_path: Path, capsys: Any) -> None:
    src, dst = _save(tmp_path, _tp(WEIGHTS, 2), "src.json"), _save(tmp_path, _tp(FP8, 1), "dst.json")
    assert main(["plan", src, dst, "--fp8-block", "16,16", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    q = st["quantized"]
    assert (q["on_sender"], q["on_receiver"]) == (1, 1)
    a, b = q["arrays"]["a"], q["arrays"]["b"]
    assert (a["where"], b["where"]) == ("sender", "receiver")
    assert a["wire_bytes"] == 64 * 40 + 4 * 3 * 4 and a["wire_bytes_unquantized"] == 64 * 40 * 2
    assert b["wire_bytes_saved"] == 0 and q["wire_bytes_saved"] == a["wire_bytes_saved"] == 64 * 40 - 48
    assert b["bytes_saved"] == 48 * 40 * 4 - 48 * 40 - 9 * 4  # stored, against float32
    assert st["moved_bytes"] == 64 * 40 + 48 + 48 * 40 * 4
    assert main(["plan", src, dst, "--fp8-block", "16,16"]) == 0
    text = capsys.readouterr().out
    assert "quantized on refit" in text and "1 by the senders, 1 by the receivers" in text
    assert "a: bfloat16 -> fp8 block 16x16 on the sender" in text


@pytest.mark.parametrize("block", ["16,16", "32,32"])
def test_plan_refuses_unaligned_destination_in_one_line(tmp_path: Path, capsys: Any, block: str) -> None:
    """TP2 of 48 rows is 24-row shards: not whole 16-row (nor 32-row) blocks."""
    fp8 = {"b": ((48, 40), "float8_e4m3fn"), "b_scale_inv": ((3, 3) if block == "16,16" else (2, 2), "float32")}
    src, dst = _save(tmp_path, _tp(WEIGHTS, 1), "src.json"), _save(tmp_path, _tp(fp8, 2), "dst.json")
    assert main(["plan", src, dst, "--fp8-block", block, "--allow-extra"]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith(f"{dst}: b: destination chunk") and "not aligned" in err[0], err
