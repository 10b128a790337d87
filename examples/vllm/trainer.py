"""An FSDP2 trainer that refits a running ``vllm serve`` after every step, through vLLM's own
trainer-side API with the ``shardstream`` backend picked by name.

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "shardstream"}' &
    torchrun --nproc-per-node 2 trainer.py --url http://127.0.0.1:8000 --model MODEL --rendezvous refit.rdv

(``serve.sh`` next to this file starts the engine.) Every rank loads MODEL's config and weights with
``transformers`` (fp32 masters), shards each layer with ``fully_shard``, loads vLLM's plugins (that
registers shardstream's trainer side), and builds the trainer engine with
``WeightTransferTrainerFactory.trainer_init``. Rank 0 drives the server through vLLM's HTTP client:
``trainer_init`` asks the server to join (``/init_weight_transfer_engine``) on a thread while the
ranks open the session, because each waits for the other; each ``send_weights(version=step)``
opens the update, runs ``/update_weights`` on a thread while every rank pushes its own shards (the
two block on each other: the engine pulls what the trainer pushes), then finishes the update
naming the step as ``weight_version``. Nothing is gathered: each rank sends its DTensor shards,
cast to the server's dtype on the way.

The training step is a toy (next-token loss on random tokens): the point is the refit. Both
environments need shardstream installed (``pip install shardstream``; the engine's vLLM 0.32).
tests/vllm/test_vllm_serve.py runs this trainer's pieces against a real ``vllm serve``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def build(model_dir: str) -> Any:
    """The model, fp32 masters, every decoder layer and the whole model sharded (FSDP2)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def connect(url: str, rendezvous: str, model: Any, *, timeout: float = 300, verify: bool = False) -> Any:
    """The trainer engine of the ``shardstream`` backend, joined with the server (every rank)."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from streamer.vllm.trainer import ShardstreamTrainerInitInfo

    load_general_plugins()  # registers shardstream's trainer engine under its name
    info = ShardstreamTrainerInitInfo(rendezvous=rendezvous, timeout=timeout, verify=verify, rank=dist.get_rank())
    return WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(url, timeout=timeout),
                                                     source=ModuleSource(model))


def train_step(model: Any, opt: Any, vocab: int) -> float:
    tokens = torch.randint(0, vocab, (2, 16))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="the vllm serve base URL")
    ap.add_argument("--model", required=True, help="the checkpoint directory the server was started from")
    ap.add_argument("--rendezvous", required=True, help="a file both jobs see, or tcp://HOST:PORT")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("gloo")  # the trainer's own group; shardstream builds its own
    model = build(args.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = connect(args.url, args.rendezvous, model)
    for step in range(1, args.steps + 1):
        loss = train_step(model, opt, model.config.vocab_size)
        engine.send_weights(version=step)  # the server serves this step's weights when it returns
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss:.3f}, the server now serves weight_version {engine.version}", flush=True)
    engine.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
