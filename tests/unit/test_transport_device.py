"""The CUDA device of the nccl and cuda-ipc transports (streamer/transport/device.py), on a mocked
8-GPU layout: a caller that owns the choice (a vLLM worker passes its own device) gets that device
and the current device is left alone, with ``LOCAL_RANK`` unset or pointing elsewhere; without one,
the launcher's local rank picks the GPU and it becomes current."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from streamer.transport import device as dev  # noqa: E402


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Eight mocked GPUs; returns the list of devices ``set_device`` was called with."""
    from fake_gpus import mock_gpus

    return mock_gpus(monkeypatch)


def test_the_callers_device_is_used_as_given_and_nothing_is_set(gpus: list[Any],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    assert dev.cuda_device(0, torch.device("cuda", 5)) == torch.device("cuda", 5)
    monkeypatch.setenv("LOCAL_RANK", "2")  # a launcher's variable does not override the caller
    assert dev.cuda_device(0, 6) == torch.device("cuda", 6)
    assert gpus == []


def test_without_one_the_launchers_local_rank_picks_it_and_it_becomes_current(
        gpus: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    assert dev.cuda_device(11) == torch.device("cuda", 3)  # no launcher variable: rank mod GPUs
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "4")
    assert dev.cuda_device(11) == torch.device("cuda", 4)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert dev.cuda_device(11) == torch.device("cuda", 1)
    assert gpus == [torch.device("cuda", 3), torch.device("cuda", 4), torch.device("cuda", 1)]


def test_a_device_that_is_not_one_gpu_is_refused(gpus: list[Any]) -> None:
    for bad in ("cpu", "cuda"):
        with pytest.raises(ValueError, match="needs a CUDA device with an index"):
            dev.cuda_device(0, bad)


def test_the_nccl_transport_takes_the_callers_device(gpus: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """TorchDistTransport("nccl") in a vLLM worker: the engine's device, no set_device (the groups
    themselves are mocked: there is no NCCL here)."""
    import torch.distributed as dist

    from streamer.transport import torch_dist

    monkeypatch.setattr(torch_dist, "_make_group", lambda *a: object())

    class Plane:
        rank, size = 1, 2

    t = torch_dist.TorchDistTransport(Plane(), "nccl", store=dist.HashStore(), device=torch.device("cuda", 7))
    assert t.device == torch.device("cuda", 7) and gpus == []
    t.pool = None
    if t.control.pool is not None:
        t.control.pool.shutdown()
