"""The devices the staged path runs on (``streamer.execute.staging``): what it needs from one
(``DeviceOps``), CUDA (``CudaOps``: a side stream, events, pinned host memory) and a fake device
(``FakeDeviceOps``: CPU tensors stand in for device tensors and a worker thread, running every
queued op late, is the stream), so that the staged code, its asynchrony and its ordering are
tested without a GPU.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

__all__ = ["CudaOps", "DeviceOps", "FakeDeviceOps"]


class DeviceOps(Protocol):
    """What the staged path needs from a device. Every op queued with ``submit`` runs in order."""

    name: str
    #: buffers, index tensors and events made so far (none after the first push)
    allocations: int

    def owns(self, tensor: Any) -> bool: ...
    def device_buffer(self, nbytes: int) -> Any: ...
    def host_buffer(self, nbytes: int) -> Any: ...
    def index(self, rows: np.ndarray) -> Any: ...
    def event(self) -> Any: ...
    def begin(self) -> None: ...
    def submit(self, fn: Callable[[], None], event: Any) -> None: ...
    def ready(self, event: Any) -> bool: ...
    def copy(self, dst: Any, src: Any) -> None: ...


class CudaOps:
    """CUDA tensors: one side stream per executor, pinned host buckets, one event per slot."""

    name = "cuda"

    def __init__(self, device: Any) -> None:
        import torch

        self.torch: Any = torch
        self.device = torch.device(device)
        self.stream = self.torch.cuda.Stream(self.device)
        self.allocations = 0

    def owns(self, tensor: Any) -> bool:
        return bool(getattr(tensor, "device", None) == self.device)

    def device_buffer(self, nbytes: int) -> Any:
        self.allocations += 1
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)

    def host_buffer(self, nbytes: int) -> Any:
        self.allocations += 1
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True)

    def index(self, rows: np.ndarray) -> Any:
        self.allocations += 1
        # made on the stream that uses it: no cross-stream hazard on its first use
        with self.torch.cuda.stream(self.stream):
            return self.torch.from_numpy(rows).to(self.device, non_blocking=False)

    def event(self) -> Any:
        self.allocations += 1
        return self.torch.cuda.Event()

    def begin(self) -> None:
        # the caller's kernels that write (trainer) or read (engine) the tensors come first
        self.stream.wait_stream(self.torch.cuda.current_stream(self.device))

    def submit(self, fn: Callable[[], None], event: Any) -> None:
        with self.torch.cuda.stream(self.stream):
            fn()
            event.record(self.stream)

    def ready(self, event: Any) -> bool:
        return bool(event.query())

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src, non_blocking=True)


class _FakeEvent:
    def __init__(self) -> None:
        self.flag = threading.Event()
        self.flag.set()  # like a CUDA event never recorded: complete
        self.error: BaseException | None = None


class FakeDeviceOps:
    """CPU torch tensors stand in for device tensors; a worker thread runs the queued ops in
    order, ``delay`` seconds late each, so an executor that used a bucket before its copy
    completed would move stale bytes."""

    name = "fake"

    def __init__(self, delay: float = 0.0) -> None:
        import torch

        self.torch: Any = torch
        self.delay = delay
        self.allocations = 0
        self.submitted = 0
        self._q: queue.Queue[tuple[Callable[[], None], _FakeEvent] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # ranks sharing one fake device (as they may share a GPU)

    def owns(self, tensor: Any) -> bool:
        return isinstance(tensor, self.torch.Tensor) and tensor.device.type == "cpu"

    def device_buffer(self, nbytes: int) -> Any:
        self.allocations += 1
        return self.torch.empty(nbytes, dtype=self.torch.uint8)

    host_buffer = device_buffer  # no pinned memory without an accelerator

    def index(self, rows: np.ndarray) -> Any:
        self.allocations += 1
        return self.torch.from_numpy(rows.copy())

    def event(self) -> _FakeEvent:
        self.allocations += 1
        return _FakeEvent()

    def begin(self) -> None:
        with self._lock:  # one worker: the stream runs its ops in order
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, daemon=True, name="fake-device-stream")
                self._thread.start()

    def submit(self, fn: Callable[[], None], event: _FakeEvent) -> None:
        event.flag.clear()
        self.submitted += 1
        self._q.put((fn, event))

    def ready(self, event: _FakeEvent) -> bool:
        if event.error is not None:
            raise event.error
        return event.flag.is_set()

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def close(self) -> None:
        with self._lock:
            if self._thread is not None:
                self._q.put(None)
                self._thread.join(10)
                self._thread = None

    def _work(self) -> None:
        import time

        while (item := self._q.get()) is not None:
            fn, ev = item
            if self.delay:
                time.sleep(self.delay)
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the thread that polls the event
                ev.error = e
            ev.flag.set()
