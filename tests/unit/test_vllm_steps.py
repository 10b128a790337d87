"""The worker's view of vLLM's pause state (streamer/vllm/steps.py) and how the engine finds its
worker (internals.worker_of), without vLLM: a scripted model runner and worker."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from streamer.vllm import internals
from streamer.vllm.steps import StepWatch, watch


class Runner:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> str:
        self.calls.append(scheduler_output.total_num_scheduled_tokens)
        return "out"


def step(runner: Runner, tokens: int) -> Any:
    return runner.execute_model(SimpleNamespace(total_num_scheduled_tokens=tokens))


def test_only_steps_that_schedule_tokens_count() -> None:
    runner = Runner()
    w = StepWatch(runner)
    step(runner, 7)
    w.mark()
    assert w.since_mark() == 0
    # a paused engine: abort/wait leave cleanup steps with no tokens; keep schedules none
    assert step(runner, 0) == "out"
    assert w.since_mark() == 0
    step(runner, 3)
    step(runner, 1)
    assert w.since_mark() == 2 and runner.calls == [7, 0, 3, 1]
    w.close()
    step(runner, 5)  # unwrapped: the runner's own method again
    assert w.since_mark() == 2 and "execute_model" not in runner.__dict__


def test_one_watch_per_worker() -> None:
    worker = SimpleNamespace(model_runner=Runner())
    first = watch(worker)
    assert watch(worker) is first  # a second session reuses it: the runner is wrapped once
    step(worker.model_runner, 2)
    assert first.steps == 1


class Worker:
    def __init__(self, engine: Any) -> None:
        self.model_runner = Runner()
        self.weight_transfer_engine = engine

    def init_weight_transfer_engine(self) -> Any:
        return self.weight_transfer_engine.init_transfer_engine()


class Engine:
    def init_transfer_engine(self) -> Any:
        return internals.worker_of(self)


def test_the_engine_finds_the_worker_that_joins_it() -> None:
    engine = Engine()
    worker = Worker(engine)
    assert worker.init_weight_transfer_engine() is worker
    with pytest.raises(internals.VllmInternalsError, match="init_weight_transfer_engine"):
        engine.init_transfer_engine()  # called from elsewhere: no worker holds it
