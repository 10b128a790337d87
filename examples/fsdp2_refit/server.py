"""A bf16 inference job that receives the FSDP2 trainer's weights (``mpiexec`` or ``torchrun``).

Its local tensors are laid out by the vLLM preset (fused ``qkv_proj`` / ``gate_up_proj``, padded
vocab) and written in place by each pull. To show that what arrived is right, after each pull it
rebuilds every HF array from its ranks' chunks and runs a bf16 ``transformers`` model on them;
with ``--reference DIR`` (the trainer's) it also compares the weights bit for bit with the
trainer's ``full_tensor()`` cast to bf16 of the version received (``ref-VERSION.pt``), and the
logits of the two models. Rank 0 prints one JSON line per push.

``--stay``: serve on across a trainer that dies (docs/resilience.md): a push that breaks off
raises ``PushFailed``; every rank prints a line with the version its weights still hold
(``held``: None after a broken full push, the previous one after a broken delta push) and, with
``--reference``, whether they equal that version's reference bit for bit, then waits for the next
push, from a restarted trainer. It pulls until the trainer closes the session (``--steps`` then
does not end it). ``--timeout S`` (default 120) bounds every wait, the one for the next push
included: a trainer that takes longer (a step, or a restart that loads its checkpoint) ends the
server with ``PeerTimeoutError``; give it more than the trainer's ``--timeout`` and its step.

    mpiexec -n 2 python server.py config.json serve.json RENDEZVOUS [--steps N] [--reference DIR] [--stay] [--timeout S]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from formats.manifest.dtypes import np_storage
from formats.manifest.wire import Manifest, load_manifest
from streamer import PushFailed, RefitSession
from streamer.refit.persist import alloc_local


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
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # a tied lm_head is the embedding itself: the manifest lists the weight once
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert not unexpected and set(missing) <= tied, (missing, unexpected)
    with torch.no_grad():
        return model(input_ids=ids).logits


def main(cfg_path: str, manifest: str, rendezvous: str, steps: int, reference: str | None,
         transport: str = "gloo", stay: bool = False, timeout: float = 120) -> int:
    config = LlamaConfig(**json.loads(Path(cfg_path).read_text()))
    m = load_manifest(manifest)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with RefitSession.open(m, "recv", rendezvous=rendezvous, control="store", transport=transport,
                           timeout=timeout) as session:
        rank = session.local_rank
        tensors = alloc_local(m, rank)  # the engine's weight buffers, updated in place
        before = None
        step = 0
        while stay or step < steps:
            try:
                st = session.pull(tensors)
            except PushFailed as e:
                if not stay:
                    raise
                held = session.version  # what the weights still hold; keep serving it
                failed: dict[str, object] = {"event": "failed", "rank": rank, "version": e.version, "held": held,
                                             "reason": e.reason}
                if reference is not None and held is not None:
                    failed["holds_reference"] = holds(m, rank, tensors, wait_reference(Path(reference) / f"ref-{held}.pt"))
                os.write(1, (json.dumps(failed) + "\n").encode())  # one write: the ranks share stdout
                continue
            if st is None:  # the trainer closed the session
                break
            got = assemble(m, rank, tensors, session.group.role_control)
            out: dict[str, object] = {"step": step, "version": st.version, "arrays": len(got)}
            a = logits(config, got, ids)
            out["logits_finite"] = bool(torch.isfinite(a.float()).all())
            if reference is not None:
                ref = wait_reference(Path(reference) / f"ref-{st.version}.pt")
                out["same_weights"] = sum(torch.equal(ref[k].view(torch.int16), got[k].view(torch.int16)) for k in got)
                b = logits(config, ref, ids)
                out["logits_equal"] = bool(torch.equal(a, b))
                out["max_abs_diff"] = float((a.float() - b.float()).abs().max())
            out["arrays_changed_since_last"] = None if before is None else sum(
                not torch.equal(before[k], got[k]) for k in got)
            out["wire_bytes"], out["full_bytes"] = st.bytes_received, st.full_bytes_received  # this rank's
            before = got
            step += 1
            if rank == 0:
                print(json.dumps(out), flush=True)
    return 0


def holds(m: Manifest, rank: int, tensors: dict[str, np.ndarray], ref: dict[str, torch.Tensor]) -> bool:
    """Whether this rank's own weights equal ``ref`` (the trainer's bf16 weights) bit for bit."""
    for fqn, a in m.arrays.items():
        want = ref[fqn].view(torch.int16).numpy()
        for c in a.chunks:
            if rank in c.holders:
                mine = tensors[c.tensor(fqn)][c.local_box.slices]
                if not np.array_equal(mine.view(np.int16), want[c.region.slices]):
                    return False
    return True


def wait_reference(path: Path, timeout: float = 60) -> dict[str, torch.Tensor]:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return dict(torch.load(path))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("manifest")
    ap.add_argument("rendezvous")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--reference", metavar="DIR")
    ap.add_argument("--transport", default="gloo", help="gloo (default), or shm when both jobs share a node")
    ap.add_argument("--stay", action="store_true", help="outlive failed pushes; pull until the trainer closes")
    ap.add_argument("--timeout", type=float, default=120,
                    help="seconds any wait may take, the next push's included (default 120)")
    a = ap.parse_args()
    sys.exit(main(a.config, a.manifest, a.rendezvous, a.steps, a.reference, a.transport, a.stay, a.timeout))
