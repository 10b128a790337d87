"""One vLLM engine with LoRA on (``enable_lora=True``, 2 slots, rank up to 16) fed LoRA adapters by
a trainer stand-in through the ``shardstream`` backend's adapter session; prints what it served.

    python lora_driver.py MODEL ADAPTER_1 ADAPTER_2 RENDEZVOUS OUT.json [TP]
    python lora_driver.py --trainer MODEL RENDEZVOUS TRAINER_OUT OUT.json TP   (peft_trainer.py's engine)
    python lora_driver.py --evict MODEL ADAPTER_1 ADAPTER_2 RENDEZVOUS OUT.json   (one slot, one cached)

ADAPTER_N: PEFT adapter directories (adapter_config.json, adapter_model.safetensors) of the same
config. A thread pushes ADAPTER_1's tensors as version 1, then ADAPTER_2's as version 2, while the
engine registers them as ``policy-v1`` (id 1) and ``policy-v2`` (id 2). Then id 1 is pushed again
under a new name (refused by name: a version is a new id), then policy-v1's name under a new id
(refused: vLLM's prefix cache keys adapters by name). OUT gets, per prompt, the greedy tokens and top-2
logprobs of: the base model, each pushed adapter, and each adapter loaded by vLLM from its
directory (ids 11, 12), each pushed adapter again after those took both slots (reloaded into a
slot from vLLM's CPU copy), and the refusal both sides saw.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

PROMPTS = [[(7 * i + 3 * p) % 200 + 1 for i in range(8)] for p in range(3)]


def _served(llm: Any, lora: Any = None) -> list[Any]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=2, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False, lora_request=lora)
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [{str(k): round(v.logprob, 4) for k, v in step.items()} for step in o.outputs[0].logprobs]}
            for o in outs]


def _trainer(rdv: str, adapters: list[Path], log: dict[str, Any], go: threading.Event) -> None:
    """The trainer stand-in: pushes each adapter as a version, then version 1's id again."""
    try:
        _push(rdv, adapters, log, go)
    except BaseException as e:  # noqa: BLE001 - the driver's output says why
        import traceback

        log["trainer_error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()


def _push(rdv: str, adapters: list[Path], log: dict[str, Any], go: threading.Event) -> None:
    from safetensors.torch import load_file

    from streamer import RefitSession, RefusedError, manifest_from_state_dict

    first = load_file(str(adapters[0] / "adapter_model.safetensors"))
    with RefitSession.open(manifest_from_state_dict(first, name="adapter"), "send", rendezvous=rdv, timeout=120) as s:
        for v, a in enumerate(adapters, 1):
            go.wait(120)
            go.clear()
            log.setdefault("pushed", []).append(s.push(load_file(str(a / "adapter_model.safetensors")), version=v).version)
        for what in ("id", "name"):  # id 1 again under a new name, then an old name under a new id
            go.wait(120)
            go.clear()
            try:
                s.push(first, version=len(adapters) + 1)
            except RefusedError as e:
                log[f"trainer_refused_{what}"] = str(e)


def main(model: str, a1: str, a2: str, rdv: str, out: str, tp: int = 1) -> None:
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    adapters = [Path(a1), Path(a2)]
    config = json.loads((adapters[0] / "adapter_config.json").read_text())
    llm = LLM(model=model, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
              tensor_parallel_size=tp, seed=0, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=4,
              weight_transfer_config={"backend": "shardstream"},
              **({"distributed_executor_backend": "uni"} if tp == 1 else {}))
    log: dict[str, Any] = {}
    go = threading.Event()
    trainer = threading.Thread(target=_trainer, args=(rdv, adapters, log, go), daemon=True)
    trainer.start()
    llm.init_weight_transfer_engine({"init_info": {"rendezvous": rdv, "timeout": 120, "verify": True,
                                                   "adapter": config}})
    result: dict[str, Any] = {"base": _served(llm)}
    for v in (1, 2):
        go.set()
        llm.start_weight_update()
        llm.update_weights({"update_info": {"lora_name": f"policy-v{v}", "lora_id": v}})
        llm.finish_weight_update(weight_version=str(v))
        result[f"pushed-{v}"] = _served(llm, LoRARequest(f"policy-v{v}", v, "/nonexistent/shardstream"))
    # version 1 again, both still registered: the older version serves on while the caller keeps it
    result["pushed-1-again"] = _served(llm, LoRARequest("policy-v1", 1, "/nonexistent/shardstream"))
    result["registered"] = sorted(llm.llm_engine.list_loras())
    for what, info in (("id", {"lora_name": "policy-v1-again", "lora_id": 1}),
                       ("name", {"lora_name": "policy-v1", "lora_id": 3})):
        go.set()
        llm.start_weight_update()
        try:
            llm.update_weights({"update_info": info})
        except Exception as e:  # noqa: BLE001 - recorded: the test checks the message
            result[f"engine_refused_{what}"] = str(e)
    trainer.join(120)
    result.update(log)
    for i, a in enumerate(adapters, 1):
        result[f"disk-{i}"] = _served(llm, LoRARequest(f"disk-{i}", 10 + i, str(a)))
    # the two directory adapters took both slots: the pushed ones come back from vLLM's CPU copy
    result["slots-after-disk"] = sorted(_active(llm))
    for v in (1, 2):
        result[f"pushed-{v}-reloaded"] = _served(llm, LoRARequest(f"policy-v{v}", v, "/nonexistent/shardstream"))
    Path(out).write_text(json.dumps(result))


def _slot_ids(worker: Any) -> list[int]:
    """The adapter ids in this worker's LoRA slots (vLLM's slot table, read through collective_rpc)."""
    return sorted(i for i in worker.model_runner.lora_manager._adapter_manager.lora_index_to_id if i is not None)


def _active(llm: Any) -> list[int]:
    """The ids in the LoRA slots, the same on every worker (else every worker's lists)."""
    got = llm.collective_rpc(_slot_ids)
    return got[0] if all(g == got[0] for g in got) else got


def trainer_job(model: str, rdv: str, trainer_out: str, out: str, tp: int = 1) -> None:
    """The engine side of peft_trainer.py (``--trainer``): versions 1 and 2 pushed by the FSDP2 PEFT
    trainer are registered as ids 1 and 2 and served side by side in one batch; version 3's push
    breaks off (the trainer dies), and then both earlier versions still serve exactly what vLLM
    serves from the directories the trainer wrote for them; id 1 is unloaded and 2 serves on."""
    from peft_trainer import CONFIG
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    llm = LLM(model=model, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
              tensor_parallel_size=tp, seed=0, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=4,
              weight_transfer_config={"backend": "shardstream"},
              **({"distributed_executor_backend": "uni"} if tp == 1 else {}))
    llm.init_weight_transfer_engine({"init_info": {"rendezvous": rdv, "timeout": 60, "verify": True,
                                                   "adapter": CONFIG}})
    pushed = [LoRARequest(f"policy-v{v}", v, "/nonexistent/shardstream") for v in (1, 2)]
    result: dict[str, Any] = {"base": _served(llm)}
    for v in (1, 2):
        llm.start_weight_update()
        llm.update_weights({"update_info": {"lora_name": f"policy-v{v}", "lora_id": v}})
        llm.finish_weight_update(weight_version=str(v))
    result["side-by-side"] = _served_each(llm, pushed)
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": {"lora_name": "policy-v3", "lora_id": 3}})
    except Exception as e:  # noqa: BLE001 - recorded: the test checks the message
        result["v3_error"] = f"{type(e).__name__}: {e}"
    result["registered"] = sorted(llm.llm_engine.list_loras())
    result["after-v3"] = _served_each(llm, pushed)
    disk = [LoRARequest(f"disk-{v}", 10 + v, f"{trainer_out}/v{v}") for v in (1, 2)]
    result["disk"] = _served_each(llm, disk)
    llm.llm_engine.remove_lora(1)  # no request uses version 1 any more
    result["registered-after-remove"] = sorted(i for i in llm.llm_engine.list_loras() if i < 10)
    result["v2-after-remove"] = _served(llm, pushed[1])
    Path(out).write_text(json.dumps(result))


def evict_job(model: str, a1: str, a2: str, rdv: str, out: str) -> None:
    """``--evict``: an engine whose CPU cache and slots hold one adapter (``max_loras=1,
    max_cpu_loras=1``). Both adapters are pushed by name, then served alternately, four times each,
    through ``shardstream://NAME`` paths: each turn evicts the other from vLLM's cache, and vLLM
    reloads it from what the workers hold. Then the same from their directories, for reference."""
    from safetensors.torch import load_file
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    from streamer import RefitSession, manifest_from_state_dict

    adapters = [Path(a1), Path(a2)]
    config = json.loads((adapters[0] / "adapter_config.json").read_text())
    llm = LLM(model=model, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
              seed=0, enable_lora=True, max_loras=1, max_lora_rank=16, max_cpu_loras=1,
              weight_transfer_config={"backend": "shardstream"}, distributed_executor_backend="uni")
    tensors = [load_file(str(a / "adapter_model.safetensors")) for a in adapters]

    def trainer() -> None:
        with RefitSession.open(manifest_from_state_dict(tensors[0], name="adapter"), "send", rendezvous=rdv,
                               timeout=120) as s:
            for v, t in enumerate(tensors, 1):
                s.push(t, version=v)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    llm.init_weight_transfer_engine({"init_info": {"rendezvous": rdv, "timeout": 120, "adapter": config}})
    for v in (1, 2):
        llm.start_weight_update()
        llm.update_weights({"update_info": {"lora_name": f"a{v}"}})
        llm.finish_weight_update()
    thread.join(60)
    result: dict[str, Any] = {"pushed": [], "cached": []}
    for turn in range(8):
        v = turn % 2 + 1
        result["pushed"].append(_served(llm, LoRARequest(f"a{v}", v, f"shardstream://a{v}")))
        result["cached"].append(sorted(llm.llm_engine.list_loras()))
    result["disk"] = [_served(llm, LoRARequest(f"disk-{v}", 10 + v, str(a))) for v, a in enumerate(adapters, 1)]
    Path(out).write_text(json.dumps(result))


def _served_each(llm: Any, loras: list[Any]) -> list[Any]:
    """Every prompt under each adapter, all in one batch (the versions side by side)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=2, detokenize=False, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for _ in loras for p in PROMPTS]
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=[lo for lo in loras for _ in PROMPTS])
    got = [{"tokens": list(o.outputs[0].token_ids),
            "logprobs": [{str(k): round(v.logprob, 4) for k, v in step.items()} for step in o.outputs[0].logprobs]}
           for o in outs]
    return [got[i * len(PROMPTS):(i + 1) * len(PROMPTS)] for i in range(len(loras))]


if __name__ == "__main__":
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(_slot_ids): a test's probe
    tp = int(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[1] != "--evict" else 1  # --evict: TP 1
    if tp > 1:  # CPU workers, one core each (engine_driver.py does the same)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if sys.argv[1] == "--trainer":  # lora_driver.py --trainer MODEL RENDEZVOUS TRAINER_OUT OUT.json TP
        del sys.argv[1]
        trainer_job(*sys.argv[1:5], int(sys.argv[5]))
    elif sys.argv[1] == "--evict":  # lora_driver.py --evict MODEL ADAPTER_1 ADAPTER_2 RENDEZVOUS OUT.json
        evict_job(*sys.argv[2:7])
    else:
        main(*sys.argv[1:6], *(int(x) for x in sys.argv[6:7]))
