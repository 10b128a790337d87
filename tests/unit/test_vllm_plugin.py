"""The vLLM plugin registers the backend on tested vLLM releases only; on any other it logs one
line and registers nothing, so that vLLM keeps working (a fake ``vllm`` module stands in here; the
vLLM tier loads the real plugin in every engine)."""

from __future__ import annotations

import logging
import sys
import types
from typing import Any

import pytest

from streamer.vllm import plugin


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, version: str) -> dict[str, Any]:
    registry: dict[str, Any] = {}

    class Factory:
        _registry: dict[str, Any] = {}

        @classmethod
        def register_engine(cls, name: str, module: str, class_name: str) -> None:
            cls._registry[name] = (module, class_name)
            registry[f"{cls.__name__}:{name}"] = (module, class_name)

    class TrainerFactory(Factory):
        _registry: dict[str, Any] = {}

    mods = {"vllm": types.ModuleType("vllm"), "vllm.distributed": types.ModuleType("vllm.distributed"),
            "vllm.distributed.weight_transfer": types.ModuleType("vllm.distributed.weight_transfer"),
            "vllm.distributed.weight_transfer.factory": types.ModuleType("vllm.distributed.weight_transfer.factory")}
    mods["vllm"].__version__ = version  # type: ignore[attr-defined]
    factory = mods["vllm.distributed.weight_transfer.factory"]
    factory.WeightTransferEngineFactory = Factory  # type: ignore[attr-defined]
    factory.WeightTransferTrainerFactory = TrainerFactory  # type: ignore[attr-defined]
    mods["vllm.distributed.weight_transfer"].factory = factory  # type: ignore[attr-defined]
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delenv("SHARDSTREAM_VLLM_ANY_VERSION", raising=False)
    return registry


def test_a_tested_vllm_gets_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = _fake_vllm(monkeypatch, "0.32.0")
    plugin.register()
    plugin.register()  # idempotent
    assert registry == {"Factory:shardstream": ("streamer.vllm.engine", "ShardstreamWeightTransferEngine"),
                        "TrainerFactory:shardstream": ("streamer.vllm.trainer", "ShardstreamTrainerEngine")}


def test_an_untested_vllm_gets_one_line_and_nothing_registered(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    registry = _fake_vllm(monkeypatch, "0.34.1")
    with caplog.at_level(logging.WARNING):
        plugin.register()
    assert registry == {}
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.shardstream"]
    assert len(lines) == 1 and "vLLM 0.34.1 is outside the tested range (0.32.x)" in lines[0], lines


def test_the_override_registers_on_any_version(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = _fake_vllm(monkeypatch, "0.34.1")
    monkeypatch.setenv("SHARDSTREAM_VLLM_ANY_VERSION", "1")
    plugin.register()
    assert "Factory:shardstream" in registry
