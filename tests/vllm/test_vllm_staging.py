"""Staged receive (``init_info={"staging": "host"}``): pushes land in host buffers while the engine
serves, and ``update_weights`` commits a staged version.

One engine (TP 1 in-process, and TP 2), one trainer (matrix_trainer.py: transformers, AdamW, two
pushes). The trainer pushes version 0, and pushes version 1 only once the engine committed 0 and
is decoding a long batch; then it closes its session and exits. Only after that does the engine start its next update: the push
never waited for the engine. Then, on the engine:

0. an update opened while requests are served (no pause; the engine stepped by hand): refused by
   name before it writes anything; the requests end exactly as on the initial weights;
1. commit version 0: it serves exactly what a fresh engine on step 0's checkpoint serves;
2. a long batch (96 tokens per prompt) decodes while the trainer pushes version 1: the push returns
   with requests in flight, and the batch equals a fresh step-0 engine's exactly;
3. commit version 1 with a test hook that makes its third layer fail: the layers it wrote are
   restored from the committed host copy, and it serves exactly version 0 again (``weight_version``
   unchanged);
4. commit version 1: exactly a fresh engine on step 1; at most one layer in extra memory;
5. commit version 0 again: refused by name (the engine serves a newer one).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_models  # noqa: E402
from test_vllm_refit import PROMPTS, Proc  # noqa: E402


def _driver_and_trainer(tmp: Path, job: dict[str, Any], cases: list[dict[str, Any]],
                        timeout: float = 1200) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One engine driver (``job``) and one trainer (``cases``) at once: the driver's results and
    the trainer's pushes."""
    (tmp / "job.json").write_text(json.dumps(job))
    (tmp / "train.json").write_text(json.dumps({"timeout": 300, "cases": cases}))
    driver = Proc([sys.executable, HERE / "engine_driver.py", tmp / "job.json", tmp / "out.json"], tmp, "driver")
    trainer = Proc([sys.executable, HERE / "matrix_trainer.py", tmp / "train.json"], tmp, "trainer")
    try:
        rcs = {"driver": driver.wait(timeout), "trainer": trainer.wait(60)}
    finally:
        driver.kill()
        trainer.kill()
    assert set(rcs.values()) == {0}, f"{rcs}\n{driver.err.read_text()[-5000:]}\n{trainer.err.read_text()[-3000:]}"
    pushes = [json.loads(line) for line in trainer.out.read_text().splitlines() if line.startswith("{")]
    return json.loads((tmp / "out.json").read_text()), pushes


LONG = 96  # tokens per prompt of the batch decoded during a push (max_model_len 128)


def _run(tmp: Path, tp: int, arch: str) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    initial = tiny_models.make_model(arch, tmp / "initial")
    for d in ("hf", "signal", "pushed"):
        (tmp / d).mkdir()
    commits = [{"version": 0, "while_serving": True}, {"version": 0},
               {"long_tokens": LONG, "pushed": str(tmp / "pushed" / "pushed-1")},
               {"version": 1, "fail_at": 3}, {"version": 1}, {"version": 0}]
    refit = {"rendezvous": str(tmp / "rdv"), "timeout": 300, "steps": 0, "commits": commits,
             "init_info": {"staging": "host", "verify": True}, "signal": str(tmp / "signal"),
             "wait_before": {"3": str(tmp / "done")}}
    runs = [{"model": str(initial), "refit": refit}, {"model": str(tmp / "hf" / "step-0")},
            {"model": str(tmp / "hf" / "step-1")}]
    job = {"tp": tp, "engine_in_process": True, "prompts": PROMPTS, "max_tokens": 6, "logprobs": 5, "runs": runs,
           "long_tokens": LONG}
    case = {"name": "staged", "initial": str(initial), "rendezvous": str(tmp / "rdv"), "save_hf": str(tmp / "hf"),
            "steps": 2, "wait_before_push": {"1": str(tmp / "signal" / "committed-2")}, "done_file": str(tmp / "done"),
            "pushed_dir": str(tmp / "pushed")}
    out, pushes = _driver_and_trainer(tmp, job, [case])
    return out[0], out[1:], pushes


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("tp,arch", [(1, "qwen3"), (2, "qwen3-moe")], ids=["tp1-dense", "tp2-moe"])
def test_staged_pushes_commit_restore_and_refuse(tmp_path: Path, tp: int, arch: str) -> None:
    refit, fresh, pushes = _run(tmp_path, tp, arch)
    # an update opened while the engine serves requests: refused before it writes anything, naming
    # vLLM's pause call; the requests end on the weights they began with, and so does the engine
    serving, c = refit["commits"][0], [x for x in refit["commits"][1:] if "long" not in x]
    (during,) = [x for x in refit["commits"] if "long" in x]
    assert serving["error"] and "not paused: nothing was written" in serving["error"], serving
    assert "pause_generation" in serving["error"], serving
    assert serving["out"] == refit["before"] and serving["after"] == refit["before"], serving
    assert c[0]["error"] is None and c[0]["out"] == fresh[0]["out"], c[0]
    assert refit["before"] != fresh[0]["out"]
    # version 1 pushed while a long batch decoded on version 0: the push returned with the batch in
    # flight, and the batch is version 0's exactly (staging never touches the served tensors)
    assert during["in_flight_at_push"] and during["version"] == c[0]["version"], during
    assert during["long"] == fresh[0]["long"], "staging changed what the engine served during the push"
    print(f"push during a batch: {during['steps_during_push']} steps decoded in {during['decode_seconds']:.2f} s; "
          f"the push seen done after {during['push_seen_seconds']:.2f} s (batch held for it: {during['held']})")
    # the failed commit: version 0 restored exactly, and vLLM keeps its weight_version
    assert c[1]["error"] and "test hook: layer 3" in c[1]["error"] and "restored from version 0" in c[1]["error"], c[1]
    assert c[1]["out"] == fresh[0]["out"] and c[1]["version"] == c[0]["version"], c[1]
    assert c[2]["error"] is None and c[2]["out"] == fresh[1]["out"], c[2]
    assert fresh[0]["out"] != fresh[1]["out"]
    assert c[3]["error"] and "version 0 is not staged: the engine serves version 1" in c[3]["error"], c[3]
    # each failed call left no reply of another worker for the next call to read (replies.one_reply)
    assert [x["late_errors"] for x in (serving, c[1], c[3])] == [[], [], []], (serving, c[1], c[3])
    # the push of version 1 returned (and the trainer closed its session) before the engine began the update
    assert pushes[1]["pushed"] < c[1]["started"], (pushes, c[1]["started"])
    for w in c[2]["last"]:
        assert w["staged"] and w["version"] == 1 and w["bytes_received"] > 0, w
        # one layer's model-format tensors at a time: far below the worker's whole share
        assert 0 < w["peak_extra_bytes"] <= w["staging_bytes"] // 4, w


@pytest.mark.timeout(900)
@pytest.mark.parametrize("tp,arch,delta", [(1, "qwen3", False), (2, "qwen3-moe", True)],
                         ids=["tp1-dense-full", "tp2-moe-delta"])
def test_a_trainer_killed_mid_push_leaves_the_served_version_whole(tmp_path: Path, tp: int, arch: str,
                                                                    delta: bool) -> None:
    """Trainer A pushes version 0 (committed), then dies (SIGKILL) right after posting the first of
    the many messages of version 1's push. The engine goes on serving version 0 exactly, its
    staging process reports the broken push and keeps no part of it. Trainer B, restarted, pushes
    version 1 with no call on the engine side; the engine commits it and serves a fresh engine's
    output for step 1. ``delta``: a delta session with a link stated slow, so that the broken push
    is one of XOR deltas, decoded as its messages arrive against the committed version's copy;
    B's first push to the engine is a full one (a new trainer holds no base)."""
    initial = tiny_models.make_model(arch, tmp_path / "initial")
    for d in ("hf", "signal"):
        (tmp_path / d).mkdir()
    sig = tmp_path / "signal"
    commits = [{"version": 0}, {"check_only": True}, {"version": 1}]
    refit = {"rendezvous": str(tmp_path / "rdv"), "timeout": 300, "steps": 0, "commits": commits,
             "init_info": {"staging": "host", "verify": True, "delta": delta}, "signal": str(sig),
             "wait_before": {"1": str(sig / "a-dead")}}
    runs = [{"model": str(initial), "refit": refit}, {"model": str(tmp_path / "hf" / "step-0")},
            {"model": str(tmp_path / "hf" / "step-1")}]
    job = {"tp": tp, "engine_in_process": True, "prompts": PROMPTS, "max_tokens": 6, "logprobs": 5, "runs": runs}
    (tmp_path / "job.json").write_text(json.dumps(job))
    base = {"initial": str(initial), "rendezvous": str(tmp_path / "rdv"), "save_hf": str(tmp_path / "hf"), "steps": 2,
            "bucket_size": 16 << 10,  # many messages: the first one is a small part of the push
            **({"delta": True, "link_gbps": 0.05} if delta else {})}
    (tmp_path / "a.json").write_text(json.dumps({"timeout": 300, "cases": [
        {**base, "name": "a", "wait_before_push": {"1": str(sig / "committed-0")}, "crash_in_push": 1}]}))
    (tmp_path / "b.json").write_text(json.dumps({"timeout": 300, "cases": [
        {**base, "name": "b", "save_hf": str(tmp_path / "hf-b"), "push_from": 1,
         "wait_before_push": {"1": str(sig / "committed-1")}}]}))
    (tmp_path / "hf-b").mkdir()
    driver = Proc([sys.executable, HERE / "engine_driver.py", tmp_path / "job.json", tmp_path / "out.json"], tmp_path,
                  "driver")
    procs = {"driver": driver}
    try:
        procs["a"] = Proc([sys.executable, HERE / "matrix_trainer.py", tmp_path / "a.json"], tmp_path, "a")
        rc_a = procs["a"].wait(600)
        (sig / "a-dead").write_text("")
        procs["b"] = Proc([sys.executable, HERE / "matrix_trainer.py", tmp_path / "b.json"], tmp_path, "b")
        rcs = {"a": rc_a, "driver": driver.wait(600), "b": procs["b"].wait(60)}
    finally:
        for p in procs.values():
            p.kill()
    assert rcs["a"] == -9 and rcs["driver"] == 0 and rcs["b"] == 0, \
        f"{rcs}\n{driver.err.read_text()[-5000:]}\n{procs['b'].err.read_text()[-3000:]}"
    refit_out, fresh0, fresh1 = json.loads((tmp_path / "out.json").read_text())
    c = refit_out["commits"]
    assert c[0]["error"] is None and c[0]["out"] == fresh0["out"]
    # after the broken push: version 0 exactly, the same weight_version, nothing of version 1 staged
    assert c[1]["out"] == fresh0["out"] and c[1]["version"] == c[0]["version"], c[1]
    assert len(c[1]["staging"]) == tp
    for state in c[1]["staging"]:  # every worker's staging process
        assert state["error"] and "PushFailed" in state["error"], state
        assert ("staged", 1) not in [tuple(b) for b in state["buffers"]], state
    assert c[2]["error"] is None and c[2]["out"] == fresh1["out"], c[2]
    assert fresh0["out"] != fresh1["out"]


@pytest.mark.timeout(900)
def test_the_prefix_cache_must_be_reset_after_a_commit(tmp_path: Path) -> None:
    """Prefix caching on (blocks of 32 tokens) and a 96-token prompt, served before the update: after
    the commit its cached blocks (computed with the old weights) are hit, and the output is stale;
    after vLLM's ``reset_prefix_cache()`` it equals a fresh engine's. The loop is pause ->
    start_weight_update -> update_weights -> finish_weight_update -> reset_prefix_cache -> resume:
    the backend does not reset the cache itself. The two jobs meet at ``tcp://127.0.0.1:PORT``
    (worker 0 serves the store there): no rendezvous file."""
    from streamer.transport.torch_dist import free_port

    rdv = f"tcp://127.0.0.1:{free_port()}"
    initial = tiny_models.make_model("qwen3", tmp_path / "initial")
    for d in ("hf", "signal"):
        (tmp_path / d).mkdir()
    long = [(7 * i + 3) % 240 + 1 for i in range(96)]
    commits = [{"version": 0}, {"check_only": True, "reset_prefix_cache": True}]
    refit = {"rendezvous": rdv, "timeout": 300, "steps": 0, "commits": commits,
             "init_info": {"staging": "host"}, "signal": str(tmp_path / "signal")}
    runs = [{"model": str(initial), "refit": refit}, {"model": str(tmp_path / "hf" / "step-0")}]
    job = {"tp": 1, "engine_in_process": True, "prompts": [long], "max_tokens": 6, "logprobs": 5, "runs": runs,
           "block_size": 32}
    case = {"name": "cache", "initial": str(initial), "rendezvous": rdv, "save_hf": str(tmp_path / "hf"), "steps": 1}
    (refit_out, fresh), _ = _driver_and_trainer(tmp_path, job, [case], timeout=600)
    assert not list(tmp_path.glob("rdv*")), "a tcp:// rendezvous writes no file"
    stale, reset = refit_out["commits"]
    assert stale["out"][0]["cached"] >= 64, stale  # the old weights' blocks were hit
    assert stale["out"] != fresh["out"], "the test cannot see the prefix cache"
    assert reset["out"][0]["tokens"] == fresh["out"][0]["tokens"] and reset["out"][0]["logprobs"] == fresh["out"][0]["logprobs"]


def _engine(tmp: Path, name: str, tp: int, rdv: str, initial: Path, commit: bool) -> Proc:
    """Engine ``name`` (staged, a named replica, a delta session) under an engine driver. ``commit``:
    once the trainer is done, it commits the newest version and a fresh engine of its TP loads step 2."""
    d = tmp / name
    d.mkdir()
    refit: dict[str, Any] = {"rendezvous": rdv, "timeout": 300, "steps": 0, "ready_file": str(d / "ready"),
                             "init_info": {"staging": "host", "replica": name, "verify": True, "delta": True}}
    runs = [{"model": str(initial), "refit": refit}]
    # without ``commit`` the engine serves on, waiting for a file that never comes, until it is killed
    refit.update(commits=[{"version": None}], wait_before={"0": str(tmp / ("done" if commit else "never"))})
    if commit:
        runs.append({"model": str(tmp / "hf" / "step-2")})
    job = {"tp": tp, "engine_in_process": True, "prompts": PROMPTS, "max_tokens": 6, "logprobs": 5, "runs": runs}
    (d / "job.json").write_text(json.dumps(job))
    return Proc([sys.executable, HERE / "engine_driver.py", d / "job.json", d / "out.json"], d, "driver")


def _until(what: str, done: Any, procs: dict[str, Proc], timeout: float = 600) -> None:
    t0 = time.monotonic()
    while not done():
        for n, p in procs.items():
            assert p.p.poll() is None, f"{n} ended while waiting for {what}:\n{p.tail()}"
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.2)


def _pushes(trainer: Proc) -> list[dict[str, Any]]:
    return [json.loads(x) for x in trainer.out.read_text().splitlines() if x.startswith("{")]


@pytest.mark.timeout(1500)
def test_one_trainer_feeds_staged_engines_that_join_and_die(tmp_path: Path) -> None:
    """Named replicas over ``tcp://127.0.0.1:PORT`` (the trainer's registry; no file is shared), staged,
    in a delta session. Engines "a" (TP 1) and "b" (TP 2) come up and serve before any trainer
    exists (their ``init_weight_transfer_engine`` returns at once). The trainer (``replicas=True``)
    pushes step 0 to both (full); engine "c" (TP 1) starts only then, and joins at step 1 with a
    full push while a and b get deltas; a is then SIGKILLed (its engine process: the staging
    process follows it), and step 2 reaches b and c as deltas while a is reported dropped, by
    name. b and c then commit the newest version and each serves exactly what a fresh engine of
    its TP serves on step 2's checkpoint."""
    import os
    import signal

    from streamer.transport.torch_dist import free_port

    initial = tiny_models.make_model("qwen3", tmp_path / "initial")
    (tmp_path / "hf").mkdir()
    rdv = f"tcp://127.0.0.1:{free_port()}"
    procs = {"a": _engine(tmp_path, "a", 1, rdv, initial, commit=False),
             "b": _engine(tmp_path, "b", 2, rdv, initial, commit=True)}
    try:
        for name in ("a", "b"):  # both engines up and serving, with no trainer anywhere yet
            _until(f"engine {name}", (tmp_path / name / "ready").exists, procs)
        case = {"name": "fleet", "initial": str(initial), "rendezvous": rdv, "save_hf": str(tmp_path / "hf"),
                "steps": 3, "replicas": True, "done_file": str(tmp_path / "done"), "delta": True, "link_gbps": 0.05,
                "wait_replicas": {"0": ["a", "b"], "1": ["c"]}, "wait_before_push": {"2": str(tmp_path / "a-killed")}}
        (tmp_path / "train.json").write_text(json.dumps({"timeout": 300, "cases": [case]}))
        procs["trainer"] = Proc([sys.executable, HERE / "matrix_trainer.py", tmp_path / "train.json"], tmp_path,
                                "trainer")
        _until("the push of step 0", lambda: len(_pushes(procs["trainer"])) >= 1, procs)
        procs["c"] = _engine(tmp_path, "c", 1, rdv, initial, commit=True)  # joins mid-run
        _until("the push of step 1", lambda: len(_pushes(procs["trainer"])) >= 2, procs)
        os.kill(procs["a"].p.pid, signal.SIGKILL)
        assert procs["a"].wait(30) == -signal.SIGKILL
        time.sleep(3)  # its staging process notices its worker is gone within a second, and exits
        (tmp_path / "a-killed").write_text("")
        rcs = {n: p.wait(900) for n, p in procs.items() if n != "a"}
    finally:
        for p in procs.values():
            p.kill()
    story = "\n".join(f"=== {n}\n{p.tail()}" for n, p in procs.items())
    assert set(rcs.values()) == {0}, f"{rcs}\n{story}"
    got = {x["step"]: x["replicas"] for x in _pushes(procs["trainer"])}
    assert sorted(got) == [0, 1, 2] and sorted(got[0]) == ["a", "b"] and sorted(got[1]) == ["a", "b", "c"], story
    for step, reps in got.items():
        for name, (version, error, joined, sent, full) in reps.items():
            if name == "a" and step == 2:
                assert version is None and error, (step, reps)  # dropped, with the reason
                continue
            first = step == 0 or name == "c" and step == 1
            assert version == step and error is None and joined == first, (step, reps)
            assert (sent == full) if first else (0 < sent < full), (step, name, sent, full)  # full, then deltas
    for name in ("b", "c"):
        refit_out, fresh = json.loads((tmp_path / name / "out.json").read_text())
        (c,) = refit_out["commits"]
        assert c["error"] is None and c["out"] == fresh["out"], (name, c)
        assert refit_out["init_seconds"] < 30, refit_out["init_seconds"]  # it did not wait for a trainer
        assert all(w["version"] == 2 for w in c["last"]), c["last"]
