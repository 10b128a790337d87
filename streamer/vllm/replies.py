"""One failure per vLLM call, raised where vLLM's executor reads it last.

vLLM 0.32's ``MultiprocExecutor.collective_rpc`` reads its workers' replies in rank order and
raises at the first failed one, so the replies of the workers after it stay queued, and the next
call reads them as its own replies. A refusal that every worker raised (a refused push at TP 2)
would come back again from the next call. ``one_reply`` keeps the replies in step: after the
wrapped method returns or raises, the workers of the engine exchange their outcomes over vLLM's
world CPU group. When any of them failed, only the last rank raises (its own error, else one
that names the first failed worker's); the others return. vLLM then reads every reply of the call, and the caller gets
one error. With one worker, or no process group, the error is raised as it is.

vLLM's worker keeps its own state around these calls, and resets it when a call raises
(``update_weights``: the update ends). A worker that returns instead must reset it the same way,
or the workers disagree from then on (the next ``start_weight_update`` is refused by vLLM on the
workers that think the update still runs, and the others wait for them in the exchange):
``swallowed(self)`` does that on the workers that return. So ``one_reply`` wraps only calls where
that state can be mirrored: ``init_weight_transfer_engine`` (vLLM keeps none) and
``update_weights`` (``engine._ended_by_failure``). ``start_weight_update`` and
``finish_weight_update`` set vLLM's state after they return, which a worker cannot undo; they
still raise on every worker, and vLLM 0.32 then reads the other workers' replies at the next call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["WorkerFailed", "one_reply", "world_cpu_group"]

F = TypeVar("F", bound=Callable[..., Any])


class WorkerFailed(RuntimeError):
    """Another worker of the engine failed this call (this worker's reply carries its error)."""


def world_cpu_group() -> Any:
    """vLLM's world CPU group, every worker of this engine (None outside a process group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    from streamer.vllm import internals

    return internals.load().get_world_group().cpu_group


def one_reply(swallowed: Callable[[Any], None] | None = None) -> Callable[[F], F]:
    """Wrap a worker-side entry point of the backend (see the module docstring); ``swallowed(self)``
    runs on each worker that returns although a worker failed (vLLM's reset of its own state)."""

    def wrap(method: F) -> F:
        return _wrap(method, swallowed)

    return wrap


def _wrap(method: F, swallowed: Callable[[Any], None] | None) -> F:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        error: BaseException | None = None
        result = None
        try:
            result = method(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - every worker learns it before any reply is sent
            error = e
        group = world_cpu_group()
        if group is None:
            if error is not None:
                raise error
            return result
        import torch.distributed as dist

        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if size == 1:
            if error is not None:
                raise error
            return result
        # one small all-reduce when every worker succeeded (the common case, inside the engine's
        # pause); the outcomes themselves are gathered only when one failed
        import torch

        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not int(flag.item()):
            return result
        outcomes: list[Any] = [None] * size
        dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}", group=group)
        failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
        if rank != size - 1:  # the last rank's reply carries the failure, read after every other reply
            if swallowed is not None and args:
                swallowed(args[0])
            return None
        if error is not None:  # every worker's agreed refusal reads the same: this one's is as good
            raise error
        first, why = failed[0]
        raise WorkerFailed(f"shardstream: worker {first} of {size} failed: {why}"
                           + (f" ({len(failed) - 1} more workers failed)" if len(failed) > 1 else ""))

    return wrapper  # type: ignore[return-value]
