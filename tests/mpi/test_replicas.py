"""Replicas join and leave (issue 22 item 4; ``docs/resilience.md``): one trainer job serves
several inference replica jobs, real processes on the store control plane with gloo
(``replica_worker.py``), in one launch of all of them, meeting at ``tcp://ADDRESS:PORT`` (the
trainer's registry: no file is shared; ADDRESS is this host's own non-loopback address where it
has one, so each replica's store is offered at the address of its interface toward the registry,
as on a cluster, rather than at its hostname's address):

- the trainer (2 ranks, rows split) opens with ``replicas=True`` once replicas ``a`` (2 ranks,
  columns split) and ``b`` (1 rank: a different layout) wait, and pushes versions 1..7 as deltas;
- ``c`` (1 rank, the command line: ``shardstream refit recv --replica c --steps 4 --save``) starts
  after version 2: it joins at push 3 with a full push of version 3 while ``a`` and ``b`` get
  deltas, then gets deltas itself, and saves version 6 byte for byte;
- ``b`` is SIGKILLed in the middle of push 5 (once it posted half its receives): the push
  reports it dropped (``StepStats.replicas``) and completes for the others, byte for byte;
- ``a`` and ``c`` close after version 6: push 7 has no replica left and raises ``PushFailed``.

Other tests: a restarted trainer (``refit send --replicas``) joins a waiting replica; the pushes
to two replicas run at once (a hung one does not hold up the other); ``bench refit --replicas``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi_helpers import BIN, Background
from replica_worker import ARRAYS, SLOW_LINK, fill, manifest, wait_file, weights

from formats.manifest.wire import save_manifest

WORKER = Path(__file__).with_name("replica_worker.py")

pytestmark = pytest.mark.skipif(shutil.which("torchrun", path=str(BIN)) is None,
                                reason="torch.distributed not installed (the torch extra)")


def _job(d: Path, name: str, n: int, *args: object) -> Background:
    return Background([BIN / "python", WORKER, "--ranks", n, *args], d, name)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_replicas_join_and_leave(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    from streamer.transport.torch_dist import free_port

    d = tmp_path
    from helpers import this_hosts_address

    rdv = f"tcp://{this_hosts_address() or '127.0.0.1'}:{free_port()}"
    save_manifest(manifest("S(0)", 1), d / "c.json")
    jobs = {"a": _job(d, "a", 2, "recv", d, "--name", "a", "--rule", "S(1)", "--pulls", 6, "--rendezvous", rdv),
            "b": _job(d, "b", 1, "recv", d, "--name", "b", "--kill-at", "5:0.5", "--rendezvous", rdv),
            "trainer": _job(d, "trainer", 2, "send", d, "--versions", "1,2,3,4,5,6,7", "--expect", "a,b",
                            "--join", "c:3", "--rendezvous", rdv)}
    try:
        try:
            wait_file(d / "pushed-2", 180)
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{_story(d, jobs, {n: j.poll() for n, j in jobs.items()})}") from None
        jobs["c"] = Background(["mpiexec", "-n", 1, "shardstream", "refit", "recv", "--manifest", d / "c.json",
                                "--rendezvous", rdv, "--replica", "c", "--transport", "gloo", "--steps", 4,
                                "--save", d / "c-saved", "--timeout", 120, "--json"], d, "c")
        codes = {name: job.wait(180) for name, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.close()
    story = _story(d, jobs, codes)  # every assertion below says what each job did
    assert codes == {"a": 0, "b": 137, "trainer": 0, "c": 0}, story
    pushes = [p for p in _lines(d / "send.jsonl") if "event" not in p]
    got = [(p["version"], p.get("replicas") and [tuple(r[:2]) + (r[3],) for r in p["replicas"]]) for p in pushes]
    assert got == [
        (1, [("a", 1, True), ("b", 1, True)]),
        (2, [("a", 2, False), ("b", 2, False)]),
        (3, [("a", 3, False), ("b", 3, False), ("c", 3, True)]),  # c joins
        (4, [("a", 4, False), ("b", 4, False), ("c", 4, False)]),
        (5, [("a", 5, False), ("b", None, False), ("c", 5, False)]),  # b was killed: dropped, the others go on
        (6, [("a", 6, False), ("c", 6, False)]),
        (7, None)], story
    # b died in its pull: its connections closed, or its store (its rank 0 served it) went away
    # before it could post the receipt that ends a trainer's push to it
    assert "store went away" in pushes[4]["replicas"][1][2] or "failed" in pushes[4]["replicas"][1][2], story
    # a and c closed after version 6: the notice of a's close, or its store gone if its rank 0
    # ended before the trainer's push 7 read it (nothing waits for a trainer that may never push)
    raised = pushes[6]["raised"]
    assert "no replica is left" in raised and "c: " in raised and \
        re.search(r"\ba: [^;]*(a closed its session|store went away)", raised), story
    # the first push moves what trainer rank 0 holds (half the model) once to each of a and b: the
    # lower bound per replica
    model = sum(int(np.prod(s)) for s in ARRAYS.values()) * 4
    assert pushes[0]["sent"] == 2 * model // 2, story
    for name, ranks, versions in (("a", 2, [1, 2, 3, 4, 5, 6]), ("b", 1, [1, 2, 3, 4])):
        for rank in range(ranks):
            ev = _lines(d / f"{name}-{rank}.jsonl")
            ok = [e for e in ev if e["event"] == "ok"]
            assert [e["version"] for e in ok] == versions and all(e["match"] and e["held"] == e["version"]
                                                                  for e in ok), (name, rank, ev, story)
            assert ok[0]["wire"] == ok[0]["full"], (name, rank, ev)  # a replica's first push is full ...
            assert all(e["wire"] < e["full"] // 10 for e in ok[1:]), (name, rank, ev)  # ... then deltas
            assert ev[-1]["event"] == ("ok" if name == "b" else "exit"), (name, rank, ev)  # b: killed in its pull of 5
    report = json.loads(jobs["c"].stdout)  # c joined late: a full push, then deltas, and it holds version 6
    assert report["steps"] == 4 and report["delta"][0]["wire_bytes"] == report["delta"][0]["full_bytes"], report
    assert all(st["wire_bytes"] < st["full_bytes"] // 10 for st in report["delta"][1:]), report
    saved = load_file(next((d / "c-saved").glob("*.safetensors")))
    assert saved.keys() == weights(0).keys() and all(np.array_equal(saved[k], v) for k, v in weights(6).items())
    assert not list(d.glob("rdv*")), "a tcp:// rendezvous writes no file"


def _story(d: Path, jobs: dict[str, Background], codes: dict[str, int | None]) -> str:
    """What each job did: its exit code and stderr's tail, the trainer's pushes, each replica's events."""
    parts = [f"exit codes {codes}"]
    for name, job in jobs.items():
        parts.append(f"--- {name} stderr (last 1500 chars):\n{job.stderr[-1500:]}")
    for log in sorted(d.glob("*.jsonl")):
        parts.append(f"--- {log.name}:\n{log.read_text()[-3000:]}")
    return "\n".join(parts)


def test_a_restarted_trainer_joins_the_waiting_replicas(tmp_path: Path) -> None:
    """A trainer dies between pushes: the replica notices (its heartbeat), waits for a new trainer
    and is joined at its open, with a full push; the new trainer's close ends it cleanly. The new
    trainer is the command line, ``refit send --replicas`` (2 ranks under mpiexec, the store plane),
    pushing its files (version 2's weights) twice: versions 2 (full) and 3 (a delta), numbered on
    from the version the replica held, and its report names what each push delivered to each one."""
    from streamer.refit.persist import alloc_local, finish_save, save_local

    d = tmp_path
    m, sums = manifest("S(0)", 2), {}
    for rank in range(2):
        local = alloc_local(m, rank)
        fill(m, rank, local, 2)
        sums.update(save_local(d / "train", m, rank, local))
    finish_save(d / "train", m, sums)
    replica = _job(d, "a", 1, "recv", d, "--name", "a", "--then-weights", 2)
    try:
        first = _job(d, "trainer-1", 1, "send", d, "--versions", "1,2", "--expect", "a", "--die-after", 1)
        assert first.wait(120) == 137, first.stderr[-2000:]
        first.close()
        second = Background(["mpiexec", "-n", 2, "shardstream", "refit", "send", "--replicas", "--manifest", d / "train",
                             "--rendezvous", d / "rdv", "--steps", 2, "--delta", "--link-gbps", SLOW_LINK,
                             "--timeout", 120, "--json"], d, "trainer-2")
        assert second.wait(120) == 0, second.stderr[-2000:]
        second.close()
        assert replica.wait(60) == 0, replica.stderr[-2000:]
    finally:
        replica.close()
    pushes = [(p["version"], p["replicas"]) for p in _lines(d / "send.jsonl") if "event" not in p]
    assert pushes == [(1, [["a", 1, None, True]])], pushes
    report = json.loads(second.stdout)
    assert report["replicas"] == [[{"name": "a", "version": 2, "error": None, "joined": True}],
                                  [{"name": "a", "version": 3, "error": None, "joined": False}]], report
    assert report["steps"] == 2 and report["transport"] == "gloo" and report["moved_bytes"] == sum(int(np.prod(s)) for s in ARRAYS.values()) * 4, report
    ev = _lines(d / "a-0.jsonl")
    assert [(e["event"], e.get("version"), e.get("held")) for e in ev] == [
        ("ok", 1, 1), ("failed", None, 1), ("ok", 2, 2), ("ok", 3, 3), ("closed", None, 3), ("exit", None, None)], ev
    assert "went silent" in ev[1]["reason"] and all(e["match"] for e in ev if e["event"] == "ok"), ev
    assert ev[2]["wire"] == ev[2]["full"] and ev[3]["wire"] < ev[3]["full"] // 10, ev  # full from the new trainer


def test_a_hung_replica_does_not_hold_up_the_others(tmp_path: Path) -> None:
    """The pushes to the replicas run at once: replica a's engine hangs 4 s after version 1 (it
    does not pull), and replica b gets version 2 at once all the same; the trainer's push of 2
    ends once a holds it too (a push to a replica ends with its receipt)."""
    d = tmp_path
    jobs = {"a": _job(d, "a", 1, "recv", d, "--name", "a", "--stall-after", 1, "--stall", 4),
            "b": _job(d, "b", 1, "recv", d, "--name", "b"),
            "trainer": _job(d, "trainer", 1, "send", d, "--versions", "1,2", "--expect", "a,b")}
    try:
        codes = {name: job.wait(120) for name, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.close()
    story = _story(d, jobs, codes)
    assert codes == {"a": 0, "b": 0, "trainer": 0}, story
    pushes = [(p["version"], [r[:3] for r in p["replicas"]]) for p in _lines(d / "send.jsonl") if "event" not in p]
    assert pushes == [(1, [["a", 1, None], ["b", 1, None]]), (2, [["a", 2, None], ["b", 2, None]])], story
    got = {name: {e["version"]: e for e in _lines(d / f"{name}-0.jsonl") if e["event"] == "ok"} for name in "ab"}
    assert all(e["match"] for r in got.values() for e in r.values()), story
    # one after another (a before b, by name), b would hold version 2 only after a's 4 s
    assert got["b"][2]["t"] < got["a"][2]["t"] - 1.5, story


def test_bench_refit_replicas_tiny(tmp_path: Path) -> None:
    """``bench refit --replicas 2``: the joiner's join and first (full) push beside a steady push."""
    from mpi_helpers import ok

    # 2 ranks per replica: the trainer's close ends both ranks' pulls (none sees the other's leaving)
    r = json.loads(ok(["shardstream", "bench", "refit", "--replicas", 2, "--senders", 1, "--receivers", 2, "--size",
                       "1MiB", "--repeats", 2, "--work", tmp_path, "--json"], timeout=180))
    j, s = r["joiner"], r["steady_replica"]
    assert j["wire_bytes"] == j["full_bytes"] == r["size_bytes"] == s["full_bytes"], r
    assert j["join_s"] > 0 and j["first_push_s"] > 0 and s["push_s"] > 0 and r["steady_before_s"] > 0, r
    assert r["join_push_s"] >= j["join_s"] + j["first_push_s"], r  # the push includes the joiner's join
    assert [sorted(p["replicas"]) for p in r["pushes"]] == [["r0"]] * 3 + [["r0", "r1"]] * 3, r
