"""The inference side outlives its trainer (issue 22; ``docs/resilience.md``): real processes
started by ``torchrun`` on the store control plane with gloo (``resilient_worker.py``).

One receiver job (2 ranks, a delta session) sees three trainer jobs in turn (the last under
torchrun):

- A (2 ranks) pushes versions 1 (full) and 2 (delta), then SIGKILLs itself 25% into the delta
  push of version 3: every receiver raises ``PushFailed`` naming version 3 within seconds, and
  still holds version 2 byte for byte (a delta push is staged until it all arrived);
- B, C, D (3, 2 and 3 ranks: other rank counts) open the session again; each one's first push
  (version 3) is full, and each SIGKILLs itself 25%, 50% or 80% into it: the receivers say they
  hold no complete version (None);
- E and F (2 ranks each) push full then delta, and die 50% and 80% into their next delta push:
  the receivers still hold the last version byte for byte;
- G (1 rank) pushes 7 (full) and 8 (delta), then closes: the receivers hold version 8 byte for
  byte (checked against their own computation of it), ``pull()`` returns None, they exit 0.

No receiver restarts. A second test: a trainer that pushes once and then hangs (alive, silent)
leaves the receivers waiting; past their timeout ``pull()`` raises ``PeerTimeoutError`` and they
close cleanly (exit 0).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from mpi_helpers import BIN, Background

TORCHRUN = shutil.which("torchrun", path=str(BIN))
WORKER = Path(__file__).with_name("resilient_worker.py")

pytestmark = pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed (the torch extra)")


def _job(d: Path, name: str, n: int, *args: object, torchrun: bool = False) -> Background:
    """A job of ``n`` ranks: under torchrun, or the worker's own launcher (the same environment
    for the ranks, without torchrun's seconds of start-up on a loaded machine)."""
    launch = [TORCHRUN, "--standalone", "--nproc-per-node", n, WORKER] if torchrun else \
        [BIN / "python", WORKER, "--ranks", n]
    return Background([*launch, *args], d, name)


def _events(d: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (d / f"recv-{rank}.jsonl").read_text().splitlines()]


def _trainer(d: Path, name: str, n: int, versions: str, *extra: object, torchrun: bool = False) -> float | None:
    """Run a trainer job to its end; the time its first rank killed itself (None: it did not)."""
    for f in d.glob("killed-*"):
        f.unlink()
    job = _job(d, name, n, "send", d, "--timeout", 60, "--versions", versions, *extra, torchrun=torchrun)
    try:
        rc = job.wait(120)
        killed = sorted(float(f.read_text()) for f in d.glob("killed-*"))
        if any(str(x).startswith("--kill-at") or str(x).startswith("--die-after") for x in extra):
            assert rc not in (0, None) and killed, f"{name} was to die midway: rc {rc}\n{job.stderr[-3000:]}"
        else:
            assert rc == 0, f"{name} exited {rc}\n{job.stderr[-3000:]}"
        return killed[0] if killed else None
    finally:
        job.close()


def test_receivers_survive_killed_trainers_and_a_restart(tmp_path: Path) -> None:
    recv = _job(tmp_path, "recv", 2, "recv", tmp_path, "--delta", "--timeout", 60)
    try:
        killed = [_trainer(tmp_path, "trainer-a", 2, "1,2,3", "--delta", "--kill-at", "3:0.25")]
        # a new trainer's first push is full: killed 25%, 50% and 80% into it
        for name, n, at in (("b", 3, "0.25"), ("c", 2, "0.5"), ("d", 3, "0.8")):
            killed.append(_trainer(tmp_path, f"trainer-{name}", n, "3", "--delta", "--kill-at", f"3:{at}"))
        # a delta push killed 50% and 80% into it (each trainer's first push is full)
        killed.append(_trainer(tmp_path, "trainer-e", 2, "3,4,5", "--delta", "--kill-at", "5:0.5"))
        killed.append(_trainer(tmp_path, "trainer-f", 2, "5,6,7", "--delta", "--kill-at", "7:0.8"))
        _trainer(tmp_path, "trainer-g", 1, "7,8", "--delta", torchrun=True)
        assert recv.wait(60) == 0, recv.stderr[-3000:]
    finally:
        recv.close()
    for rank in range(2):
        ev = [e for e in _events(tmp_path, rank) if e["event"] != "open"]
        assert [(e["event"], e.get("version"), e.get("held")) for e in ev] == [
            ("ok", 1, 1), ("ok", 2, 2),
            ("failed", 3, 2),  # the delta push broke off at 25%: version 2 intact
            # restarted trainers' full pushes broke off at 25%, 50%, 80%: no complete version
            ("failed", 3, None), ("failed", 3, None), ("failed", 3, None),
            ("ok", 3, 3), ("ok", 4, 4), ("failed", 5, 4),  # a delta broken at 50%: 4 intact
            ("ok", 5, 5), ("ok", 6, 6), ("failed", 7, 6),  # a delta broken at 80%: 6 intact
            ("ok", 7, 7), ("ok", 8, 8), ("closed", None, 8), ("exit", None, None)], ev
        ok, failed = [e for e in ev if e["event"] == "ok"], [e for e in ev if e["event"] == "failed"]
        # byte for byte what each version holds, and what a broken delta push left
        assert all(e["match"] for e in ok + [failed[0], failed[4], failed[5]]), ev
        assert all(e["wire"] < e["full"] // 10 for e in ok[1::2]), ev  # deltas: 2, 4, 6, 8
        assert all(e["wire"] == e["full"] for e in ok[2::2]), ev  # a new trainer's first push is full
        # a dead trainer is noticed within seconds (its connections close), not at the 60 s timeout
        assert all(k is not None for k in killed), killed
        # (from the kill, or from the call when the receiver was still checking the last version)
        for k, f in zip(killed, failed):
            assert k is not None and f["t"] - max(k, f["called"]) < 10, (k, ev)
        assert all("failed" in e["reason"] or "silent" in e["reason"] for e in failed), failed


def test_receiver_times_out_and_closes_cleanly(tmp_path: Path) -> None:
    trainer = _job(tmp_path, "trainer", 1, "send", tmp_path, "--timeout", 60, "--versions", "1", "--hang-after", 1)
    recv = _job(tmp_path, "recv", 2, "recv", tmp_path, "--timeout", 60, "--pull-timeout", 6)
    try:
        assert recv.wait(90) == 0, recv.stderr[-3000:]
    finally:
        recv.close()
        trainer.close()
    for rank in range(2):
        ev = [e for e in _events(tmp_path, rank) if e["event"] != "open"]
        assert [e["event"] for e in ev] == ["ok", "timeout", "exit"], ev
        assert ev[1]["held"] == 1 and "timed out after 6 s" in ev[1]["reason"], ev
        assert 5 < ev[1]["t"] - ev[1]["called"] < 20, ev


def test_trainer_dying_between_pushes_is_noticed(tmp_path: Path) -> None:
    """No connection is open between pushes: the trainer's silent heartbeat ends the wait."""
    recv = _job(tmp_path, "recv", 1, "recv", tmp_path, "--timeout", 60)
    try:
        killed = _trainer(tmp_path, "trainer-a", 1, "1", "--die-after", 1)
        _trainer(tmp_path, "trainer-b", 2, "2")
        assert recv.wait(60) == 0, recv.stderr[-3000:]
    finally:
        recv.close()
    ev = [e for e in _events(tmp_path, 0) if e["event"] != "open"]
    assert [(e["event"], e.get("version"), e.get("held")) for e in ev] == [
        ("ok", 1, 1), ("failed", None, 1), ("ok", 2, 2), ("closed", None, 2), ("exit", None, None)], ev
    assert "sender rank 0 went silent" in ev[1]["reason"] and ev[1]["match"], ev
    # silent for 5 s (the default) since the last heartbeat seen, and soon after the call
    assert killed is not None and ev[1]["t"] - killed > 4 and ev[1]["t"] - max(killed, ev[1]["called"]) < 15, \
        (killed, ev)
