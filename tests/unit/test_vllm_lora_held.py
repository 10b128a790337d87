"""Adapters pushed by name (streamer/vllm/lora.py ``hold``, ``held_adapters``): vLLM's own loading
of a ``shardstream://NAME`` path gets the pushed adapter under the id its caller picked, any other
path loads as vLLM loads it, an unknown name is refused by name, and a worker keeps no more
adapters than its CPU cache could hold. vLLM's worker LoRA manager is faked."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from streamer.vllm import lora


def _manager(capacity: int = 2) -> Any:
    return SimpleNamespace(_load_adapter=lambda req: ("from disk", req.lora_path),
                           _adapter_manager=SimpleNamespace(capacity=capacity))


def _receiver(wm: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    r = object.__new__(lora.AdapterReceiver)
    r.worker_manager = wm
    monkeypatch.setattr(r, "_lora_model", lambda tensors, lora_id: SimpleNamespace(id=lora_id, loras=tensors))
    return r


def test_a_held_adapter_loads_under_the_callers_id_and_other_paths_load_from_disk(
        monkeypatch: pytest.MonkeyPatch) -> None:
    wm = _manager()
    r = _receiver(wm, monkeypatch)
    r.hold({"a": 1}, "policy-v1")
    got = wm._load_adapter(SimpleNamespace(lora_path="shardstream://policy-v1", lora_int_id=7))
    again = wm._load_adapter(SimpleNamespace(lora_path="shardstream://policy-v1", lora_int_id=9))  # evicted, reloaded
    assert (got.id, again.id, got.loras) == (7, 9, {"a": 1}) and got is not again
    assert wm._load_adapter(SimpleNamespace(lora_path="/adapters/x", lora_int_id=3)) == ("from disk", "/adapters/x")
    with pytest.raises(ValueError, match="no adapter pushed as 'policy-v9' on this worker .held: policy-v1"):
        wm._load_adapter(SimpleNamespace(lora_path="shardstream://policy-v9", lora_int_id=4))


def test_a_worker_holds_more_than_vllms_cpu_cache_and_drops_the_oldest_beyond_that(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Held adapters are what vLLM reloads evicted ones from: with a CPU cache of 1, two versions
    alternate only if the worker holds both; beyond max(4, 2 x the cache) the oldest go."""
    wm = _manager(capacity=1)
    r = _receiver(wm, monkeypatch)
    for v in range(1, 6):
        r.hold({"v": v}, f"policy-v{v}")
    assert list(lora.held_adapters(wm)) == [f"policy-v{v}" for v in (2, 3, 4, 5)]
    assert lora.held_limit(1) == 4 and lora.held_limit(3) == 6
    r.hold({"v": 20}, "policy-v2")  # the same name again (lora_replace): replaced, now the newest
    assert list(lora.held_adapters(wm)) == ["policy-v3", "policy-v4", "policy-v5", "policy-v2"]
    assert wm._load_adapter(SimpleNamespace(lora_path="shardstream://policy-v2", lora_int_id=1)).loras == {"v": 20}


def test_a_push_by_name_needs_a_name_and_no_id_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    r = _receiver(_manager(), monkeypatch)
    r.problems = []
    assert r.refusals(None, "policy-v1") == []
    assert "update_info needs lora_name" in r.refusals(None, None)[0]


def test_a_name_pushed_before_is_refused_unless_the_caller_replaces_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's prefix cache keys an adapter's KV blocks by its name and path: a new version under an
    old name would be served with the old version's blocks, so the name is refused (by id and by
    name alike) until the caller says it resets the prefix cache itself."""
    r = _receiver(_manager(), monkeypatch)
    r.problems = []
    r.hold({"v": 1}, "policy")
    (problem,) = r.refusals(None, "policy")
    assert "lora_name 'policy' was pushed to this engine before" in problem and "reset_prefix_cache" in problem
    assert r.refusals(None, "policy", replace=True) == []
    assert r.refusals(None, "policy-v2") == []
