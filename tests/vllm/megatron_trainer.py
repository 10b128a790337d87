"""A megatron-core trainer that refits another job every step: the seed's own scenario.

    torchrun --nproc-per-node N megatron_trainer.py JOB.json

JOB: ``{"hf": CONFIG, "tp": T, "pp": P, "ep": E, "vpp": V|null, "fp32": bool, "wrap": bool,
"steps": N, "rendezvous": PATH, "timeout": S, "out": DIR, "tokens": [[ids]], "vocab": V|null}``
(``vocab``: ``manifest_from_megatron``'s ``vocab_size``, default the config's; null: the receivers'). Every rank builds
the GPTModel of the HF config ``CONFIG`` (mcore.py; ``wrap``: inside megatron-core's
``Float16Module``, as a bf16 trainer holds it), describes it with ``manifest_from_megatron`` and
opens the sending side. Per step: one Adam step on seeded gradients; rank 0 writes the oracle,
``ddp``: inside megatron-core's ``DistributedDataParallel`` (its parameters then live in its
contiguous buffers). ``DIR/step-N`` (an HF checkpoint in bf16; its float32 tensors in ``DIR/step-N-fp32.safetensors``, gathered and converted by
hand in mcore.py, not by shardstream), plus Megatron's own forward of ``tokens`` (pp = 1:
``megatron-logits.npy``); then ``session.push(model, version=N)``. One JSON line per push and rank.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mcore  # noqa: E402


def write_oracle(hf: dict[str, Any], tensors: dict[str, Any], out: Path, logits: Any) -> None:
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    tmp = out.with_name(f".{out.name}")
    tmp.mkdir(parents=True)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    fields = {k: v for k, v in hf.items() if k != "model_type"}
    cfg = AutoConfig.for_model(hf["model_type"], **fields, torch_dtype="bfloat16")
    cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf["model_type"]]]
    cfg.save_pretrained(tmp)
    t32 = {k: torch.from_numpy(v) for k, v in tensors.items()}
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in t32.items()}, str(tmp / "model.safetensors"))
    # beside the checkpoint, not in it: an engine loads every *.safetensors of its directory
    save_file(t32, str(out.with_name(f"{out.name}-fp32.safetensors")))
    if logits is not None:
        np.save(tmp / "megatron-logits.npy", logits)
    os.replace(tmp, out)


def main(job: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from streamer import RefitOptions, RefitSession, manifest_from_megatron

    hf = job["hf"]
    mcore.setup(job["tp"], job["pp"], job.get("ep", 1), job.get("vpp"))
    model = mcore.build(hf, fp32=job["fp32"], vpp=job.get("vpp"))
    chunks = model if isinstance(model, list) else [model]
    if job.get("wrap"):
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(c.config, c) for c in chunks]
        model = chunks if isinstance(model, list) else chunks[0]
    if job.get("ddp"):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        chunks = [DistributedDataParallel(c.config, DistributedDataParallelConfig(), c) for c in chunks]
        model = chunks if isinstance(model, list) else chunks[0]
    bare = [c.module if hasattr(c, "module") else c for c in chunks]
    opt = torch.optim.Adam([p for c in bare for p in c.parameters()], lr=1e-2)
    # "vocab": null leaves the vocabulary to the receivers' manifest; a number overrides the config's
    manifest = manifest_from_megatron(model, vocab_size=job.get("vocab", hf["vocab_size"]))
    rank = dist.get_rank()
    with RefitSession.open(manifest, "send", rendezvous=job["rendezvous"], timeout=job["timeout"],
                           options=RefitOptions(verify=True)) as session:
        for step in range(job["steps"]):
            mcore.optimizer_step(bare, opt, step)
            reports: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(reports, mcore.local_report(bare))
            logits = (mcore.forward_logits(bare[0], job["tokens"], hf["vocab_size"])
                      if job["pp"] == 1 and job.get("vpp") is None else None)
            if rank == 0:
                write_oracle(hf, mcore.to_hf(reports, hf), Path(job["out"]) / f"step-{step}", logits)
            st = session.push(model, version=step)
            line = {"rank": rank, "step": step, "bytes_sent": st.bytes_sent, "seconds": st.seconds}
            os.write(1, (json.dumps(line) + "\n").encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
