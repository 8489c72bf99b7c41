"""The step window: what a layer-wise optimizer knows between two `step()` calls, what each hook does, and what a
stage of the pipeline is given (`StageContext`). What a stage knows of a window (fp16's flags, clipping's factor) is
the stage's own, forgotten by its own `end_window()`."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from ..platform.norms import grad_norm_kernel, total_norm


class Action(enum.Enum):
    """
    What a parameter's hook does with the gradient it was handed (see `StepWindow.action`).

    Example:

    ```python
    >>> from layerwise_hf.optim.window import Action
    >>> [action.value for action in Action]
    ['accumulate', 'measure', 'hold', 'step', 'repeated']
    ```
    """

    ACCUMULATE = "accumulate"
    MEASURE = "measure"
    HOLD = "hold"
    STEP = "step"
    REPEATED = "repeated"


class StepWindow:
    """
    Per-window state of a `LayerwiseOptimizer`, from one `step()` to the next (one gradient-accumulation window),
    with a single `reset()`: every field is re-created from `__init__`, so none can be forgotten.

    The hook's decision table (`action`), for the parameter `i` whose gradient just became ready:

    | backward                                   | action       | what the optimizer does                          |
    |--------------------------------------------|--------------|--------------------------------------------------|
    | not the window's last (`sync` is False)    | `ACCUMULATE` | leave the gradient in `.grad`                     |
    | a norm pass                                | `MEASURE`    | unscale/inf-check, measure the norm, free it      |
    | last, the step needs every gradient first  | `HOLD`       | keep it; `step()` clips (and unscales) and steps  |
    | (exact clipping or fp16, no norm pass ran; |              |                                                  |
    | or `hold_all`)                             |              |                                                  |
    | last, otherwise                            | `STEP`       | (unscale,) clip, step this parameter, free it     |
    | the same parameter twice in one backward   | `REPEATED`   | refuse: it would be stepped twice                 |

    Args:
        num_params (`int`):
            How many parameters the optimizer steps.

    Example:

    ```python
    >>> from layerwise_hf.optim.window import Action, StepWindow
    >>> window = StepWindow(2)
    >>> window.action(0, sync=True, whole_step=False)
    <Action.STEP: 'step'>
    >>> window.action(0, sync=True, whole_step=False)
    <Action.REPEATED: 'repeated'>
    >>> window.reset(); window.action(0, sync=False, whole_step=False), window.accumulating
    (<Action.ACCUMULATE: 'accumulate'>, True)
    ```
    """

    def __init__(self, num_params: int):
        self.num_params = num_params
        self.stepped = [False] * num_params  # stepped in this window
        self.fired = [False] * num_params  # hook seen in the window's final backward
        self.seen_in_norm_pass = [False] * num_params
        # Per parameter: (device, gradient dtype, norm), as `clipping.total_norm` takes them.
        self.norms: list[tuple[torch.device, torch.dtype, torch.Tensor] | None] = [None] * num_params
        self.accumulating = False  # an earlier micro-batch of this window left gradients in .grad
        self.in_norm_pass = False
        self.measured = False  # a norm pass measured (and, with a scaler, inf-checked) this window
        # Hold every gradient for step() even where the step needs none first (`connect(hold_first_step=True)`).
        self.hold_all = False

    def reset(self) -> None:
        """Forget the window: after a step, a skipped step, or an exception in the middle of one."""
        self.__init__(self.num_params)

    def _row(self, sync: bool, whole_step: bool) -> Action:
        # The table's row for a gradient arriving now, before its parameter's own history (REPEATED) is looked at.
        if not sync:
            return Action.ACCUMULATE
        if self.in_norm_pass:
            return Action.MEASURE
        if (whole_step or self.hold_all) and not self.measured:
            return Action.HOLD
        return Action.STEP

    def steps_now(self, sync: bool, whole_step: bool) -> bool:
        """Whether a gradient arriving now would step at once (what `action` decides, without noting anything)."""
        return self._row(sync, whole_step) is Action.STEP

    def action(self, i: int, sync: bool, whole_step: bool) -> Action:
        """Decide, and note, what the hook of parameter `i` does (see the class docstring's table)."""
        row = self._row(sync, whole_step)
        if row is Action.ACCUMULATE:
            self.accumulating = True
            return row
        if row is Action.MEASURE:
            if self.seen_in_norm_pass[i]:
                return Action.REPEATED
            self.seen_in_norm_pass[i] = True
            return row
        if self.stepped[i] or self.fired[i]:
            return Action.REPEATED
        self.fired[i] = True
        return row

    def total_norm(self, params: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The global norm of this window's gradients: measured ones, and any still held in `.grad`."""
        norms = []
        for recorded, p in zip(self.norms, params):
            if recorded is not None:
                norms.append(recorded)
            elif p.grad is not None:
                norms.append((p.device, p.grad.dtype, grad_norm_kernel(p.grad)))
        return total_norm(norms)


class StageContext(NamedTuple):
    """
    What a stage of the pipeline (offload; loss scaling and clipping are asked by the pipeline itself) may read, and
    the one call that steps a parameter: never the pipeline itself.

    Attributes:
        params (`list[torch.Tensor]`): the parameters (the same list across `rebind`).
        inner (`Sequence[torch.optim.Optimizer]`): one optimizer per parameter.
        window (`StepWindow`): this step's window (the same object across `reset`).
        step (`Callable[[int], None]`): clip parameter `i`'s gradient, step it and free it.
        stepped (`Callable[[int], None]`): parameter `i` was stepped elsewhere (on the host).
        coef (`Callable[[int], torch.Tensor | None]`): the clip coefficient of parameter `i` (`None`: none).
    """

    params: list[torch.Tensor]
    inner: Sequence[torch.optim.Optimizer]
    window: StepWindow
    step: Callable[[int], None]
    stepped: Callable[[int], None]
    coef: Callable[[int], torch.Tensor | None]
