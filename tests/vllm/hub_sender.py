"""A one-rank sender that pushes a hub checkpoint (safetensors, one name per MoE expert) once.

    python hub_sender.py MODEL_DIR RENDEZVOUS TIMEOUT [--bad] [--file NAME]

``--bad``: hand ``push`` one tensor in float16 where the manifest says bfloat16. The agreement round
refuses the push on every rank of both jobs before any byte moves; this prints the refusal and
exits 0 (1 if the push went through). ``--file NAME``: push ``MODEL_DIR/NAME`` instead of
model.safetensors (``adapter_model.safetensors``: a PEFT adapter's tensors).
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import load_file

from streamer import RefitSession, RefusedError, manifest_from_state_dict

if __name__ == "__main__":
    name = sys.argv[sys.argv.index("--file") + 1] if "--file" in sys.argv else "model.safetensors"
    weights = load_file(f"{sys.argv[1]}/{name}")
    manifest = manifest_from_state_dict(weights, name="hub-checkpoint")
    bad = "--bad" in sys.argv[4:]
    pushed = dict(weights)
    if bad:
        first = next(iter(pushed))
        pushed[first] = pushed[first].to(torch.float16)
    with RefitSession.open(manifest, "send", rendezvous=sys.argv[2], timeout=float(sys.argv[3])) as s:
        try:
            st = s.push(pushed)
        except RefusedError as e:
            print(json.dumps({"refused": str(e)}), flush=True)
            sys.exit(0 if bad else 1)
    print(json.dumps({"bytes_sent": st.bytes_sent, "arrays": len(manifest.arrays)}), flush=True)
    sys.exit(1 if bad else 0)
