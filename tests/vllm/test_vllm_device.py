"""The worker's own device reaches every receiving path of the backend, on a mocked 8-GPU node
with ``LOCAL_RANK`` unset: vLLM placed this worker on cuda:5 (a remapped CUDA_VISIBLE_DEVICES, or
data parallelism), and the session the engine opens, fast path, staged or ``load_weights``, is
handed cuda:5; nothing calls ``set_device`` (the transports' half of this is
tests/unit/test_transport_device.py). No engine is started: the engine object is built as vLLM's
factory builds it, with this worker's device."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")
import torch  # noqa: E402


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Any:
    from fake_gpus import mock_gpus

    from streamer.vllm import engine as eng_mod

    calls = mock_gpus(monkeypatch)
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(), model_config=SimpleNamespace())
    e = eng_mod.ShardstreamWeightTransferEngine(SimpleNamespace(backend="shardstream"), vllm_config,
                                                torch.device("cuda", 5), torch.nn.Linear(2, 2))
    e.set_device_calls = calls
    return e


def test_the_fast_path_opens_its_session_on_the_workers_device(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from streamer.vllm import engine as eng_mod

    seen: list[Any] = []
    monkeypatch.setattr(eng_mod, "open_receiver", lambda args: (seen.append(args["device"]), ("session", "per_expert"))[1])
    engine.described = SimpleNamespace(manifests={})
    assert engine._open_session({"rendezvous": "r"}) == "session"
    assert seen == [torch.device("cuda", 5)] and engine.set_device_calls == []


def test_the_load_weights_path_opens_its_session_on_the_workers_device(engine: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import streamer
    from streamer.vllm import engine as eng_mod

    seen: list[Any] = []
    monkeypatch.setattr(streamer.RefitSession, "open", classmethod(lambda cls, *a, **kw: seen.append(kw["device"])))
    monkeypatch.setattr(eng_mod, "LoadWeightsReceiver", lambda model, config: SimpleNamespace(choose=None))
    monkeypatch.setattr("streamer.transport.jobs.launcher_rank", lambda: (0, 1))
    engine._open_load_session(eng_mod.ShardstreamInitInfo(rendezvous="r", reload="load_weights"))
    assert engine._join.wait(30) and engine._join.error is None  # joined on a thread (joining.py)
    assert seen == [torch.device("cuda", 5)] and engine.set_device_calls == []


def test_a_cpu_worker_names_no_device(engine: Any) -> None:
    engine.device = torch.device("cpu")
    assert engine._cuda_device() is None
