"""Fixtures for the ``mpi`` tier: real ``mpiexec`` launches of the ``shardstream`` CLI.

Everything is built through the CLI once per session in a temp dir (``ckpt``): a seeded
``qwen3-tiny`` HF checkpoint, its manifest, the trainer's TP2xPP2 per-rank files, and the
serving layouts (TP4, TP2xDP2, one-rank HF). ``mpmd_saved`` runs the reference MPMD refit
(TP2xPP2 -> TP4, ``--save --verify``) once; other tests compare their saved bytes to it.

Every subprocess runs with ``HYDRA_LAUNCHER=fork``, ``OMP_NUM_THREADS=1`` and the venv's
``bin`` first on ``PATH``, under a hard timeout (the whole process group is killed on expiry).
The tier is skipped when ``mpiexec`` or ``mpi4py`` is missing. ``run(cmd, timeout) -> (rc, stdout,
stderr)`` and the other helpers live in ``mpi_helpers.py`` (importable from the test modules).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from mpi_helpers import BIN, ENV, MPIEXEC, SHARDSTREAM, Ckpt, Saved, ok, run, tp_rules
from mpi_helpers import ok as _ok

__all__ = ["ok", "run"]


@pytest.fixture(scope="session", autouse=True)
def _need_mpi() -> None:
    if MPIEXEC is None:
        pytest.skip("mpiexec not found (install the mpi extra: mpi4py + mpich)")
    if SHARDSTREAM is None:
        pytest.skip("the shardstream entry point is not installed")
    rc = subprocess.run([str(BIN / "python") if (BIN / "python").exists() else sys.executable, "-c",
                         "import mpi4py"], check=False, env=ENV, capture_output=True).returncode
    if rc != 0:
        pytest.skip("mpi4py is not importable")


@contextmanager
def _shared(factory: pytest.TempPathFactory, name: str) -> Iterator[tuple[Path, bool]]:
    """``(directory, built)`` for session data that the xdist workers of one run share: the first
    worker builds it (``built`` False) while the others wait on a lock, then reuse it."""
    base = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's temp root, above each worker's own
    root, stamp = base / name, base / f"{name}.built"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            built = stamp.exists()
            if not built:
                shutil.rmtree(root, ignore_errors=True)
                root.mkdir()
            yield root, built
            stamp.touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory: pytest.TempPathFactory, _need_mpi: None) -> Ckpt:
    with _shared(tmp_path_factory, "mpi-ckpt") as (root, built):
        return _ckpt(root, build=not built)


def _ckpt(root: Path, build: bool) -> Ckpt:
    """The tier's checkpoint and layouts under ``root`` (made by the CLI when ``build``)."""
    ok: Callable[[list[object]], object] = _ok if build else (lambda cmd: None)
    hf = root / "hf"
    ok(["shardstream", "synth", "--preset", "qwen3-tiny", "--out", hf])
    ok(["shardstream", "import", hf, "-o", hf / "manifest.json"])
    train_m = root / "train.json"
    ok(["shardstream", "layout", "--like", hf / "manifest.json", "--mesh", "pp=2,tp=2", *tp_rules(2), "-o", train_m])
    ok(["shardstream", "convert", hf / "manifest.json", train_m, "--out", root / "train"])
    serve = root / "serve.json"
    ok(["shardstream", "layout", "--like", hf / "manifest.json", "--mesh", "tp=4", *tp_rules(1), "-o", serve])
    serve_dp = root / "serve_dp.json"
    ok(["shardstream", "layout", "--like", hf / "manifest.json", "--mesh", "dp=2,tp=2", *tp_rules(2), "-o",
        serve_dp])
    hf1 = root / "hf1.json"
    ok(["shardstream", "layout", "--like", hf / "manifest.json", "-o", hf1])

    # a different model: one array's shape changed, one array dropped
    m = json.loads((hf / "manifest.json").read_text())
    arrays = m["arrays"]
    shape_name = next(n for n in arrays if n.endswith("layers.0.input_layernorm.weight"))
    missing_name = next(n for n in arrays if n.endswith("layers.1.mlp.up_proj.weight"))
    a = arrays[shape_name]
    a["shape"] = [2 * a["shape"][0]]
    a["chunks"][0]["region"]["sizes"] = [2 * a["chunks"][0]["region"]["sizes"][0]]
    del arrays[missing_name]
    if build:
        (hf / "other.json").write_text(json.dumps(m))
    serve_bad = root / "serve_bad.json"
    ok(["shardstream", "layout", "--like", hf / "other.json", "--mesh", "tp=4", *tp_rules(1), "-o", serve_bad])
    return Ckpt(root, hf, hf / "manifest.json", train_m, root / "train", serve, serve_dp, hf1, serve_bad,
                shape_name, missing_name)


@pytest.fixture(scope="session")
def mpmd_saved(ckpt: Ckpt, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """The reference refit: MPMD 4 senders (TP2xPP2) + 4 receivers (TP4), --save --verify, 3 steps."""
    with _shared(tmp_path_factory, "mpi-saved") as (root, built):
        out, record = root / "saved-mpmd", root / "run.json"
        if not built:
            t0 = time.monotonic()
            rc, so, se = run(["mpiexec", "-n", "4", "shardstream", "refit", "send", "--manifest", ckpt.train,
                              "--timeout", "30", "--steps", "3", ":",
                              "-n", "4", "shardstream", "refit", "recv", "--manifest", ckpt.serve, "--save", out,
                              "--verify", "--timeout", "30", "--steps", "3"], timeout=90)
            record.write_text(json.dumps([rc, so, se, time.monotonic() - t0]))
        rc, so, se, seconds = json.loads(record.read_text())
        return Saved(out, rc, so, se, seconds)
