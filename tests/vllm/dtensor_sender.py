"""A checkpoint pushed once by a torchrun job, every 2-D weight as a DTensor sharded by rows.

    torchrun --standalone --nproc-per-node N dtensor_sender.py MODEL_DIR RENDEZVOUS TIMEOUT

Each rank holds ``Shard(0)`` of every 2-D tensor (uneven when N does not divide the rows) and the
rest whole. With N = 3 the row shards of the tiny models cut their 32-row FP8 blocks, so a block-FP8
engine quantizes on the receivers (docs/refit.md, "Quantize on refit"). The values are the
checkpoint's bf16, so the reference is the checkpoint's own quantization.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from streamer import RefitSession, manifest_from_state_dict

if __name__ == "__main__":
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    weights = load_file(f"{sys.argv[1]}/model.safetensors")
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) if v.dim() == 2 else v for k, v in weights.items()}
    manifest = manifest_from_state_dict(state, name="dtensor-sender")
    with RefitSession.open(manifest, "send", rendezvous=sys.argv[2], timeout=float(sys.argv[3])) as s:
        st = s.push(state)
    line = json.dumps({"rank": dist.get_rank(), "bytes_sent": st.bytes_sent})
    os.write(1, (line + "\n").encode())
    dist.destroy_process_group()
    sys.exit(0)
