"""The coverage matrix's trainer: one process that trains and pushes each architecture in turn.

    python matrix_trainer.py JOB.json

JOB: ``{"timeout": S, "cases": [{"name": ..., "initial": DIR, "rendezvous": PATH, "save_hf": DIR,
"steps": N}, ...]}``. Per case: the model that transformers loads from ``initial`` (the bf16
checkpoint the engine starts from) gets fp32 masters and AdamW; each step trains on seeded random
tokens (so every tensor moves: biases, norms, tied embeddings), writes the bf16 weights as an HF
checkpoint ``save_hf/step-N`` (what a fresh engine loads) and pushes the model (cast to bf16 on the
way) with its step as the version. One line of JSON per push on stdout. Staging tests add
``"wait_before_push": {"N": PATH}`` (push step N once PATH exists) and ``"done_file": PATH``
(written once the session is closed); ``"crash_in_push": N`` (SIGKILL after posting the first
message of step N's push), ``"push_from": N`` (a restarted trainer: train the steps before N
without pushing them), ``"bucket_size": BYTES`` and ``"replicas": true`` (serve every inference
replica that joins: ``RefitSession.open(..., replicas=True)``; each push's line names, per replica,
``[version, error, joined, bytes_sent, full_bytes_sent]``), with ``"wait_replicas": {"N": [NAME,
...]}`` (push step N once these replicas were joined or wait to be). ``"delta": true`` and
``"link_gbps": G``: a delta session (``RefitOptions``). ``"pushed_dir": DIR``: write
``DIR/pushed-N`` as soon as step N's push returned (the engine's cue that it did).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def run_case(case: dict[str, Any], timeout: float) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from streamer import RefitOptions, RefitSession, manifest_from_state_dict

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(case["initial"], dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    vocab = model.config.vocab_size
    data = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))
    manifest = manifest_from_state_dict(model.state_dict(), name=f"matrix-{case['name']}")
    options = RefitOptions(verify=True, delta=bool(case.get("delta")), link_gbps=case.get("link_gbps"),
                           **({"bucket_size": case["bucket_size"]} if "bucket_size" in case else {}))
    with RefitSession.open(manifest, "send", rendezvous=case["rendezvous"], timeout=timeout,
                           options=options, replicas=bool(case.get("replicas"))) as session:
        for step in range(case["steps"]):
            loss = model(input_ids=data, labels=data).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out = Path(case["save_hf"]) / f"step-{step}"
            tmp = out.with_name(f".{out.name}")
            copy = AutoModelForCausalLM.from_config(model.config).to(torch.bfloat16)
            copy.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
            copy.save_pretrained(tmp)  # HF names; tied weights once; the fp32 masters untouched
            os.replace(tmp, out)
            wait = case.get("wait_before_push", {}).get(str(step))
            while wait and not Path(wait).exists():  # the engine's go-ahead (staging tests)
                time.sleep(0.05)
            names = case.get("wait_replicas", {}).get(str(step))
            if names:  # an engine joining mid-run: its staging process entered the registry
                session.await_replicas(names)
            if step < case.get("push_from", 0):
                continue  # a restarted trainer: this step was pushed by the one before it
            if step == case.get("crash_in_push"):
                crash_midway(session)
            st = session.push(model, version=step)
            line = json.dumps({"case": case["name"], "step": step, "loss": float(loss), "bytes_sent": st.bytes_sent,
                               "pushed": time.time(),
                               "replicas": {r.name: [r.version, r.error, r.joined, r.bytes_sent, r.full_bytes_sent]
                                            for r in st.replicas}})
            os.write(1, (line + "\n").encode())
            if case.get("pushed_dir"):
                Path(case["pushed_dir"], f"pushed-{step}").write_text("")
    if case.get("done_file"):  # the session is closed: every push returned
        Path(case["done_file"]).write_text("")


def crash_midway(session: Any) -> None:
    """SIGKILL this process right after it posts the push's first message: a trainer that dies
    half-way through a push (its other messages never leave)."""
    import signal

    isend = session.transport.isend

    def posting_then_dying(buf: object, dst: int, tag: int) -> object:
        request = isend(buf, dst, tag)
        os.kill(os.getpid(), signal.SIGKILL)
        return request

    session.transport.isend = posting_then_dying


if __name__ == "__main__":
    job = json.loads(Path(sys.argv[1]).read_text())
    for case in job["cases"]:
        run_case(case, float(job["timeout"]))
