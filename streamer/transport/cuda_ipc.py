"""The ``cuda-ipc`` backend of the one-sided transport (``handles``): device memory shared on one node.

Colocated RL runs the trainer and the inference engine on the same GPUs; a refit there is a
device-to-device copy. Any CUDA storage can be exposed (torch's CUDA IPC: the handle of its
allocation and its offset, ``UntypedStorage._share_cuda_``), so large regions go straight from
the trainer's tensors and packed ones from the bucket they were packed in: no staging copy. A
receiver opens each storage's handle once per session (``_new_shared_cuda``) and copies with
``copy_`` into its own tensors, in place (same data pointers, which captured CUDA graphs need;
never run on a GPU yet), on its current stream.

Completion: the sender records an event after its writes (packing) and sends the header once
the event completed; the receiver records an event after its copy and acks once it completed,
so the sender may reuse the bucket. Both processes may use the same single GPU.

Exposed storages are kept alive until the transport closes: the peer maps them by handle.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from formats.errors import TransportError
from streamer.transport.handles import Exposure

__all__ = ["CudaIpcBackend", "TorchCudaIpc"]


def _b64(x: bytes | None) -> str | None:
    return None if x is None else base64.b64encode(x).decode()


def _unb64(x: str | None) -> bytes | None:
    return None if x is None else base64.b64decode(x)


class TorchCudaIpc:
    """The device primitives: share a storage, open a peer's, record an event (torch's CUDA IPC).
    Tests stand in a CPU version (the same backend code, CPU tensors standing in)."""

    device_type = "cuda"

    def __init__(self) -> None:
        self._uuids: dict[str, int] = {}
        #: completed events, recorded again by later messages: no event is created after the first push
        self._events: list[Any] = []

    @staticmethod
    def _uuid(index: int) -> str:
        import torch

        return str(getattr(torch.cuda.get_device_properties(index), "uuid", index))

    def share(self, st: Any) -> dict[str, Any]:
        """How a peer opens storage ``st``: its allocation's IPC handle, offset and size."""
        dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = st._share_cuda_()
        return {"uuid": self._uuid(int(dev)), "device": int(dev), "handle": _b64(handle), "size": int(size),
                "offset": int(offset), "rc_handle": _b64(rc_handle), "rc_offset": int(rc_offset),
                "event": _b64(ev_handle), "event_sync": bool(ev_sync)}

    def open(self, d: dict[str, Any]) -> Any:
        """A peer's storage, opened in this process (on the GPU with the same UUID)."""
        import torch

        if not self._uuids:
            self._uuids = {self._uuid(i): i for i in range(torch.cuda.device_count())}
        dev = self._uuids.get(d["uuid"], d["device"])
        try:
            return torch.UntypedStorage._new_shared_cuda(
                dev, _unb64(d["handle"]), d["size"], d["offset"], _unb64(d["rc_handle"]), d["rc_offset"],
                _unb64(d["event"]), d["event_sync"])
        except RuntimeError as e:
            raise TransportError(f"cannot open its CUDA IPC handle on cuda:{dev} ({str(e).splitlines()[0][:200]}): "
                                 "both processes must run on one node and see the same GPUs") from e

    def event(self, device: Any) -> Any:
        """An event recorded now on ``device``'s current stream (``query()`` once the work before it is done)."""
        import torch

        ev = self._events.pop() if self._events else torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(torch.cuda.current_stream(device))
        return ev

    def done(self, ev: Any) -> bool:
        """Whether the work before ``ev`` completed; a completed event goes back to the pool."""
        if not ev.query():
            return False
        self._events.append(ev)
        return True


class CudaIpcBackend:
    """CUDA buffers on ``device``; peers' storages mapped by IPC handle, copied with ``copy_``."""

    name = "cuda-ipc"

    def __init__(self, device: Any, ipc: Any = None) -> None:
        self.device = device
        self.ipc = ipc or TorchCudaIpc()
        #: exposed storages: (data pointer, bytes) -> segment id, and the storages kept alive
        self._seg_of: dict[tuple[int, int], int] = {}
        self._kept: dict[int, tuple[Any, bytes]] = {}
        #: peers' storages opened here: (peer, segment) -> uint8 tensor over the whole storage
        self._mapped: dict[tuple[int, int], Any] = {}

    @classmethod
    def for_rank(cls, rank: int, device: Any = None) -> CudaIpcBackend:
        """The device of this process: ``device`` when the caller names it (a vLLM worker's own),
        else ``LOCAL_RANK`` when a launcher set it, else ``rank`` (its rank in its own job: on one
        node, trainer rank i and server rank i share GPU i, as colocated RL places them), modulo
        the visible GPUs (``transport.device``)."""
        try:
            import torch
        except ImportError as e:
            raise TransportError("torch is not installed") from e
        if not torch.cuda.is_available():
            raise TransportError("no CUDA device is visible (torch.cuda.is_available() is False)")
        from streamer.transport.device import cuda_device

        return cls(cuda_device(rank, device))

    # -- buffers
    def byte_view(self, tensor: Any) -> Any:
        from streamer.ops.buffers import torch_byte_view

        v = torch_byte_view(tensor)
        if v.device.type != self.ipc.device_type:
            raise ValueError("the cuda-ipc transport moves GPU tensors: move the local tensors to a CUDA device")
        return v

    def alloc(self, nbytes: int) -> Any:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    # -- sending
    def expose(self, buf: Any) -> Exposure:
        flat = _flat(buf, self.ipc.device_type)
        st = flat.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        seg = self._seg_of.get(key)
        if seg is None:
            seg = len(self._kept)
            self._seg_of[key] = seg
            self._kept[seg] = (st, json.dumps(self.ipc.share(st)).encode())
        return Exposure(seg, flat.storage_offset() * flat.element_size(), flat.numel(), self._kept[seg][1],
                        pending=self.ipc.event(flat.device))

    def ready(self, exp: Exposure) -> bool:
        if exp.pending is not None and self.ipc.done(exp.pending):
            exp.pending = None
        return exp.pending is None

    def release(self, exp: Exposure) -> None:
        pass  # storages stay exposed for the session

    # -- receiving
    def attach(self, peer: int, segment: int, descriptor: bytes) -> None:
        if (peer, segment) in self._mapped:
            return
        import torch

        d = json.loads(descriptor)
        st = self.ipc.open(d)
        whole = torch.empty(0, dtype=torch.uint8, device=st.device)
        whole.set_(st, 0, (d["size"],), (1,))
        self._mapped[(peer, segment)] = whole

    def attached(self, peer: int, segment: int) -> bool:
        return (peer, segment) in self._mapped

    def copy(self, dst: Any, peer: int, segment: int, offset: int, nbytes: int) -> Any:

        src = self._mapped[(peer, segment)]
        if offset < 0 or offset + nbytes > src.numel():
            raise TransportError(f"bytes [{offset}, {offset + nbytes}) lie outside its {src.numel()}-byte storage")
        out = _flat(dst, self.ipc.device_type)[:nbytes]
        out.copy_(src[offset:offset + nbytes], non_blocking=True)
        return self.ipc.event(out.device)

    def copied(self, token: Any) -> bool:
        return bool(self.ipc.done(token))  # called until it is True, then never again

    def close(self) -> None:
        self._mapped.clear()  # the peers' storages: their handles close with the last reference
        self._kept.clear()
        self._seg_of.clear()


def _flat(buf: Any, device_type: str = "cuda") -> Any:
    """A CUDA uint8 view of ``buf`` (never a copy: a receive must land in the caller's memory)."""
    import torch

    if not isinstance(buf, torch.Tensor) or buf.device.type != device_type:
        raise TransportError("the cuda-ipc transport moves GPU tensors only (got host memory)")
    try:
        return buf.view(-1).view(torch.uint8)
    except RuntimeError as e:
        raise TransportError(f"the cuda-ipc transport needs contiguous buffers ({e})") from e
