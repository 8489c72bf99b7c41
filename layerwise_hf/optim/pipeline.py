"""`GradientPipeline`: the path of each gradient a route hands over, between two optimizer steps.

The pipeline is the routes' `GradientSink` (`layerwise_hf.routes.sink`). It owns the step window (what is known this
step), the gradient meter and the end of each backward (`BackwardEnd`), and runs the stages in one order for each
gradient: the window decides (accumulate, measure, hold or step), loss scaling unscales and inf-checks, offload takes
a gradient that waits to the host, clipping gives its factor, and the step steps the parameter's inner optimizer and
frees the gradient. Each stage is one object with a stand-in for "off" (`NoLossScaling`, `NO_OFFLOAD`, the `off`
clipper), owns its part of the window, and is handed what it needs (a `StageContext`, an inverse scale): no stage
calls another or the pipeline.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..placement.host_step import unwrap_host_step
from ..platform.backward_end import BackwardEnd
from ..platform.compat import checkpointing_kwargs_name
from ..platform.dtensor import local_tensor
from ..platform.norms import scale_grad
from ..platform.streams import GroupSteps, step_in_backward
from .clipping import ClipMode, Clipper, make_clipper
from .grad_scaler import GradScalerBridge, NoLossScaling
from .host_offload import NO_OFFLOAD, NoOffload, OffloadStage, Where
from .memory import GradMeter, MemoryReport
from .window import Action, StageContext, StepWindow

logger = logging.getLogger(__name__)


def _accelerate_sync_gradients() -> bool:
    # NOTE: accelerate sets `sync_gradients` before the backward of each micro-batch (False on all but the last of
    # a gradient-accumulation window), and Trainer sets it explicitly; outside Accelerate it stays True.
    from accelerate.state import GradientState

    return GradientState().sync_gradients


class WindowEnd:
    """Whether the current backward ends the window: the source's answer (Accelerate's `sync_gradients`), unless
    inside `extra_backward`."""

    def __init__(self, source: Callable[[], bool]):
        self.source = source
        self.extra = False

    def __call__(self) -> bool:
        return not self.extra and self.source()

    @contextlib.contextmanager
    def extra_backward(self, active: bool = True) -> Iterator[None]:
        """Backward passes within only accumulate into `.grad`, as a micro-batch that does not end the window (an
        auxiliary loss's own backward in `compute_loss`); `active=False` lifts that for the step's real backward."""
        previous, self.extra = self.extra, active
        try:
            yield
        finally:
            self.extra = previous


class GradientPipeline:
    """
    The per-gradient path of a layer-wise optimizer, and the `GradientSink` its route feeds.

    Args:
        names (`Sequence[str]`): the parameters' names, for error messages.
        params (`Sequence[torch.Tensor]`): the parameters (followed in place when the owner rebinds them).
        inner (`Sequence[torch.optim.Optimizer]`): one optimizer per parameter.
        sync_gradients (`Callable[[], bool]`, *optional*): whether the current backward ends an accumulation window
            (default: Accelerate's `sync_gradients`).
        track_grad_norm (`bool`): measure every gradient's norm even when clipping does not need it.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.optim.pipeline import GradientPipeline
    >>> weight = torch.nn.Parameter(torch.ones(3))
    >>> pipeline = GradientPipeline(["w"], [weight], [torch.optim.SGD([weight], lr=0.5)], lambda: True)
    >>> weight.grad = torch.ones(3)
    >>> pipeline.grad_ready(0); weight.data, weight.grad
    (tensor([0.5000, 0.5000, 0.5000]), None)
    ```
    """

    def __init__(
        self,
        names: Sequence[str],
        params: Sequence[torch.Tensor],
        inner: Sequence[torch.optim.Optimizer],
        sync_gradients: Callable[[], bool] | None = None,
        track_grad_norm: bool = False,
    ):
        self.names = names
        self.params = list(params)
        self.inner = inner
        self.backward_end = BackwardEnd()  # one per pipeline: the routes, the hold and the stages queue on it
        self.window = StepWindow(len(self.params))
        self.meter = GradMeter()
        self.clipper: Clipper = make_clipper(0.0, ClipMode.OFF)
        self.scaling: GradScalerBridge | NoLossScaling = NoLossScaling()
        self.offload: OffloadStage | NoOffload = NO_OFFLOAD
        self.route: Any = None  # the route attached last (kept after detach: its name is the optimizer's `route`)
        self.track_grad_norm = track_grad_norm
        self.last_grad_norm: torch.Tensor | None = None
        self.applied_lr: dict[str, float] = {}  # per optimizer class, the lr of its latest step
        self.norm_pass_choice: Any = None  # what layerwise_norm_pass="auto" decided (`norm_pass.NormPassChoice`)
        self.sync = WindowEnd(sync_gradients or _accelerate_sync_gradients)
        self.context = StageContext(
            self.params, inner, self.window, self.meter, self.backward_end, self.sync_gradients,
            self.measures_all, self.step_param, self.note_step, self.coef,
        )  # fmt: skip

    # ---- the sink: what a route calls ----

    def grad_ready(self, i: int, steps: GroupSteps | None = None) -> None:
        """Parameter `i`'s (reduced) gradient is in its `.grad`: act on it as the step window decides (`steps`: the
        FSDP2 route's holder of 8-bit steps, handed on to the step)."""
        param, scaling = self.params[i], self.scaling
        if not param.requires_grad:
            # Frozen since the optimizer was built: not stepped, as a standard optimizer skips a parameter without a
            # gradient (the routes hook no frozen tensor; only the data-parallel route's zero-filled slot hands one).
            param.grad = None
            return
        if scaling.window_was_skipped():
            self.end_window()
        action = self.window.action(i, self.sync_gradients(), self.whole_step())
        where = self.offload.where(i, action)
        if where is not None:
            self._to_host(i, action is not Action.ACCUMULATE, where)
        elif action is Action.ACCUMULATE:
            self.meter.hold(i, param.grad)  # the gradient stays in .grad until the window's last micro-batch
        elif action is Action.STEP:
            scaling.capture()
            if scaling.unscale_to_step(param.grad):
                self.step_param(i, steps)
            else:
                # Overflowed in this pass only: GradScaler will skip the step; this and later gradients do not step.
                param.grad = None
        elif action is Action.MEASURE:
            scaling.capture()
            self.meter.hold(i, param.grad)
            scaling.unscale(param.grad)
            if self.wants_norms():
                self.window.record_norm(i, param)
            param.grad = None
            self.meter.release(i)
        elif action is Action.HOLD:
            # step() clips and steps exactly; a scaled gradient is measured there, once GradScaler has unscaled it.
            scaling.capture()
            self.meter.hold(i, param.grad)
            if not scaling.enabled:
                self.window.record_norm(i, param)
        else:
            raise RuntimeError(
                f"The gradient hook of {self.names[i]} fired twice before optimizer.step(): it would be stepped "
                "twice. This happens with reentrant activation checkpointing when a parameter is used in two "
                f"checkpointed segments (use {checkpointing_kwargs_name()}={{'use_reentrant': False}}), or with "
                "several backward passes per step outside gradient accumulation (use accelerator.accumulate or "
                "gradient_accumulation_steps)."
            )

    def _to_host(self, i: int, final: bool, where: Where) -> None:
        # Loss scaling first: a whole gradient is unscaled (and measured) on the device before its copy; a host sum
        # gets the inverse scale for the host worker.
        scaling, param, inv_scale = self.scaling, self.params[i], None
        if final and where is Where.DEVICE:
            scaling.capture()
            scaling.unscale(param.grad)
            self.window.record_norm(i, param)
        elif final:
            inv_scale = scaling.inverse_scale(self.offload.host_device(i))
        self.offload.take(self.context, i, final, inv_scale)
        if final:
            offload, ctx = self.offload, self.context

            def host_flag(at_end: bool) -> torch.Tensor | None:
                return offload.host_flag(ctx, at_end, lambda: scaling.inverse_scale(torch.device("cpu")))

            scaling.publish_at_end(local_tensor(self.params[0]).device, host_flag)

    def grad_held(self, i: int) -> None:
        """A route keeps parameter `i`'s gradient to hand it over later: count it among the gradients alive."""
        self.meter.hold(i, self.params[i].grad)

    def merge_waiting(self, i: int) -> None:
        """Add parameter `i`'s host sum of this window (offload) into its `.grad`, before a route's reduction."""
        # NOTE: a route may ask before any hook of the next window runs; a window GradScaler skipped is closed first.
        self.close_skipped_window()
        self.offload.merge_waiting(self.context, i)

    def steps_in_backward(self) -> bool:
        """Whether a gradient handed over now steps at once: the window's decision table, asked without noting."""
        if self.offload.active:
            return False  # this window's gradients step from the host at step()
        return self.window.steps_now(self.sync_gradients(), self.whole_step())

    def sync_gradients(self) -> bool:
        """Whether the current backward ends a gradient-accumulation window."""
        return self.sync()

    # ---- the step of one parameter ----

    @torch.no_grad()
    def step_param(self, i: int, steps: GroupSteps | None = None) -> None:
        """Clip parameter `i`'s gradient, step its optimizer, free the gradient."""
        p = self.params[i]
        grad = p.grad
        self.meter.hold(i, grad)
        if self.clipper.needs_param_norm or self.track_grad_norm:
            self.window.record_norm(i, p)
        coef = self.coef(i)
        if coef is not None:
            scale_grad(grad, coef)
        step_in_backward(self.inner[i], p, steps=steps)
        self.note_step(i)
        p.grad = None
        self.meter.release(i)

    def coef(self, i: int) -> torch.Tensor | None:
        """Parameter `i`'s clip coefficient (`None`: leave its gradient as it is)."""
        norm = self.window.norms[i]
        return self.clipper.coef(None if norm is None else norm[2], self.last_grad_norm)

    def note_step(self, i: int) -> None:
        """Parameter `i` stepped in this window (on the device or on the host)."""
        inner = self.inner[i]
        self.applied_lr[type(unwrap_host_step(inner)).__name__] = inner.param_groups[0]["lr"]
        self.window.stepped[i] = True

    # ---- the step ----

    def step(self) -> None:
        """`optimizer.step()`: step what no hook consumed (held or hand-set gradients), then close the window."""
        self.backward_end.outside_backward()
        self.close_skipped_window()
        window = self.window
        pending = [i for i, p in enumerate(self.params) if p.grad is not None and not window.stepped[i]]
        offloaded = self.offload.pending()
        if pending or offloaded:
            # With a scaler, GradScaler.step has unscaled these held gradients before calling step().
            for i in pending:
                window.record_norm(i, self.params[i])
            if self.clipper.needs_global_norm:
                self.clipper.start_step(self.total_norm())
            for i in pending:
                self.step_param(i)
            self.offload.step(self.context, offloaded)
        self.end_window()

    def zero_grad(self) -> None:
        """`optimizer.zero_grad()`: a window with host sums is forgotten; otherwise only the meter."""
        self.backward_end.outside_backward()
        self.reset_window() if self.offload.enabled else self.meter.clear()

    def end_window(self) -> None:
        """Close the window: its global norm is the last one (`grad_norm()` after `step()`)."""
        total = self.total_norm()
        if total is not None:
            self.last_grad_norm = total
        self.reset_window()

    def attach(self, route: Any) -> None:
        """Feed `route`'s gradients into this pipeline (training begins): a fresh window, as one cut short by an
        exception (Ctrl-C, OOM, a callback) must not carry into the next step; host copies are taken again."""
        self.reset_window()
        self.offload.new_route(self.context)
        self.backward_end.forget()
        route.attach(self)
        self.route = route

    def reset_window(self) -> None:
        """Forget a window that will not be finished (a new route, or an exception in the middle of a step)."""
        self.window.reset()
        self.meter.clear()
        self.clipper.end_window()
        self.scaling.end_window()
        self.offload.end_window()

    def close_skipped_window(self) -> None:
        """Forget, without stepping, a window whose step GradScaler skipped (our step() never ran)."""
        if self.scaling.window_was_skipped():
            self.end_window()

    def note_accumulation(self) -> None:
        """A micro-batch that does not end the window ran backward (under DDP's no_sync no hook says so)."""
        self.close_skipped_window()
        self.window.accumulating = True

    # ---- what the step needs ----

    def whole_step(self) -> bool:
        # Exact clipping needs the global norm, and fp16 loss scaling every gradient's inf check, before any layer
        # steps: from a norm pass, or by holding the gradients until step().
        return self.clipper.needs_global_norm or self.scaling.enabled

    def wants_norms(self) -> bool:
        return self.track_grad_norm or self.clipper.needs_param_norm

    def measures_all(self) -> bool:
        """Every gradient's norm is measured: asked for, or needed for the global norm of exact clipping."""
        return self.wants_norms() or self.clipper.needs_global_norm

    # ---- norm passes ----

    def needs_norm_pass(self) -> bool:
        """Whether the coming backward ends a window that exact clipping or fp16 wants measured first."""
        self.close_skipped_window()
        # With offload the gradients wait on the host for the global norm: one backward, no norm pass.
        attached = self.route is not None and self.route.attached
        return (
            attached
            and not self.offload.enabled
            and self.whole_step()
            and self.sync_gradients()
            and not self.window.accumulating
        )

    @contextlib.contextmanager
    def norm_pass(self) -> Iterator[None]:
        """Hooks within it only measure (and fp16-check) gradients and free them (`layerwise_hf.optim.norm_pass`)."""
        self.close_skipped_window()
        self.window.in_norm_pass = True
        try:
            yield
        finally:
            self.window.in_norm_pass = False
        self.window.measured = True
        self.clipper.start_step(self.total_norm())
        route = self.route
        self.scaling.publish(route.reduce_found_inf if route is not None else lambda flags: None)

    # ---- gradient norm and memory ----

    def total_norm(self) -> torch.Tensor | None:
        self.offload.before_norm(self.context, not self.scaling.enabled and self.sync_gradients())
        return self.window.total_norm(self.params)

    def grad_norm(self, owner: Any) -> torch.Tensor | None:
        """See `LayerwiseOptimizer.grad_norm`; `owner` is the optimizer GradScaler knows."""
        self.close_skipped_window()
        if not self.window.measured and self.sync_gradients():
            self.scaling.unscale_held(owner, self.params)
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

    @property
    def memory(self) -> MemoryReport:
        """The memory figures: the gradient bytes held at most, the optimizer states' and all gradients' bytes."""
        return MemoryReport(self.meter, self.inner, self.params)
