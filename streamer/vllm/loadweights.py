"""The public-API path: each push received whole on every worker and handed to ``load_weights``.

The fast path (engine.py) writes each worker's own regions straight into the layers, through
vLLM's layerwise-reload internals (``internals.USED``), which vLLM 0.33/0.34 rework. This path uses
only what vLLM's own NCCL engine uses: ``initialize_layerwise_reload(model)`` at
``start_weight_update``, ``model.load_weights(...)`` with checkpoint-format tensors, and
``finalize_layerwise_reload(model, model_config)`` at ``finish_weight_update``. The model's weight
loaders then slice, fuse and process the weights as a load from disk does.

``init_info["reload"]``: "fast" (the internals; refused by name when this vLLM lacks them),
"load_weights" (this path), or "auto" (the default: fast where this vLLM has every internal, else
this path, said once in the log). What this path costs: every worker receives every array whole
(a replicated receiving manifest: the bytes a gather-broadcast moves, planned so that each byte
crosses the link once per worker) into one host copy of the model per worker, kept between pushes
(so delta sessions work), and ``load_weights`` copies it once more. What it keeps: every check of
a push before any byte moves, the audit after it (every layer with a parameter must rebuild its
derived state), and tied layers: a head sharing the embedding's weight is processed again after
the embedding, which vLLM's reload alone does not do (its limitation 2).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from formats.manifest.spec import Manifest

__all__ = ["PUBLIC", "RELOAD_MODES", "LoadWeightsReceiver", "process_again", "reload_mode"]

RELOAD_MODES = ("auto", "fast", "load_weights")
#: the module and names this path takes from vLLM (public: vLLM's own NCCL engine calls them)
PUBLIC = ("vllm.model_executor.model_loader.reload", ("initialize_layerwise_reload", "finalize_layerwise_reload"))


def _public() -> Any:
    mod = importlib.import_module(PUBLIC[0])
    gone = [n for n in PUBLIC[1] if not hasattr(mod, n)]
    if gone:
        raise RuntimeError("shardstream: this vLLM lacks " + ", ".join(f"{PUBLIC[0]}.{n}" for n in gone)
                           + ": neither reload path can run")
    return mod


def reload_mode(asked: str, missing: list[str]) -> str:
    """"fast" or "load_weights": what ``asked`` ("auto", "fast", "load_weights") comes to on a
    vLLM that lacks the internals ``missing`` (``internals.missing()``)."""
    if asked not in RELOAD_MODES:
        raise ValueError(f"shardstream: init_info reload must be one of {', '.join(RELOAD_MODES)}, got {asked!r}")
    if asked == "auto":
        return "fast" if not missing else "load_weights"
    return asked


class LoadWeightsReceiver:
    """One worker's side of the public-API path: receives every array whole, then loads it."""

    def __init__(self, model: Any, model_config: Any) -> None:
        self.model, self.model_config = model, model_config
        self.reload = _public()
        self.manifest: Manifest | None = None
        self._buffers: dict[str, Any] | None = None
        self._tied = _tied_modules(model)

    def choose(self, src: Manifest, world_size: int) -> Manifest:
        from streamer.vllm.lora import replicated

        self.manifest = replicated(src, world_size, name="vllm-load-weights")
        return self.manifest

    def buffers(self) -> dict[str, Any]:
        """One host tensor per array, whole, allocated at the first push and kept (a delta
        session's base: the session sends changes into the same memory)."""
        import torch

        if self._buffers is None:
            assert self.manifest is not None
            self._buffers = {n: torch.empty(tuple(a.shape), dtype=getattr(torch, a.data_type))
                             for n, a in self.manifest.arrays.items()}
        return self._buffers

    def start(self) -> None:
        self.reload.initialize_layerwise_reload(self.model)

    def load(self, tensors: Mapping[str, Any]) -> None:
        self.model.load_weights(iter(tensors.items()))

    def finish(self) -> None:
        self.reload.finalize_layerwise_reload(self.model, self.model_config)
        for layer in self._tied:  # after their owners: they serve the owner's new weights
            qm = getattr(layer, "quant_method", None)
            if qm is not None and hasattr(qm, "process_weights_after_loading"):
                process_again(layer, qm)

    def audited(self) -> list[str]:
        """Every module with a parameter of its own: the layers a reload rebuilds."""
        return [n for n, m in self.model.named_modules() if any(True for _ in m.parameters(recurse=False))]


def _tied_modules(model: Any) -> list[Any]:
    """Modules whose parameter another module registered first (a tied ``lm_head``), in order."""
    seen: set[int] = set()
    tied = []
    for _, m in model.named_modules(remove_duplicate=False):
        params = list(m.parameters(recurse=False))
        if params and all(id(p) in seen for p in params) and m not in tied:
            tied.append(m)
        seen.update(id(p) for p in params)
    return tied


def process_again(layer: Any, qm: Any) -> None:
    """``qm.process_weights_after_loading(layer)`` as vLLM's loading runs it, once more: its ran-once
    flag cleared first (the engine's fast path runs it on each layer it commits)."""
    if hasattr(layer, "_already_called_process_weights_after_loading"):
        delattr(layer, "_already_called_process_weights_after_loading")
    qm.process_weights_after_loading(layer)
