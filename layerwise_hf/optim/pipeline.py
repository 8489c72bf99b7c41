"""`GradientPipeline`: what happens to each gradient a route hands over, between two optimizer steps.

It owns the step window (what is known this step), the clipper and the gradient meter, and applies the window's
decision table (`StepWindow`) to each gradient: accumulate it, measure it in a norm pass, hold it for `step()`, or clip
and step its parameter's inner optimizer and free it. Two features join that path as stages, each behind one
interface with a stand-in for "off", so the path has no branch per feature:
- loss scaling (`scaler`): `GradScalerBridge` under fp16, else `NoLossScaling`;
- host offload (`offload`): `OffloadStage` with `layerwise_offload`, else `NO_OFFLOAD`; a gradient it takes waits on
  the host and leaves the path here.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..bases.support import check_fp16_clip_mode, check_fp16_weights
from ..placement.host_step import unwrap_host_step
from ..platform.backward_end import BackwardEnd
from ..platform.compat import checkpointing_kwargs_name
from ..platform.norms import scale_grad
from ..platform.streams import step_in_backward
from .clipping import ClipMode, make_clipper
from .grad_scaler import GradScalerBridge, NoLossScaling
from .host_offload import NO_OFFLOAD, NoOffload, OffloadStage
from .memory import GradMeter
from .window import Action, StepWindow

logger = logging.getLogger(__name__)


class GradientPipeline:
    """
    The per-gradient logic of a layer-wise optimizer.

    Args:
        names (`Sequence[str]`): the parameters' names, for error messages.
        params (`list[torch.Tensor]`): the parameters (replaced by the owner on `rebind`).
        inner (`Sequence[torch.optim.Optimizer]`): one optimizer per parameter.
        sync (`Callable[[], bool]`): whether the current backward ends an accumulation window.
        track_grad_norm (`bool`): measure every gradient's norm even when clipping does not need it.
        backward_end (`BackwardEnd`, *optional*): the owner's end-of-backward work (fp16 flags of offloaded
            gradients are gathered there).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.optim.pipeline import GradientPipeline
    >>> weight = torch.nn.Parameter(torch.ones(3))
    >>> pipeline = GradientPipeline(["w"], [weight], [torch.optim.SGD([weight], lr=0.5)], sync=lambda: True)
    >>> weight.grad = torch.ones(3)
    >>> pipeline.grad_ready(0); weight.data, weight.grad
    (tensor([0.5000, 0.5000, 0.5000]), None)
    ```
    """

    def __init__(
        self,
        names: Sequence[str],
        params: list[torch.Tensor],
        inner: Sequence[torch.optim.Optimizer],
        sync: Callable[[], bool],
        track_grad_norm: bool = False,
        backward_end: BackwardEnd | None = None,
    ):
        self.names = names
        self.params = params
        self.inner = inner
        self.sync = sync
        self.backward_end = backward_end if backward_end is not None else BackwardEnd()
        self.window = StepWindow(len(params))
        self.meter = GradMeter()
        self.clipper = make_clipper(0.0, ClipMode.OFF)
        self.scaler: GradScalerBridge | NoLossScaling = NoLossScaling()
        self.offload: OffloadStage | NoOffload = NO_OFFLOAD
        self.track_grad_norm = track_grad_norm
        self.last_grad_norm: torch.Tensor | None = None
        self.applied_lr: dict[str, float] = {}  # per optimizer class, the lr of its latest step

    # ---- one gradient ----

    def grad_ready(self, i: int) -> None:
        """Parameter `i`'s (reduced) gradient is in its `.grad`: act on it as the step window decides."""
        window, scaler = self.window, self.scaler
        if scaler.window_was_skipped(window):
            self.end_window()
        param = self.params[i]
        action = window.action(i, self.sync(), self.whole_step())
        if self.offload.take(self, i, action):
            return
        if action is Action.ACCUMULATE:
            self.meter.hold(i, param.grad)  # the gradient stays in .grad until the window's last micro-batch
            return
        scaler.capture(window)
        if action is Action.STEP:
            if not scaler.unscale_to_step(window, param.grad):
                # Overflowed in this pass only: GradScaler will skip the step; this and later gradients do not step.
                param.grad = None
                return
            self.step_param(i)
        elif action is Action.MEASURE:
            self.meter.hold(i, param.grad)
            scaler.unscale(window, param.grad)
            if self.wants_norms():
                window.record_norm(i, param)
            param.grad = None
            self.meter.release(i)
        elif action is Action.HOLD:
            # step() clips and steps exactly; a scaled gradient is measured there, once GradScaler has unscaled it.
            self.meter.hold(i, param.grad)
            if not scaler.enabled:
                window.record_norm(i, param)
        else:
            raise RuntimeError(
                f"The gradient hook of {self.names[i]} fired twice before optimizer.step(): it would be stepped "
                "twice. This happens with reentrant activation checkpointing when a parameter is used in two "
                f"checkpointed segments (use {checkpointing_kwargs_name()}={{'use_reentrant': False}}), or with "
                "several backward passes per step outside gradient accumulation (use accelerator.accumulate or "
                "gradient_accumulation_steps)."
            )

    @torch.no_grad()
    def step_param(self, i: int) -> None:
        """Clip parameter `i`'s gradient, step its optimizer, free the gradient."""
        p = self.params[i]
        grad = p.grad
        window = self.window
        self.meter.hold(i, grad)
        clipper = self.clipper
        if clipper.needs_param_norm or self.track_grad_norm:
            window.record_norm(i, p)
        norm = window.norms[i]
        coef = clipper.coef(window, None if norm is None else norm[2], self.last_grad_norm)
        if coef is not None:
            scale_grad(grad, coef)
        step_in_backward(self.inner[i], p)
        self.note_step(i)
        p.grad = None
        self.meter.release(i)

    def note_step(self, i: int) -> None:
        """Parameter `i` stepped in this window (on the device or on the host)."""
        inner = self.inner[i]
        self.applied_lr[type(unwrap_host_step(inner)).__name__] = inner.param_groups[0]["lr"]
        self.window.stepped[i] = True

    def merge_waiting(self, i: int) -> None:
        """Add parameter `i`'s host sum of this window (offload) into its `.grad`, before a route's reduction."""
        self.offload.merge_waiting(self, i)

    # ---- the step ----

    def step_pending(self) -> None:
        """`optimizer.step()`: step what no hook consumed (held or hand-set gradients), then close the window."""
        self.close_skipped_window()
        window = self.window
        pending = [i for i, p in enumerate(self.params) if p.grad is not None and not window.stepped[i]]
        offloaded = self.offload.pending()
        if pending or offloaded:
            # With a scaler, GradScaler.step has unscaled these held gradients before calling step().
            for i in pending:
                window.record_norm(i, self.params[i])
            if self.clipper.needs_global_norm:
                self.clipper.start_step(window, self.total_norm())
            for i in pending:
                self.step_param(i)
            self.offload.step(self, offloaded)
        self.end_window()

    def end_window(self) -> None:
        total = self.total_norm()
        if total is not None:
            self.last_grad_norm = total
        self.reset_window()

    def new_route(self) -> None:
        """A route is attached (training begins): a fresh window, and host copies taken again from the device."""
        self.reset_window()
        self.offload.new_route(self)

    def reset_window(self) -> None:
        """Forget a window that will not be finished (a new route, or an exception in the middle of a step)."""
        self.window.reset()
        self.meter.clear()
        self.offload.end_window()

    def close_skipped_window(self) -> None:
        """Forget, without stepping, a window whose step GradScaler skipped (our step() never ran)."""
        if self.scaler.window_was_skipped(self.window):
            self.end_window()

    def note_accumulation(self) -> None:
        self.close_skipped_window()
        self.window.accumulating = True

    # ---- clipping and fp16 ----

    def configure_clipping(self, max_grad_norm: float | None, mode: str | ClipMode = ClipMode.EXACT) -> None:
        clipper = make_clipper(max_grad_norm, mode)
        if self.scaler.enabled:
            check_fp16_clip_mode(clipper.mode.value, True, clipper.max_grad_norm)
        self.clipper = clipper

    def use_grad_scaler(self, scaler: Any, owner: Any) -> None:
        if scaler is not None and not scaler.is_enabled():
            scaler = None
        if scaler is not None:
            check_fp16_clip_mode(self.clipper.mode.value, True, self.clipper.max_grad_norm)
            check_fp16_weights(zip(self.names, self.params))
        self.scaler = NoLossScaling() if scaler is None else GradScalerBridge(scaler, owner, self.backward_end)

    def whole_step(self) -> bool:
        # Exact clipping needs the global norm, and fp16 loss scaling every gradient's inf check, before any layer
        # steps: from a norm pass, or by holding the gradients until step().
        return self.clipper.needs_global_norm or self.scaler.enabled

    def steps_now(self) -> bool:
        """Whether a gradient handed over now steps at once: the window's decision table, asked without noting."""
        if self.offload.active:
            return False  # this window's gradients step from the host at step()
        return self.window.steps_now(self.sync(), self.whole_step())

    def wants_norms(self) -> bool:
        return self.track_grad_norm or self.clipper.needs_param_norm

    def measures_all(self) -> bool:
        """Every gradient's norm is measured: asked for, or needed for the global norm of exact clipping."""
        return self.wants_norms() or self.clipper.needs_global_norm

    # ---- norm passes ----

    def needs_norm_pass(self, attached: bool) -> bool:
        self.close_skipped_window()
        # With offload the gradients wait on the host for the global norm: one backward, no norm pass.
        return (
            attached
            and not self.offload.enabled
            and self.whole_step()
            and self.sync()
            and not self.window.accumulating
        )

    @contextlib.contextmanager
    def norm_pass(self, reduce_found_inf: Callable[[dict], None]) -> Iterator[None]:
        self.close_skipped_window()
        self.window.in_norm_pass = True
        try:
            yield
        finally:
            self.window.in_norm_pass = False
        window = self.window
        window.measured = True
        self.clipper.start_step(window, self.total_norm())
        self.scaler.publish(window, reduce_found_inf)

    # ---- gradient norm ----

    def total_norm(self) -> torch.Tensor | None:
        self.offload.before_norm(self)
        return self.window.total_norm(self.params)

    def grad_norm(self, owner: Any) -> torch.Tensor | None:
        self.close_skipped_window()
        if not self.window.measured and self.sync():
            self.scaler.unscale_held(owner, self.params)
        current = self.total_norm()
        if current is None and not self.wants_norms():
            # Norms of gradients that already stepped were not measured: nobody asked for them until now.
            logger.warning(
                "grad_norm() was read, but gradient norms were not measured (no clipping, track_grad_norm=False); "
                "measuring from the next step on. Pass track_grad_norm=True to build_layerwise_optimizer to have it "
                "from the start."
            )
            self.track_grad_norm = True
        return current if current is not None else self.last_grad_norm
