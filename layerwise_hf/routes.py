"""How reduced gradients reach a layer-wise optimizer: one small interface, one class per route.

- `LocalHooks` (one process): each parameter's post-accumulate-grad hook hands its gradient to the optimizer.
- `FSDP2Hooks`: FSDP2 calls the sharded parameters' post-accumulate-grad hooks itself after the reduce-scatter, with
  the reduced local shard, so the local hooks are right as they are; only elementwise optimizers are allowed.
- `DDPCommHook` (`layerwise_hf.ddp`): DDP's post-accumulate-grad hooks fire BEFORE the all-reduce, so a comm hook
  all-reduces each bucket and hands the reduced gradients over instead.

A route only calls the optimizer's public per-parameter entry point, `LayerwiseOptimizer.grad_ready(i)`, once
parameter `i`'s reduced gradient is in `.grad`.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .support import check_fsdp2_optimizers

if TYPE_CHECKING:
    from .optimizer import LayerwiseOptimizer

logger = logging.getLogger(__name__)

# id(param) -> the LayerwiseOptimizer whose hooks are on it. A second optimizer attaching to the same parameter
# (a second Trainer on the same model, or one whose train() died before detaching) takes the hooks over, so a
# parameter can never be stepped twice per backward. Kept off the Parameter itself so models still pickle.
_OWNERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


class GradientRoute:
    """
    The interface every route implements.

    Attributes:
        name (`str`): `"local"`, `"ddp"` or `"fsdp2"` (what `LayerwiseOptimizer.connect` returns).
        collective_per_forward (`bool`): gradients are reduced by collectives that run once per forward, so a norm
            pass must rerun forward and backward (`run_with_norm_pass`) rather than backward alone.

    Example:

    ```python
    >>> from layerwise_hf.routes import LocalHooks
    >>> route = LocalHooks()  # optimizer.set_route(route) attaches it; optimizer.detach() removes it
    >>> route.name, route.attached
    ('local', False)
    ```
    """

    name = "none"
    collective_per_forward = False

    def __init__(self) -> None:
        self.attached = False

    def attach(self, optimizer: LayerwiseOptimizer) -> None:
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
    >>> from layerwise_hf.routes import LocalHooks
    >>> optimizer.set_route(LocalHooks())  # `optimizer`: a LayerwiseOptimizer on one process (= optimizer.attach())
    >>> optimizer.route, optimizer.attached
    ('local', True)
    ```
    """

    name = "local"

    def __init__(self) -> None:
        super().__init__()
        self._handles: list[Any] = []
        self._params: list[torch.Tensor] = []

    def attach(self, optimizer: LayerwiseOptimizer) -> None:
        taken_from = set()
        for p in optimizer.params:
            other = _OWNERS.get(id(p))
            if other is not None and other is not optimizer and other.index_of(p) is not None:
                other.detach()
                taken_from.add(id(other))
        if taken_from:
            logger.warning(
                "Layer-wise hooks of %d other optimizer(s) were still attached to these parameters (a previous "
                "train() did not finish?); they were removed so no parameter is stepped twice.",
                len(taken_from),
            )
        ready = self._entry(optimizer)
        self._params = list(optimizer.params)
        for i, p in enumerate(self._params):
            self._handles.append(p.register_post_accumulate_grad_hook(_Hook(ready, i)))
            _OWNERS[id(p)] = optimizer
        self._owner = weakref.ref(optimizer)
        self.attached = True

    def _entry(self, optimizer: LayerwiseOptimizer) -> Callable[[int], None]:
        # What each parameter's hook calls with its index.
        return optimizer.grad_ready

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        owner = self._owner() if self.attached else None
        for p in self._params:
            if owner is not None and _OWNERS.get(id(p)) is owner:
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


class FSDP2Hooks(LocalHooks):
    """
    Local hooks on FSDP2's sharded parameters: FSDP2 calls them after the reduce-scatter.

    Example:

    ```python
    >>> from layerwise_hf.routes import FSDP2Hooks
    >>> route = FSDP2Hooks()  # what `connect(model)` picks once `fully_shard` made the parameters DTensors
    >>> route.name, route.collective_per_forward
    ('fsdp2', True)
    ```
    """

    name = "fsdp2"
    collective_per_forward = True

    def attach(self, optimizer: LayerwiseOptimizer) -> None:
        check_fsdp2_optimizers(optimizer.optimizer_name, optimizer.inner)
        super().attach(optimizer)

    def reduce_found_inf(self, flags):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # Each rank checked its own shards; GradScaler's DTensor handler all-reduces the flag the same way. Every
            # rank gets here once per step (the norm pass runs everywhere), so the collectives line up.
            for flag in flags.values():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
