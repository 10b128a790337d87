"""The public-API reload path's pure parts (streamer/vllm/loadweights.py): which path ``reload``
picks, the tied layers it processes again after their owners, and the layers it audits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from streamer.vllm.loadweights import _tied_modules, reload_mode  # noqa: E402


def test_auto_takes_the_fast_path_only_where_every_internal_exists() -> None:
    assert reload_mode("auto", []) == "fast"
    assert reload_mode("auto", ["vllm.model_executor.model_loader.reload.meta.materialize_layer"]) == "load_weights"
    assert reload_mode("fast", ["x"]) == "fast"  # asked: refused later, by name, by internals.check
    assert reload_mode("load_weights", []) == "load_weights"
    with pytest.raises(ValueError, match="reload must be one of auto, fast, load_weights, got 'quick'"):
        reload_mode("quick", [])


def test_a_head_sharing_the_embeddings_weight_is_tied_and_comes_after_it() -> None:
    class Model(torch.nn.Module):
        def __init__(self, tie: bool, same_module: bool = False) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.body = torch.nn.Linear(4, 4)
            self.head = self.embed if same_module else torch.nn.Linear(4, 10, bias=False)
            if tie and not same_module:
                self.head.weight = self.embed.weight

    tied = Model(tie=True)
    assert _tied_modules(tied) == [tied.head]
    assert _tied_modules(Model(tie=False)) == []
    shared = Model(tie=True, same_module=True)  # Qwen2's lm_head is embed_tokens itself: processed once more
    assert _tied_modules(shared) == [shared.embed]
