"""How reduced gradients reach a layer-wise optimizer: one small interface, one class per route.

- `LocalHooks` (one process): each parameter's post-accumulate-grad hook hands its gradient to the optimizer; the
  step of a large gradient followed by smaller ones (an untied `lm_head`, first in backward) is delayed until right
  before the next large gradient is computed, or the end of backward (`_StepDelay`).
- `FSDP2Hooks`: FSDP2 calls the sharded parameters' post-accumulate-grad hooks itself after the reduce-scatter, with
  the reduced local shard, so the local hooks are right as they are; only elementwise optimizers are allowed.
- `DDPCommHook` (`layerwise_hf.routes.ddp`): DDP's post-accumulate-grad hooks fire BEFORE the all-reduce, so a comm
  hook all-reduces each bucket and hands the reduced gradients over instead.

A route is handed a `GradientSink` (`layerwise_hf.routes.sink`; the optimizer is one) and hands it each gradient,
`sink.grad_ready(i)`, once parameter `i`'s reduced gradient is in `.grad`.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..platform.streams import GroupSteps
from .sink import GradientSink

logger = logging.getLogger(__name__)

# id(param) -> the route whose hooks are on it. A route of a second optimizer attaching to the same parameter (a
# second Trainer on the same model, or one whose train() died before detaching) takes the hooks over, so a parameter
# can never be stepped twice per backward. Kept off the Parameter itself so models still pickle; it is per parameter,
# not per optimizer: whatever holds the hooks of a tensor must be known to whoever would hook it next.
_OWNERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

# A gradient at least this fraction of the largest trainable one is "large" for `_StepDelay`: delaying it costs its
# bytes through the smaller gradients' steps, which only pays when its own step temporaries (about twice it) are
# larger than those.
LARGE_FRACTION = 0.5


class GradientRoute:
    """
    The interface every route implements.

    Attributes:
        name (`str`): `"local"`, `"ddp"` or `"fsdp2"` (what `LayerwiseOptimizer.connect` returns).
        collective_per_forward (`bool`): gradients are reduced by collectives that run once per forward, so a norm
            pass must rerun forward and backward (`run_with_norm_pass`) rather than backward alone.
        steps_shards (`bool`): the sink steps FSDP2 shards, so its updates must be elementwise (the sink checks).

    Example:

    ```python
    >>> from layerwise_hf.routes.hooks import LocalHooks
    >>> route = LocalHooks()  # optimizer.connect(route=route) attaches it; optimizer.detach() removes it
    >>> route.name, route.attached
    ('local', False)
    ```
    """

    name = "none"
    collective_per_forward = False
    steps_shards = False

    def __init__(self) -> None:
        self.attached = False

    def attach(self, sink: GradientSink) -> None:
        raise NotImplementedError

    def detach(self) -> None:
        raise NotImplementedError

    def reduce_found_inf(self, flags: dict[torch.device, torch.Tensor]) -> None:
        """Make fp16 found-inf flags agree across ranks when each rank checked only its own shards."""


class LocalHooks(GradientRoute):
    """
    Post-accumulate-grad hooks on every trainable parameter, each owned by one optimizer at a time.

    Example:

    ```python
    >>> from layerwise_hf.routes.hooks import LocalHooks
    >>> optimizer.connect(route=LocalHooks())  # `optimizer`: a LayerwiseOptimizer on one process (= attach())
    >>> optimizer.route, optimizer.attached
    ('local', True)
    ```
    """

    name = "local"
    delay_large_steps = True  # see `_StepDelay`; FSDP2's hooks are called per unit after its reduce-scatter

    def __init__(self) -> None:
        super().__init__()
        self._handles: list[Any] = []
        self._params: list[torch.Tensor] = []
        self._delay: _StepDelay | None = None

    def attach(self, sink: GradientSink) -> None:
        taken_from = set()
        for p in sink.params:
            other = _OWNERS.get(id(p))
            if other is not None and other is not self and other.attached and other.hooks(p):
                other.detach()
                taken_from.add(id(other))
        if taken_from:
            logger.warning(
                "Layer-wise hooks of %d other optimizer(s) were still attached to these parameters (a previous "
                "train() did not finish?); they were removed so no parameter is stepped twice.",
                len(taken_from),
            )
        ready = self._entry(sink)
        self._params = list(sink.params)
        for i, p in enumerate(self._params):
            if not p.requires_grad:
                # Frozen since the optimizer was built: autograd gives it no gradient, so no hook (torch refuses one
                # on a tensor that does not require grad); nothing steps it, as a standard optimizer skips it.
                continue
            self._handles.append(p.register_post_accumulate_grad_hook(_Hook(ready, i)))
            _OWNERS[id(p)] = self
        self.attached = True

    def hooks(self, param: torch.Tensor) -> bool:
        """Whether this route's hook is on `param` (the very tensor)."""
        return any(p is param for p in self._params)

    def _entry(self, sink: GradientSink) -> Callable[[int], None]:
        # What each parameter's hook calls with its index.
        if not self.delay_large_steps:
            return sink.grad_ready
        self._delay = _StepDelay(sink)
        return self._delay.grad_ready

    @property
    def delayed(self) -> tuple[int, ...]:
        """Indices whose gradient is ready but whose step the route delays (empty outside backward)."""
        return tuple(self._delay.plan.delayed) if self._delay is not None else ()

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._delay is not None:
            self._delay.forget()
            self._delay = None
        for p in self._params:
            if self.attached and _OWNERS.get(id(p)) is self:
                del _OWNERS[id(p)]
        self._params = []
        self.attached = False


class _Hook:
    # A small callable rather than a closure: the hook runs once per parameter per backward.
    __slots__ = ("ready", "index")

    def __init__(self, ready, index: int):
        self.ready = ready
        self.index = index

    def __call__(self, param: torch.Tensor) -> None:
        self.ready(self.index)


class DelayPlan:
    """
    When to delay the step of a large unit and when to let it go: the one policy of both routes that delay steps, for
    units that are gradients (`_StepDelay`, one process) or buckets (`DataParallelReducer`, the DDP config).

    An untied `lm_head`'s gradient is ready first in backward, while almost every activation is still alive; its
    inner step allocates temporaries of about twice the tensor (AdamW's `sqrt` and division; bitsandbytes
    dequantizes its states on CPU), which then set the training peak. Stepped right before the next large gradient is
    computed (for a decoder: the input embedding's, at the end of backward), they meet few activations, and the delayed
    gradient costs only its own bytes while the smaller ones step (58M Llama, 256 tokens: see
    benchmarks/README.md). Inner optimizers are independent, so the order they step in changes no result.

    A large unit followed, in the expected order, by smaller ones is delayed (`delay`) until every unit planned between
    it and the next large one (or the end) has arrived (`arrived` says when); the route steps what `release` gives
    back, and at the latest at the end of backward.

    Args:
        large (`Sequence[bool]`): per unit, whether it is large.
        order (`Iterable[int]`): the order the units are expected in.

    Example:

    ```python
    >>> from layerwise_hf.routes.hooks import DelayPlan
    >>> plan = DelayPlan([True, False, False, True], [0, 1, 2, 3])
    >>> plan.delay(0), plan.arrived(1), plan.arrived(2), plan.release()
    (True, False, True, [0])
    ```
    """

    def __init__(self, large: Sequence[bool], order: Iterable[int]):
        self.large = list(large)
        self.delayed: list[int] = []
        self.waiting: set[int] = set()
        self.replan(order)

    def replan(self, order: Iterable[int]) -> None:
        """Expect the units in `order` from now on (a backward's actual order plans the next one)."""
        # Per large unit followed by smaller ones: the units before the next large one.
        self.between: dict[int, frozenset[int]] = {}
        current: int | None = None
        smaller: list[int] = []
        for i in [*order, None]:
            if i is None or self.large[i]:
                if current is not None and smaller:
                    self.between[current] = frozenset(smaller)
                current, smaller = i, []
            else:
                smaller.append(i)

    def delay(self, unit: int) -> bool:
        """Whether `unit`'s step waits: it is large, and smaller units are expected after it."""
        between = self.between.get(unit) if self.large[unit] else None
        if not between:
            return False
        self.delayed.append(unit)
        self.waiting = set(between)
        return True

    def arrived(self, unit: int) -> bool:
        """A smaller unit was handed over: whether the delayed units may step now (the next one is large, or none is
        left)."""
        if not self.delayed:
            return False
        self.waiting.discard(unit)
        return not self.waiting

    def release(self) -> list[int]:
        """The delayed units, in the order they were delayed; none is delayed afterwards."""
        delayed, self.delayed, self.waiting = self.delayed, [], set()
        return delayed


class _StepDelay:
    """
    Delays the step of a large gradient followed by smaller ones on one process (`DelayPlan` says which and when).

    The gradients expected between a large one and the next come from the previous backward's ready order (the
    reverse of the parameter order before the first); the delayed step is released once they have all stepped, when
    another large gradient arrives, and at the latest by an autograd-engine callback at the end of the backward.
    Only a gradient that would step at once is delayed (`steps_in_backward()`): not while accumulating, not in a norm
    pass's measuring backward (which frees each gradient at once), not when exact clipping or fp16 keeps every
    gradient for `step()`; under exact clipping it is delayed in the backward that follows the norm pass.
    """

    def __init__(self, sink: GradientSink):
        self.sink = sink
        # Plain tensors: only the one-process route delays a step (not FSDP2's DTensors).
        sizes = [p.numel() * p.element_size() for p in sink.params]
        self.plan = DelayPlan([s >= LARGE_FRACTION * max(sizes) for s in sizes], reversed(range(len(sizes))))
        self.forget()

    def forget(self) -> None:
        """Drop what the current backward noted: after it ends, or one cut short by an exception."""
        self.plan.release()
        self.order: list[int] = []
        self.seen: set[int] = set()
        self.queued = False
        self.task, self.steps = -1, False  # the backward whose `steps_in_backward()` answer is `steps`

    def grad_ready(self, i: int) -> None:
        sink = self.sink
        steps_now = self._steps_now()
        if i in self.seen or (self.queued and not steps_now):
            # A backward noted here ended without its end callback: cut short by an exception. What it delayed is
            # still in `.grad`, as a gradient no hook consumed (`step()` steps it, `zero_grad()` frees it).
            self.forget()
        if not steps_now or not self._queue_finish():
            sink.grad_ready(i)
            return
        self.seen.add(i)
        self.order.append(i)
        if self.plan.large[i]:
            self.release()  # arrived before the gradients planned ahead of it (the order changed)
            if self.plan.delay(i):
                sink.grad_delayed(i)  # alive next to the ones stepping meanwhile: the meter counts it
                return
        sink.grad_ready(i)
        if self.plan.arrived(i):
            self.release()  # the next gradient is a large one, not computed yet

    def _steps_now(self) -> bool:
        # The sink's answer holds for a whole backward (its window decides per backward, not per gradient): asked
        # once per autograd graph task, so that each gradient goes into the sink once, by `grad_ready`.
        task = torch._C._current_graph_task_id()
        if task == -1 or task != self.task:
            self.task, self.steps = task, self.sink.steps_in_backward()
        return self.steps

    def release(self) -> None:
        """Step every delayed gradient (the sink's `grad_ready`), in the order they arrived."""
        for i in self.plan.release():
            self.sink.grad_ready(i)

    def _queue_finish(self) -> bool:
        if not self.queued:
            if not self.sink.backward_end.queue("delayed", self._finish):
                return False  # not inside the autograd engine (a hook called by hand): nothing can be delayed
            self.queued = True
        return True

    def _finish(self) -> None:
        # End of backward: step what is still delayed (a gradient planned ahead of it never came), then plan the next
        # backward from this one's order.
        order = self.order
        try:
            self.release()
        finally:
            self.forget()
        if order:
            self.plan.replan(order)


class FSDP2Hooks(LocalHooks):
    """
    Local hooks on FSDP2's sharded parameters: FSDP2 calls them after the reduce-scatter.

    Example:

    ```python
    >>> from layerwise_hf.routes.hooks import FSDP2Hooks
    >>> route = FSDP2Hooks()  # what `connect(model)` picks once `fully_shard` made the parameters DTensors
    >>> route.name, route.collective_per_forward
    ('fsdp2', True)
    ```
    """

    name = "fsdp2"
    collective_per_forward = True
    steps_shards = True
    delay_large_steps = False

    def _entry(self, sink: GradientSink) -> Callable[[int], None]:
        # FSDP2 calls a group's hooks before the next layer's backward is queued: an 8-bit step, which the default
        # stream must order after the reduce-scatter, is deferred until the next group's hooks (`streams.GroupSteps`).
        return functools.partial(sink.grad_ready, steps=GroupSteps(sink.backward_end))

    def reduce_found_inf(self, flags):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # Each rank checked its own shards; GradScaler's DTensor handler all-reduces the flag the same way. Every
            # rank gets here once per step (the norm pass runs everywhere), so the collectives line up.
            for flag in flags.values():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
