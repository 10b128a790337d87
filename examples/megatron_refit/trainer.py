"""A megatron-core trainer that refits an inference job after every step (NeMo RL's ``nccl_reshard``
scenario): a GPTModel at TP × PP (× EP for MoE) trains and pushes its own parameters, as they are.

    torchrun --standalone --nproc-per-node N trainer.py config.json RENDEZVOUS [--tp T] [--pp P] [--ep E]
        [--steps S] [--fp32] [--vocab-from-receivers]

Every rank builds the GPTModel of the HF ``config.json`` (gpt.py; llama, qwen3 or qwen3_moe; random
init, nothing downloaded) on its pipeline stage, with megatron-core's own parallel state. At
pp = 1 each step is a real one: Megatron's forward and its vocab-parallel cross entropy on seeded
tokens, backward, AdamW. (A pipelined trainer runs Megatron's schedules here; this example keeps
to one stage there and takes an AdamW step on seeded gradients, which is all a refit sees.) After
each step, ``session.push(model, version=step)`` sends every rank's parameters straight into the
receivers' layout: ``linear_qkv`` de-interleaved into q/k/v, ``linear_fc1`` split into gate/up, the
vocabulary padding left behind; nothing is gathered. bf16 parameters travel as they are; with
``--fp32`` the fp32 parameters are cast to the receivers' dtype on the way. The receiver is any job
that joins through RENDEZVOUS: a vLLM engine with the ``shardstream`` backend (docs/vllm.md) or
``shardstream refit recv`` (docs/megatron.md). Adopting shardstream is the three marked lines.
One JSON line per push and rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import build, setup  # noqa: E402

from streamer import RefitOptions, RefitSession, manifest_from_megatron  # noqa: E402


def train_step(model: Any, opt: torch.optim.Optimizer, data: torch.Tensor, pp: int, step: int) -> float:
    if pp == 1:
        s = data.shape[1]
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
        # GPTModel with labels returns the per-token loss (vocab-parallel cross entropy over TP ranks)
        loss = model(data[:, :-1], torch.arange(s - 1).unsqueeze(0), mask[..., :-1, :-1], labels=data[:, 1:]).mean()
        loss.backward()
    else:
        loss = torch.zeros(())
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():  # the same on every replica of a parameter: seeded by step only
            p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype)
    opt.step()
    opt.zero_grad()
    return float(loss)


def main(a: argparse.Namespace) -> None:
    hf = json.loads(Path(a.config).read_text())
    setup(a.tp, a.pp, a.ep)
    model = build(hf, fp32=a.fp32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = None if a.vocab_from_receivers else hf["vocab_size"]
    manifest = manifest_from_megatron(model, vocab_size=vocab)  # shardstream 1/3
    data = torch.randint(0, hf["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(1))
    rank = dist.get_rank()
    with RefitSession.open(manifest, "send", rendezvous=a.rendezvous, timeout=a.timeout,
                           options=RefitOptions(verify=True)) as session:  # shardstream 2/3
        for step in range(a.steps):
            loss = train_step(model, opt, data, a.pp, step)
            st = session.push(model, version=step)  # shardstream 3/3
            line = {"rank": rank, "step": step, "loss": loss, "bytes_sent": st.bytes_sent, "seconds": st.seconds}
            os.write(1, (json.dumps(line) + "\n").encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("rendezvous")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--fp32", action="store_true", help="fp32 parameters (cast to the receivers' dtype on the way)")
    p.add_argument("--vocab-from-receivers", action="store_true",
                   help="leave the unpadded vocabulary size to the receivers' manifest")
    p.add_argument("--timeout", type=float, default=300)
    main(p.parse_args())
