"""The coverage matrix: every architecture docs/vllm.md lists, at TP 1 and TP 2, refitted twice.

Per cell: a one-process trainer (matrix_trainer.py) loads the architecture's tiny checkpoint with
transformers, trains it with AdamW (fp32 masters; every tensor moves, biases, norms and tied
embeddings included) and pushes it after each of two steps; the engine (``LLM`` with the
``shardstream`` backend, the audit on: ``verify``) generates after each update. A fresh engine is
then loaded from each step's checkpoint: the refitted engine must serve exactly what it serves,
greedy tokens and top-k logprobs (vLLM on this CPU is deterministic at TP 1 and TP 2: two fresh
engines on one checkpoint agree bit for bit, which the test checks too). An architecture the
backend does not support must be refused by name at ``init_weight_transfer_engine``.

The cells share their processes: one engine driver per TP runs every architecture's engines in
turn (vLLM imported once, the engine core in the driver's process; at TP 2 the workers, where the
backend runs, are processes of their own), and one trainer process trains them in turn.
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

MATRIX = tiny_models.MATRIX


def _cell(tmp: Path, dirname: str, arch: str, steps: int, refit: dict[str, Any]) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """One cell's directory, initial checkpoint, refit run (``refit`` adds to its keys) and trainer case."""
    d = tmp / dirname
    initial = tiny_models.make_model(arch, d / "initial")
    (d / "hf").mkdir()
    run = {"model": str(initial), "refit": {"rendezvous": str(d / "rdv"), "timeout": 300, "steps": steps, **refit}}
    case = {"name": dirname, "initial": str(initial), "rendezvous": str(d / "rdv"), "save_hf": str(d / "hf"),
            "steps": steps}
    return d, run, case


def run_matrix(tmp: Path, tp: int, archs: list[str], sabotaged: str | None = None) -> dict[str, Any]:
    """Every architecture of ``archs`` at ``tp``; ``sabotaged``: one more cell of that (tied)
    architecture, named ``stale``, whose engine skips rebuilding its tied layers (TP 1)."""
    job = {"tp": tp, "prompts": PROMPTS, "max_tokens": 6, "logprobs": 5}
    jobs, cases = [], []
    if sabotaged is not None:
        _, run, case = _cell(tmp, "stale", sabotaged, 1, {"sabotage": "tied"})
        jobs.append({**job, "runs": [run]})
        cases.append(case)
    for name in archs:
        refused = MATRIX[name] is not None
        d, run, case = _cell(tmp, name, name, 2, {"init_info": {"verify": True}, "refused": refused})
        runs: list[dict[str, Any]] = [run]
        if not refused:
            runs += [{"model": str(d / "hf" / "step-0")}, {"model": str(d / "hf" / "step-1")}]
            if name == archs[0]:
                runs.append({"model": str(d / "hf" / "step-1")})  # the noise between two fresh engines
            cases.append(case)
        jobs.append({**job, "runs": runs})
    (tmp / "job.json").write_text(json.dumps({"tp": tp, "engine_in_process": True, "jobs": jobs}))
    (tmp / "train.json").write_text(json.dumps({"timeout": 600, "cases": cases}))
    procs = {"trainer": Proc([sys.executable, HERE / "matrix_trainer.py", tmp / "train.json"], tmp, "trainer"),
             "driver": Proc([sys.executable, HERE / "engine_driver.py", tmp / "job.json", tmp / "out.json"], tmp,
                            "driver")}
    try:
        rcs = {"driver": procs["driver"].wait(3000)}
        rcs["trainer"] = procs["trainer"].wait(60)
    finally:
        for p in procs.values():
            p.kill()
    assert set(rcs.values()) == {0}, f"{rcs}\n" + "\n".join(f"=== {n}\n{p.tail()}" for n, p in procs.items())
    out = json.loads((tmp / "out.json").read_text())
    return dict(zip((["stale"] if sabotaged else []) + archs, out))


def check_cell(name: str, runs: list[dict[str, Any]]) -> list[str]:
    """What is wrong with one cell (empty: it serves exactly what fresh engines serve)."""
    refit = runs[0]
    if MATRIX[name] is not None:
        why = refit.get("refused")
        return [] if why and MATRIX[name] in why else [f"{name}: expected a refusal naming {MATRIX[name]!r}, got {why!r}"]
    bad = []
    steps, fresh = refit["steps"], runs[1:3]
    for i, (st, ref) in enumerate(zip(steps, fresh)):
        for p, (got, want) in enumerate(zip(st["out"], ref["out"])):
            if got["tokens"] != want["tokens"]:
                bad.append(f"{name} step {i} prompt {p}: tokens {got['tokens']} != fresh {want['tokens']}")
            elif got["logprobs"] != want["logprobs"]:
                worst = max(abs(a[t] - b.get(t, 0.0)) for a, b in zip(got["logprobs"], want["logprobs"]) for t in a)
                bad.append(f"{name} step {i} prompt {p}: logprobs differ from a fresh engine's (max {worst:.3g})")
    if fresh[0]["out"] == fresh[1]["out"]:
        bad.append(f"{name}: steps 0 and 1 serve alike; the check could not see a stale push")
    if refit["before"] == fresh[0]["out"]:
        bad.append(f"{name}: the initial model serves like step 0")
    if len(runs) > 3 and runs[3]["out"] != runs[2]["out"]:
        bad.append(f"{name}: two fresh engines on one checkpoint differ: the exact check does not hold here")
    return bad


@pytest.mark.timeout(3000)
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_coverage_matrix(tmp_path: Path, tp: int) -> None:
    t0 = time.monotonic()
    cells = run_matrix(tmp_path, tp, list(MATRIX), sabotaged="llama3-tied" if tp == 1 else None)
    if tp == 1:
        # the audit has teeth: an engine that does not rebuild its tied head (the defect) is refused at
        # finish, naming the stale packed copy, and does not take the version
        stale = cells.pop("stale")[0]["steps"][0]
        assert stale["error"] and "lm_head.cpu_linear" in stale["error"], stale
        assert stale["version"] != "0", stale
    bad = [line for name, runs in cells.items() for line in check_cell(name, runs)]
    assert not bad, "\n".join(bad)
    print(f"coverage matrix tp{tp}: {len(cells)} architectures in {time.monotonic() - t0:.0f} s")
