"""LoRA adapters pushed into a running vLLM engine (``init_info["adapter"]``, streamer/vllm/lora.py),
against the same adapters loaded by vLLM from PEFT directories (the vllm tier).

One engine (TP 1, then TP 2; ``enable_lora=True``, 2 slots, ``max_lora_rank=16``) on a tiny dense Qwen3; two
adapters of rank 8 on q/k/v/o, gate/up/down, embed_tokens and lm_head (``lora_alpha=12``: a scale of 1.5, folded into B
in bf16 by vLLM's own loader on both paths). lora_driver.py pushes adapter 1 as ``policy-v1``
(id 1), then adapter 2 as ``policy-v2`` (id 2), through a rendezvous file, and generates with each
``LoRARequest`` (whose path does not exist: nothing is read from disk). Checked: each pushed
adapter serves exactly what vLLM serves from that adapter's directory (greedy tokens and top-2
logprobs), differs from the base model and from the other adapter; version 1 still serves after
version 2 arrived; each still serves the same after two adapters from directories took both slots
(reloaded from vLLM's CPU copy, which the push filled); pushing id 1 again, and the name
policy-v1 again, is refused by name on both sides.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_models  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: the input embedding and the output head have LoRA slots too (PEFT names the embedding's tensors
#: lora_embedding_A [r, vocab] and lora_embedding_B [hidden, r])
EMBEDDINGS = ["embed_tokens", "lm_head"]


def make_adapter(model_dir: Path, out: Path, seed: int, r: int = 8, alpha: int = 12,
                 embeddings: bool = True) -> Path:
    """A PEFT adapter directory: lora_A [r, in] and lora_B [out, r] per target module (and the
    embedding's lora_embedding_A / _B with ``embeddings``), seeded."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.2).to(torch.bfloat16)

    targets = TARGETS + (EMBEDDINGS if embeddings else [])
    tensors = {}
    for name, mod in model.named_modules():
        base, last = f"base_model.model.{name}", name.rsplit(".", 1)[-1]
        if last in targets and isinstance(mod, torch.nn.Embedding):
            tensors[f"{base}.lora_embedding_A"] = rand(r, mod.num_embeddings)
            tensors[f"{base}.lora_embedding_B"] = rand(mod.embedding_dim, r)
        elif last in targets:
            tensors[f"{base}.lora_A.weight"] = rand(r, mod.in_features)
            tensors[f"{base}.lora_B.weight"] = rand(mod.out_features, r)
    assert not embeddings or sum("embed_tokens" in k or "lm_head" in k for k in tensors) == 4
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "r": r, "lora_alpha": alpha, "target_modules": targets, "bias": "none", "peft_type": "LORA",
        "task_type": "CAUSAL_LM", "use_rslora": False, "use_dora": False}))
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp", [1, 2])
def test_pushed_adapters_serve_what_vllm_serves_from_their_directories(tmp_path: Path, tp: int) -> None:
    model = tiny_models.make_model("dense", tmp_path / "model", seed=0)
    a1 = make_adapter(model, tmp_path / "adapter-1", seed=1)
    a2 = make_adapter(model, tmp_path / "adapter-2", seed=2)
    out = tmp_path / "out.json"
    p = subprocess.run([sys.executable, str(HERE / "lora_driver.py"), str(model), str(a1), str(a2),
                        str(tmp_path / "rdv"), str(out), str(tp)], capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["pushed"] == [1, 2]
    assert got["registered"] == [1, 2]
    assert got["pushed-1"] == got["disk-1"], "the pushed adapter 1 does not serve what vLLM serves from its directory"
    assert got["pushed-2"] == got["disk-2"], "the pushed adapter 2 does not serve what vLLM serves from its directory"
    assert got["pushed-1-again"] == got["disk-1"], "version 1 changed when version 2 arrived"
    assert got["pushed-1"] != got["base"] and got["pushed-2"] != got["pushed-1"]
    # evicted from the 2 slots by the two directory adapters, then reloaded from vLLM's CPU copy
    assert got["slots-after-disk"] == [11, 12], got["slots-after-disk"]
    assert got["pushed-1-reloaded"] == got["disk-1"] and got["pushed-2-reloaded"] == got["disk-2"]
    for side in ("engine", "trainer"):
        assert "LoRA id 1 is registered already" in got[f"{side}_refused_id"], got[f"{side}_refused_id"]
        assert "lora_name 'policy-v1' was pushed to this engine before" in got[f"{side}_refused_name"], \
            got[f"{side}_refused_name"]


@pytest.mark.timeout(900)
def test_adapters_pushed_by_name_serve_through_vllm_serve(tmp_path: Path) -> None:
    """``vllm serve --enable-lora``: the trainer pushes each adapter with ``update_info`` naming it
    (``lora_name``, no id); ``/v1/load_lora_adapter`` with path ``shardstream://NAME`` then loads it
    through vLLM's own add_lora, under the id the serving layer picks, so ``/v1/models`` lists it and
    completions name it as they name any adapter. Each serves what the same server serves from that
    adapter's directory; version 1 still serves after version 2; an unknown name is refused."""
    import urllib.error

    from test_vllm_refit import Proc
    from test_vllm_serve import Server, _free_port, start_server

    model = tiny_models.make_model("dense", tmp_path / "model", seed=0)
    adapters = [make_adapter(model, tmp_path / f"adapter-{i}", seed=i) for i in (1, 2)]
    config = json.loads((adapters[0] / "adapter_config.json").read_text())
    port = _free_port()
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # Proc copies os.environ: /v1/load_lora_adapter
    try:
        server = start_server(tmp_path, model, port, "--enable-lora", "--max-loras", 2, "--max-lora-rank", 16,
                              "--max-cpu-loras", 4)
    finally:
        os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    procs = [server]
    got: dict[str, Any] = {}
    try:
        srv = Server(port)
        srv.wait_up(server, 600)
        for v, a in enumerate(adapters, 1):
            rdv = tmp_path / f"rdv-{v}"
            sender = Proc([sys.executable, HERE / "hub_sender.py", a, rdv, 240, "--file", "adapter_model.safetensors"],
                          tmp_path, f"sender-{v}")
            procs.append(sender)
            srv.post("/init_weight_transfer_engine", {"init_info": {"rendezvous": str(rdv), "timeout": 240,
                                                                    "adapter": config}})
            srv.post("/start_weight_update")
            srv.post("/update_weights", {"update_info": {"lora_name": f"policy-v{v}"}})
            srv.post("/finish_weight_update", {"weight_version": str(v)})
            srv.post("/shutdown_weight_transfer_engine")
            assert sender.wait(120) == 0, sender.tail()
            _load_lora(srv, f"policy-v{v}", f"shardstream://policy-v{v}")
            got[f"pushed-{v}"] = srv.served(f"policy-v{v}")
        got["pushed-1-again"] = srv.served("policy-v1")
        got["models"] = sorted(m["id"] for m in srv.get("/v1/models")["data"])
        for v, a in enumerate(adapters, 1):
            _load_lora(srv, f"disk-{v}", str(a))
            got[f"disk-{v}"] = srv.served(f"disk-{v}")
        got["base"] = srv.served(str(model))
        try:
            _load_lora(srv, "x", "shardstream://never")
            got["unknown"] = "accepted"
        except urllib.error.HTTPError as e:
            got["unknown"] = e.read().decode()
    finally:
        for p in procs:
            p.kill()
    assert {"policy-v1", "policy-v2"} <= set(got["models"]), got["models"]
    assert got["pushed-1"] == got["disk-1"] and got["pushed-2"] == got["disk-2"]
    assert got["pushed-1-again"] == got["disk-1"], "version 1 changed when version 2 arrived"
    assert got["pushed-1"] != got["base"] and got["pushed-2"] != got["pushed-1"]
    assert "no adapter pushed as 'never'" in got["unknown"], got["unknown"]


@pytest.mark.timeout(600)
def test_an_fsdp2_peft_trainer_refits_versions_and_a_broken_push_leaves_them_serving(tmp_path: Path) -> None:
    """peft_trainer.py (PEFT under FSDP2, torchrun 2 ranks) pushes its adapter after each AdamW
    step into a TP 2 engine (lora_driver.py --trainer): versions 1 and 2 serve side by side in one
    batch, each exactly what vLLM serves from the PEFT directory the trainer wrote for it; the
    trainer dies half-way through version 3's push (rank 0 SIGKILLed after posting its first
    message), the engine refuses version 3, and 1 and 2 still serve exactly; id 1 is unloaded and 2
    serves on."""
    from test_vllm_refit import TORCHRUN, Proc

    assert TORCHRUN is not None, "torchrun not found beside this python"
    model = tiny_models.make_model("dense", tmp_path / "model", seed=0)
    rdv, trainer_out, out = tmp_path / "rdv", tmp_path / "trainer", tmp_path / "out.json"
    trainer_out.mkdir()
    driver = Proc([sys.executable, HERE / "lora_driver.py", "--trainer", model, rdv, trainer_out, out, 2], tmp_path,
                  "driver")
    trainer = Proc([TORCHRUN, "--standalone", "--nproc-per-node", 2, HERE / "peft_trainer.py", model, rdv,
                    trainer_out, 60], tmp_path, "trainer")
    try:
        rcs = (driver.wait(540), trainer.wait(60))
    finally:
        for p in (driver, trainer):
            p.kill()
    assert rcs[0] == 0, f"{rcs}\n=== driver\n{driver.tail()}\n=== trainer\n{trainer.tail()}"
    pushes = [json.loads(line) for line in trainer.out.read_text().splitlines() if line.startswith("{")]
    assert [p["version"] for p in pushes] == [1, 2], trainer.tail()
    assert rcs[1] != 0, "the trainer was to die in its third push"
    got = json.loads(out.read_text())
    v1, v2 = got["side-by-side"]
    assert [v1, v2] == got["disk"], "a pushed version does not serve what vLLM serves from its PEFT directory"
    assert v1 != v2 and v1 != got["base"], "the versions serve alike: the check could not see a stale adapter"
    assert "the push of version 3 failed" in got.get("v3_error", ""), got.get("v3_error")
    assert got["registered"] == [1, 2], got["registered"]
    assert got["after-v3"] == [v1, v2], "a broken push changed a version that was served"
    assert got["registered-after-remove"] == [2] and got["v2-after-remove"] == v2


@pytest.mark.timeout(600)
def test_two_adapters_alternate_through_one_slot_and_one_cached_copy(tmp_path: Path) -> None:
    """``max_loras=1, max_cpu_loras=1``: two adapters pushed by name, served alternately four times
    each; every turn evicts the other from vLLM's CPU cache, and vLLM reloads it from what the
    workers hold (``shardstream://NAME``). Each turn serves exactly what that adapter's directory
    serves."""
    model = tiny_models.make_model("dense", tmp_path / "model", seed=0)
    a1 = make_adapter(model, tmp_path / "adapter-1", seed=1)
    a2 = make_adapter(model, tmp_path / "adapter-2", seed=2)
    out = tmp_path / "out.json"
    p = subprocess.run([sys.executable, str(HERE / "lora_driver.py"), "--evict", str(model), str(a1), str(a2),
                        str(tmp_path / "rdv"), str(out)], capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["cached"] == [[1], [2]] * 4, got["cached"]  # one adapter in vLLM's CPU cache at a time
    assert got["disk"][0] != got["disk"][1]
    for turn, served in enumerate(got["pushed"]):
        assert served == got["disk"][turn % 2], f"turn {turn}: adapter {turn % 2 + 1} reloaded wrong"


@pytest.mark.timeout(600)
def test_bench_vllm_lora_measures_both_ways_on_one_engine(tmp_path: Path) -> None:
    """``bench vllm --lora``: the push and the disk path each ran every repeat, the pushed adapter
    serves what the same adapter loaded from disk serves, and each worker received the whole
    adapter (the lower bound: vLLM's CPU copy is unsliced on every rank), no more."""
    from test_vllm_refit import Proc

    model = tiny_models.make_model("dense", tmp_path / "model", seed=0)
    run = Proc([sys.executable, "-m", "streamer", "bench", "vllm", "--lora", "--model", model, "--lora-ranks", "8,16",
                "--repeats", 2, "--dst-tp", 2, "--json"], tmp_path, "bench")
    assert run.wait(500) == 0, run.tail()
    (r,) = [json.loads(ln) for ln in run.out.read_text().splitlines() if ln.startswith('{"model"')]  # vLLM logs too
    assert [x["rank"] for x in r["sizes"]] == [8, 16]
    for x in r["sizes"]:
        assert len(x["push"]) == len(x["disk"]) == 2 and x["serves_alike"], x
        assert x["push_received"] == [x["adapter_bytes"]] * 2, x


def _load_lora(srv: Any, name: str, path: str) -> str:
    """``POST /v1/load_lora_adapter`` (vLLM answers it in plain text, not JSON)."""
    import urllib.request

    req = urllib.request.Request(srv.base + "/v1/load_lora_adapter", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"lora_name": name, "lora_path": path}).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode()
