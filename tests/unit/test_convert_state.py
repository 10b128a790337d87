"""``streamer.convert.state.mark_incomplete``: a resumed conversion removes what a killed run left
half-written, the checksum sidecar's temp file included (a kill while it was written left it
behind, and the resumed output then held a stale ``.manifest.checksums.tmp-PID``)."""

from __future__ import annotations

from pathlib import Path

from streamer.convert.state import mark_incomplete


def test_a_resume_removes_every_temp_file_of_an_interrupted_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    keep = ["rank-00000.safetensors", "manifest.checksums", "unrelated.tmp-1", ".other.tmp-5"]
    stale = [".rank-00000.safetensors.tmp-42", ".manifest.json.tmp-42", ".manifest.checksums.tmp-42"]
    for name in keep + stale + ["manifest.json"]:
        (out / name).write_text("x")
    mark_incomplete(out, ["rank-00000.safetensors"])
    assert sorted(p.name for p in out.iterdir()) == sorted(keep)
