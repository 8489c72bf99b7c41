"""What a route needs from whatever receives its gradients (`GradientSink`).

A route (`layerwise_hf.routes.hooks`, `.data_parallel`, `.ddp`) knows how a reduced gradient reaches `.grad`; the sink
(`layerwise_hf.optim.pipeline.GradientPipeline`, a `LayerwiseOptimizer`'s) knows what to do with it. The routes import
nothing from the optimizer's side: they are handed a sink and call only the members of `GradientSink`.

Work that must run once a backward has ended (the data-parallel route's last buckets, a delayed step) is queued on the
sink's `BackwardEnd` (`layerwise_hf.platform.backward_end`), which runs it in the order of `BackwardEnd.ORDER`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from ..platform.backward_end import BackwardEnd
from ..platform.streams import GroupSteps


@runtime_checkable
class GradientSink(Protocol):
    """
    What a route calls on the receiver of its gradients; the optimizer's pipeline
    (`layerwise_hf.optim.pipeline.GradientPipeline`) implements it.

    Attributes:
        params (`Sequence[torch.Tensor]`): the trainable parameters, indexed as `grad_ready(i)` indexes them.
        names (`Sequence[str]`): their names, for error messages.
        backward_end (`BackwardEnd`): the owner of the end of each backward (one per sink).

    Example:

    ```python
    >>> from layerwise_hf.routes.sink import GradientSink
    >>> isinstance(layerwise_optimizer.pipeline, GradientSink)
    True
    ```
    """

    params: Sequence[torch.Tensor]
    names: Sequence[str]
    backward_end: BackwardEnd

    def grad_ready(self, i: int, steps: GroupSteps | None = None) -> None:
        """Parameter `i`'s reduced gradient is in `.grad`: accumulate, measure, hold or step it. `steps`: the FSDP2
        route's deferrer of its reduce-scatter group's 8-bit steps (`platform.streams.GroupSteps`)."""

    def grad_delayed(self, i: int) -> None:
        """The route keeps parameter `i`'s gradient to hand it over later: count it among the gradients alive."""

    def steps_in_backward(self) -> bool:
        """Whether a gradient handed over now steps at once (so a route may delay it a little)."""

    def sync_gradients(self) -> bool:
        """Whether the current backward ends a gradient-accumulation window."""

    def merge_waiting(self, i: int) -> None:
        """Bring what parameter `i`'s window accumulated elsewhere (a host sum) back into `.grad`, before the
        window's one reduction."""
