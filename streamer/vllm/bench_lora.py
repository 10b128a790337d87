"""``shardstream bench vllm --lora``: a LoRA adapter into a running vLLM engine, pushed against the disk path.

One engine (``enable_lora=True``; TP 1 in-process, or ``--dst-tp N``), and per rank in
``--lora-ranks`` a seeded adapter on every linear projection of the checkpoint (q/k/v/o,
gate/up/down; fp32, as a PEFT trainer holds it). Both ways are timed end to end, interleaved,
from "the trainer holds new adapter tensors" to "the engine can serve them":

- **shardstream push**: a sender process pushes the tensors (``RefitSession``); the engine runs
  ``start_weight_update`` -> ``update_weights({"lora_name", "lora_id"})`` -> ``finish_weight_update``
  (the adapter session of ``docs/lora.md``);
- **disk**: the trainer writes a PEFT directory (``adapter_model.safetensors`` + ``adapter_config.json``,
  fsynced, as ``save_pretrained`` does), then the engine loads it (``add_lora``, what
  ``/v1/load_lora_adapter`` calls).

Per worker, the bytes each way brings it: the push, what its pull received; the disk, the file
it reads. The lower bound is the whole adapter per worker, because vLLM keeps an unsliced CPU copy
of every adapter on every rank (the copy its LoRA slots are refilled from); the bytes the worker's
slots hold (its tensor-parallel slice) are printed beside it. Both ways must then serve the same
tokens and logprobs.

    shardstream bench vllm --lora --model DIR [--lora-ranks 8,64] [--repeats N] [--dst-tp N]
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["bench_lora", "lora_cli", "lora_text", "make_adapter"]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LINEAR = re.compile(r"^(?P<module>.+\.(?P<last>[a-z_]+))\.weight$")


def make_adapter(model_dir: str, rank: int, seed: int = 0) -> dict[str, Any]:
    """A seeded fp32 adapter (PEFT's saved names) on every dense linear projection of the checkpoint:
    lora_A [rank, in], lora_B [out, rank]; the shapes are read from the safetensors headers."""
    import torch
    from safetensors import safe_open

    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                m = _LINEAR.match(name)
                if m is None or m["last"] not in TARGETS or ".experts." in name:
                    continue
                rows, cols = st.get_slice(name).get_shape()
                base = f"base_model.model.{m['module']}"
                out[f"{base}.lora_A.weight"] = torch.randn(rank, cols, generator=g) * 0.05
                out[f"{base}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.05
    if not out:
        raise ValueError(f"{model_dir}: no q/k/v/o or gate/up/down projection in its safetensors")
    return out


def config(rank: int) -> dict[str, Any]:
    return {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}


def _write_peft(tensors: dict[str, Any], rank: int, out: Path) -> int:
    """What the disk path's trainer does: a PEFT directory, fsynced; its file's bytes."""
    from safetensors.torch import save_file

    from streamer.tools.bench_dcp import _fsync

    out.mkdir(parents=True)
    path = out / "adapter_model.safetensors"
    save_file(tensors, str(path))
    (out / "adapter_config.json").write_text(json.dumps({**config(rank), "peft_type": "LORA", "bias": "none"}))
    for f in (path, out / "adapter_config.json", out):
        _fsync(f)
    return path.stat().st_size


def _slot_bytes(worker: Any) -> int:
    """In each worker: the bytes its LoRA slots hold for one adapter (its tensor-parallel slice)."""
    import torch

    total = 0
    for module in worker.model_runner.lora_manager._adapter_manager.modules.values():
        for attr in ("lora_a_stacked", "lora_b_stacked"):
            held = getattr(module, attr, None)
            for t in [held] if isinstance(held, torch.Tensor) else list(held or ()):  # one tensor, or one per slice
                if isinstance(t, torch.Tensor):
                    total += t[0].numel() * t.element_size()  # one slot of max_loras
    return total


def _adapter_last(worker: Any) -> dict[str, Any]:
    """In each worker: its last adapter push (bytes received, pull and register seconds)."""
    return dict(worker.weight_transfer_engine.last)


def bench_lora(model_dir: str, ranks: tuple[int, ...] = (8, 64), repeats: int = 3, tp: int = 1,
               timeout: float = 600) -> dict[str, Any]:
    """Both ways per adapter rank, interleaved (module docstring)."""
    from vllm.lora.request import LoRARequest

    from streamer.vllm.bench import _engine, _generate, _rpc

    llm = _engine(model_dir, tp, lora={"enable_lora": True, "max_loras": 2, "max_lora_rank": max(ranks),
                                       "max_cpu_loras": 4})
    me = _rpc("streamer.vllm.bench_lora")  # its worker functions, pickled by reference
    out: dict[str, Any] = {"model": model_dir, "tp": tp, "repeats": repeats, "sizes": []}
    with tempfile.TemporaryDirectory() as d:
        for rank in ranks:
            tensors = make_adapter(model_dir, rank)
            src = Path(d) / f"r{rank}"
            _write_peft(tensors, rank, src)
            adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            rdv = str(Path(d) / f"r{rank}.rdv")
            sender = subprocess.Popen([sys.executable, "-m", me.__name__, "--send", str(src), rdv, str(repeats), str(timeout)])
            row: dict[str, Any] = {"rank": rank, "adapter_bytes": adapter_bytes, "push": [], "disk": []}
            try:
                llm.init_weight_transfer_engine({"init_info": {"rendezvous": rdv, "timeout": timeout,
                                                               "adapter": config(rank)}})
                for i in range(repeats):
                    pid, did = 100 * rank + 2 * i + 1, 100 * rank + 2 * i + 2
                    t0 = time.perf_counter()
                    llm.start_weight_update()
                    llm.update_weights({"update_info": {"lora_name": f"push-{pid}", "lora_id": pid}})
                    llm.finish_weight_update()
                    row["push"].append(time.perf_counter() - t0)
                    lasts = llm.collective_rpc(me._adapter_last)
                    row["push_received"] = [int(x["bytes_received"]) for x in lasts]
                    row.setdefault("pull", []).append(max(x["pull_seconds"] for x in lasts))
                    row.setdefault("register", []).append(max(x["register_seconds"] for x in lasts))
                    t0 = time.perf_counter()
                    _write_peft(tensors, rank, Path(d) / f"disk-{did}")
                    llm.llm_engine.add_lora(LoRARequest(f"disk-{did}", did, str(Path(d) / f"disk-{did}")))
                    row["disk"].append(time.perf_counter() - t0)
                    pushed, disk = LoRARequest(f"push-{pid}", pid, "/nonexistent"), LoRARequest(f"disk-{did}", did, "x")
                    row["serves_alike"] = _generate(llm, pushed) == _generate(llm, disk)
                    llm.llm_engine.remove_lora(pid)
                    llm.llm_engine.remove_lora(did)
                llm.shutdown_weight_transfer_engine()
                if sender.wait(timeout) != 0:
                    raise RuntimeError(f"the bench's sender exited with {sender.returncode}")
            finally:
                if sender.poll() is None:
                    sender.kill()
            row["slot_bytes"] = [int(x) for x in llm.collective_rpc(me._slot_bytes)]
            out["sizes"].append(row)
    return out


def lora_text(r: dict[str, Any]) -> str:
    rows = [f"bench vllm --lora ({r['model']}, TP {r['tp']}, median of {r['repeats']}, interleaved; end to end: "
            "trainer tensors -> servable adapter):",
            f"  {'rank':>4} {'adapter MiB':>11} {'push s':>8} {'disk s':>8} {'push/disk':>9} "
            f"{'push MiB/worker':>16} {'lower bound':>11} {'slots hold':>10}  serves alike"]
    for x in r["sizes"]:
        push, disk = statistics.median(x["push"]), statistics.median(x["disk"])
        got = x["push_received"]
        rows.append(f"  {x['rank']:>4} {x['adapter_bytes'] / 2**20:>11.2f} {push:>8.3f} {disk:>8.3f} {push / disk:>9.2f} "
                    f"{'/'.join(f'{g / 2**20:.2f}' for g in got):>16} {x['adapter_bytes'] / 2**20:>11.2f} "
                    f"{'/'.join(f'{s / 2**20:.2f}' for s in x['slot_bytes']):>10}  "
                    f"{'yes' if x['serves_alike'] else 'NO'}")
    rows.append("  lower bound: the whole adapter per worker (vLLM keeps an unsliced CPU copy of every adapter on "
                "every rank); 'slots hold': one LoRA slot's tensor-parallel slice, padded to max_lora_rank")
    rows.append("  push s = the pull (slowest worker) + vLLM's LoRAModel build and registration + the engine's three "
                "update calls: " + "; ".join(
                    f"rank {x['rank']}: pull {statistics.median(x['pull']):.3f} s, register "
                    f"{statistics.median(x['register']):.3f} s" for x in r["sizes"]))
    return "\n".join(rows)


def lora_cli(model: str | None, ranks: str, repeats: int | None, tp: int | None) -> tuple[dict[str, Any], str]:
    """``shardstream bench vllm --lora --model DIR [--lora-ranks 8,64] [--repeats N] [--dst-tp N]``."""
    from formats.errors import UsageError

    if not model:
        raise UsageError("bench vllm --lora needs --model DIR (an HF checkpoint directory)")
    parts = ranks.split(",")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise UsageError(f"bench vllm --lora-ranks takes positive integers, comma-separated, not {ranks!r}")
    r = bench_lora(model, tuple(int(p) for p in parts), repeats or 3, tp or 1)
    return r, lora_text(r)


def _send(src: str, rdv: str, pushes: int, timeout: float) -> int:
    """The bench's trainer stand-in: push the adapter ``pushes`` times."""
    from safetensors.torch import load_file

    from streamer import RefitSession, manifest_from_state_dict

    tensors = load_file(str(Path(src) / "adapter_model.safetensors"))
    with RefitSession.open(manifest_from_state_dict(tensors, name="bench-lora"), "send", rendezvous=rdv,
                           timeout=timeout) as s:
        for i in range(pushes):
            s.push(tensors, version=i + 1)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--send"]:
        sys.exit(_send(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])))
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1)
    a = ap.parse_args()
    print(lora_text(bench_lora(a.model, tuple(int(x) for x in a.ranks.split(",")), a.repeats, a.tp)))
