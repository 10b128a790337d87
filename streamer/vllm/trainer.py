"""The trainer side of the ``shardstream`` backend, on vLLM's trainer contract (0.32).

RL frameworks that drive vLLM through its weight-sync clients pick a trainer backend by name::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # registers shardstream's trainer engine (streamer.vllm.plugin)
    engine = WeightTransferTrainerFactory.trainer_init(
        ShardstreamTrainerInitInfo(rendezvous="/shared/refit.rdv", rank=rank),
        client=HTTPVLLMWeightSyncClient("http://engine:8000"), source=ModuleSource(model))
    for step in ...:
        ...                            # train
        engine.send_weights(version=step)

On every trainer rank: ``trainer_init`` describes the rank's own shards
(``manifest_from_state_dict``: DTensors stay sharded) and opens the refit session; on rank 0 it
calls the engine's ``init_weight_transfer_engine`` on a thread meanwhile (the call returns at once
on this backend's engine; the thread bounds a client that does not). ``send_weights`` asks the
engine to start an update, runs its ``update_weights`` on a thread while every rank pushes its own regions, then finishes the update
with the pushed version as the ``weight_version``, so ``/weight_info`` names what the engine holds.
Nothing is gathered: vLLM's ``ModuleSource`` would call ``full_tensor()`` when iterated, so the
engine reads the module it wraps instead and pushes local shards.

One client drives one engine: to feed several engines, open one session per engine (replicas:
``RefitSession.open(replicas=True)``, docs/resilience.md) rather than this class.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

__all__ = ["ShardstreamTrainerEngine", "ShardstreamTrainerInitInfo"]


@dataclass
class ShardstreamTrainerInitInfo(TrainerInitInfo):  # type: ignore[misc]
    """``rendezvous``: the store rendezvous file both jobs see; ``timeout``: seconds any wait may
    take; ``transport``, ``verify``, ``delta``: as the engine's init_info (docs/vllm.md);
    ``link_gbps``: the link to the engine, for delta sessions. ``rank`` (keyword): this trainer
    rank; rank 0 drives the engine's calls."""

    backend: ClassVar[str] = "shardstream"

    rendezvous: str = ""
    timeout: float = 300.0
    transport: str | None = None
    verify: bool = False
    delta: bool = False
    link_gbps: float | None = None

    def engine_init_info(self) -> dict[str, Any]:
        """What the engine's ``init_weight_transfer_engine`` gets."""
        out: dict[str, Any] = {"rendezvous": self.rendezvous, "timeout": self.timeout, "verify": self.verify,
                               "delta": self.delta}
        if self.transport is not None:
            out["transport"] = self.transport
        return out


def _module(source: Any) -> Any:
    """The ``nn.Module`` behind ``source``: vLLM's ``ModuleSource`` (its module, never iterated:
    iterating gathers every DTensor) or a module itself. Which attribute holds the module is
    feature-detected (0.32 keeps it as ``_module``; later releases may rename it). Any other
    ``WeightSource`` (0.33's custom sources: ``metadata()`` of ``ParamMeta`` and full tensors when
    iterated) is refused by name: its tensors exist only whole, which is what this backend avoids."""
    import torch

    if isinstance(source, torch.nn.Module):
        return source
    if type(source).__name__ == "ModuleSource":
        for attr in ("_module", "module", "_model", "model"):
            module = getattr(source, attr, None)
            if isinstance(module, torch.nn.Module):
                return module
    raise TypeError(f"shardstream's trainer engine pushes a module's own shards: pass ModuleSource(model) or the "
                    f"model, not {type(source).__name__} (a source that yields full tensors would gather every "
                    "array on every trainer rank; a model that needs converting, such as a Megatron export, is "
                    "pushed by RefitSession.push with its manifest, e.g. manifest_from_megatron)")


class _Call:
    """A blocking engine call on a thread, joined with a timeout; its error is raised at join."""

    def __init__(self, name: str, fn: Any, *args: Any) -> None:
        self.name = name
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True,
                                       name=f"shardstream-{name}")
        self.thread.start()

    def _run(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - raised at join
            self.error = e

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"shardstream: the engine's {self.name} did not return within {timeout:.0f} s")
        if self.error is not None:
            raise RuntimeError(f"shardstream: the engine's {self.name} failed: {self.error}") from self.error


class ShardstreamTrainerEngine(TrainerWeightTransferEngine[ShardstreamTrainerInitInfo]):  # type: ignore[misc]
    """The trainer side of the ``shardstream`` backend, built by vLLM's
    ``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=model)``: every
    trainer rank holds one, rank 0 (``is_sender``) also drives the engine through ``client``
    (``VLLMWeightSyncClient``: HTTP or Ray)."""

    init_info_cls = ShardstreamTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool, session: Any, module: Any,
                 timeout: float) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.session, self.module, self.timeout = session, module, timeout
        #: the version of the last push (what the engine was told it holds)
        self.version: int | None = None

    @classmethod
    def trainer_init(cls, init_info: ShardstreamTrainerInitInfo, *, client: Any,
                     source: Any = None) -> ShardstreamTrainerEngine:
        """Open the trainer's session on ``source`` (an ``nn.Module``, or an object holding one)
        while rank 0 asks the engine to join (``client.init_weight_transfer_engine`` on a thread:
        the two block on each other)."""
        from streamer import RefitOptions, RefitSession, manifest_from_state_dict

        if not init_info.rendezvous:
            raise ValueError("ShardstreamTrainerInitInfo needs a rendezvous (the file both jobs see)")
        module = _module(source)
        manifest = manifest_from_state_dict(module.state_dict(), name="vllm-trainer")
        joining = _Call("init_weight_transfer_engine", client.init_weight_transfer_engine,
                        init_info.engine_init_info()) if init_info.is_sender else None
        try:
            session = RefitSession.open(manifest, "send", rendezvous=init_info.rendezvous,
                                        transport=init_info.transport, timeout=init_info.timeout,
                                        options=RefitOptions(verify=init_info.verify, delta=init_info.delta,
                                                             link_gbps=init_info.link_gbps))
        finally:
            if joining is not None:
                joining.join(init_info.timeout)
        return cls(client=client, source=source, is_sender=init_info.is_sender, session=session, module=module,
                   timeout=init_info.timeout)

    def send_weights(self, version: int | None = None) -> None:
        """One update of the engine: start it, push every rank's regions while the engine pulls,
        finish it naming the pushed version. Every trainer rank calls it; rank 0 drives the engine."""
        pulling = None
        if self.is_sender:
            self.client.start_weight_update()
            pulling = _Call("update_weights", self.client.update_weights, {})
        try:
            st = self.session.push(self.module, version=version)
        finally:
            if pulling is not None:
                pulling.join(self.timeout)
        self.version = st.version
        if self.is_sender:
            self.client.finish_weight_update(weight_version=str(st.version))

    def shutdown(self) -> None:
        """Close the session (the engine's pulls end) and, on rank 0, the engine's backend."""
        if self.session is not None:
            session, self.session = self.session, None
            session.close()
            if self.is_sender:
                self.client.shutdown_weight_transfer_engine()
