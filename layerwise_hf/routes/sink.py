"""What a route needs from whatever receives its gradients (`GradientSink`), and the one owner of a backward's end.

A route (`layerwise_hf.routes.hooks`, `.data_parallel`, `.ddp`) knows how a reduced gradient reaches `.grad`; the sink
(`layerwise_hf.optim.optimizer.LayerwiseOptimizer`) knows what to do with it. The routes import nothing from the
optimizer's side: they are handed a sink and call only the members of `GradientSink`.

Work that must run once a backward has ended (the data-parallel route's last buckets, a held step, the last FSDP2
group's 8-bit steps, fp16's found-inf flags) registers with the sink's `BackwardEnd`, which queues one autograd-engine
callback per backward and runs the registered work in the order of `BackwardEnd.ORDER`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class GradientSink(Protocol):
    """
    What a route calls on the receiver of its gradients; `LayerwiseOptimizer` implements it.

    Attributes:
        params (`Sequence[torch.Tensor]`): the trainable parameters, indexed as `grad_ready(i)` indexes them.
        names (`Sequence[str]`): their names, for error messages.
        backward_end (`BackwardEnd`): the owner of the end of each backward (one per sink).

    Example:

    ```python
    >>> from layerwise_hf.routes.sink import GradientSink
    >>> isinstance(layerwise_optimizer, GradientSink)
    True
    ```
    """

    params: Sequence[torch.Tensor]
    names: Sequence[str]
    backward_end: BackwardEnd

    def grad_ready(self, i: int) -> None:
        """Parameter `i`'s reduced gradient is in `.grad`: accumulate, measure, hold or step it."""

    def grad_held(self, i: int) -> None:
        """The route keeps parameter `i`'s gradient to hand it over later: count it among the gradients alive."""

    def steps_in_backward(self) -> bool:
        """Whether a gradient handed over now steps at once (so a route may hold it a little)."""

    def sync_gradients(self) -> bool:
        """Whether the current backward ends a gradient-accumulation window."""

    def merge_waiting(self, i: int) -> None:
        """Bring what parameter `i`'s window accumulated elsewhere (a host sum) back into `.grad`, before the
        window's one reduction."""


class BackwardEnd:
    """
    One sink's end-of-backward work: one autograd-engine callback per backward runs every stage queued in it, in
    `ORDER`.

    - `"route"`: the data-parallel route reduces its last buckets and hands their gradients over;
    - `"hold"`: a step held for fewer activations (`LocalHooks`) is released;
    - `"shard_steps"`: the 8-bit steps of FSDP2's last reduce-scatter group run (`platform.streams.GroupSteps` holds
      each group's until the next group's hooks, so that the default stream need not wait for its reduce-scatter);
    - `"offload_flags"`: fp16 found-inf flags of offloaded gradients are gathered and published for GradScaler;
    - `"agree_flags"`: fp16 flags of a stepping pass are made to agree across ranks (FSDP2: each checked its shards).

    A stage queued while the callback runs (a gradient the route hands over at the end queues the flags' gather)
    runs in the same callback. Stages are kept per backward (autograd graph task): a backward nested in another (a
    reentrant checkpoint's) runs only what was queued in it, at its own end.

    Example:

    ```python
    >>> from layerwise_hf.routes.sink import BackwardEnd
    >>> end = BackwardEnd()
    >>> end.queue("hold", lambda: None)  # outside backward: nothing can run at its end
    False
    ```
    """

    ORDER = ("route", "hold", "shard_steps", "offload_flags", "agree_flags")

    def __init__(self) -> None:
        self._dropped: list[weakref.WeakMethod] = []
        self.forget()

    def forget(self) -> None:
        """Drop what was queued: a backward cut short by an exception never runs its callback. Whoever holds work for
        the end of a backward (`when_cut_short`) drops it too."""
        self._pending: dict[int, dict[str, Callable[[], None]]] = {}
        self._dropped = [ref for ref in self._dropped if ref() is not None]
        for ref in list(self._dropped):
            drop = ref()
            if drop is not None:
                drop()

    def when_cut_short(self, drop: Callable[[], None]) -> None:
        """Call `drop` (a bound method, held weakly) when a backward's queued work is forgotten."""
        self._dropped.append(weakref.WeakMethod(drop))

    def outside_backward(self) -> None:
        """Called between backwards (the optimizer's `step` and `zero_grad`): work still queued belongs to a backward
        that ended without its callback, cut short by an exception (an out-of-memory batch a loop skipped), and must
        not run in the next backward with that backward's gradients."""
        if self._pending and torch._C._current_graph_task_id() == -1:
            self.forget()

    def queue(self, stage: str, work: Callable[[], None]) -> bool:
        """Run `work` at the end of the current backward (once per stage; a later `queue` of the same stage replaces
        it). Returns `False`, queueing nothing, outside the autograd engine (a hook called by hand)."""
        if stage not in self.ORDER:
            raise ValueError(f"unknown end-of-backward stage {stage!r}; stages: {', '.join(self.ORDER)}")
        task = torch._C._current_graph_task_id()
        if task == -1:
            return False
        stages = self._pending.get(task)
        if stages is None:
            stages = self._pending[task] = {}
            # NOTE: callbacks queued on the engine run after the whole graph task, including callbacks queued by
            # earlier ones: a stage queued while `_run` runs is still picked up there.
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._run(task))
        stages[stage] = work
        return True

    def _run(self, task: int) -> None:
        stages = self._pending.get(task, {})
        try:
            while stages:
                stage = next(s for s in self.ORDER if s in stages)
                stages.pop(stage)()
        finally:
            self._pending.pop(task, None)
