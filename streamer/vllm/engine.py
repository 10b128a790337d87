"""The ``shardstream`` weight-transfer engine: each vLLM worker pulls its own regions in place.

vLLM creates one engine per worker (``WeightTransferEngineFactory``, backend ``shardstream``,
registered by :mod:`streamer.vllm.plugin`). The calls, from ``LLM`` or ``vllm serve``:

``init_weight_transfer_engine({"init_info": {"rendezvous": PATH, "timeout": S}})``
    every worker describes what it holds (:func:`~streamer.vllm.manifest.manifest_from_vllm`, one
    all-gather over the engine's workers) and joins the trainer's ``RefitSession`` as a receiver
    through the store rendezvous file ``PATH`` (the receivers write it: start the engine side first,
    or the trainer waits for the file up to its timeout). The expert naming (fused or one per expert)
    follows the trainer's manifest. Planning happens here, once.
``start_weight_update()``
    opens the update: the state every layer derives from its weights is recorded (for the audit),
    and the worker starts watching the engine's steps (:mod:`streamer.vllm.steps`). The served
    tensors are not touched yet.
``update_weights({"update_info": {}})``
    the whole update, in one call, so that no engine step can run on a half-loaded model: vLLM's
    layerwise reload is set up (``initialize_layerwise_reload``: every layer back in model format on
    the meta device, its kernel tensors kept aside), then one ``pull``: the trainer's matching
    ``push`` moves each region straight into the tensor it
    belongs to. Layers that keep weights as loaded (``inplace``: norms; unquantized linear and
    embedding layers on CUDA) receive into the kernel tensors themselves: same storage, pointers
    unchanged. Layers that transform weights after loading (``reprocess``: the CPU build's packed
    linear and embedding weights, FusedMoE, quantized methods) are materialized in model format and
    receive there; then vLLM's own ``process_weights_after_loading`` runs per layer and the result is
    copied into the kernel tensors (as vLLM's ``sharded_rdt`` engine does). The device is
    synchronized afterwards on accelerators only (``torch.accelerator.synchronize()`` raises on CPU).
    Tied layers (a ``lm_head`` serving ``embed_tokens.weight``) are then processed again on their
    owner's new bytes, as a fresh load processes them: their derived copies (the CPU build's packed
    head) are rebuilt. Last, ``finalize_layerwise_reload``: attention layers are processed, the
    rest restored. If the engine served requests since ``start_weight_update`` (it was not paused),
    the update is refused before it writes anything, naming vLLM's pause call; the trainer's push
    is refused with the same reason.
``finish_weight_update()``
    the audit (:mod:`streamer.vllm.audit`): a layer that still holds state built from the previous
    weights is named and the call raises, so vLLM does not take the new ``weight_version``.

Block-FP8 layers (``Fp8LinearMethod`` with ``weight_block_size``) take the ``reprocess`` path; the
engine asks the session for its block (``fp8_block``), so a bf16/fp32 trainer's push is quantized
on the way (quantize on refit, docs/refit.md).

Delta sessions (``RefitOptions(delta=True)`` on the trainer, or ``"delta": true`` in ``init_info``):
the pull writes into a host base that the engine keeps per session (one model-format copy of the
worker's parameters), the XOR deltas apply to it, and it is copied into the update's tensors.

Staged updates (``"staging": "host"`` in ``init_info``, :mod:`streamer.vllm.staging`): a process of
each worker's own (:mod:`streamer.vllm.stage_proc`) receives every push into shared host buffers
while the engine serves (delta sessions too: each buffer first takes a copy of the last push); ``update_weights`` commits a staged
version (``{"version": N}`` or the newest) layer by layer, and a commit that fails puts back the
layers it wrote from the committed host copy.

A refused or failed pull restores every layer's kernel tensors before the error is raised (the
weights of ``reprocess`` layers stay the last good ones; ``inplace`` tensors may hold part of the
failed push). ``shutdown_weight_transfer_engine`` closes the session; a later
``init_weight_transfer_engine`` joins a new one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from streamer.vllm import internals
from streamer.vllm.audit import Snapshot, snapshot, stale
from streamer.vllm.joining import Join
from streamer.vllm.loadweights import LoadWeightsReceiver, process_again, reload_mode
from streamer.vllm.manifest import VllmManifests, VllmTensor, manifest_from_vllm
from streamer.vllm.replies import one_reply, world_cpu_group
from streamer.vllm.stage_proc import ProcessReceiver, open_receiver
from streamer.vllm.staging import Stager
from streamer.vllm.steps import StepWatch, watch

__all__ = ["ShardstreamInitInfo", "ShardstreamUpdateInfo", "ShardstreamWeightTransferEngine"]

_log = logging.getLogger(__name__)


@dataclass
class ShardstreamInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    """``rendezvous``: the store rendezvous file the trainer's ``RefitSession.open`` names;
    ``timeout``: seconds any wait may take; ``transport``: "gloo" (default) or "nccl" / "shm";
    ``verify``: checksum every region after each pull; ``delta``: ask for a delta session (on if
    either job asks; the engine then keeps a host base, see ``ShardstreamWeightTransferEngine``)."""

    rendezvous: str
    timeout: float = 300.0
    transport: str | None = None
    verify: bool = False
    delta: bool = False
    #: "none": ``update_weights`` pulls the push itself; "host": a process of each worker's own stages
    #: every push in shared host buffers while the engine serves, and ``update_weights`` commits a
    #: staged version (staging.py, stage_proc.py)
    staging: str = "none"
    #: this engine's name as one of several inference replicas fed by one trainer
    #: (``RefitSession.open(..., replicas=True)``); None: the trainer's only receiver job
    replica: str | None = None
    #: "fast" (vLLM's layerwise-reload internals), "load_weights" (vLLM's public reload and
    #: ``model.load_weights``, every array received whole: loadweights.py), or "auto": fast where
    #: this vLLM has every internal the fast path uses, else load_weights
    reload: str = "auto"
    #: an adapter session: the PEFT config of the LoRA adapters the trainer pushes (r, lora_alpha,
    #: target_modules, ...); each push is registered as a LoRA adapter (lora.py), the base weights
    #: are not touched. Needs an engine started with enable_lora=True
    adapter: dict[str, Any] | None = None


@dataclass
class ShardstreamUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """``version`` (staging "host"): the staged version to commit; None: the newest staged one, or
    the push under way (waited for up to the timeout). Without staging the trainer's push says
    what moves and ``version`` is not read."""

    version: int | None = None
    #: adapter sessions: the name and id the pushed adapter is registered under (``LoRARequest``)
    lora_name: str | None = None
    lora_id: int | None = None
    #: a name already pushed to this engine is refused: vLLM's prefix cache keys an adapter's KV
    #: blocks by its name and path, so a new version under an old name would reuse blocks the old
    #: version computed. True: take it anyway; the caller resets the prefix cache before serving it
    lora_replace: bool = False


class ShardstreamWeightTransferEngine(
        WeightTransferEngine[ShardstreamInitInfo, ShardstreamUpdateInfo]):  # type: ignore[misc]
    init_info_cls = ShardstreamInitInfo
    update_info_cls = ShardstreamUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.session: Any = None
        self.described: VllmManifests | None = None
        self.naming = "per_expert"
        self._reloading = False
        self._received = False  # this update's pull is done (a second update_weights is refused)
        #: delta sessions: this worker's model-format bytes of the last push, one host tensor per
        #: local tensor (what the next push's XOR deltas apply to); None outside a delta session
        self.base: dict[str, Any] | None = None
        #: seconds and bytes of the last update (pull, then per-layer processing)
        self.last: dict[str, Any] = {}
        #: the derived state of every layer the update processes, before it (audit.snapshot)
        self._before: Snapshot | None = None
        #: staging "host": the thread that receives pushes while the engine serves (None: not staged)
        self.stager: Stager | None = None
        #: an adapter session's receiving side (init_info ``adapter``, lora.py)
        self.adapter: Any = None
        #: the public-API path's receiving side (init_info ``reload``, loadweights.py); None: fast path
        self.loader: LoadWeightsReceiver | None = None
        #: the worker's steps that served requests (steps.py): an update they fall into is refused
        self.steps: StepWatch | None = None
        self._started = False  # between start_weight_update and finish_weight_update
        self._worker: Any = None  # vLLM's worker that owns this engine (internals.worker_of)
        self._split = [0.0, 0.0]  # a staged commit's copy and processing seconds (``_commit_layer``)
        self._groups: tuple[str, list[tuple[Any, str, list[VllmTensor]]]] | None = None  # (naming, _layer_groups)
        #: the session being joined on a thread (joining.py): init returns at once, the first update waits
        self._join: Join | None = None
        self._timeout = 300.0

    # ------------------------------------------------------------------ joining
    @one_reply()
    def init_transfer_engine(self, init_info: ShardstreamInitInfo) -> None:
        if self.session is not None or self.stager is not None or self._join is not None:
            self.shutdown()
        self._timeout = init_info.timeout
        if init_info.staging not in ("none", "host"):
            raise ValueError(f"shardstream: init_info staging must be 'none' or 'host', got {init_info.staging!r}")
        if init_info.staging == "host" and init_info.transport in ("nccl", "cuda-ipc"):
            raise ValueError(f"shardstream: staging 'host' receives into host buffers, which the {init_info.transport} "
                             "transport cannot write: use transport 'gloo' with staging 'host'")
        try:
            self._worker = internals.worker_of(self)
        except internals.VllmInternalsError:
            self._worker = None  # the load_weights path needs no worker; the fast path refuses below
        init_info = dataclasses.replace(init_info, replica=dp_replica(self.parallel_config, init_info.replica))
        mode = reload_mode(init_info.reload, internals.missing())
        _check_parallel(self.parallel_config)  # every path: no layout is taken that no test has run
        if mode == "load_weights" and init_info.adapter is None:
            self._open_load_session(init_info)
            return
        internals.check()  # a vLLM without what the updates use is refused here, before any push
        worker = self._worker if self._worker is not None else internals.worker_of(self)
        if init_info.adapter is not None:
            self._open_adapter_session(init_info, worker)
            return
        self.steps = watch(worker)
        self.described = described = manifest_from_vllm(self.model)
        self._groups = None

        opts = {"rendezvous": init_info.rendezvous, "transport": init_info.transport, "timeout": init_info.timeout,
                "verify": init_info.verify, "delta": init_info.delta, "fp8_block": described.fp8_block,
                "replica": init_info.replica}
        if init_info.staging == "none":
            self._join = Join(lambda: self._open_session(opts))
            return
        import torch

        def joined(naming: str) -> dict[str, tuple[tuple[int, ...], Any]]:
            self.naming = naming  # the trainer's manifest chose it: the local tensors follow
            return {t.name: (t.shape, getattr(torch, t.data_type)) for t in self._locals()}

        # staged: a process of its own joins the trainer and receives (stage_proc: no GIL shared with the
        # engine), so this returns at once and the engine serves meanwhile
        device = self._cuda_device()
        receiver = ProcessReceiver({**opts, "manifests": dict(described.manifests),
                                    "device": None if device is None else str(device)}, joined, init_info.timeout)
        self.stager = Stager(receiver, init_info.timeout)
        self.stager.start()

    def _open_adapter_session(self, init_info: ShardstreamInitInfo, worker: Any) -> None:
        from streamer.vllm.lora import AdapterReceiver

        if init_info.staging != "none":
            raise ValueError("shardstream: adapter sessions are not staged yet: use staging 'none'")
        assert init_info.adapter is not None
        self.adapter = receiver = AdapterReceiver(worker, init_info.adapter, world_cpu_group())
        self._join = Join(lambda: _open_whole(init_info, receiver.choose, delta=False, device=None))

    def _open_load_session(self, init_info: ShardstreamInitInfo) -> None:
        """The public-API path (loadweights.py): every array received whole, then ``load_weights``."""
        if init_info.staging != "none":
            raise ValueError("shardstream: reload 'load_weights' is not staged: use staging 'none'")
        if internals.missing():
            _log.warning("shardstream: this vLLM lacks internals of the fast path (%s): every push is received "
                         "whole and loaded with model.load_weights", ", ".join(internals.missing()))
        self.loader = receiver = LoadWeightsReceiver(self.model, self.model_config)
        device = self._cuda_device()
        self._join = Join(lambda: _open_whole(init_info, receiver.choose, delta=init_info.delta, device=device))

    def _receive_loaded(self) -> None:
        """One push on the public-API path: received whole, then loaded by vLLM's weight loaders."""
        assert self.loader is not None
        session = self._need_session()
        t0 = time.perf_counter()
        try:
            st = session.pull(self.loader.buffers())
        except BaseException:
            # vLLM ends an update whose update_weights raised (no finish follows): put every layer
            # back as it was, from its kernel tensors (nothing was loaded), then report the failure
            self.loader.finish()
            self._before = None
            raise
        t1 = time.perf_counter()
        self.loader.load(self.loader.buffers())
        self.last = {"pull_s": t1 - t0, "load_s": time.perf_counter() - t1, "bytes_received": st.bytes_received,
                     "full_bytes_received": st.full_bytes_received, "encodings": dict(st.encodings),
                     "version": st.version, "reload": "load_weights", "delta": session.options.delta}

    def _receive_adapter(self, update_info: ShardstreamUpdateInfo) -> None:
        """One adapter push: refused before any byte moves when it cannot be registered; registered
        on every worker only once every worker holds all of it."""
        receiver, session = self.adapter, self._need_session()
        assert receiver is not None
        problems = receiver.refusals(update_info.lora_id, update_info.lora_name, update_info.lora_replace)
        if problems:
            session.refuse(problems)
        tensors = receiver.buffers()
        error: BaseException | None = None
        t0 = time.perf_counter()
        try:
            st = session.pull(tensors)
        except BaseException as e:  # noqa: BLE001 - every worker learns it before anyone registers
            error = e
        if not receiver.agreed(error is None and st is not None):
            if error is not None:
                raise error
            raise RuntimeError("shardstream: another worker did not receive the whole adapter: nothing was registered")
        assert update_info.lora_name is not None
        t1 = time.perf_counter()
        if update_info.lora_id is None:
            receiver.hold(tensors, update_info.lora_name)  # loaded later as shardstream://NAME (lora.py)
        else:
            receiver.register(tensors, update_info.lora_id, update_info.lora_name)
        self.last = {"adapter": update_info.lora_name, "lora_id": update_info.lora_id,
                     "bytes_received": st.bytes_received, "version": st.version, "pull_seconds": t1 - t0,
                     "register_seconds": time.perf_counter() - t1}

    def _open_session(self, opts: dict[str, Any]) -> Any:
        assert self.described is not None
        session, self.naming = open_receiver({**opts, "manifests": self.described.manifests,
                                              "device": self._cuda_device()})
        return session

    def _cuda_device(self) -> Any:
        """The worker's own device for the nccl transport (None on CPU): vLLM chose it, and it need
        not be ``LOCAL_RANK`` (remapped ``CUDA_VISIBLE_DEVICES``, data parallelism); the session
        uses it as given and never calls ``set_device`` inside the worker."""
        device = getattr(self, "device", None)
        return device if getattr(device, "type", None) == "cuda" else None

    # ------------------------------------------------------------------ one update
    def start_weight_update(self) -> None:
        """Opens the update; the served tensors stay as they are until ``update_weights``, which
        does the whole update in one call (no engine step can fall inside it). A join still under
        way is waited for here (up to the timeout); its failure is raised by ``update_weights``."""
        if not self._settled():
            self._started, self._received = True, False
            return
        self._need_session()
        if self.adapter is not None:  # an adapter push touches no served weight: nothing to audit
            self._started = True
            return
        if self.loader is not None:
            self._before = snapshot(self.model, self.loader.audited())
            self.loader.start()
            self._started, self._received = True, False
            return
        self._before = snapshot(self.model, self._audited())
        if self.steps is not None:
            self.steps.mark()
        self._started = True
        self._received = False

    @one_reply(lambda self: self._ended_by_failure())
    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class calls torch.accelerator.synchronize() unconditionally, which raises on CPU
        self.receive_weights(self.parse_update_info(update_info))
        if getattr(self.device, "type", "cpu") != "cpu":
            import torch

            torch.accelerator.synchronize()

    def _ended_by_failure(self) -> None:
        """Another worker's update_weights failed and raises for the engine (replies.py): end the
        update here as vLLM's worker ends one whose update_weights raised (its flag and target)."""
        self._started = False
        if self._worker is not None and hasattr(self._worker, "_weight_update_active"):
            self._worker._weight_update_active = False
        reset = getattr(self, "reset_weight_update_target", None)
        if reset is not None:
            reset()

    def receive_weights(self, update_info: ShardstreamUpdateInfo) -> None:
        if self.adapter is not None:
            self._receive_adapter(update_info)
            return
        if self.loader is not None:
            if not self._started or self._received:
                raise RuntimeError("shardstream: update_weights outside start_weight_update, or twice in one update "
                                   "(one push per update)")
            self._received = True
            self._receive_loaded()
            return
        if self.stager is not None:
            self._commit_staged(update_info.version)
            return
        session = self._need_session()
        if not self._started:
            raise RuntimeError("shardstream: update_weights before start_weight_update")
        if self._received:
            # one push is one update: the first pull already rebuilt every layer. vLLM ends an update
            # whose update_weights raised (no finish follows), so complete this one here: its weights,
            # received in full, stay served, and vLLM keeps the previous weight_version
            self.finish_weight_update()
            raise RuntimeError("shardstream: update_weights was already called in this update (one push per update: "
                               "call finish_weight_update, then start_weight_update for the next push); the update "
                               "ends with the first push's weights")
        running = self._running()
        if running:
            self._abort()
            session.refuse([running])  # the trainer's push ends at once, on every rank, with the reason
        self._begin()
        try:
            t0 = time.perf_counter()
            tensors, layers = self._targets()
            t1 = time.perf_counter()
            st = session.pull(self._with_base(tensors) if session.options.delta else tensors)
            if session.options.delta:
                for n, t in tensors.items():
                    t.copy_(self.base[n])  # type: ignore[index]  # _with_base made it
            t2 = time.perf_counter()
            self._process(layers)
            self._process_aliases()
            self._end()
            t3 = time.perf_counter()
        except BaseException:
            self._abort()
            raise
        self._received = True
        self.last = {"version": st.version, "materialize_seconds": t1 - t0, "pull_seconds": t2 - t1,
                     "process_seconds": t3 - t2,
                     "bytes_received": st.bytes_received, "naming": self.naming,
                     "reprocessed_layers": sum(1 for _, p in layers if p == "reprocess"),
                     "tied_layers": len(self._aliases()),
                     "inplace_layers": sum(1 for _, p in layers if p == "inplace"),
                     "delta": session.options.delta, "full_bytes_received": st.full_bytes_received,
                     "encodings": dict(st.encodings), "base_bytes": sum(b.nbytes for b in (self.base or {}).values()),
                     "quantized": _quantized(session), "quantize_seconds": st.quantize_seconds}

    def _commit_staged(self, version: int | None) -> None:
        """Staging "host": copy a staged version into the served tensors and process it, one layer at
        a time (one layer's model-format tensors in extra memory at once). A commit that fails puts
        back, from the committed host copy, every layer it had written (before the first commit
        there is none: the error says the engine then serves a mix, until the next commit)."""
        stager = self.stager
        assert stager is not None
        if not self._started:
            raise RuntimeError("shardstream: update_weights before start_weight_update")
        if self._received:
            self.finish_weight_update()
            raise RuntimeError("shardstream: update_weights was already called in this update (one version per "
                               "update); the update ends with the first version committed")
        running = self._running()
        if running:
            self._abort()
            raise RuntimeError(running)
        t0 = time.perf_counter()
        try:
            buf = stager.take(version)
        except BaseException:
            self._abort()
            raise
        t1 = time.perf_counter()
        done: list[tuple[Any, str, list[VllmTensor]]] = []
        peak = 0
        self._split = [0.0, 0.0]  # the commit's seconds copying staged bytes, and in vLLM's processing
        try:
            self._begin()
            for group in self._layer_groups():
                peak = max(peak, self._commit_layer(*group, buf.tensors))
                done.append(group)
            self._process_aliases()
            self._end()
        except BaseException as e:
            self._abort()
            stager.release(buf)
            restored = self._restore(done)
            raise RuntimeError(f"shardstream: committing version {buf.version} failed ({type(e).__name__}: {e}); "
                               + (f"the {len(done)} layers it had written were restored from version {restored}"
                                  if restored is not None else
                                  f"{len(done)} layers hold the new weights and the rest the old ones (no committed "
                                  "host copy before the first commit): commit again")) from e
        stager.committed(buf)
        self._received = True
        t2 = time.perf_counter()
        pushes = stager.received
        self.last = {"staged": True, "version": buf.version, "wait_seconds": t1 - t0, "commit_seconds": t2 - t1,
                     "copy_seconds": self._split[0], "process_seconds": self._split[1],
                     "peak_extra_bytes": peak, "staging_bytes": stager.nbytes, "naming": self.naming,
                     "layers": len(done), "tied_layers": len(self._aliases()),
                     "bytes_received": pushes[-1][2] if pushes else 0,
                     "pull_seconds": pushes[-1][1] if pushes else 0.0}

    def _layer_groups(self) -> list[tuple[Any, str, list[VllmTensor]]]:
        """Per layer (in model order): the layer, its update path and its local tensors. Found once
        per naming (the modules outlive every update), not inside each commit's pause."""
        if self._groups is None or self._groups[0] != self.naming:
            groups: dict[int, tuple[Any, str, list[VllmTensor]]] = {}
            for t in self._locals():
                layer = self.model.get_submodule(t.module)
                groups.setdefault(id(layer), (layer, t.path, []))[2].append(t)
            self._groups = (self.naming, list(groups.values()))
        return self._groups[1]

    def _commit_layer(self, layer: Any, path: str, ts: list[VllmTensor], src: Mapping[str, Any]) -> int:
        """One layer: its tensors from ``src`` (host), then vLLM's processing; the bytes it held in
        model format while it was processed (its share of the commit's extra memory)."""
        targets = self._open_layer(layer, path, ts)
        t0 = time.perf_counter()
        for name, view in targets.items():
            view.copy_(src[name])
        t1 = time.perf_counter()
        self._process([(layer, path)])
        self._split[0] += t1 - t0
        self._split[1] += time.perf_counter() - t1
        return sum(view.nbytes for view in targets.values()) if path == "reprocess" else 0

    def _restore(self, done: list[tuple[Any, str, list[VllmTensor]]]) -> int | None:
        """After a failed commit: the layers it wrote, from the committed host copy; its version
        (None: no copy, nothing restored)."""
        prev = self.stager.last_committed() if self.stager is not None else None
        if prev is None or not done:
            return None if done else (prev.version if prev else None)
        self._begin()
        try:
            for group in done:
                self._commit_layer(*group, prev.tensors)
            self._process_aliases()
        finally:
            self._end()
        return prev.version

    def finish_weight_update(self) -> None:
        self._started = False  # update_weights ended vLLM's reload already
        if self.adapter is not None:
            from streamer.vllm.lora import keep_adapters_once

            keep_adapters_once(self.adapter.worker.model_runner)
            return
        if self.loader is not None:
            self.loader.finish()
        if self._before is not None:
            before, self._before = self._before, None
            left = stale(before)
            self.last["audit"] = {"layers": len(before), "stale": left}
            if left:
                raise RuntimeError(f"shardstream: {len(left)} tensors serve the previous weights after this update "
                                   f"(the engine does not claim this version): " + "; ".join(left))

    def shutdown(self) -> None:
        if self._join is not None:
            join, self._join = self._join, None
            join.abandon()
        self.base = None
        self.adapter = self.loader = None
        if self.stager is not None:
            stager, self.stager = self.stager, None
            stager.stop()
        if self.session is not None:
            session, self.session = self.session, None
            session.close()

    # ------------------------------------------------------------------ the pieces
    def _settled(self) -> bool:
        """Wait (up to the timeout) for a join under way; False when it failed or timed out, and
        ``_need_session`` will raise why. True otherwise (nothing was being joined)."""
        if self._join is None:
            return True
        if not self._join.wait(self._timeout) or self._join.error is not None:
            return False
        self.session, self._join = self._join.session, None
        return True

    def _need_session(self) -> Any:
        if self.session is None and self._join is not None:
            # the join's failure, by name; a start_weight_update that waited for it already (and
            # skipped its own set-up) is not followed by a second wait: this update fails now
            self.session = self._join.result(self._timeout, waited=self._started)
            self._join = None
        if self.session is None and self.stager is not None:
            return self.stager  # staged: the thread holds the session
        if self.session is None:
            raise RuntimeError("shardstream: init_weight_transfer_engine has not joined a refit session")
        return self.session

    def _locals(self) -> tuple[VllmTensor, ...]:
        assert self.described is not None
        return self.described.tensors[self.naming]

    def _aliases(self) -> Mapping[str, str]:
        assert self.described is not None
        return self.described.aliases

    def _audited(self) -> list[str]:
        """Every layer an update writes or rebuilds: the described ones and the tied ones."""
        return list(dict.fromkeys([t.module for t in self._locals()] + list(self._aliases())))

    def _process_aliases(self) -> None:
        """Tied layers (``lm_head`` serving ``embed_tokens.weight``): once their owner's kernel
        tensors hold the pushed bytes, run the layer's own processing on them again, as a fresh
        load does (vLLM processes every module after loading, the tied head after the embedding).
        On the CPU build that rebuilds the head's packed copy, which the logits are computed from;
        without it the engine served the new body with the first load's output head."""
        v = internals.load()
        for module in self._aliases():
            layer = self.model.get_submodule(module)
            info = v.LAYERWISE_INFO.get(layer)
            if info is None or info.kernel_tensors is None:
                raise RuntimeError(f"shardstream: tied layer {module} was not set up for reload (start_weight_update)")
            v.place_kernel_tensors(layer, info)  # the owner's tensors, which now hold the pushed bytes
            _rerun_processing(layer, v)
            v.copy_and_restore_kernel_tensors(layer, info)
            info.reset()

    def _with_base(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Delta sessions: the pull writes into this worker's host base, not into the tensors the
        update fills. Those change storage on every update (``reprocess`` layers are materialized
        afresh) and no longer hold the last push's bytes once vLLM processed them, so a delta could
        not apply to them; the base keeps one storage per session, which is what lets the session
        send deltas (a receiver's other buffers count as unknown: full bytes). The base is copied
        into the targets after each pull, so every update writes every tensor whole."""
        import torch

        if self.base is None:
            self.base = {n: torch.zeros(t.shape, dtype=t.dtype, device="cpu") for n, t in tensors.items()}
        return self.base

    def _targets(self) -> tuple[dict[str, Any], list[tuple[Any, str]]]:
        """The tensors the pull writes, every layer opened at once (``_open_layer``), and the layers."""
        tensors: dict[str, Any] = {}
        layers: list[tuple[Any, str]] = []
        for layer, path, ts in self._layer_groups():
            tensors.update(self._open_layer(layer, path, ts))
            layers.append((layer, path))
        return tensors, layers

    def _open_layer(self, layer: Any, path: str, ts: list[VllmTensor]) -> dict[str, Any]:
        """One layer ready to be written: its tensors an update writes, by local name. The kernel
        tensors of an ``inplace`` layer; freshly materialized model-format parameters of a
        ``reprocess`` layer (vLLM's ``materialize_layer``)."""
        v = internals.load()
        info = v.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or info.kernel_tensors is None:
            raise RuntimeError(f"shardstream: {ts[0].module} was not set up for reload (start_weight_update)")
        if path == "reprocess":
            v.materialize_layer(layer, info)
        return {t.name: (getattr(layer, t.param) if path == "reprocess" else info.kernel_tensors[0][t.param])
                .data.view(t.shape) for t in ts}

    def _process(self, layers: list[tuple[Any, str]]) -> None:
        """Per layer, what ``_layerwise_process`` does after its loads: vLLM's processing of the new
        weights, copied into the kernel tensors (``reprocess``); or just the kernel tensors put back
        (``inplace``). Either way the layer is done: finalize skips it."""
        v = internals.load()
        for layer, path in layers:
            info = v.LAYERWISE_INFO[layer]
            if path == "reprocess":
                qm = _rerun_processing(layer, v)
                if qm is not None:
                    _experts_prepack(qm, layer)
                    if hasattr(layer, "update_param_tp_status"):
                        layer.update_param_tp_status()
                v.copy_and_restore_kernel_tensors(layer, info)
            else:
                v.place_kernel_tensors(layer, info)
            info.reset()

    def _running(self) -> str | None:
        """Why this update may not write (the engine served requests since ``start_weight_update``:
        it is not paused), or None. Every worker runs every step, so all of them agree."""
        n = self.steps.since_mark() if self.steps is not None else 0
        if not n:
            return None
        return (f"shardstream: the engine served requests during this update ({n} steps since start_weight_update), "
                "so it is not paused: nothing was written and it serves the previous weights. Pause generation "
                "first (LLM.pause_generation() or POST /pause, mode abort, wait or keep), then start_weight_update, "
                "update_weights, finish_weight_update, reset_prefix_cache, and resume")

    def _begin(self) -> None:
        """vLLM's layerwise reload set up: every layer in model format on the meta device, its
        kernel tensors kept aside. Only inside ``update_weights``: no step runs on meta tensors."""
        internals.load().initialize_layerwise_reload(self.model)
        self._reloading = True

    def _end(self) -> None:
        """``finalize_layerwise_reload``: the layers the update did not process (attention) are
        processed, the rest restored."""
        if self._reloading:
            self._reloading = False
            internals.load().finalize_layerwise_reload(self.model, self.model_config)

    def _abort(self) -> None:
        """Put every layer's kernel tensors back (vLLM's finalize does: nothing was loaded through its
        loaders), so a failed update leaves a model that still serves."""
        self._before = None
        self._started = False
        self._end()


def _open_whole(init_info: ShardstreamInitInfo, choose: Any, *, delta: bool, device: Any) -> Any:
    """A receiving session whose manifest ``choose(src, world_size)`` builds from the trainer's, with
    every array whole on each worker (adapter sessions and the load_weights path)."""
    from formats.manifest.spec import Manifest
    from streamer import RefitOptions, RefitSession
    from streamer.transport.jobs import launcher_rank

    size = launcher_rank()[1]
    return RefitSession.open(Manifest(world_size=size, arrays={}), "recv", rendezvous=init_info.rendezvous,
                             transport=init_info.transport, timeout=init_info.timeout,
                             options=RefitOptions(verify=init_info.verify, delta=delta),
                             choose_manifest=lambda src: choose(src, size), replica=init_info.replica, device=device)


def dp_replica(pc: Any, replica: str | None) -> str | None:
    """The replica name this engine joins the trainer under. vLLM runs the data-parallel ranks of a
    dense model as independent engines (each reconfigured to DP 1; ``data_parallel_index`` keeps its
    rank) and sends ``init_weight_transfer_engine`` to all of them, so each joins as a replica of its
    own: ``NAME`` for DP rank 0, ``NAME-dpK`` for rank K (rank 0 cannot tell that it has peers). A
    DP group that kept ``data_parallel_size`` > 1 (an MoE's) is not independent ranks: the name
    stands, and ``_check_parallel`` refuses it by name."""
    index = int(getattr(pc, "data_parallel_index", 0) or 0)
    if index == 0 or int(getattr(pc, "data_parallel_size", 1) or 1) > 1:
        return replica
    if replica is None:
        raise ValueError(f"shardstream: this engine is data-parallel rank {index} of a vLLM engine whose ranks "
                         "each receive on their own: name a replica in init_info (replica=NAME; rank K joins as "
                         "NAME-dpK) and open the trainer with replicas=True")
    return f"{replica}-dp{index}"


def _check_parallel(pc: Any) -> None:
    """Refuse, by name, the vLLM parallel layouts no test has run: pipeline parallelism (each stage
    would describe only its layers) and data parallelism (each DP rank's workers are a receiver job
    of their own, which needs one replica name per DP rank)."""
    problems = []
    pp = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    dp = int(getattr(pc, "data_parallel_size", 1) or 1)
    if pp > 1:
        problems.append(f"pipeline_parallel_size {pp} is not supported yet (untested; use tensor parallelism)")
    if dp > 1:
        problems.append(f"data_parallel_size {dp} is not supported yet (untested): start one engine per replica "
                        "instead, each with its own init_info replica name")
    if problems:
        raise ValueError("shardstream: " + "; ".join(problems))


def _rerun_processing(layer: Any, v: Any) -> Any:
    """Run the layer's quant method's ``process_weights_after_loading`` on its current weights, as
    vLLM's loading does (its ran-once flag cleared first); the method, or None for a layer without
    one."""
    qm = getattr(layer, "quant_method", None)
    if not isinstance(qm, v.QuantizeMethodBase):
        return None
    process_again(layer, qm)
    return qm


def _quantized(session: Any) -> dict[str, int]:
    """Quantize on refit: how many FP8 weights the senders and this job's receivers quantize."""
    q = session.quant
    if q is None:
        return {}
    where = [q.where(f) for f in q.targets]
    return {w: where.count(w) for w in sorted(set(where))}


def _experts_prepack(qm: Any, layer: Any) -> None:
    """FusedMoE: run the experts kernel's own weight preparation on the new weights. vLLM 0.32's
    ``UnquantizedFusedMoEMethod._setup_kernel`` runs it on the first load only (the CPU kernels
    prepack w13 / w2 into their grouped-GEMM layout there) and skips it on a weight update, which
    would leave the kernel reading unpacked bytes as packed ones; the engine's logprobs then drift
    from a fresh load's. A hook that is a no-op (GPU backends) costs nothing."""
    kernel = getattr(qm, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    hook = getattr(experts, "process_weights_after_loading", None)
    if hook is not None:
        hook(layer)
