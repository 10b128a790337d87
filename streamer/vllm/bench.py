"""``shardstream bench vllm``: three ways to put new weights into one running vLLM engine, side by side.

One in-process engine (TP 1, the vLLM venv), one HF checkpoint, the same weights every time:

- **shardstream**: the ``shardstream`` weight-transfer backend; a sender process pushes the
  checkpoint's tensors (``RefitSession``), the engine pulls its regions in place;
- **full tensors + load_weights**: every HF tensor handed to the worker whole (what vLLM's NCCL
  backend and checkpoint-engine deliver), then ``model.load_weights`` inside vLLM's layerwise
  reload (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``);
- **reload from disk**: vLLM's ``reload_weights`` from the checkpoint directory.

For each: the apply time (median over ``repeats``), the bytes the worker receives (shardstream:
what its pull received; full tensors: every tensor's bytes; disk: the checkpoint's bytes read), the
peak extra memory (resident set, sampled every millisecond, above the level before the update),
and whether the engine then serves exactly what it served from its first load (greedy tokens and
top-5 logprobs). The engine's start and the sender's connection are not timed.

    python -m streamer.vllm.bench MODEL_DIR [--repeats N]        # or: shardstream bench vllm --model DIR
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["bench_cli", "bench_vllm", "vllm_text"]

PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 100, 200, 9]]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def _peak(out: list[int]) -> Iterator[None]:
    """Appends the peak resident-set growth (bytes) seen while the block runs."""
    base = _rss()
    top = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            top[0] = max(top[0], _rss())
            time.sleep(0.001)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
        out.append(max(top[0], _rss()) - base)


def _generate(llm: Any) -> list[Any]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=5, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
            for o in outs]


def _timed(fn: Callable[[], None], repeats: int) -> tuple[list[float], int]:
    times: list[float] = []
    peaks: list[int] = []
    for _ in range(repeats):
        with _peak(peaks):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times, max(peaks)


def bench_vllm(model_dir: str, repeats: int = 3, timeout: float = 600) -> dict[str, Any]:
    """Run the three ways on one in-process engine loaded from ``model_dir``; see the module docstring."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from safetensors.torch import load_file
    from vllm import LLM
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    files = sorted(Path(model_dir).glob("*.safetensors"))
    disk_bytes = sum(f.stat().st_size for f in files)
    llm = LLM(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
              distributed_executor_backend="uni", weight_transfer_config={"backend": "shardstream"})
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    model, engine = worker.model_runner.model, worker.weight_transfer_engine
    first = _generate(llm)
    out: dict[str, Any] = {"model": model_dir, "repeats": repeats, "checkpoint_bytes": disk_bytes}
    with tempfile.TemporaryDirectory() as d:
        rdv = str(Path(d) / "rdv")
        sender = subprocess.Popen([sys.executable, "-m", "streamer.vllm.bench", "--send", model_dir, rdv,
                                   str(repeats), str(timeout)])
        try:
            llm.init_weight_transfer_engine({"init_info": {"rendezvous": rdv, "timeout": timeout}})

            def shardstream_update() -> None:
                llm.start_weight_update()
                llm.update_weights({"update_info": {}})
                llm.finish_weight_update()

            times, peak = _timed(shardstream_update, repeats)
            if sender.wait(timeout) != 0:
                raise RuntimeError(f"the bench's sender exited with {sender.returncode}")
        finally:
            if sender.poll() is None:
                sender.kill()
    out["shardstream"] = {"seconds": times, "peak_extra_bytes": peak, "bytes_received": engine.last["bytes_received"],
                          "pull_seconds": engine.last["pull_seconds"],
                          "process_seconds": engine.last["process_seconds"], "serves_first_load": _generate(llm) == first}

    def full_tensors() -> None:
        weights: dict[str, Any] = {}
        for f in files:
            weights.update(load_file(f))  # every HF tensor whole, in this worker's memory
        initialize_layerwise_reload(model)
        model.load_weights(iter(weights.items()))
        finalize_layerwise_reload(model, worker.model_runner.model_config)

    times, peak = _timed(full_tensors, repeats)
    out["full_tensors"] = {"seconds": times, "peak_extra_bytes": peak, "bytes_received": disk_bytes,
                           "serves_first_load": _generate(llm) == first}

    def from_disk() -> None:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": model_dir, "is_checkpoint_format": True})

    times, peak = _timed(from_disk, repeats)
    out["reload_from_disk"] = {"seconds": times, "peak_extra_bytes": peak, "bytes_received": disk_bytes,
                               "serves_first_load": _generate(llm) == first}
    for k in ("shardstream", "full_tensors", "reload_from_disk"):
        out[k]["median_seconds"] = statistics.median(out[k]["seconds"])
    return out


def vllm_text(r: dict[str, Any]) -> str:
    rows = [f"bench vllm ({r['model']}, TP 1 in-process, median of {r['repeats']}; checkpoint "
            f"{r['checkpoint_bytes'] / 2**20:.2f} MiB):",
            f"  {'way':28} {'apply s':>9} {'received MiB':>13} {'peak extra MiB':>15}  serves a fresh load's output"]
    for k, label in (("shardstream", "shardstream pull"), ("full_tensors", "full tensors + load_weights"),
                     ("reload_from_disk", "vLLM reload from disk")):
        x = r[k]
        rows.append(f"  {label:28} {x['median_seconds']:9.3f} {x['bytes_received'] / 2**20:13.2f} "
                    f"{x['peak_extra_bytes'] / 2**20:15.1f}  {'yes' if x['serves_first_load'] else 'NO'}")
    return "\n".join(rows)


def bench_cli(model: str | None, repeats: int | None) -> tuple[dict[str, Any], str]:
    """``shardstream bench vllm --model DIR [--repeats N]``: the figures and their table."""
    from formats.errors import UsageError

    if not model:
        raise UsageError("bench vllm needs --model DIR (an HF checkpoint directory)")
    r = bench_vllm(model, repeats=repeats or 3)
    return r, vllm_text(r)


def _send(model_dir: str, rdv: str, pushes: int, timeout: float) -> int:
    """The bench's trainer stand-in: push the checkpoint's tensors ``pushes`` times."""
    from safetensors.torch import load_file

    from streamer import RefitSession, manifest_from_state_dict

    weights: dict[str, Any] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update(load_file(f))
    with RefitSession.open(manifest_from_state_dict(weights), "send", rendezvous=rdv, timeout=timeout) as s:
        for _ in range(pushes):
            s.push(weights)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--send"]:
        sys.exit(_send(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])))
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="an HF checkpoint directory (config.json + safetensors)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args()
    res = bench_vllm(a.model, a.repeats)
    print(json.dumps(res) if a.json else vllm_text(res))
