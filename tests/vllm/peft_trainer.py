"""A LoRA RL trainer as RL teams run one: PEFT under FSDP2 (torchrun, 2 ranks, gloo), pushing its
adapter to a vLLM engine after each optimizer step, and dying in the middle of its third push.

    torchrun --standalone --nproc-per-node 2 peft_trainer.py MODEL_DIR RENDEZVOUS OUT_DIR TIMEOUT

The model is the checkpoint the engine serves (transformers), wrapped by PEFT (LoRA rank 8,
``lora_alpha`` 12, on q/k/v/o and gate/up/down; B drawn non-zero so that version 1 already
matters), every layer and the model sharded with ``fully_shard``: the LoRA tensors are fp32
DTensors, ``lora_A`` split along its rank dim. Each version is one AdamW step on a next-token loss,
then a push of ``adapter_names(model.state_dict())`` (the local shards: nothing is gathered for
the push). For reference only, before each push, the ranks gather the adapter and rank 0 writes
it as a PEFT directory ``OUT_DIR/v{N}`` (what ``save_pretrained`` writes, in fp32), which the
engine then loads from disk to compare. Version 3's push SIGKILLs rank 0 right after it posts its
first message, so the engine receives part of it; torchrun then ends rank 1. One JSON line per
finished push on stdout (rank 0).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from matrix_trainer import crash_midway  # this directory is on sys.path: the script's own

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIG = {"r": 8, "lora_alpha": 12, "target_modules": TARGETS}


def save_reference(model: Any, out: Path) -> None:
    """Rank 0 writes the adapter as PEFT saves it (gathered here, for the test's reference only)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    from streamer.vllm.lora import adapter_names

    full = {k: t.full_tensor() for k, t in adapter_names(model.state_dict()).items()}  # collective: both ranks
    if dist.get_rank() != 0:
        return
    saved = get_peft_model_state_dict(model, state_dict={k.replace(".weight", ".default.weight"): v
                                                         for k, v in full.items()})
    assert set(saved) == set(full), "PEFT would save other names than the push sends"
    tmp = out.with_name(f".{out.name}")
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in saved.items()}, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps({**CONFIG, "bias": "none", "peft_type": "LORA",
                                                         "task_type": "CAUSAL_LM", "use_rslora": False}))
    os.replace(tmp, out)


def main(model_dir: str, rdv: str, out: Path, timeout: float) -> None:
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from streamer import RefitSession, manifest_from_state_dict
    from streamer.vllm.lora import adapter_names

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(**CONFIG, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # PEFT starts B at zero
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    vocab = model.config.vocab_size
    adapter = adapter_names(model.state_dict())
    assert adapter and all(isinstance(t, DTensor) for t in adapter.values())
    with RefitSession.open(manifest_from_state_dict(adapter, name="peft-fsdp2"), "send", rendezvous=rdv,
                           timeout=timeout) as session:
        for version in (1, 2, 3):
            tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(version))
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad()
            if version < 3:
                save_reference(model, out / f"v{version}")
            elif dist.get_rank() == 0:
                crash_midway(session)  # SIGKILL right after posting its first message
            st = session.push(adapter_names(model.state_dict()), version=version)
            if dist.get_rank() == 0:
                os.write(1, (json.dumps({"version": st.version, "bytes_sent": st.bytes_sent}) + "\n").encode())


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), float(sys.argv[4]))
    dist.destroy_process_group()
