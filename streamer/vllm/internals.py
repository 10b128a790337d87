"""Everything the backend takes from vLLM beyond its public weight-transfer API, in one place.

The weight-transfer engine base class and its factory are vLLM's public contract. The rest is not:
the layerwise reload machinery (its per-layer records, ``materialize_layer``, the kernel-tensor
copy), which vLLM 0.33/0.34 rework (``VLLM_RELOAD_MODE=direct``), the layer classes whose
attributes describe each worker's regions, and the LoRA manager that adapter sessions register with. ``USED`` lists each name, this module is the only one of
``streamer/vllm`` that imports them (tests/unit/test_vllm_internals.py), and :func:`check` runs at
``init_weight_transfer_engine``: a vLLM that lacks any of them is refused by name, before any push,
instead of failing half-way through an update.

One more dependency is structural: the engine reaches its worker (:func:`worker_of`) through the
call that creates the transfer (``Worker.init_weight_transfer_engine``), to watch the model
runner's steps (``streamer.vllm.steps``), and to end vLLM's update on the workers that return
while another raises (``streamer.vllm.replies``: the worker's ``_weight_update_active`` flag,
set to False as vLLM's own ``update_weights`` does when it raises; skipped when absent).
"""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace
from typing import Any

__all__ = ["USED", "VllmInternalsError", "check", "load", "missing", "worker_of"]

#: module -> the names taken from it (the contract; the vLLM tier checks that each resolves)
USED: dict[str, tuple[str, ...]] = {
    "vllm.model_executor.model_loader.reload": ("initialize_layerwise_reload", "finalize_layerwise_reload"),
    "vllm.model_executor.model_loader.reload.layerwise": (
        "LAYERWISE_INFO", "_copy_and_restore_kernel_tensors", "_place_kernel_tensors"),
    "vllm.model_executor.model_loader.reload.meta": ("materialize_layer",),
    "vllm.model_executor.model_loader.weight_utils": ("default_weight_loader",),
    "vllm.model_executor.layers.quantization.base_config": ("QuantizeMethodBase",),
    "vllm.model_executor.layers.quantization.fp8": ("Fp8LinearMethod",),
    "vllm.model_executor.layers.fused_moe.routed_experts": ("RoutedExperts",),
    "vllm.model_executor.layers.linear": (
        "ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear", "ReplicatedLinear",
        "RowParallelLinear", "UnquantizedLinearMethod"),
    "vllm.model_executor.layers.vocab_parallel_embedding": ("UnquantizedEmbeddingMethod", "VocabParallelEmbedding"),
    "vllm.distributed.parallel_state": ("get_world_group",),
    # adapter sessions (lora.py): an adapter's PEFT config, as vLLM reads it from a directory; also
    # used there, as attributes of the worker's LoRA manager: _adapter_manager, _lora_model_cls,
    # _registered_adapters (its CPU cache), _load_adapter (held adapters), the checks its loader runs
    # after building (_validate_moe_lora_format, _validate_modules_to_save,
    # _validate_token_classification_lora: each run where present) and the model runner's reset_lora_state
    "vllm.lora.peft_helper": ("PEFTHelper",),
}


class VllmInternalsError(RuntimeError):
    """This vLLM lacks names the backend needs; the message names each one."""


def missing() -> list[str]:
    """Every name of ``USED`` this vLLM does not provide, as ``module.name``."""
    out: list[str] = []
    for module, names in USED.items():
        try:
            mod = importlib.import_module(module)
        except ImportError:
            out.extend(f"{module}.{n}" for n in names)
            continue
        out.extend(f"{module}.{n}" for n in names if not hasattr(mod, n))
    return out


def check() -> None:
    """Refuse, naming each one, a vLLM that lacks any name of ``USED``."""
    gone = missing()
    if gone:
        import vllm

        raise VllmInternalsError(
            f"shardstream: vLLM {getattr(vllm, '__version__', '?')} lacks {len(gone)} internals the backend uses "
            f"(tested on vLLM 0.32.x): " + ", ".join(gone))


@functools.cache
def load() -> Any:
    """Every name of ``USED``, imported once, as attributes of one namespace."""
    ns = SimpleNamespace()
    for module, names in USED.items():
        mod = importlib.import_module(module)
        for n in names:
            setattr(ns, n.lstrip("_"), getattr(mod, n))
    return ns


def worker_of(engine: Any) -> Any:
    """The vLLM worker whose ``weight_transfer_engine`` is ``engine``: the caller of
    ``init_transfer_engine`` (vLLM's ``Worker.init_weight_transfer_engine``). Refused by name when
    no caller up the stack holds it (a vLLM that creates the engine some other way)."""
    import sys

    frame: Any = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if getattr(owner, "weight_transfer_engine", None) is engine and hasattr(owner, "model_runner"):
            return owner
        frame = frame.f_back
    raise VllmInternalsError("shardstream: the weight-transfer engine was not joined through a vLLM worker's "
                             "init_weight_transfer_engine (tested on vLLM 0.32.x): cannot watch its steps")
