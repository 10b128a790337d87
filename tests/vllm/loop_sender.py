"""A one-rank trainer stand-in that pushes hub checkpoints as numbered versions, each once a file
says so.

    python loop_sender.py JOB.json

JOB: ``{"rendezvous": R, "timeout": S, "pushes": [{"model": DIR, "version": N, "wait": PATH}, ...]}``,
optionally ``"delta": true`` and ``"link_gbps": G`` (``RefitOptions``: G makes a one-host link
count as slow, so that changes are encoded).
Joins the session at once (one line of JSON: ``joined``), then per push: waits for ``wait`` to exist, pushes ``DIR``'s
safetensors as version ``N``, and prints one line of JSON (``pushed``: the wall-clock time the
push returned; ``encodings``: its delta messages per encoding, empty for full bytes). ``"stop": PATH``: once PATH exists, exit instead of waiting for the next push.
``"replicas": [NAME, ...]``: serve named replicas (``replicas=True``), once all of them wait; each
push's line then says what each received (``replicas``: name -> [version, error]).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from streamer import RefitOptions, RefitSession, manifest_from_state_dict

if __name__ == "__main__":
    job = json.loads(Path(sys.argv[1]).read_text())
    pushes = job["pushes"]
    first = load_file(f"{pushes[0]['model']}/model.safetensors")
    manifest = manifest_from_state_dict(first, name="loop-checkpoint")
    options = RefitOptions(delta=bool(job.get("delta")), link_gbps=job.get("link_gbps"))
    names = job.get("replicas", [])
    with RefitSession.open(manifest, "send", rendezvous=job["rendezvous"], timeout=float(job["timeout"]),
                           options=options, replicas=bool(names)) as s:
        if names:
            s.await_replicas(names)
        os.write(1, (json.dumps({"joined": time.time()}) + "\n").encode())
        for p in pushes:
            while not Path(p["wait"]).exists():
                if job.get("stop") and Path(job["stop"]).exists():
                    sys.exit(0)  # the pushes left are not wanted
                time.sleep(0.02)
            t0 = time.time()
            st = s.push(load_file(f"{p['model']}/model.safetensors"), version=int(p["version"]))
            line = {"version": st.version, "bytes_sent": st.bytes_sent, "started": t0, "pushed": time.time(),
                    "encodings": st.encodings, "replicas": {r.name: [r.version, r.error] for r in st.replicas}}
            os.write(1, (json.dumps(line) + "\n").encode())
