"""Refit from a real FSDP2 trainer (issue: PyTorch-native refit).

A ``torchrun`` job trains a ``transformers`` Llama (built from a config, random init) with fp32
master weights under ``fully_shard``, on its own gloo process group, for two AdamW steps. After
each step it pushes the module into a bf16 TP=2 inference job started by ``mpiexec`` whose local
tensors come from the vLLM preset (fused qkv / gate_up, padded vocab). The manifest on the
trainer side comes from ``manifest_from_state_dict``; the cast to bf16 happens on the way. After
each push the server's weights equal ``full_tensor()`` cast to bf16 bit for bit, and so do the
logits of the models built from each.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from mpi_helpers import BIN, Background, ok

pytest.importorskip("transformers")
TORCHRUN = shutil.which("torchrun", path=str(BIN))
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp2_refit"


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed (the torch extra)")
@pytest.mark.parametrize(("tied", "transport"), [(False, "gloo"), (True, "gloo"), (False, "shm")],
                         ids=["untied", "tied", "untied-shm"])
def test_fsdp2_trainer_refits_bf16_tp2_server(tmp_path: Path, tied: bool, transport: str) -> None:
    """With ``tie_word_embeddings`` the weight moves once, as ``model.embed_tokens.weight`` (20
    arrays), with no flag on either side. ``shm``: the same real FSDP2 trainer over the colocated
    one-sided transport (both jobs on this node)."""
    cfg = EXAMPLE / "config.json"
    if tied:
        cfg = tmp_path / "config.json"
        cfg.write_text(json.dumps(dict(json.loads((EXAMPLE / "config.json").read_text()), tie_word_embeddings=True)))
    n_arrays = 20 if tied else 21
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
