"""``bench vllm --source megatron``: the bench's sender as a live megatron-core trainer.

    torchrun --nproc-per-node N -m streamer.vllm.bench_megatron MODEL_DIR RDV PUSHES TIMEOUT TP PP OUT.json

Every rank builds the checkpoint's model as a megatron-core GPTModel (examples/megatron_refit/gpt.py:
a source checkout's example, with the CPU patches where there is no CUDA) at TP × PP, loads the
checkpoint's tensors into its own parameters through the manifest ``manifest_from_megatron``
describes (each chunk's region of the HF tensor into its place in the local parameter: the same
weights, so the engine must serve what its first load served), then pushes them ``PUSHES`` times.
Rank 0 writes each push's time (the slowest rank's) and the bytes every rank sent to ``OUT.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["example_dir", "load_into", "main"]


def example_dir() -> Path:
    """examples/megatron_refit of the checkout this package runs from."""
    from formats.errors import UsageError

    d = Path(__file__).resolve().parents[2] / "examples" / "megatron_refit"
    if not (d / "gpt.py").is_file():
        raise UsageError(f"bench vllm --source megatron builds its model with {d / 'gpt.py'}, which this install "
                         "lacks: run it from a source checkout")
    return d


def load_into(manifest: Any, local: dict[str, Any], weights: dict[str, Any], rank: int) -> int:
    """Write each HF tensor's regions that ``rank`` holds into its local tensors; returns how many."""
    n = 0
    for fqn, spec in manifest.arrays.items():
        w = weights[fqn]
        for c in spec.chunks:
            if rank in c.holders:
                local[c.tensor(fqn)][c.local_box.slices].copy_(w[c.region.slices])
                n += 1
    return n


def main(model_dir: str, rdv: str, pushes: int, timeout: float, tp: int, pp: int, out: str) -> int:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from streamer import RefitSession, manifest_from_megatron
    from streamer.refit.megatron import megatron_tensors

    sys.path.insert(0, str(example_dir()))
    from gpt import build, setup  # type: ignore[import-not-found]

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    setup(tp, pp)
    model = build(hf, fp32=False)
    manifest = manifest_from_megatron(model, vocab_size=hf["vocab_size"])
    weights: dict[str, Any] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update(load_file(f))
    with torch.no_grad():
        load_into(manifest, megatron_tensors(model), weights, dist.get_rank())
    seconds: list[float] = []
    sent = 0
    with RefitSession.open(manifest, "send", rendezvous=rdv, timeout=timeout) as s:
        for _ in range(pushes):
            st = s.push(model)
            slowest = torch.tensor([st.seconds], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            seconds.append(float(slowest))
            sent = st.bytes_sent
    total = torch.tensor([sent], dtype=torch.int64)
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"push_seconds": seconds, "bytes_sent_per_push": int(total), "tp": tp,
                                         "pp": pp, "ranks": dist.get_world_size()}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(main(a[0], a[1], int(a[2]), float(a[3]), int(a[4]), int(a[5]), a[6]))
