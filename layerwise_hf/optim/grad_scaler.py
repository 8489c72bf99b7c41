"""The bridge to `torch.amp.GradScaler`: the only code that touches GradScaler's private per-optimizer records.

With fp16 loss scaling, the hooks see scaled gradients and free them before Trainer calls `scaler.step()`. The bridge
unscales each gradient with GradScaler's own kernel as it arrives, collects the found-inf flags, and records them
where `scaler.unscale_(optimizer)` would have put them, so `GradScaler.step` / `update` decide the skip and the scale
exactly as they do for a standard optimizer.

With host offload (`layerwise_hf.placement.offload`) the gradients wait in host buffers for the step, so no norm pass
runs and no gradient is in `.grad` for `unscale_()` to find: each final gradient is unscaled and checked as it is
offloaded (on the device when it is whole there, by the host worker on a window's host sum), and at the end of the
window's last backward the flags are gathered and recorded for GradScaler (`check_offloaded`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..platform.backward_end import BackwardEnd
from ..platform.dtensor import local_tensor as _local
from .window import StepWindow


class NoLossScaling:
    """
    The loss-scaling stage without fp16 loss scaling: every gradient is already unscaled and none is checked. It
    answers as `GradScalerBridge` does when nothing overflows.

    Example:

    ```python
    >>> from layerwise_hf.optim.grad_scaler import NoLossScaling
    >>> from layerwise_hf.optim.window import StepWindow
    >>> NoLossScaling().unscale_to_step(StepWindow(1), None), NoLossScaling.enabled
    (True, False)
    ```
    """

    enabled = False

    def window_was_skipped(self, window: StepWindow) -> bool:
        return False

    def capture(self, window: StepWindow) -> None:
        pass

    def unscale(self, window: StepWindow, grad: torch.Tensor) -> None:
        pass

    def unscale_to_step(self, window: StepWindow, grad: torch.Tensor) -> bool:
        return True

    def inverse_scale(self, window: StepWindow, device: torch.device) -> torch.Tensor | None:
        return None

    def check_offloaded(self, window: StepWindow, offload: Any, params: Any, measure: bool) -> None:
        pass

    def publish(self, window: StepWindow, reduce_found_inf: Callable[[dict], None]) -> None:
        pass

    def unscale_held(self, optimizer: Any, params: Any) -> None:
        pass


class GradScalerBridge:
    """
    Unscale and inf-check gradients one at a time for the optimizer `owner` under `scaler`.

    Args:
        scaler (`torch.amp.GradScaler`):
            Accelerate's `accelerator.scaler`, enabled.
        owner (`torch.optim.Optimizer`):
            The optimizer GradScaler keys its record by (the one `scaler.step` is given, unwrapped).
        backward_end (`BackwardEnd`, *optional*):
            The owner's end-of-backward work, where the flags are gathered and made to agree across ranks.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.optim.grad_scaler import GradScalerBridge
    >>> from layerwise_hf.optim.window import StepWindow
    >>> weight = torch.nn.Parameter(torch.ones(3))
    >>> optimizer = torch.optim.SGD([weight], lr=0.1)
    >>> scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    >>> scaler.scale(weight.sum()).backward()
    >>> bridge, window = GradScalerBridge(scaler, optimizer), StepWindow(1)
    >>> bridge.unscale(window, weight.grad); weight.grad
    tensor([1., 1., 1.])
    ```
    """

    enabled = True

    def __init__(self, scaler: Any, owner: Any, backward_end: BackwardEnd | None = None):
        self.scaler = scaler
        self.owner_id = id(owner)
        self._owner = weakref.ref(owner)
        self.backward_end = backward_end if backward_end is not None else BackwardEnd()
        # The scaler record of the window in which a gradient overflowed only in the stepping pass, and of the one
        # whose stepping pass will make the ranks' flags agree.
        self.overflowed_record: dict[str, Any] | None = None
        self.agreed_record: dict[str, Any] | None = None
        self.reduce_found_inf: Callable[[dict], None] = lambda flags: None

    def _record(self) -> dict[str, Any]:
        return self.scaler._per_optimizer_states[self.owner_id]

    def capture(self, window: StepWindow) -> None:
        """Note the scaler's record of this window (GradScaler.update() replaces it when the window ends)."""
        if window.scaler_record is None:
            window.scaler_record = self._record()

    def window_was_skipped(self, window: StepWindow) -> bool:
        """
        GradScaler.step skips our step() on inf/nan, and update() then replaces its per-optimizer records: seeing
        ours replaced while a window is still open means that window was skipped.
        """
        record = window.scaler_record
        return record is not None and self.scaler._per_optimizer_states.get(self.owner_id) is not record

    def inverse_scale(self, window: StepWindow, device: torch.device) -> torch.Tensor:
        """The window's `1 / scale` on `device`, as `GradScaler.unscale_` makes it (double reciprocal, then float)."""
        inv_scale = window.inv_scale.get(device)
        if inv_scale is None:
            if self.scaler._scale is None:
                raise RuntimeError(
                    "fp16: the loss was not scaled by the GradScaler given to use_grad_scaler (call "
                    "accelerator.backward(loss), or scaler.scale(loss).backward())."
                )
            inv_scale = window.inv_scale[device] = self.scaler._scale.double().reciprocal().float().to(device)
        return inv_scale

    def _flag(self, window: StepWindow, device: torch.device) -> torch.Tensor:
        if device not in window.found_inf:
            self.inverse_scale(window, device)
            window.found_inf[device] = torch.zeros((), dtype=torch.float32, device=device)
        return window.found_inf[device]

    def unscale(self, window: StepWindow, grad: torch.Tensor) -> None:
        """Unscale `grad` in place, accumulating its device's found-inf flag in the window."""
        # NOTE: the kernel GradScaler.unscale_ runs (elementwise, so one tensor at a time is bit-identical), on the
        # local shard of an FSDP2 DTensor: found-inf is all-reduced once per step, not once per parameter.
        grad = _local(grad)
        flag = self._flag(window, grad.device)
        torch._amp_foreach_non_finite_check_and_unscale_([grad], flag, window.inv_scale[grad.device])

    def unscale_to_step(self, window: StepWindow, grad: torch.Tensor) -> bool:
        """
        After a norm pass, unscale `grad` and say whether it may step: `False` for a gradient with inf/nan that the
        norm pass did not see, and for every gradient after it in this window. The window's published flag is then
        set, so GradScaler skips the step and lowers the scale; gradients stepped before it keep their step.
        """
        # NOTE: the two passes can differ on CUDA (non-deterministic backward kernels, e.g. SDPA's), so the norm pass
        # alone cannot vouch for the gradient stepped now. Knowing before the step costs one host read of a scalar
        # per gradient, in fp16's second pass only.
        if window.scaler_record is not self.agreed_record and torch._C._current_graph_task_id() != -1:
            # NOTE: under FSDP2 each rank checks only its own shards: after this backward, on every rank (an
            # autograd-engine callback), the flags are reduced again so that every GradScaler skips alike.
            self.agreed_record = window.scaler_record
            flags, reduce = window.found_inf, self.reduce_found_inf
            self.backward_end.queue("agree_flags", lambda: reduce(flags))
        if window.scaler_record is not None and window.scaler_record is self.overflowed_record:
            return False
        grad = _local(grad)
        flag = torch.zeros((), dtype=torch.float32, device=grad.device)
        torch._amp_foreach_non_finite_check_and_unscale_([grad], flag, window.inv_scale[grad.device])
        if not flag.item():
            return True
        window.found_inf[grad.device].fill_(1.0)
        self.overflowed_record = window.scaler_record
        return False

    def check_offloaded(self, window: StepWindow, offload: Any, params: Any, measure: bool) -> None:
        """
        With host offload: a final gradient of this window was offloaded (unscaled on the device, or its host sum
        queued for the host worker's check). At the end of this backward (an autograd-engine callback) the flags are
        gathered and recorded for GradScaler (`publish`), so whatever the driver calls next (`grad_norm()`,
        `scaler.step`) sees every gradient checked. `offload` is the pipeline's `GradientOffload`; `measure`: the step
        wants the norms of host sums finished there too.
        """

        def gather(at_end: bool = True) -> None:
            if at_end and offload.unfinished():
                # Summed in earlier micro-batches, no gradient in the last one: still scaled, checked now.
                offload.finish(measure, self.inverse_scale(window, torch.device("cpu")))
            offload.settle(window, params)
            flag = self._flag(window, _local(params[0]).device)
            if offload.found_inf is not None:
                torch.maximum(flag, offload.found_inf.to(flag.device), out=flag)
            self.publish(window, self.reduce_on_route)

        # NOTE: a backward nested in this one (a reentrant checkpoint) has a task of its own; its end runs what was
        # queued in it, and a later gradient queues the gather again: the last one to run has seen every gradient.
        if not self.backward_end.queue("offload_flags", gather):
            # Not inside the autograd engine (a hook called by hand): record what is known now, and again with each
            # gradient; nothing can say which gradient is the window's last.
            gather(at_end=False)

    def reduce_on_route(self, flags: dict) -> None:
        """Make the flags agree across ranks the way the owner's gradient route does (FSDP2: each rank checked its
        own shards)."""
        owner = self._owner()
        route = getattr(owner, "gradient_route", None)
        if route is not None:
            route.reduce_found_inf(flags)

    def publish(self, window: StepWindow, reduce_found_inf: Callable[[dict], None]) -> None:
        """After a norm pass: record the flags where `unscale_()` would have, for GradScaler.step / update."""
        from torch.amp.grad_scaler import OptState

        if not window.found_inf:
            # No gradient reached a hook (nothing trainable was used): a flag of 0, as unscale_ over no grads gives
            # none and GradScaler.step would assert.
            device = self.scaler._scale.device
            window.found_inf[device] = torch.zeros((), dtype=torch.float32, device=device)
        reduce_found_inf(window.found_inf)
        self.reduce_found_inf = reduce_found_inf
        record = self._record()
        if record["stage"] is OptState.UNSCALED and record["found_inf_per_device"] is not window.found_inf:
            raise RuntimeError("GradScaler.unscale_() was called on the layer-wise optimizer during its norm pass.")
        record["found_inf_per_device"] = window.found_inf
        record["stage"] = OptState.UNSCALED
        window.scaler_record = record

    @staticmethod
    def will_skip(window: StepWindow) -> bool:
        return any(bool(t.item()) for t in window.found_inf.values())

    def unscale_held(self, optimizer: Any, params: Any) -> None:
        """Held gradients are still scaled: unscale them the way Trainer's clip_grad_norm_ path does."""
        from torch.amp.grad_scaler import OptState

        if self._record()["stage"] is OptState.READY and any(p.grad is not None for p in params):
            self.scaler.unscale_(optimizer)
