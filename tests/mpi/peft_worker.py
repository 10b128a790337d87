"""Both jobs of test_peft_adapter.py, under torchrun (2 ranks each, gloo).

    torchrun ... peft_worker.py trainer RENDEZVOUS OUT_DIR
    torchrun ... peft_worker.py receiver RENDEZVOUS OUT_DIR

trainer: a tiny Qwen3 (transformers, from a config) wrapped by PEFT (LoRA rank 8 on q/k/v/o and
gate/up/down, B drawn non-zero so that the adapter matters), every layer and the model sharded
with ``fully_shard``. Its LoRA tensors (fp32 DTensors, ``lora_A`` split along the rank dim) go
through ``adapter_names`` and ``manifest_from_state_dict`` and are pushed as version 1, then, after
one AdamW step on a next-token loss, as version 2. Rank 0 writes what PEFT itself would save
(``get_peft_model_state_dict`` of the gathered tensors) to OUT_DIR/expected-V.pt. receiver: an engine stand-in whose every rank holds the whole adapter (the
manifest ``replicated`` builds from the trainer's, as vLLM's adapter session does); each rank
writes what it received to OUT_DIR/received-RANK-V.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def trainer(rdv: str, out: Path) -> None:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM, Qwen3Config

    from streamer import RefitSession, manifest_from_state_dict
    from streamer.vllm.lora import adapter_names

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg),
                           LoraConfig(r=8, lora_alpha=12, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # PEFT starts B at zero: the adapter would change nothing
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    def expected(version: int) -> dict[str, Any]:
        """The adapter's tensors as the push sends them, and (rank 0) what PEFT saves for them."""
        adapter = adapter_names(model.state_dict())
        assert adapter and all(isinstance(t, DTensor) for t in adapter.values())
        full = {k: t.full_tensor() for k, t in adapter.items()}  # the reference only: the push gathers nothing
        if dist.get_rank() == 0:
            # what PEFT saves for this model: the names vLLM loads from an adapter directory
            saved = get_peft_model_state_dict(model, state_dict={k.replace(".weight", ".default.weight"): v
                                                                 for k, v in full.items()})
            torch.save({k: v.clone() for k, v in saved.items()}, out / f"expected-{version}.pt")
        return adapter

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    adapter = expected(1)
    with RefitSession.open(manifest_from_state_dict(adapter, name="adapter"), "send", rendezvous=rdv,
                           timeout=120) as s:
        s.push(adapter, version=1)
        tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
        model(input_ids=tokens, labels=tokens).loss.backward()  # one real step: every A and B moves
        opt.step()
        s.push(expected(2), version=2)


def receiver(rdv: str, out: Path) -> None:
    from formats.manifest.spec import Manifest
    from streamer import RefitSession
    from streamer.vllm.lora import replicated

    size = dist.get_world_size()
    chosen: list[Manifest] = []

    def choose(src: Manifest) -> Manifest:
        chosen.append(replicated(src, size))
        return chosen[-1]

    with RefitSession.open(Manifest(world_size=size, arrays={}), "recv", rendezvous=rdv, timeout=120,
                           choose_manifest=choose) as s:
        bufs = {n: torch.empty(a.shape, dtype=getattr(torch, a.data_type)) for n, a in chosen[-1].arrays.items()}
        for version in (1, 2):
            st = s.pull(bufs)
            assert st is not None and st.version == version
            torch.save({k: v.clone() for k, v in bufs.items()}, out / f"received-{dist.get_rank()}-{version}.pt")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    role, rdv, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    (trainer if role == "trainer" else receiver)(rdv, out)
    dist.destroy_process_group()
