"""A live megatron-core trainer refits other jobs every step (issue: NeMo RL's ``nccl_reshard`` scenario).

The trainer (megatron_trainer.py under ``torchrun``) builds a GPTModel on CPU over gloo, describes
it with ``manifest_from_megatron`` and pushes it after each of two Adam steps. The oracle is
written by the trainer with an independent gather-and-convert (mcore.py), and is itself checked
against Megatron's own forward: transformers, loading it, gives Megatron's logits within float32
noise. Then:

* shardstream's own receivers (``refit recv --save``) hold exactly the oracle's tensors, bit for bit;
* a vLLM engine (``shardstream`` backend) of another layout serves after each push exactly what a
  fresh engine loaded from the oracle serves (greedy tokens and top-k logprobs), and not what it
  served before; each worker receives exactly the bytes its parameters hold (the lower bound) and
  nothing is gathered on any trainer rank (``push`` sends local parameters only: bytes sent by all
  trainer ranks sum to what the workers received).

Cells: dense Llama-like TP 2 (fp32, in megatron-core's ``DistributedDataParallel``, cast to bf16
on the way) -> vLLM TP 1 and receivers; TP 2 × PP 2
(bf16, inside megatron-core's ``Float16Module``, the vocabulary size left to vLLM's manifest) -> vLLM TP 2; Qwen3-MoE-like EP 2 (fp32) -> vLLM TP 2.
The oracle is checked against Megatron's forward where that runs in float32 at pp = 1 (a bf16
forward differs from transformers' by more than a wrong mapping might).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_vllm_refit import PROMPTS, Proc  # noqa: E402

TOKENS = [[1, 17, 42, 199, 5, 88, 123, 7]]
DENSE = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 250,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
MOE = {**DENSE, "model_type": "qwen3_moe", "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
       "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
#: name -> (HF config, trainer layout); each trainer runs under torchrun
CELLS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tp2": (DENSE, {"tp": 2, "pp": 1, "fp32": True, "ddp": True}),
    "tp2pp2": (DENSE, {"tp": 2, "pp": 2, "fp32": False, "wrap": True, "vocab": None}),
    "moe-ep2": (MOE, {"tp": 1, "pp": 1, "ep": 2, "fp32": True}),
}


def _initial(hf: dict[str, Any], out: Path) -> Path:
    """The checkpoint the engine starts from: the same architecture, other (seeded) weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(7)
    cfg = AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"})
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def _trainer(tmp: Path, name: str, rendezvous: Path, steps: int = 2, **extra: Any) -> Proc:
    hf, layout = CELLS[name]
    layout = {**layout, **extra}
    d = tmp / name
    (d / "oracle").mkdir(parents=True, exist_ok=True)
    job = {"hf": hf, **layout, "steps": steps, "rendezvous": str(rendezvous), "timeout": 600, "out": str(d / "oracle"),
           "tokens": TOKENS}
    (d / "job.json").write_text(json.dumps(job))
    n = layout["tp"] * layout["pp"] * layout.get("ep", 1)
    return Proc([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", n,
                 HERE / "megatron_trainer.py", d / "job.json"], d, "trainer")


def _pushes(proc: Proc) -> list[dict[str, Any]]:
    return [json.loads(line) for line in proc.out.read_text().splitlines() if line.startswith("{")]


def _check_oracle(step_dir: Path) -> float:
    """transformers on the oracle checkpoint against Megatron's own forward: the largest difference."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    # from_pretrained, not load_state_dict: transformers 5 fuses per-expert checkpoint keys on loading
    fp32 = step_dir.with_name(f"{step_dir.name}-fp32")
    fp32.mkdir(exist_ok=True)
    shutil.copy(step_dir / "config.json", fp32 / "config.json")
    shutil.copy(f"{step_dir}-fp32.safetensors", fp32 / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.float32)
    with torch.no_grad():
        got = model(torch.tensor(TOKENS)).logits.numpy()
    return float(np.abs(got - np.load(step_dir / "megatron-logits.npy")).max())


def _receivers(tmp: Path, dtype: str, *args: Any) -> tuple[Path, Proc]:
    """One ``refit recv`` rank in the HF layout of DENSE (``dtype``), joining through ``tmp/tp2/rdv``:
    under ``mpiexec`` from the core venv (``.venv``, which scripts/test.sh makes before this tier;
    this venv has no MPI), else a plain process."""
    d = tmp / "tp2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(DENSE))
    layout = Proc([sys.executable, "-m", "streamer", "layout", "--model", d / "config.json", "--preset", "hf",
                   "--dtype", dtype, "--no-files", "-o", d / "recv.json"], d, "layout")
    assert layout.wait(120) == 0, layout.err.read_text()
    core = HERE.parents[1] / ".venv" / "bin"
    launch = ([core / "mpiexec", "-n", 1, core / "python"] if (core / "mpiexec").exists() else [sys.executable])
    return d, Proc([*launch, "-m", "streamer", "refit", "recv", "--manifest", d / "recv.json", "--rendezvous",
                    d / "rdv", "--control", "store", *args], d, "recv")


@pytest.mark.timeout(900)
def test_megatron_to_shardstream_receivers(tmp_path: Path) -> None:
    """TP 2 fp32 Megatron -> one receiver in the HF layout, fp32, saving what it received."""
    import torch
    from safetensors.torch import load_file

    d, recv = _receivers(tmp_path, "float32", "--steps", 2, "--save", tmp_path / "tp2" / "saved", "--timeout", 600)
    trainer = _trainer(tmp_path, "tp2", d / "rdv")
    rcs = {"recv": recv.wait(600), "trainer": trainer.wait(120)}
    assert set(rcs.values()) == {0}, f"{rcs}\n{trainer.err.read_text()[-4000:]}\n{recv.err.read_text()[-2000:]}"
    oracle = d / "oracle"
    for step in (0, 1):
        noise = _check_oracle(oracle / f"step-{step}")
        assert noise < 1e-4, f"step {step}: the oracle is not Megatron's model (logits differ by {noise})"
    want = load_file(str(oracle / "step-1-fp32.safetensors"))
    got = load_file(str(next((d / "saved").glob("*.safetensors"))))
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"received tensors differ from Megatron's: {bad}"
    before = load_file(str(oracle / "step-0-fp32.safetensors"))
    assert any(not torch.equal(before[k], want[k]) for k in want)
    # the lower bound: each element of the HF model once (fp32), summed over the trainer's ranks
    need = sum(t.numel() * 4 for t in want.values())
    per_step: dict[int, int] = {}
    for p in _pushes(trainer):
        per_step[p["step"]] = per_step.get(p["step"], 0) + p["bytes_sent"]
    assert per_step == {0: need, 1: need}, (per_step, need)


@pytest.mark.timeout(300)
def test_megatron_vocab_that_differs_from_the_receivers_is_refused_by_name(tmp_path: Path) -> None:
    d, recv = _receivers(tmp_path, "bfloat16", "--timeout", 120)
    trainer = _trainer(tmp_path, "tp2", d / "rdv", steps=1, vocab=240)
    rcs = {"recv": recv.wait(200), "trainer": trainer.wait(60)}
    assert rcs["recv"] == 1 and rcs["trainer"] != 0, rcs
    for text in (recv.err.read_text(), trainer.err.read_text()):
        assert "model.embed_tokens.weight" in text and "[240, 64]" in text and "[250, 64]" in text, text[-3000:]


def _vllm_cells(tmp: Path, tp: int, names: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Each cell's trainer in turn, and one engine driver at ``tp`` running their engines in turn."""
    jobs = []
    for name in names:
        hf = CELLS[name][0]
        d = tmp / name
        d.mkdir()
        initial = _initial(hf, d / "initial")
        oracle = d / "oracle"
        runs = [{"model": str(initial), "refit": {"rendezvous": str(d / "rdv"), "timeout": 600, "steps": 2,
                                                  "manifests": str(d / "dump"), "init_info": {"verify": True}}},
                {"model": str(oracle / "step-0")}, {"model": str(oracle / "step-1")}]
        jobs.append({"tp": tp, "prompts": PROMPTS, "max_tokens": 6, "logprobs": 5, "runs": runs})
    (tmp / "job.json").write_text(json.dumps({"tp": tp, "engine_in_process": True, "jobs": jobs}))
    driver = Proc([sys.executable, HERE / "engine_driver.py", tmp / "job.json", tmp / "out.json"], tmp, "driver")
    trainers: dict[str, Proc] = {}
    try:
        for name in names:  # one trainer at a time: each waits for its engine at its rendezvous
            trainers[name] = _trainer(tmp, name, tmp / name / "rdv")
            rc = trainers[name].wait(900)
            assert rc == 0, f"{name} trainer: {rc}\n{trainers[name].err.read_text()[-6000:]}\n" \
                            f"{driver.err.read_text()[-3000:]}"
        rc = driver.wait(900)
        assert rc == 0, f"driver: {rc}\n{driver.err.read_text()[-6000:]}"
    finally:
        driver.kill()
        for p in trainers.values():
            p.kill()
    out = json.loads((tmp / "out.json").read_text())
    for name in names:
        out_n = out[names.index(name)]
        out_n[0]["pushes"] = _pushes(trainers[name])
    return dict(zip(names, out))


def _worker_bytes(dump: Path) -> tuple[int, int]:
    """(bytes every worker's regions hold, bytes the workers received) at one update."""
    from formats.manifest.dtypes import DTYPES
    from formats.manifest.wire import loads_manifest

    need = got = 0
    for f in sorted(dump.glob("rank-*.json")):
        body = json.loads(f.read_text())
        m = loads_manifest(json.dumps(body["manifests"][body["naming"]]), where=str(f))
        for _, spec, c in m.iter_chunks():
            if body["rank"] in c.holders:
                need += c.region.volume * DTYPES[spec.data_type].itemsize
        got += body["last"]["bytes_received"]
    return need, got


def _check(name: str, runs: list[dict[str, Any]], dump: Path) -> list[str]:
    refit, fresh = runs[0], runs[1:3]
    bad = []
    for i, (st, ref) in enumerate(zip(refit["steps"], fresh)):
        if st["out"] != ref["out"]:
            bad.append(f"{name} step {i}: the refitted engine serves {st['out'][0]['tokens']}..., a fresh engine on "
                       f"the same weights {ref['out'][0]['tokens']}...")
        need, got = _worker_bytes(dump / f"step-{i}")
        sent = sum(p["bytes_sent"] for p in refit["pushes"] if p["step"] == i)
        if not need == got == sent:
            bad.append(f"{name} step {i}: workers hold {need} bytes, received {got}, the trainer sent {sent}")
    if fresh[0]["out"] == fresh[1]["out"]:
        bad.append(f"{name}: steps 0 and 1 serve alike; the check could not see a stale push")
    if refit["before"] == fresh[0]["out"]:
        bad.append(f"{name}: the initial model serves like step 0")
    return bad


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("tp,names", [(1, ["tp2"]), (2, ["tp2pp2", "moe-ep2"])], ids=["vllm-tp1", "vllm-tp2"])
def test_megatron_refits_vllm(tmp_path: Path, tp: int, names: list[str]) -> None:
    t0 = time.monotonic()
    cells = _vllm_cells(tmp_path, tp, names)
    bad = [line for name, runs in cells.items() for line in _check(name, runs, tmp_path / name / "dump")]
    assert not bad, "\n".join(bad)
    for name in names:  # the oracle is Megatron's model (its forward runs at pp = 1)
        if CELLS[name][1]["pp"] == 1 and CELLS[name][1]["fp32"]:
            for step in (0, 1):
                noise = _check_oracle(tmp_path / name / "oracle" / f"step-{step}")
                assert noise < 1e-4, f"{name} step {step}: the oracle is not Megatron's model ({noise})"
    print(f"megatron -> vLLM TP {tp}: {', '.join(names)} in {time.monotonic() - t0:.0f} s")


@pytest.mark.timeout(600)
def test_example_trainer_runs_as_docs_megatron_shows(tmp_path: Path) -> None:
    """docs/megatron.md's example, exactly: a TP 2 × PP 2 trainer (examples/megatron_refit) refits
    receivers laid out as vLLM TP 2, the vocabulary size left to them, checksums verified."""
    import re

    page = (HERE.parents[1] / "docs" / "megatron.md").read_text()
    block = re.search(r"```bash\n(E=\$REPO/examples/megatron_refit\n.*?)```", page, re.S)
    assert block, "docs/megatron.md lost the example's commands"
    script = f"set -euo pipefail\nREPO={HERE.parents[1]}\nshardstream() {{ python -m streamer \"$@\"; }}\n" + block.group(1)
    (tmp_path / "run.sh").write_text(script)
    run = Proc(["bash", tmp_path / "run.sh"], tmp_path, "example")
    assert run.wait(500) == 0, run.err.read_text()[-4000:]
    assert "2 step(s)" in run.out.read_text() and "checksums verified" in run.out.read_text(), run.out.read_text()
    pushes = _pushes(run)
    assert sorted((p["rank"], p["step"]) for p in pushes) == [(r, s) for r in range(4) for s in range(2)]


@pytest.mark.timeout(600)
def test_bench_vllm_from_megatron(tmp_path: Path) -> None:
    """``bench vllm --source megatron``: a TP 2 megatron-core trainer, loaded with the checkpoint's
    weights through its own manifest, refits the engine that serves that checkpoint: it serves what
    it served, and each worker receives exactly its regions' bytes."""
    model = _initial(DENSE, tmp_path / "model")
    run = Proc([sys.executable, "-m", "streamer", "bench", "vllm", "--model", model, "--source", "megatron",
                "--train-mesh", "tp=2", "--repeats", 1, "--json"], tmp_path, "bench")
    assert run.wait(500) == 0, run.err.read_text()[-4000:]
    r = json.loads(run.out.read_text().splitlines()[-1])
    m = r["megatron"]
    assert m["bytes_received"] == m["lower_bound_bytes"] and m["serves_first_load"], m
    assert m["trainer"]["bytes_sent_per_push"] == sum(m["lower_bound_bytes"])
    assert r["shardstream"]["serves_first_load"] and r["shardstream"]["bytes_received"] == m["bytes_received"]
    # the other sender ways: every array pushed whole (load_weights), and staged, unpaced and paced
    whole, staged, slow = r["pushed_whole"], r["staged"], r["staged_slow"]
    assert whole["serves_first_load"] and whole["bytes_received"] == r["shardstream"]["bytes_received"], whole  # TP 1
    assert staged["serves_first_load"] and slow["serves_first_load"], (staged, slow)
    assert staged["copy_seconds"][0] > 0 and staged["process_seconds"][0] > 0 and staged["host_copy_seconds"][0] > 0
    # each timed update's own split (the pause is set against its own processing)
    assert len(staged["update_process_seconds"]) == len(staged["seconds"]) == 1, staged
    assert staged["update_process_seconds"][0] > 0 and staged["update_copy_seconds"][0] > 0, staged
    # the paced sender's link is a quarter of the unpaced push's rate: its push takes about 4x as long
    assert min(slow["push_seconds"]) > 2 * max(staged["push_seconds"]), (staged, slow)
