"""Eight mocked CUDA devices for tests that check which device a transport or engine takes: CUDA
reads as available with 8 devices, ``set_device`` records its calls instead of running, and the
launchers' local-rank variables are unset (``LOCAL_RANK`` must not be what picks the device)."""

from __future__ import annotations

from typing import Any


def mock_gpus(monkeypatch: Any) -> list[Any]:
    """Install the mock; returns the list of devices ``torch.cuda.set_device`` was called with."""
    import torch

    calls: list[Any] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    for name in ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return calls
