"""An FSDP2 trainer that feeds ``vllm serve`` through vLLM's own trainer-side API, picking the
``shardstream`` backend by name (streamer/vllm/trainer.py): the model and the connection are
examples/vllm/trainer.py's own ``build`` and ``connect``.

    torchrun --nproc-per-node 2 backend_trainer.py URL RENDEZVOUS MODEL_A MODEL_B DIR

Every rank builds the model from MODEL_A's checkpoint (fp32 masters), shards it with
``fully_shard``, loads vLLM's plugins and calls ``WeightTransferTrainerFactory.trainer_init(
ShardstreamTrainerInitInfo(...), client=HTTPVLLMWeightSyncClient(URL), source=ModuleSource(model))``.
Then ``send_weights()`` pushes A; rank 0 writes ``DIR/sent-1`` (the pushed version) and waits for
``DIR/go-2``; the model then takes MODEL_B's weights and ``send_weights()`` pushes B
(``DIR/sent-2``). ``DTensor.full_tensor`` is counted throughout: nothing may gather.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "vllm"))
from trainer import build, connect  # noqa: E402  # the example's pieces, tested here

GATHERS = [0]
_full_tensor = DTensor.full_tensor


def counted_full_tensor(self: DTensor, *args: object, **kwargs: object) -> torch.Tensor:
    GATHERS[0] += 1
    return _full_tensor(self, *args, **kwargs)  # type: ignore[arg-type]


def load_weights(model: torch.nn.Module, ckpt: str) -> None:
    """Every parameter takes the checkpoint's value (cast to fp32), sharded as it is."""
    weights = load_file(f"{ckpt}/model.safetensors")
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = weights[name].float()
            p.copy_(distribute_tensor(w, p.device_mesh, p.placements) if isinstance(p, DTensor) else w)


def main(url: str, rdv: str, model_a: str, model_b: str, out: Path) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(model_a)
    DTensor.full_tensor = counted_full_tensor  # type: ignore[method-assign]
    engine = connect(url, rdv, model, timeout=240, verify=True)
    engine.send_weights()
    report(out, 1, engine.version, rank)
    if rank == 0:
        deadline = time.monotonic() + 240
        while not (out / "go-2").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("no go-2 from the test")
            time.sleep(0.2)
    dist.barrier()
    DTensor.full_tensor = _full_tensor  # type: ignore[method-assign]  # loading B may gather; pushing may not
    load_weights(model, model_b)
    gathered = GATHERS[0]
    DTensor.full_tensor = counted_full_tensor  # type: ignore[method-assign]
    engine.send_weights()
    assert GATHERS[0] == gathered
    report(out, 2, engine.version, rank)
    engine.shutdown()
    dist.destroy_process_group()
    return 0


def report(out: Path, n: int, version: int | None, rank: int) -> None:
    if rank == 0:
        tmp = out / f".sent-{n}"
        tmp.write_text(json.dumps({"version": version, "gathers": GATHERS[0]}))
        os.replace(tmp, out / f"sent-{n}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], Path(sys.argv[5])))
