"""vLLM data parallelism: ``vllm serve --data-parallel-size 2`` runs a dense model's DP ranks as
independent engines and sends every weight-transfer call to both, so each DP rank joins the
trainer as a replica of its own (``NAME``, ``NAME-dp1``: ``engine.dp_replica``).

The server loads B; one trainer (``replicas=True``, ``tcp://``: its registry) pushes A as version 1,
then B as version 2, and the loop (pause, start, update, finish, reset the prefix cache, resume)
commits each through the HTTP endpoints, which reach both DP engines. Requests pinned to each DP
rank (vLLM's ``X-data-parallel-rank`` header) then serve A's output on both ranks, and after B
exactly what the server's own load of B served on both: each DP rank received the whole model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_models  # noqa: E402
from test_vllm_refit import Proc  # noqa: E402
from test_vllm_serve import Server, _free_port, start_server  # noqa: E402
from test_vllm_serve_loop import loop, wait_line  # noqa: E402


@pytest.mark.timeout(900)
def test_each_data_parallel_rank_of_vllm_serve_is_refitted_as_a_replica(tmp_path: Path) -> None:
    from streamer.transport.torch_dist import free_port

    a = tiny_models.make_model("dense", tmp_path / "a", seed=0)
    b = tiny_models.make_model("dense", tmp_path / "b", seed=1)
    port, rdv = _free_port(), f"tcp://127.0.0.1:{free_port()}"
    server = start_server(tmp_path, b, port, "--data-parallel-size", 2)
    procs = [server]
    try:
        srv = Server(port)
        srv.wait_up(server, 600)
        first = {r: srv.served(str(b), dp_rank=r) for r in (0, 1)}
        srv.post("/init_weight_transfer_engine",
                 {"init_info": {"rendezvous": rdv, "timeout": 240, "staging": "host", "replica": "x", "verify": True}})
        go = {1: tmp_path / "go-1", 2: tmp_path / "go-2"}
        (tmp_path / "sender.json").write_text(json.dumps({
            "rendezvous": rdv, "timeout": 240, "replicas": ["x", "x-dp1"],
            "pushes": [{"model": str(m), "version": v, "wait": str(go[v])} for v, m in ((1, a), (2, b))]}))
        sender = Proc([sys.executable, HERE / "loop_sender.py", tmp_path / "sender.json"], tmp_path, "sender")
        procs.append(sender)
        served, pushed = {}, {}
        for v in (1, 2):
            go[v].write_text("")
            pushed[v] = wait_line(sender, v)
            loop(srv, "abort", v)
            served[v] = {r: srv.served(str(b), dp_rank=r) for r in (0, 1)}
            assert srv.get("/weight_info") == {"weight_version": str(v)}
        srv.post("/shutdown_weight_transfer_engine")
        assert sender.wait(120) == 0, sender.tail()
    finally:
        for p in procs:
            p.kill()
    assert first[0] == first[1], "the two DP ranks of one checkpoint serve differently"
    for v in (1, 2):
        assert pushed[v]["replicas"] == {"x": [v, None], "x-dp1": [v, None]}, pushed[v]
    assert served[1][0] == served[1][1] != first[0], "after A the DP ranks do not both serve A"
    assert served[2][0] == first[0] and served[2][1] == first[1], "after B a DP rank does not serve B's own load"
