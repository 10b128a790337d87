"""A one-rank sender that pushes a hub checkpoint (safetensors, one name per MoE expert) once.

    python hub_sender.py MODEL_DIR RENDEZVOUS TIMEOUT
"""

from __future__ import annotations

import sys

from safetensors.torch import load_file

from streamer import RefitSession, manifest_from_state_dict

if __name__ == "__main__":
    weights = load_file(f"{sys.argv[1]}/model.safetensors")
    manifest = manifest_from_state_dict(weights, name="hub-checkpoint")
    with RefitSession.open(manifest, "send", rendezvous=sys.argv[2], timeout=float(sys.argv[3])) as s:
        st = s.push(weights)
    print(f'{{"bytes_sent": {st.bytes_sent}, "arrays": {len(manifest.arrays)}}}', flush=True)
