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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..placement.host_step import unwrap_host_step
from ..platform.backward_end import BackwardEnd
from ..platform.compat import checkpointing_kwargs_name
from ..platform.dtensor import local_tensor
from ..platform.norms import grad_norm_kernel, scale_grad
from ..platform.streams import GroupSteps, step_in_backward
from .clipping import ClipMode, Clipper, make_clipper
from .grad_scaler import GradScalerBridge
from .host_offload import OffloadStage, Where
from .memory import MemoryReport
from .window import Action, StageContext, StepWindow


def _accelerate_sync_gradients() -> bool:
    # NOTE: accelerate sets `sync_gradients` before the backward of each micro-batch (False on all but the last of
    # a gradient-accumulation window), and Trainer sets it explicitly; outside Accelerate it stays True.
    from accelerate.state import GradientState

    return GradientState().sync_gradients


class GradMeter:
    """
    The gradients alive in a layer-wise optimizer (accumulating, or waiting for the step) and the most bytes alive at
    once. A gradient is counted from the moment its hook sees it until its parameter steps and frees it.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.optim.pipeline import GradMeter
    >>> meter = GradMeter()
    >>> meter.add(0, torch.zeros(256))
    >>> meter.remove(0)
    >>> meter.alive_bytes, meter.peak_bytes
    (0, 1024)
    ```
    """

    def __init__(self) -> None:
        self.alive: dict[int, int] = {}
        self.alive_bytes = 0
        self.peak_bytes = 0

    def add(self, i: int, grad: torch.Tensor | None) -> None:
        if grad is None or i in self.alive:
            return
        # A DTensor's numel() is the global size; this rank holds only its local shard.
        local = grad if type(grad) is torch.Tensor else local_tensor(grad)
        nbytes = local.numel() * local.element_size()
        self.alive[i] = nbytes
        self.alive_bytes += nbytes
        if self.alive_bytes > self.peak_bytes:
            self.peak_bytes = self.alive_bytes

    def remove(self, i: int) -> None:
        self.alive_bytes -= self.alive.pop(i, 0)

    def clear(self) -> None:
        self.alive.clear()
        self.alive_bytes = 0


class NoLossScaling:
    """
    The loss-scaling stage without fp16 loss scaling (`GradScalerBridge` with it): every gradient is already unscaled
    and none is checked. The pipeline's own stand-in, so a stage that is off is not entered.

    Example:

    ```python
    >>> from layerwise_hf.optim.pipeline import NoLossScaling
    >>> NoLossScaling().unscale_to_step(None), NoLossScaling.enabled
    (True, False)
    ```
    """

    enabled = False

    def window_was_skipped(self) -> bool:
        return False

    def capture(self) -> None:
        pass

    def unscale(self, grad: torch.Tensor) -> None:
        pass

    def unscale_to_step(self, grad: torch.Tensor) -> bool:
        return True

    def inverse_scale(self, device: torch.device) -> torch.Tensor | None:
        return None

    def publish_at_end(self, device: torch.device, host_flag: Callable[[bool], torch.Tensor | None]) -> None:
        pass

    def publish(self, reduce_found_inf: Callable[[dict], None]) -> None:
        pass

    def will_skip(self) -> bool:
        return False

    def unscale_held(self, optimizer: Any, params: Any) -> None:
        pass

    def end_window(self) -> None:
        pass


class NoOffload:
    """
    The offload stage with `layerwise_offload="none"` (`OffloadStage` with it): every gradient stays on the device,
    none is taken. The pipeline's own stand-in, so a stage that is off is not entered.

    Example:

    ```python
    >>> from layerwise_hf.optim.pipeline import NO_OFFLOAD
    >>> NO_OFFLOAD.enabled, NO_OFFLOAD.pending(), NO_OFFLOAD.buffers is None
    (False, [], True)
    ```
    """

    enabled = False
    active = False
    buffers = None

    def where(self, i: int, action: Action) -> Where | None:
        return None

    def take(self, ctx: StageContext, i: int, final: bool, measure: bool, inv_scale: torch.Tensor | None) -> None:
        raise AssertionError("no offload takes no gradient")

    def host_device(self, i: int) -> torch.device:
        raise AssertionError("no offload has no host sum")

    def unfinished(self) -> bool:
        return False

    def host_flag(self, ctx: StageContext, at_end: bool, measure: bool, inv_scale: torch.Tensor | None) -> None:
        return None

    def merge_waiting(self, ctx: StageContext, i: int) -> None:
        pass

    def pending(self) -> list[int]:
        return []

    def step(self, ctx: StageContext, indices: list[int]) -> None:
        pass

    def before_norm(self, ctx: StageContext, finish: bool, measure: bool) -> None:
        pass

    def new_route(self, ctx: StageContext) -> None:
        pass

    def end_window(self) -> None:
        pass

    def close(self) -> None:
        pass


NO_OFFLOAD = NoOffload()


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
        sync_gradients (`Callable[[], bool]`, *optional*): whether a backward ends the window (Accelerate's).
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
        self.backward_end = BackwardEnd()  # one per pipeline: the routes, the delay and the stages queue on it
        self.window = StepWindow(len(self.params))
        self.meter = GradMeter()
        self.clipper: Clipper = make_clipper(0.0, ClipMode.OFF)
        self.scaling: GradScalerBridge | NoLossScaling = NoLossScaling()
        self.offload: OffloadStage | NoOffload = NO_OFFLOAD
        self.route: Any = None  # the route attached last (kept after detach: its name is the optimizer's `route`)
        self.track_grad_norm = track_grad_norm
        self.last_grad_norm: torch.Tensor | None = None
        self.applied_lr: dict[str, float] = {}  # per optimizer class, the lr of its latest step
        self._kinds = [type(unwrap_host_step(o)).__name__ for o in inner]  # each inner optimizer's class
        self.norm_pass_choice: Any = None  # what layerwise_norm_pass="auto" decided (`norm_pass.NormPassChoice`)
        self.sync_gradients = WindowEnd(sync_gradients or _accelerate_sync_gradients)
        self.context = StageContext(self.params, inner, self.window, self.step_param, self.note_step, self.coef)

    # ---- the sink: what a route calls ----

    def grad_ready(self, i: int, steps: GroupSteps | None = None) -> None:
        """Parameter `i`'s (reduced) gradient is in its `.grad`: act on it as the step window decides (`steps`: the
        FSDP2 route's deferrer of 8-bit steps, handed on to the step)."""
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
            self.meter.add(i, param.grad)  # the gradient stays in .grad until the window's last micro-batch
        elif action is Action.STEP:
            scaling.capture()
            if scaling.unscale_to_step(param.grad):
                self.step_param(i, steps)
            else:
                # Overflowed in this pass only: GradScaler will skip the step; this and later gradients do not step.
                param.grad = None
        elif action is Action.MEASURE:
            scaling.capture()
            self.meter.add(i, param.grad)
            scaling.unscale(param.grad)
            if self.wants_norms():
                self.record_norm(i)
            param.grad = None
            self.meter.remove(i)
        elif action is Action.HOLD:
            # step() clips and steps exactly; a scaled gradient is measured there, once GradScaler has unscaled it.
            scaling.capture()
            self.meter.add(i, param.grad)
            if not scaling.enabled:
                self.record_norm(i)
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
            self.record_norm(i)
        elif final:
            inv_scale = scaling.inverse_scale(self.offload.host_device(i))
        meter, measures = self.meter, self.measures_all()
        meter.add(i, param.grad)
        # Logged as the gradient bytes alive on the device: this one and the copies out still reading theirs.
        meter.peak_bytes = max(meter.peak_bytes, meter.alive_bytes + self.offload.buffers.device_bytes)
        self.offload.take(self.context, i, final, final and measures, inv_scale)
        meter.remove(i)
        if final:
            offload, ctx = self.offload, self.context

            def host_flag(at_end: bool) -> torch.Tensor | None:
                # Sums still scaled (no gradient in the last micro-batch) are unscaled on the host.
                inv_scale = scaling.inverse_scale(torch.device("cpu")) if at_end and offload.unfinished() else None
                return offload.host_flag(ctx, at_end, measures, inv_scale)

            scaling.publish_at_end(local_tensor(self.params[0]).device, host_flag)

    def grad_delayed(self, i: int) -> None:
        """A route keeps parameter `i`'s gradient to hand it over later: count it among the gradients alive."""
        self.meter.add(i, self.params[i].grad)

    def merge_waiting(self, i: int) -> None:
        """Add parameter `i`'s host sum of this window (offload) into its `.grad`, before a route's reduction (maybe
        before any hook of the window ran: a window GradScaler skipped is closed first)."""
        self.close_skipped_window()
        self.offload.merge_waiting(self.context, i)

    def steps_in_backward(self) -> bool:
        """Whether a gradient handed over now steps at once: the window's decision table, asked without noting."""
        if self.offload.active:
            return False  # this window's gradients step from the host at step()
        return self.window.steps_now(self.sync_gradients(), self.whole_step())

    # ---- the step of one parameter ----

    @torch.no_grad()
    def step_param(self, i: int, steps: GroupSteps | None = None) -> None:
        """Clip parameter `i`'s gradient, step its optimizer, free the gradient."""
        p = self.params[i]
        grad = p.grad
        self.meter.add(i, grad)
        if self.clipper.needs_param_norm or self.track_grad_norm:
            self.record_norm(i)
        coef = self.coef(i)
        if coef is not None:
            scale_grad(grad, coef)
        inner = self.inner[i]
        if getattr(inner, "takes_steps", False):
            inner.step(steps=steps)  # a local shard's optimizer: it orders its base's step itself, deferred by `steps`
        else:
            step_in_backward(inner, p, steps=steps)
        self.note_step(i)
        p.grad = None
        self.meter.remove(i)

    def record_norm(self, i: int) -> None:
        """Measure parameter `i`'s gradient once per window, with `clip_grad_norm_`'s kernel."""
        norms, grad = self.window.norms, self.params[i].grad
        if norms[i] is None and grad is not None:
            norms[i] = (self.params[i].device, grad.dtype, grad_norm_kernel(grad))

    def coef(self, i: int) -> torch.Tensor | None:
        """Parameter `i`'s clip coefficient (`None`: leave its gradient as it is)."""
        norm = self.window.norms[i]
        return self.clipper.coef(None if norm is None else norm[2], self.last_grad_norm)

    def note_step(self, i: int) -> None:
        """Parameter `i` stepped in this window (on the device or on the host)."""
        self.applied_lr[self._kinds[i]] = self.inner[i].param_groups[0]["lr"]
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
                self.record_norm(i)
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
        self.offload.before_norm(self.context, not self.scaling.enabled and self.sync_gradients(), self.measures_all())
        return self.window.total_norm(self.params)

    @property
    def memory(self) -> MemoryReport:
        """The gradient bytes alive at most, the optimizer states' and all gradients' bytes."""
        return MemoryReport(self.meter, self.inner, self.params)
