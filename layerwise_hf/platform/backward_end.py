"""The one owner of the end of a backward: work that must run once a backward has ended (the data-parallel route's
last buckets, a delayed step, the last FSDP2 group's 8-bit steps, fp16's found-inf flags) is queued here, and one
autograd-engine callback per backward runs it in the order of `BackwardEnd.ORDER`. An autograd primitive, so it lives
beside the other torch-facing parts; each `LayerwiseOptimizer` makes one and hands it to whatever queues work.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch


class BackwardEnd:
    """
    One sink's end-of-backward work: one autograd-engine callback per backward runs every stage queued in it, in
    `ORDER`.

    - `"route"`: the data-parallel route reduces its last buckets and hands their gradients over;
    - `"delayed"`: a step delayed for fewer activations (`LocalHooks`) is released;
    - `"shard_steps"`: the 8-bit steps of FSDP2's last reduce-scatter group run (`platform.streams.GroupSteps` defers
      each group's until the next group's hooks, so that the default stream need not wait for its reduce-scatter);
    - `"offload_flags"`: fp16 found-inf flags of offloaded gradients are gathered and published for GradScaler;
    - `"agree_flags"`: fp16 flags of a stepping pass are made to agree across ranks (FSDP2: each checked its shards).

    A stage queued while the callback runs (a gradient the route hands over at the end queues the flags' gather)
    runs in the same callback. Stages are kept per backward (autograd graph task): a backward nested in another (a
    reentrant checkpoint's) runs only what was queued in it, at its own end.

    Example:

    ```python
    >>> from layerwise_hf.platform.backward_end import BackwardEnd
    >>> end = BackwardEnd()
    >>> end.queue("delayed", lambda: None)  # outside backward: nothing can run at its end
    False
    ```
    """

    ORDER = ("route", "delayed", "shard_steps", "offload_flags", "agree_flags")

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
