"""Nothing served stale: after each update, every copy that vLLM built from the weights at load is
built again from the pushed ones.

A vLLM layer serves from more than its parameters. Its quant method's
``process_weights_after_loading`` may build derived state from them: the CPU build packs every
linear and embedding weight for its GEMM kernels and keeps the packed copy inside a closure
(``layer.cpu_linear``); FP8 and other methods keep transformed tensors as attributes. An update
that writes the parameters and does not rebuild that state leaves the layer serving the old
weights, silently (a tied ``lm_head`` did: it shares ``embed_tokens.weight``, so no push writes it,
and its packed copy kept the first load's embedding).

The audit has two halves:

* at ``init_weight_transfer_engine`` (``manifest.describe_worker``): every parameter a module
  serves from is written by the push or is a tied alias of one that is (reprocessed after its
  owner on every update); every persistent buffer is one no weight determines; anything else is
  refused by name;
* after every update (:func:`snapshot` before, :func:`stale` after, cheap: a walk over the
  modules, no data read): every piece of derived state of each layer the update processed
  (tensor attributes and closures in the layer's ``__dict__``, not its parameters or buffers) is a
  new object, not the one built from the previous weights. A layer that kept one is named, and the
  update fails: the engine does not claim weights its kernels do not serve.

Weak references: the snapshot must not keep the old packed copies alive (a second copy of the
model), and an object freed during the update cannot be mistaken for one that survived it.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Iterable
from typing import Any

__all__ = ["derived_state", "snapshot", "stale"]

#: per module name: the layer (an update keeps the module objects), and weak references to its derived state
Snapshot = dict[str, tuple[Any, dict[str, "weakref.ReferenceType[Any]"]]]


def derived_state(layer: Any) -> dict[str, Any]:
    """The layer's state that processing may build from its weights: tensors and closures held as
    plain attributes (parameters, buffers and submodules are not plain attributes). Functions
    without a closure (``torch.nn.functional.linear`` as a fallback) hold no weights."""
    import torch

    out: dict[str, Any] = {}
    for k, v in vars(layer).items():
        # the Parameter check only for tensors: its metaclass check is slow, and this runs twice per
        # layer inside the engine's pause (a module is neither a tensor nor a function)
        if isinstance(v, types.FunctionType):
            if v.__closure__:
                out[k] = v
        elif isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
            out[k] = v
    return out


def snapshot(model: Any, modules: Iterable[str]) -> Snapshot:
    """Weak references to the derived state of ``modules`` (names in ``model``), before an update."""
    out: Snapshot = {}
    for m in modules:
        layer = model.get_submodule(m)
        out[m] = (layer, {k: weakref.ref(v) for k, v in derived_state(layer).items()})
    return out


def stale(before: Snapshot) -> list[str]:
    """Each piece of derived state that the update left as it was, one line per attribute."""
    out = []
    for m, (layer, refs) in before.items():
        now = derived_state(layer)
        for k, ref in refs.items():
            old = ref()
            if old is not None and now.get(k) is old:
                out.append(f"{m}.{k}: built from the previous weights and not rebuilt by this update "
                           f"({type(old).__name__})")
    return out
