"""The bf16 TP=2 inference side of the FSDP2 refit test (run under ``mpiexec`` or ``torchrun``).

Its local tensors are laid out by the vLLM preset (fused ``qkv_proj`` / ``gate_up_proj``, vocab
padded). After each pull it rebuilds every HF array from its ranks' chunks, compares them bit for
bit with the trainer's ``full_tensor()`` cast to bf16, and compares the logits of a bf16 model
loaded from each. Rank 0 prints one JSON line per step.

    fsdp_refit_server.py CONFIG MANIFEST RENDEZVOUS OUT STEPS
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from formats.dtypes import np_storage
from formats.manifest import Manifest, load_manifest
from streamer import RefitSession
from streamer.persist import alloc_local


def assemble(m: Manifest, rank: int, tensors: dict[str, np.ndarray], role: object) -> dict[str, torch.Tensor]:
    """Every array whole, from the chunks each rank holds (first holder only), over the job's plane."""
    parts = []
    for fqn, a in m.arrays.items():
        full = np.zeros(a.shape, dtype=np_storage(a.dtype))
        for c in a.chunks:
            if c.holders[0] == rank:
                full[c.region.slices] = tensors[c.tensor(fqn)][c.local_box.slices]
        parts.append(full.reshape(-1).view(np.uint8))
    mine = np.concatenate(parts).tobytes()
    every = [np.frombuffer(b, dtype=np.uint8) for b in role.allgather_bytes(mine, 60)]  # type: ignore[attr-defined]
    merged = np.bitwise_or.reduce(np.stack(every), axis=0)  # regions are disjoint: OR puts them together
    out = {}
    off = 0
    for fqn, a in m.arrays.items():
        n = a.nbytes
        raw = torch.from_numpy(merged[off:off + n].copy())
        out[fqn] = raw.view(torch.bfloat16).reshape(a.shape)
        off += n
    return out


def logits(config: LlamaConfig, weights: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        return model(input_ids=ids).logits


def main(cfg_path: str, manifest: str, rendezvous: str, out: str, steps: int) -> int:
    config = LlamaConfig(**json.loads(Path(cfg_path).read_text()))
    m = load_manifest(manifest)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with RefitSession.open(m, "recv", rendezvous=rendezvous, control="store", transport="gloo",
                           timeout=120) as session:
        rank = session.local_rank
        tensors = alloc_local(m, rank)
        before = None
        for step in range(steps):
            session.pull(tensors)
            got = assemble(m, rank, tensors, session.group.role_control)
            ref_path = Path(out) / f"ref-{step}.pt"
            deadline = time.monotonic() + 60
            while not ref_path.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            ref = torch.load(ref_path)
            same_weights = sorted(k for k in ref if torch.equal(ref[k].view(torch.int16), got[k].view(torch.int16)))
            a, b = logits(config, got, ids), logits(config, ref, ids)
            changed = None if before is None else sum(not torch.equal(before[k], got[k]) for k in got)
            before = got
            if rank == 0:
                print(json.dumps({"step": step, "arrays": len(got), "same_weights": len(same_weights),
                                  "logits_equal": bool(torch.equal(a, b)),
                                  "max_abs_diff": float((a.float() - b.float()).abs().max()),
                                  "arrays_changed_since_last": changed}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
