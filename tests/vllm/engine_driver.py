"""Runs vLLM engines one after another in one process and prints what they generate (JSON).

    python engine_driver.py JOB.json OUT.json

JOB: ``{"tp": 1, "prompts": [[ids]], "max_tokens": N, "logprobs": K, "runs": [RUN, ...]}``. A RUN
is ``{"model": DIR}`` (a fresh engine loaded from DIR) or ``{"model": DIR, "refit": {"rendezvous":
PATH, "timeout": S, "steps": N}}``: an engine with the ``shardstream`` weight-transfer backend that
joins the trainer's session and generates after each of N updates. Greedy tokens and the top-K
logprobs of every generated position are recorded per prompt.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def generate(llm: Any, job: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=job["max_tokens"], logprobs=job["logprobs"], detokenize=False,
                        ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], sp, use_tqdm=False)
    got = []
    for o in outs:
        c = o.outputs[0]
        got.append({"tokens": list(c.token_ids),
                    "logprobs": [{str(t): lp.logprob for t, lp in pos.items()} for pos in c.logprobs]})
    return got


def engine(model: str, job: dict[str, Any], refit: bool) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = {}
    if refit:
        kw["weight_transfer_config"] = {"backend": "shardstream"}
    if job["tp"] == 1:
        kw["distributed_executor_backend"] = "uni"
    return LLM(model=model, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
               tensor_parallel_size=job["tp"], seed=0, **kw)


def run(job: dict[str, Any]) -> list[dict[str, Any]]:
    results = []
    for r in job["runs"]:
        t0 = time.perf_counter()
        llm = engine(r["model"], job, "refit" in r)
        entry: dict[str, Any] = {"model": r["model"], "start_seconds": time.perf_counter() - t0}
        if "refit" in r:
            rf = r["refit"]
            t1 = time.perf_counter()
            llm.init_weight_transfer_engine({"init_info": {"rendezvous": rf["rendezvous"], "timeout": rf["timeout"]}})
            entry["init_seconds"] = time.perf_counter() - t1
            entry["before"] = generate(llm, job)
            entry["steps"] = []
            for step in range(rf["steps"]):
                t2 = time.perf_counter()
                llm.start_weight_update()
                llm.update_weights({"update_info": {}})
                llm.finish_weight_update(weight_version=str(step))
                entry["steps"].append({"update_seconds": time.perf_counter() - t2,
                                       "version": llm.get_weight_version(), "out": generate(llm, job)})
        else:
            entry["out"] = generate(llm, job)
        results.append(entry)
        del llm
        gc.collect()
    return results


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    job = json.loads(Path(sys.argv[1]).read_text())
    if job["tp"] == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: starts in seconds
    else:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(job["tp"])))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    out = run(job)
    tmp = Path(sys.argv[2] + ".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, sys.argv[2])
