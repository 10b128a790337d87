"""``streamer.vllm.stage_proc``: the process a staged vLLM worker receives in, without vLLM. A real
sender session (gloo, store rendezvous over tcp://) pushes to a ``ProcessReceiver`` as the engine's
staging thread drives it: the bytes land in buffers the test process maps, a dying trainer is one
``StageFailed``, a closed session ends the pulls, and a staging process that dies is named."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from streamer.vllm.stage_proc import ProcessReceiver, layout
from streamer.vllm.staging import StageFailed

torch = pytest.importorskip("torch")


def _state(v: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(v)
    return {"a.weight": torch.randn(6, 10, generator=g).to(torch.bfloat16),
            "b.bias": torch.randn(7, generator=g), "c.idx": torch.arange(5, dtype=torch.int64) * v}


def _receiver(sd: dict[str, Any], rdv: str, timeout: float = 60,
              delta: bool = False) -> tuple[ProcessReceiver, list[str]]:
    from streamer import manifest_from_state_dict

    m = manifest_from_state_dict(sd, name="staged")
    names: list[str] = []

    def joined(naming: str) -> dict[str, Any]:
        names.append(naming)
        return {k: (tuple(t.shape), t.dtype) for k, t in sd.items()}

    args = {"manifests": {"per_expert": m, "fused": m}, "rendezvous": rdv, "transport": "gloo", "timeout": timeout,
            "verify": True, "delta": delta, "fp8_block": None, "device": None, "replica": None}
    return ProcessReceiver(args, joined, timeout), names


def _open_both(sd: dict[str, Any], timeout: float = 60, delta: bool = False,
               link_gbps: float = 0.01) -> tuple[Any, ProcessReceiver, list[str]]:
    from streamer import RefitOptions, RefitSession, manifest_from_state_dict
    from streamer.transport.torch_dist import free_port

    rdv = f"tcp://127.0.0.1:{free_port()}"
    recv, names = _receiver(sd, rdv, timeout, delta)
    opened: list[Any] = []
    t = threading.Thread(target=lambda: opened.append(recv.open()))
    t.start()
    send = RefitSession.open(manifest_from_state_dict(sd, name="staged"), "send", rendezvous=rdv, timeout=timeout,
                             options=RefitOptions(delta=delta, link_gbps=link_gbps if delta else None))
    t.join(120)
    assert opened, "the staging process did not join"
    return send, recv, names


def test_pushes_land_in_the_mapped_buffers_and_a_closed_session_ends_the_pulls() -> None:
    sd = _state(1)
    send, recv, names = _open_both(sd)
    try:
        bufs = recv.buffers(2)
        assert names == ["per_expert"] and [sorted(b) for b in bufs] == [sorted(sd)] * 2
        for v, i in ((1, 0), (2, 1), (3, 0)):
            pushed: list[Any] = []
            t = threading.Thread(target=lambda v=v: pushed.append(send.push(_state(v), version=v)))
            t.start()
            got = recv.pull(i)
            t.join(60)
            assert got is not None and got.version == v and got.nbytes == sum(x.nbytes for x in sd.values())
            for k, x in _state(v).items():
                assert torch.equal(bufs[i][k], x), (v, k)
        send.close()
        assert recv.pull(1) is None  # the trainer job closed the session
    finally:
        recv.close()
    assert recv.proc is not None and recv.proc.wait(10) == 0


def test_no_push_within_the_timeout_is_one_failed_pull_and_a_dead_staging_process_is_named() -> None:
    sd = _state(1)
    send, recv, _ = _open_both(sd, timeout=5)
    try:
        recv.buffers(2)
        with pytest.raises(StageFailed, match="PeerTimeoutError"):  # the trainer is there and pushes nothing
            recv.pull(0)
        assert recv.proc is not None and recv.proc.poll() is None  # the next pull waits for the next push
        recv.proc.kill()
        with pytest.raises(RuntimeError, match=r"the staging process ended \(exit code -9\)"):
            recv.pull(1)
    finally:
        recv.close()
        send.close()


def test_the_layout_aligns_every_tensor_and_a_full_staging_dir_is_named(tmp_path: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    slots, size = layout({"x": ((3,), torch.bfloat16), "y": ((2, 2), torch.float64)})
    assert [s[1] % 64 for s in slots] == [0, 0] and size == 128
    recv, _ = _receiver(_state(1), "tcp://127.0.0.1:1")
    recv._shapes = {"x": ((1 << 40,), torch.uint8)}  # a terabyte: more than any tmpfs here holds
    monkeypatch.setenv("SHARDSTREAM_STAGING_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"staging needs 2 buffers of 1099511627776 bytes in .*SHARDSTREAM_STAGING_DIR"):
        recv.buffers(2)
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_a_delta_session_rotates_buffers_and_still_sends_only_changes() -> None:
    """Each buffer takes a copy of the last push before the next one lands, so the trainer's deltas
    apply to the right base although the buffers alternate; a complete push holds exact bytes."""
    pytest.importorskip("numcodecs")
    g = torch.Generator().manual_seed(7)
    big = {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g)}
    send, recv, _ = _open_both(big, delta=True)
    try:
        bufs = recv.buffers(2)
        state = {k: v.clone() for k, v in big.items()}
        sizes = []
        for v in range(1, 5):
            if v > 1:
                state["w"][v, :8] += 1.0  # a few elements change per push
            pushed: list[Any] = []
            t = threading.Thread(target=lambda v=v: pushed.append(send.push(state, version=v)))
            t.start()
            got = recv.pull((v - 1) % 2)
            t.join(60)
            assert got is not None and got.version == v
            sizes.append(got.nbytes)
            for k, x in state.items():
                assert torch.equal(bufs[(v - 1) % 2][k], x), (v, k)
        full = sum(x.nbytes for x in big.values())
        assert sizes[0] == full and all(n < full // 10 for n in sizes[1:]), sizes  # changes only, after the first
    finally:
        send.close()
        recv.close()


def test_a_trainer_that_comes_after_the_timeout_is_joined_by_a_new_try() -> None:
    """The staged engine outlives a trainer that has not come yet: the staging process that found
    none within the timeout is replaced by one that waits again, with no call on the engine side."""
    import time

    from streamer import RefitSession, manifest_from_state_dict
    from streamer.transport.torch_dist import free_port
    from streamer.vllm.staging import Stager

    sd = _state(1)
    rdv = f"tcp://127.0.0.1:{free_port()}"
    recv, _ = _receiver(sd, rdv, timeout=3)
    stager = Stager(recv, timeout=60)
    stager.start()
    try:
        time.sleep(6)  # past the first process's join timeout
        assert not stager.closed and stager.error is None
        with RefitSession.open(manifest_from_state_dict(sd, name="staged"), "send", rendezvous=rdv, timeout=60) as send:
            send.push(_state(2), version=2)
            buf = stager.take(None)
            assert buf.version == 2 and torch.equal(buf.tensors["a.weight"], _state(2)["a.weight"])
            stager.committed(buf)
    finally:
        stager.stop()
