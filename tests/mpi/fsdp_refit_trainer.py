"""A TorchTitan-style trainer for the FSDP2 refit test (run under ``torchrun``).

It owns its process group (gloo, the default group), builds a small ``transformers`` Llama from
a config (random init, nothing downloaded) in fp32, shards it with ``fully_shard``, and trains
with AdamW. Before each push it writes the reference, every parameter's ``full_tensor()`` cast
to bf16, to ``OUT/ref-STEP.pt`` (rank 0); then it pushes the module itself into the bf16 server:
DTensors send their local shards, cast to bf16 on the way. Its own collectives run before and
after every push.

    torchrun --nproc-per-node 2 fsdp_refit_trainer.py CONFIG RENDEZVOUS OUT STEPS
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from streamer import RefitSession, manifest_from_state_dict


def main(cfg_path: str, rendezvous: str, out: str, steps: int) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = LlamaConfig(**json.loads(Path(cfg_path).read_text()))
    model = LlamaForCausalLM(config).float()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manifest = manifest_from_state_dict(model.state_dict(), name="fsdp2-trainer")
    assert {a.data_type for a in manifest.arrays.values()} == {"float32"}, "fp32 masters stay float32"
    data = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with RefitSession.open(manifest, "send", rendezvous=rendezvous, transport="gloo", timeout=120,
                           verify=True) as session:
        for step in range(steps):
            loss = model(input_ids=data, labels=data).loss
            loss.backward()  # FSDP2's own reduce-scatters on the trainer's group
            opt.step()
            opt.zero_grad()
            full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).to(torch.bfloat16)
                    for k, v in model.state_dict().items()}
            if rank == 0:
                tmp = Path(out) / f".ref-{step}.pt"
                torch.save(full, tmp)
                os.replace(tmp, Path(out) / f"ref-{step}.pt")
            dist.barrier()
            st = session.push(model)
            dist.all_reduce(torch.ones(1))  # the trainer's group still works after a push
            print(json.dumps({"rank": rank, "step": step, "loss": float(loss), "bytes_sent": st.bytes_sent}),
                  flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
