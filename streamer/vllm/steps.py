"""Whether the engine ran requests during an update: the worker's view of vLLM's pause state.

An update is only safe, and only one version per request, when the engine is paused
(``LLM.pause_generation()`` / ``POST /pause``). The pause state lives in vLLM's engine core, which
a worker cannot see, and the model runner's own list of requests cannot tell either: it learns that
a request finished one step late, and a request frozen by ``mode=keep`` stays in it. What a worker
does see is every step: vLLM's engine core steps only between its utility calls, and a step that
schedules tokens means requests are being served. Paused in any mode, the engine schedules none
(``abort`` ends the requests, ``wait`` drains them first, ``keep`` schedules zero tokens), so a
step with tokens between ``start_weight_update`` and ``update_weights`` proves the engine was not
paused. :class:`StepWatch` counts those steps by wrapping the model runner's ``execute_model``.

The update itself runs inside ``update_weights`` (one utility call: no step can fall inside it), so
an unpaused engine is never served half-loaded layers; the watch only refuses an update that would
mix versions within requests.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StepWatch", "watch"]


class StepWatch:
    """Counts the model runner's steps that schedule tokens (see the module docstring)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.steps = 0
        self._mark = 0
        inner = runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(scheduler_output, "total_num_scheduled_tokens", 0):
                self.steps += 1
            return inner(scheduler_output, *args, **kwargs)

        runner.execute_model = execute_model  # the instance attribute shadows the method

    def mark(self) -> None:
        """From now on (``start_weight_update``)."""
        self._mark = self.steps

    def since_mark(self) -> int:
        """Steps that ran requests since :meth:`mark`."""
        return self.steps - self._mark

    def close(self) -> None:
        if self.runner.__dict__.get("execute_model") is not None:
            del self.runner.execute_model


def watch(worker: Any) -> StepWatch:
    """The worker's watch, installed once per worker (a new session reuses it)."""
    existing = getattr(worker, "_shardstream_steps", None)
    if isinstance(existing, StepWatch):
        return existing
    w = StepWatch(worker.model_runner)
    worker._shardstream_steps = w
    return w
