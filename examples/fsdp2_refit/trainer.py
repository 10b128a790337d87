"""A TorchTitan-style FSDP2 trainer that refits a bf16 inference job after every step.

It owns its process group (gloo here; the default group), builds a ``transformers`` causal LM from
a config (its ``model_type``: Llama, Qwen3, Qwen3-MoE...; random init, nothing downloaded) with
fp32 master weights, shards it with
``fully_shard``, and trains with AdamW. After each step it pushes the module itself: DTensors
send their local shards (nothing is gathered), cast to bf16 on the way. The trainer's own
collectives run before and after every push. Adopting shardstream is the three marked lines.

    torchrun --standalone --nproc-per-node 2 trainer.py config.json RENDEZVOUS [--steps N] [--reference DIR]

``--reference DIR``: also write every parameter's ``full_tensor()`` cast to bf16 to
``DIR/ref-STEP.pt`` before each push (rank 0), so the server can check what it received.
``--save-hf DIR``: also write the same bf16 weights as an HF checkpoint, ``DIR/step-STEP/``
(``save_pretrained``: what a fresh vLLM engine loads, to compare with the one refitted).
``--delta``: a delta session (``RefitOptions(delta=True)``): the first push is full, the next ones
send each message's change since the last push (docs/refit.md, "Delta refit"). ``--link-gbps G``
states the link to the engine: on one host, without it, encoding loses to shared memory and the
session sends full bytes.
Each push carries its training step as its version (``push(model, version=step)``).
``--checkpoint DIR``: save the model and optimizer (``torch.distributed.checkpoint``) after each
step's push, and at start resume from DIR's last step (``--steps N`` still ends before step N):
a trainer restarted after a crash continues its numbering, and its first push (full) restores the receivers, which stayed up
(``server.py --stay``; docs/resilience.md). ``--crash-in-push STEP``: try that out: every rank
SIGKILLs itself right after posting its first message of step STEP's push (the push breaks off).
The receiver can be any job that joins through RENDEZVOUS: the example server, or a vLLM engine
with the ``shardstream`` weight-transfer backend (docs/vllm.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from streamer import RefitOptions, RefitSession, manifest_from_state_dict


def load_config(cfg_path: str) -> object:
    cfg = json.loads(Path(cfg_path).read_text())
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def main(cfg_path: str, rendezvous: str, steps: int, reference: str | None, transport: str = "gloo",
         save_hf: str | None = None, timeout: float = 120, delta: bool = False,
         link_gbps: float | None = None, checkpoint: str | None = None, crash_in_push: int | None = None) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = load_config(cfg_path)
    model = AutoModelForCausalLM.from_config(config).float()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = load_checkpoint(model, opt, Path(checkpoint)) if checkpoint is not None else 0
    manifest = manifest_from_state_dict(model.state_dict(), name="fsdp2-trainer")  # shardstream 1/3
    assert {a.data_type for a in manifest.arrays.values()} == {"float32"}, "fp32 masters stay float32"
    data = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with RefitSession.open(manifest, "send", rendezvous=rendezvous, transport=transport, timeout=timeout,
                           options=RefitOptions(verify=True, delta=delta, link_gbps=link_gbps)) as session:  # shardstream 2/3
        for step in range(first, steps):
            loss = model(input_ids=data, labels=data).loss
            loss.backward()  # FSDP2's own reduce-scatters on the trainer's group
            opt.step()
            opt.zero_grad()
            if reference is not None:
                write_reference(model, Path(reference), step, rank)
            if save_hf is not None:
                write_hf(model, config, Path(save_hf), step, rank)
            if step == crash_in_push:
                crash_midway(session)
            st = session.push(model, version=step)  # shardstream 3/3
            dist.all_reduce(torch.ones(1))  # the trainer's group still works after a push
            if checkpoint is not None:
                save_checkpoint(model, opt, Path(checkpoint), step, rank)
            # one write per line: ranks share torchrun's stdout, and print() may write the text and
            # its newline apart (unbuffered), which lets another rank's line land in between
            line = json.dumps({"rank": rank, "step": step, "version": st.version, "loss": float(loss), "bytes_sent": st.bytes_sent,
                               "full_bytes_sent": st.full_bytes_sent, "changed_fraction": st.changed_fraction})
            os.write(1, (line + "\n").encode())
    dist.destroy_process_group()
    return 0


def load_checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer, ckpt: Path) -> int:
    """Resume from ``ckpt``'s last step (its ``latest`` file names it): the step to run next (0: none)."""
    latest = ckpt / "latest"
    if not latest.exists():
        return 0
    step = int(latest.read_text())
    model_sd, optim_sd = get_state_dict(model, opt)  # sharded like the live model: each rank reads its shards
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt / f"step-{step}")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step + 1


def save_checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer, ckpt: Path, step: int, rank: int) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt / f"step-{step}")  # collective
    if rank == 0:  # once every rank's shards are written: ``latest`` names a whole checkpoint
        (ckpt / ".latest").write_text(str(step))
        os.replace(ckpt / ".latest", ckpt / "latest")


def crash_midway(session: RefitSession) -> None:
    """``--crash-in-push``: SIGKILL this rank right after it posts its first message of the next
    push, as a trainer that dies mid-push (the rest of its messages never leave)."""
    transport = session.transport
    assert transport is not None
    isend = transport.isend

    def posting_then_dying(buf: object, dst: int, tag: int) -> object:
        request = isend(buf, dst, tag)
        os.kill(os.getpid(), signal.SIGKILL)
        return request

    transport.isend = posting_then_dying  # type: ignore[method-assign,assignment]


def write_reference(model: torch.nn.Module, out: Path, step: int, rank: int) -> None:
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).to(torch.bfloat16)
            for k, v in model.state_dict().items()}  # collective: every rank
    if rank == 0:
        tmp = out / f".ref-{step}.pt"
        torch.save(full, tmp)
        os.replace(tmp, out / f"ref-{step}.pt")


def write_hf(model: torch.nn.Module, config: object, out: Path, step: int, rank: int) -> None:
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).to(torch.bfloat16)
            for k, v in model.state_dict().items()}  # collective: every rank
    if rank == 0:
        copy = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        copy.load_state_dict(full)
        tmp, final = out / f".step-{step}", out / f"step-{step}"
        copy.save_pretrained(tmp)  # HF checkpoint names (per-expert MoE names, as on the hub)
        os.replace(tmp, final)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("rendezvous")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--reference", metavar="DIR")
    ap.add_argument("--transport", default="gloo", help="gloo (default), or shm when both jobs share a node")
    ap.add_argument("--save-hf", metavar="DIR", help="write each step's bf16 weights as an HF checkpoint DIR/step-N")
    ap.add_argument("--timeout", type=float, default=120, help="seconds any wait may take (default 120)")
    ap.add_argument("--delta", action="store_true", help="a delta session: pushes after the first send changes only")
    ap.add_argument("--link-gbps", type=float, metavar="G", help="--delta: the link to the receiver, GB/s")
    ap.add_argument("--checkpoint", metavar="DIR", help="save model and optimizer after each push; resume from DIR's last")
    ap.add_argument("--crash-in-push", type=int, metavar="STEP", help="SIGKILL every rank midway through STEP's push")
    a = ap.parse_args()
    sys.exit(main(a.config, a.rendezvous, a.steps, a.reference, a.transport, a.save_hf, a.timeout, a.delta,
                  a.link_gbps, a.checkpoint, a.crash_in_push))
