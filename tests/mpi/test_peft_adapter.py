"""A live PEFT LoRA adapter under FSDP2 pushed to receivers that each hold it whole (the trainer
side of issue 37; vLLM's side is tests/vllm/test_vllm_lora.py). peft_worker.py runs both jobs.

Checked, for the first push and for a second one after a real optimizer step (which moves every
tensor): every receiver rank holds exactly what PEFT itself saves for the trainer's adapter (same
names, as vLLM reads from an adapter directory; same fp32 values), although ``lora_A`` was split
along its rank dim over the trainer's two ranks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mpi_helpers import BIN, Background, have

pytestmark = pytest.mark.skipif(not (have("transformers") and have("peft")), reason="transformers and peft (the test extra)")
TORCHRUN = shutil.which("torchrun", path=str(BIN))
WORKER = Path(__file__).resolve().parent / "peft_worker.py"


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not installed (the torch extra)")
def test_a_peft_adapter_under_fsdp2_reaches_every_receiver_whole(tmp_path: Path) -> None:
    import torch

    rdv = tmp_path / "rdv"
    jobs = [Background([TORCHRUN, "--standalone", "--nproc-per-node", "2", WORKER, role, rdv, tmp_path], tmp_path, role)
            for role in ("receiver", "trainer")]
    try:
        rcs = [j.wait(240) for j in jobs]
    finally:
        for j in jobs:
            j.close()
    assert rcs == [0, 0], "\n".join(j.stderr[-3000:] for j in jobs)
    expected = {v: torch.load(tmp_path / f"expected-{v}.pt") for v in (1, 2)}
    assert len(expected[1]) == 2 * 2 * 7  # 2 layers x A and B x 7 modules
    # the optimizer step moved every tensor: a receiver still holding version 1 anywhere fails below
    assert all(not torch.equal(expected[1][k], expected[2][k]) for k in expected[1])
    for v in (1, 2):
        for rank in (0, 1):
            got = torch.load(tmp_path / f"received-{rank}-{v}.pt")
            assert sorted(got) == sorted(expected[v])
            for k, want in expected[v].items():
                assert got[k].dtype == want.dtype and torch.equal(got[k], want), (v, rank, k)
