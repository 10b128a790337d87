"""``manifest_from_state_dict`` on real 4-rank gloo jobs (CPU), launched by ``mpiexec`` and by
``torchrun``: fully_shard, FSDP2 + TP (``_StridedShard``), pipeline stages with different keys,
refusals. The checks run inside ``torch_state_worker.py`` on every rank (chunk bytes against
``full_tensor()``, coverage, validation, byte-identical JSON); here: every rank says OK and both
launchers give the same manifests."""

from __future__ import annotations

import json
import re
import shutil
import socket

import pytest
from mpi_helpers import BIN, ENV, MPIEXEC, REPO, have, run

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(not have("torch"), reason="torch not installed (the torch extra)")]

WORKER = REPO / "tests" / "mpi" / "torch_state_worker.py"
PYTHON = str(BIN / "python") if (BIN / "python").exists() else "python"
CASES = ["fsdp", "fsdp_tp", "fsdp_tp_bf16", "pipeline", "refusals"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _results(rc: int, out: str, err: str) -> dict[int, dict[str, dict[str, object]]]:
    assert rc == 0, f"exit {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    res = {}
    dec = json.JSONDecoder()
    # tolerant of a launcher that joins two ranks' lines: each result is "OK RANK {json}"
    for m in re.finditer(r"OK (\d+) ", out):
        summary, _ = dec.raw_decode(out, m.end())
        res[int(m.group(1))] = summary
    assert sorted(res) == [0, 1, 2, 3], out[-3000:]
    for r in res.values():
        assert sorted(r) == sorted(CASES)
    # one manifest per case, the same on every rank
    for case in CASES[:-1]:
        assert len({r[case]["digest"] for r in res.values()}) == 1, case
    return res


def _expected_shape(res: dict[int, dict[str, dict[str, object]]]) -> None:
    assert res[3]["fsdp"]["chunks_held"] == 4  # torch.chunk leaves rank 3 most arrays empty
    assert res[0]["pipeline"]["chunks_held"] == 3 and res[2]["pipeline"]["chunks_held"] == 4


_DIGESTS: dict[str, dict[str, object]] = {}


def test_mpiexec_four_ranks() -> None:
    rc, out, err = run([MPIEXEC, "-n", "4", PYTHON, WORKER, str(_free_port())], timeout=120)
    res = _results(rc, out, err)
    _expected_shape(res)
    _DIGESTS["mpiexec"] = {c: res[0][c]["digest"] for c in CASES[:-1]}


def test_torchrun_four_ranks() -> None:
    torchrun = shutil.which("torchrun", path=ENV["PATH"])
    if torchrun is None:
        pytest.skip("torchrun not found")
    rc, out, err = run([torchrun, "--standalone", "--nproc-per-node", "4", WORKER], timeout=120)
    res = _results(rc, out, err)
    _expected_shape(res)
    digests = {c: res[0][c]["digest"] for c in CASES[:-1]}
    if "mpiexec" in _DIGESTS:  # the launcher does not change the manifest
        assert digests == _DIGESTS["mpiexec"]
