"""Refit from a real FSDP2 trainer (issue: PyTorch-native refit).

A ``torchrun`` job trains a ``transformers`` Llama (built from a config, random init) with fp32
master weights under ``fully_shard``, on its own gloo process group, for two AdamW steps. After
each step it pushes the module into a bf16 TP=2 inference job started by ``mpiexec`` whose local
tensors come from the vLLM preset (fused qkv / gate_up, padded vocab). The manifest on the
trainer side comes from ``manifest_from_state_dict``; the cast to bf16 happens on the way. After
each push the server's weights equal ``full_tensor()`` cast to bf16 bit for bit, and so do the
logits of the models built from each. A second test SIGKILLs that trainer mid-push (issue 22):
the server stays up with the last version, and the trainer resumed from its checkpoint restores it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from mpi_helpers import BIN, Background, have, ok

# find_spec, not importorskip: importing transformers at collection costs each xdist worker seconds
pytestmark = pytest.mark.skipif(not have("transformers"), reason="transformers not installed (the test extra)")
TORCHRUN = shutil.which("torchrun", path=str(BIN))
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp2_refit"


def _tied_config(tmp_path: Path) -> Path:
    """The example's model with ``tie_word_embeddings``: the weight moves once, as
    ``model.embed_tokens.weight`` (20 arrays, not 21), with no flag on either side."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(json.loads((EXAMPLE / "config.json").read_text()), tie_word_embeddings=True)))
    return cfg


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed (the torch extra)")
def test_fsdp2_trainer_refits_bf16_tp2_server_over_shm(tmp_path: Path) -> None:
    """The example as shipped (untied embeddings), over the colocated one-sided transport (both
    jobs on this node). Over gloo, tied: test_fsdp2_trainer_killed_mid_push_then_resumed."""
    cfg, transport, n_arrays = EXAMPLE / "config.json", "shm", 21
    serve = tmp_path / "serve.json"
    ok(["shardstream", "layout", "--preset", "vllm", "--model", cfg, "--mesh", "tp=2", "--dtype", "bfloat16",
        "--no-files", "-o", serve])
    rdv = tmp_path / "rdv"
    python = str(BIN / "python")
    server = Background(["mpiexec", "-n", "2", python, EXAMPLE / "server.py", cfg, serve, rdv, "--reference",
                         tmp_path, "--transport", transport], tmp_path, "server")
    try:
        deadline = time.monotonic() + 60
        while not rdv.exists() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rdv.exists(), f"the server never wrote {rdv}:\n{server.stderr[-3000:]}"
        trainer = Background([TORCHRUN, "--standalone", "--nproc-per-node", "2", EXAMPLE / "trainer.py", cfg, rdv,
                              "--reference", tmp_path, "--transport", transport], tmp_path, "trainer")
        try:
            rc_t = trainer.wait(240)
            rc_s = server.wait(60)
        finally:
            trainer.close()
    finally:
        server.close()
    assert rc_t == 0 and rc_s == 0, f"trainer {rc_t} server {rc_s}\n{trainer.stderr[-3000:]}\n{server.stderr[-3000:]}"
    steps = [json.loads(line) for line in server.stdout.splitlines() if line.startswith("{")]
    assert [s["step"] for s in steps] == [0, 1], server.stdout
    for s in steps:
        assert s["arrays"] == n_arrays and s["same_weights"] == n_arrays, s
        assert s["logits_equal"] and s["max_abs_diff"] == 0.0 and s["logits_finite"], s
    assert steps[1]["arrays_changed_since_last"] >= n_arrays - 3, steps[1]  # the second push carried new weights
    losses = [json.loads(line)["loss"] for line in trainer.stdout.splitlines() if line.startswith("{")]
    assert len(losses) == 4 and losses[2] < losses[0], trainer.stdout


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed (the torch extra)")
def test_fsdp2_trainer_killed_mid_push_then_resumed(tmp_path: Path) -> None:
    """Issue 22 with the example itself (docs/resilience.md), over gloo, its model's embeddings
    tied (``_tied_config``): the FSDP2 trainer (torchrun, delta
    pushes over a stated slow link, so they are staged) pushes step 0 (full), then every rank
    SIGKILLs itself midway through the delta push of step 1 (``--crash-in-push 1``). The server
    (``--stay``, mpiexec) stays up: each rank reports ``PushFailed`` for version 1 and still holds
    version 0, bit for bit the trainer's reference. The trainer started again resumes from its
    checkpoint (``--checkpoint``: step 0 done) and pushes steps 1 (full: a new trainer) and 2 (a
    delta); the server holds each bit for bit, with equal logits, and exits 0 at the trainer's close."""
    cfg = _tied_config(tmp_path)
    serve, rdv, ckpt = tmp_path / "serve.json", tmp_path / "rdv", tmp_path / "ckpt"
    ok(["shardstream", "layout", "--preset", "vllm", "--model", cfg, "--mesh", "tp=2", "--dtype", "bfloat16",
        "--no-files", "-o", serve])
    server = Background(["mpiexec", "-n", "2", BIN / "python", EXAMPLE / "server.py", cfg, serve, rdv, "--reference",
                         tmp_path, "--stay"], tmp_path, "server")

    def trainer(name: str, *extra: object) -> tuple[int | None, str, str]:
        job = Background([TORCHRUN, "--standalone", "--nproc-per-node", "2", EXAMPLE / "trainer.py", cfg, rdv,
                          "--reference", tmp_path, "--delta", "--link-gbps", "0.01", "--checkpoint", ckpt, *extra],
                         tmp_path, name)
        try:
            return job.wait(240), job.stdout, job.stderr
        finally:
            job.close()

    try:
        deadline = time.monotonic() + 60
        while not rdv.exists() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rdv.exists(), f"the server never wrote {rdv}:\n{server.stderr[-3000:]}"
        rc_a, out_a, err_a = trainer("trainer-a", "--steps", 2, "--crash-in-push", 1)
        assert rc_a not in (0, None), f"trainer a was to die in its second push: rc {rc_a}\n{err_a[-3000:]}"
        rc_b, out_b, err_b = trainer("trainer-b", "--steps", 3)
        assert rc_b == 0, f"the restarted trainer exited {rc_b}\n{err_b[-3000:]}\n{server.stderr[-3000:]}"
        rc_s = server.wait(60)
        assert rc_s == 0, f"server exited {rc_s}\n{server.stderr[-3000:]}"
    finally:
        server.close()
    lines = [json.loads(line) for line in server.stdout.splitlines() if line.startswith("{")]
    assert [(x.get("event", "ok"), x["version"]) for x in lines] == [
        ("ok", 0), ("failed", 1), ("failed", 1), ("ok", 1), ("ok", 2)], server.stdout
    for x in lines[1:3]:  # the broken delta push left version 0, byte for byte
        assert x["held"] == 0 and x["holds_reference"] is True, x
    assert {x["rank"] for x in lines[1:3]} == {0, 1}, lines
    pushed = lines[0:1] + lines[3:]
    for x in pushed:
        assert x["arrays"] == 20 and x["same_weights"] == 20, x  # tied: the embedding moves once
        assert x["logits_equal"] and x["max_abs_diff"] == 0.0 and x["logits_finite"], x
    # a trainer's first push is full (version 0, and 1 from the restarted one); then a delta
    assert [x["wire_bytes"] == x["full_bytes"] for x in pushed] == [True, True, False], pushed
    versions = [(json.loads(line)["rank"], json.loads(line)["version"]) for line in out_a.splitlines() + out_b.splitlines()
                if line.startswith("{")]
    assert sorted(versions) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)], (out_a, out_b)
    losses = {json.loads(line)["step"]: json.loads(line)["loss"] for line in out_a.splitlines() + out_b.splitlines()
              if line.startswith("{") and json.loads(line)["rank"] == 0}
    assert losses[2] < losses[0], losses  # it trains, across the restart (the checkpoint's optimizer state)
