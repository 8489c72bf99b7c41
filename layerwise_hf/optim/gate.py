"""`GradientGate`: what happens to each gradient a route hands over, between two optimizer steps.

It owns the step window (what is known this step), the clipper, the fp16 GradScaler bridge and the gradient meter,
and applies the window's decision table (`StepWindow`) to each gradient: accumulate it, measure it in a norm pass,
hold it for `step()`, or clip and step its parameter's inner optimizer and free it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..bases.support import check_fp16_clip_mode, check_fp16_weights
from ..placement.host_step import HostStepOptimizer, unwrap_host_step
from ..placement.offload import GradientOffload
from ..platform.compat import checkpointing_kwargs_name
from ..platform.streams import step_in_backward
from ..routes.sink import BackwardEnd
from .clipping import ClipMode, make_clipper
from .grad_scaler import GradScalerBridge
from .host_offload import HostCoefficient
from .memory import GradMeter
from .window import Action, StepWindow

logger = logging.getLogger(__name__)


class GradientGate:
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
    >>> from layerwise_hf.optim.gate import GradientGate
    >>> weight = torch.nn.Parameter(torch.ones(3))
    >>> gate = GradientGate(["w"], [weight], [torch.optim.SGD([weight], lr=0.5)], sync=lambda: True)
    >>> weight.grad = torch.ones(3)
    >>> gate.grad_ready(0); weight.data, weight.grad
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
        self.scaler: GradScalerBridge | None = None
        self.track_grad_norm = track_grad_norm
        self.last_grad_norm: torch.Tensor | None = None
        self.applied_lr: dict[str, float] = {}  # per optimizer class, the lr of its latest step
        self.offload: GradientOffload | None = None  # layerwise_offload="gradients": gradients wait on the host
        self.host_coef = HostCoefficient()  # the window's clip coefficient on the host, moved once a step

    # ---- one gradient ----

    def grad_ready(self, i: int) -> None:
        """Parameter `i`'s (reduced) gradient is in its `.grad`: act on it as the step window decides."""
        window = self.window
        scaler = self.scaler
        if scaler is not None and scaler.window_was_skipped(window):
            self.end_window()
        param = self.params[i]
        action = window.action(i, self.sync(), self.whole_step())
        if self.offload is not None and self._offloaded(i, action):
            return
        if action is Action.ACCUMULATE:
            self.meter.hold(i, param.grad)  # the gradient stays in .grad until the window's last micro-batch
            return
        if scaler is not None:
            scaler.capture(window)
        if action is Action.STEP:
            if scaler is not None and not scaler.unscale_to_step(window, param.grad):
                # Overflowed in this pass only: GradScaler will skip the step; this and later gradients do not step.
                param.grad = None
                return
            self.step_param(i)
        elif action is Action.MEASURE:
            self.meter.hold(i, param.grad)
            if scaler is not None:
                scaler.unscale(window, param.grad)
            if self.wants_norms():
                window.record_norm(i, param)
            param.grad = None
            self.meter.release(i)
        elif action is Action.HOLD:
            # step() clips and steps exactly (with a scaler, after GradScaler has unscaled every held gradient).
            self.meter.hold(i, param.grad)
            if scaler is None:
                window.record_norm(i, param)
        else:
            raise RuntimeError(
                f"The gradient hook of {self.names[i]} fired twice before optimizer.step(): it would be stepped "
                "twice. This happens with reentrant activation checkpointing when a parameter is used in two "
                f"checkpointed segments (use {checkpointing_kwargs_name()}={{'use_reentrant': False}}), or with "
                "several backward passes per step outside gradient accumulation (use accelerator.accumulate or "
                "gradient_accumulation_steps)."
            )

    def _offloaded(self, i: int, action: Action) -> bool:
        # Accumulated and held gradients wait on the host; a gradient stepping at once with nothing on the host
        # (no accumulation, no clipping) steps as without offload.
        offload = self.offload
        if action not in (Action.ACCUMULATE, Action.HOLD) and not (action is Action.STEP and offload.holds(i)):
            return False
        final, scaler, window = action is not Action.ACCUMULATE, self.scaler, self.window
        inv_scale = None  # fp16: a host sum is unscaled and inf-checked by the host worker
        if final and not offload.holds(i):
            # The whole gradient is on the device: checked and measured there, before it is copied.
            if scaler is not None:
                scaler.capture(window)
                scaler.unscale(window, self.params[i].grad)
            window.record_norm(i, self.params[i])
        elif final and scaler is not None:
            inv_scale = scaler.inverse_scale(window, offload.host[i].device)
        measure = final and (self.wants_norms() or self.clipper.needs_global_norm)
        inner = self.inner[i]
        if not offload.holds(i) and isinstance(inner, HostStepOptimizer):
            inner.wait_host()  # its last host step may still read the buffer this gradient is copied into
        meter = self.meter
        meter.hold(i, self.params[i].grad)
        # Logged as the gradient bytes alive on the device: this one and the copies out still reading theirs.
        meter.peak_bytes = max(meter.peak_bytes, meter.held_bytes + offload.device_bytes)
        offload.stash(i, self.params[i], measure, final, inv_scale)
        meter.release(i)
        if final and scaler is not None:
            scaler.check_offloaded(window, offload, self.params, self.wants_norms() or self.clipper.needs_global_norm)
        return True

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
            grad.mul_(coef.to(grad.device))
        inner = self.inner[i]
        step_in_backward(inner, p)
        self.applied_lr[type(unwrap_host_step(inner)).__name__] = inner.param_groups[0]["lr"]
        window.stepped[i] = True
        p.grad = None
        self.meter.release(i)

    def step_on_host(self, i: int) -> None:
        """`layerwise_offload="optimizer"`: step parameter `i` on the host from its host gradient (clipped there)."""
        window, inner = self.window, self.inner[i]
        norm = window.norms[i]
        coef = self.clipper.coef(window, None if norm is None else norm[2], self.last_grad_norm)
        buffer = self.offload.host[i]
        if coef is not None:
            coef = self.host_coef(coef, buffer.device)
        inner.step_host(buffer, [], coef)
        self.applied_lr[type(unwrap_host_step(inner)).__name__] = inner.param_groups[0]["lr"]
        window.stepped[i] = True
        self.offload.filled[i] = False

    def merge_waiting(self, i: int) -> None:
        """Add parameter `i`'s host sum of this window (offload) into its `.grad`, before a route's reduction."""
        offload = self.offload
        if offload is not None and offload.holds(i):
            offload.merge_into(i, self.params[i])

    # ---- the step ----

    def step_pending(self) -> None:
        """`optimizer.step()`: step what no hook consumed (held or hand-set gradients), then close the window."""
        self.close_skipped_window()
        window = self.window
        pending = [i for i, p in enumerate(self.params) if p.grad is not None and not window.stepped[i]]
        offloaded = self.offload.pending() if self.offload is not None else []
        if pending or offloaded:
            # With a scaler, GradScaler.step has unscaled these held gradients before calling step().
            for i in pending:
                window.record_norm(i, self.params[i])
            if self.clipper.needs_global_norm:
                self.clipper.start_step(window, self.total_norm())
            for i in pending:
                self.step_param(i)
            if offloaded and self.offload.host_steps:
                self.offload.settle(window, self.params)
                for i in offloaded:
                    self.step_on_host(i)
            elif offloaded:
                self.offload.restore_each(offloaded, self.params, self.step_param, window)
        self.end_window()

    def end_window(self) -> None:
        total = self.total_norm()
        if total is not None:
            self.last_grad_norm = total
        self.reset_window()

    def new_route(self) -> None:
        """A route is attached (training begins): a fresh window, and host copies taken again from the device."""
        self.reset_window()
        for inner in self.inner:
            if isinstance(inner, HostStepOptimizer):
                inner.stale = True

    def reset_window(self) -> None:
        """Forget a window that will not be finished (a new route, or an exception in the middle of a step)."""
        self.window.reset()
        self.meter.clear()
        if self.offload is not None:
            self.offload.end_window()

    def close_skipped_window(self) -> None:
        """Forget, without stepping, a window whose step GradScaler skipped (our step() never ran)."""
        if self.scaler is not None and self.scaler.window_was_skipped(self.window):
            self.end_window()

    def note_accumulation(self) -> None:
        self.close_skipped_window()
        self.window.accumulating = True

    # ---- clipping and fp16 ----

    def configure_clipping(self, max_grad_norm: float | None, mode: str | ClipMode = ClipMode.EXACT) -> None:
        clipper = make_clipper(max_grad_norm, mode)
        if self.scaler is not None:
            check_fp16_clip_mode(clipper.mode.value, True, clipper.max_grad_norm)
        self.clipper = clipper

    def use_grad_scaler(self, scaler: Any, owner: Any) -> None:
        if scaler is not None and not scaler.is_enabled():
            scaler = None
        if scaler is not None:
            check_fp16_clip_mode(self.clipper.mode.value, True, self.clipper.max_grad_norm)
            check_fp16_weights(zip(self.names, self.params))
        self.scaler = None if scaler is None else GradScalerBridge(scaler, owner, self.backward_end)

    def whole_step(self) -> bool:
        # Exact clipping needs the global norm, and fp16 loss scaling every gradient's inf check, before any layer
        # steps: from a norm pass, or by holding the gradients until step().
        return self.clipper.needs_global_norm or self.scaler is not None

    def steps_now(self) -> bool:
        """Whether a gradient handed over now steps at once: the window's decision table, asked without noting."""
        if self.offload is not None and self.offload.active:
            return False  # this window's gradients step from the host at step()
        return self.window.steps_now(self.sync(), self.whole_step())

    def wants_norms(self) -> bool:
        return self.track_grad_norm or self.clipper.needs_param_norm

    # ---- norm passes ----

    def needs_norm_pass(self, attached: bool) -> bool:
        self.close_skipped_window()
        # With offload the gradients wait on the host for the global norm: one backward, no norm pass.
        offloaded = self.offload is not None
        return attached and not offloaded and self.whole_step() and self.sync() and not self.window.accumulating

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
        if self.scaler is not None:
            self.scaler.publish(window, reduce_found_inf)

    # ---- gradient norm ----

    def total_norm(self) -> torch.Tensor | None:
        if self.offload is not None:
            if self.scaler is None and self.sync():
                # A sum whose parameter got no gradient in the window's last micro-batch counts in the norm too.
                self.offload.finish(self.wants_norms() or self.clipper.needs_global_norm)
            self.offload.settle(self.window, self.params)
        return self.window.total_norm(self.params)

    def grad_norm(self, owner: Any) -> torch.Tensor | None:
        self.close_skipped_window()
        if self.scaler is not None and not self.window.measured and self.sync():
            self.scaler.unscale_held(owner, any(p.grad is not None for p in self.params))
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
