"""The bridge to `torch.amp.GradScaler`: the only code that touches GradScaler's private per-optimizer records.

With fp16 loss scaling, the hooks see scaled gradients and free them before Trainer calls `scaler.step()`. The bridge
unscales each gradient with GradScaler's own kernel as it arrives, collects the found-inf flags, and records them
where `scaler.unscale_(optimizer)` would have put them, so `GradScaler.step` / `update` decide the skip and the scale
exactly as they do for a standard optimizer.

With host offload (`layerwise_hf.placement.offload`) the gradients wait in host buffers for the step, so no norm pass
runs and no gradient is in `.grad` for `unscale_()` to find: each final gradient is unscaled and checked as it is
offloaded (on the device when it is whole there, by the host worker on a window's host sum, with the inverse scale
this stage hands the pipeline), and at the end of the window's last backward the host's flag is folded in and the
flags are recorded for GradScaler (`publish_at_end`). The stage keeps its own part of the window (the flags, the
inverse scales, GradScaler's record of the window) and forgets it in `end_window`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..platform.backward_end import BackwardEnd
from ..platform.dtensor import local_tensor as _local


class GradScalerBridge:
    """
    Unscale and inf-check gradients one at a time for the optimizer `owner` under `scaler`.

    Args:
        scaler (`torch.amp.GradScaler`):
            Accelerate's `accelerator.scaler`, enabled.
        owner (`torch.optim.Optimizer`):
            The optimizer GradScaler keys its record by (the one `scaler.step` is given, unwrapped).
        backward_end (`BackwardEnd`):
            The owner's end-of-backward work, where the flags are gathered and made to agree across ranks.
        route (`Callable[[], Any]`, *optional*):
            The owner's gradient route now (its `reduce_found_inf` makes flags agree across ranks).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.optim.grad_scaler import GradScalerBridge
    >>> from layerwise_hf.platform.backward_end import BackwardEnd
    >>> weight = torch.nn.Parameter(torch.ones(3))
    >>> optimizer = torch.optim.SGD([weight], lr=0.1)
    >>> scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    >>> scaler.scale(weight.sum()).backward()
    >>> bridge = GradScalerBridge(scaler, optimizer, BackwardEnd())
    >>> bridge.unscale(weight.grad); weight.grad
    tensor([1., 1., 1.])
    ```
    """

    enabled = True

    def __init__(self, scaler: Any, owner: Any, backward_end: BackwardEnd, route: Callable[[], Any] = lambda: None):
        self.scaler = scaler
        self.owner_id = id(owner)
        self.backward_end = backward_end
        self.route = route
        # The scaler record of the window in which a gradient overflowed only in the stepping pass, and of the one
        # whose stepping pass will make the ranks' flags agree.
        self.overflowed_record: dict[str, Any] | None = None
        self.agreed_record: dict[str, Any] | None = None
        self.reduce_found_inf: Callable[[dict], None] = lambda flags: None
        self.end_window()

    def end_window(self) -> None:
        """Forget the window: new dicts on every reset, not `clear()`: `step()` runs inside GradScaler.step, and
        update() reads the flags afterwards."""
        self.found_inf: dict[torch.device, torch.Tensor] = {}  # per device, this window's found-inf flag
        self.inv_scale: dict[torch.device, torch.Tensor] = {}  # per device, this window's 1 / scale
        self.scaler_record: dict[str, Any] | None = None  # GradScaler's record of the owner for this window

    def _record(self) -> dict[str, Any]:
        return self.scaler._per_optimizer_states[self.owner_id]

    def capture(self) -> None:
        """Note the scaler's record of this window (GradScaler.update() replaces it when the window ends)."""
        if self.scaler_record is None:
            self.scaler_record = self._record()

    def window_was_skipped(self) -> bool:
        """
        GradScaler.step skips our step() on inf/nan, and update() then replaces its per-optimizer records: seeing
        ours replaced while a window is still open means that window was skipped.
        """
        record = self.scaler_record
        return record is not None and self.scaler._per_optimizer_states.get(self.owner_id) is not record

    def inverse_scale(self, device: torch.device) -> torch.Tensor:
        """The window's `1 / scale` on `device`, as `GradScaler.unscale_` makes it (double reciprocal, then float)."""
        inv_scale = self.inv_scale.get(device)
        if inv_scale is None:
            if self.scaler._scale is None:
                raise RuntimeError(
                    "fp16: the loss was not scaled by the GradScaler given to use_grad_scaler (call "
                    "accelerator.backward(loss), or scaler.scale(loss).backward())."
                )
            inv_scale = self.inv_scale[device] = self.scaler._scale.double().reciprocal().float().to(device)
        return inv_scale

    def _flag(self, device: torch.device) -> torch.Tensor:
        if device not in self.found_inf:
            self.inverse_scale(device)
            self.found_inf[device] = torch.zeros((), dtype=torch.float32, device=device)
        return self.found_inf[device]

    def unscale(self, grad: torch.Tensor) -> None:
        """Unscale `grad` in place, accumulating its device's found-inf flag in the window."""
        # NOTE: the kernel GradScaler.unscale_ runs (elementwise, so one tensor at a time is bit-identical), on the
        # local shard of an FSDP2 DTensor: found-inf is all-reduced once per step, not once per parameter.
        grad = _local(grad)
        flag = self._flag(grad.device)
        torch._amp_foreach_non_finite_check_and_unscale_([grad], flag, self.inv_scale[grad.device])

    def unscale_to_step(self, grad: torch.Tensor) -> bool:
        """
        After a norm pass, unscale `grad` and say whether it may step: `False` for a gradient with inf/nan that the
        norm pass did not see, and for every gradient after it in this window. The window's published flag is then
        set, so GradScaler skips the step and lowers the scale; gradients stepped before it keep their step.
        """
        # NOTE: the two passes can differ on CUDA (non-deterministic backward kernels, e.g. SDPA's), so the norm pass
        # alone cannot vouch for the gradient stepped now. Knowing before the step costs one host read of a scalar
        # per gradient, in fp16's second pass only.
        if self.scaler_record is not self.agreed_record and torch._C._current_graph_task_id() != -1:
            # NOTE: under FSDP2 each rank checks only its own shards: after this backward, on every rank (an
            # autograd-engine callback), the flags are reduced again so that every GradScaler skips alike.
            self.agreed_record = self.scaler_record
            flags, reduce = self.found_inf, self.reduce_found_inf
            self.backward_end.queue("agree_flags", lambda: reduce(flags))
        if self.scaler_record is not None and self.scaler_record is self.overflowed_record:
            return False
        grad = _local(grad)
        flag = torch.zeros((), dtype=torch.float32, device=grad.device)
        torch._amp_foreach_non_finite_check_and_unscale_([grad], flag, self.inv_scale[grad.device])
        if not flag.item():
            return True
        self.found_inf[grad.device].fill_(1.0)
        self.overflowed_record = self.scaler_record
        return False

    def publish_at_end(self, device: torch.device, host_flag: Callable[[bool], torch.Tensor | None]) -> None:
        """
        A final gradient of this window left the device (host offload: unscaled there, or its host sum checked by the
        host worker). At the end of this backward (an autograd-engine callback, after the offload stage's own end)
        the host's flag, `host_flag(at_end)`, is folded into the flag of `device`, the parameters' device, and the
        flags are recorded for GradScaler (`publish`), so whatever the driver calls next (`grad_norm()`,
        `scaler.step`) sees every gradient checked.
        """

        def gather(at_end: bool = True) -> None:
            flag = self._flag(device)
            found = host_flag(at_end)
            if found is not None:
                torch.maximum(flag, found.to(flag.device), out=flag)
            self.publish(self.reduce_on_route)

        # NOTE: a backward nested in this one (a reentrant checkpoint) has a task of its own; its end runs what was
        # queued in it, and a later gradient queues the gather again: the last one to run has seen every gradient.
        if not self.backward_end.queue("offload_flags", gather):
            # Not inside the autograd engine (a hook called by hand): record what is known now, and again with each
            # gradient; nothing can say which gradient is the window's last.
            gather(at_end=False)

    def reduce_on_route(self, flags: dict) -> None:
        """Make the flags agree across ranks the way the owner's gradient route does (FSDP2: each rank checked its
        own shards)."""
        route = self.route()
        if route is not None:
            route.reduce_found_inf(flags)

    def publish(self, reduce_found_inf: Callable[[dict], None]) -> None:
        """After a norm pass: record the flags where `unscale_()` would have, for GradScaler.step / update."""
        from torch.amp.grad_scaler import OptState

        if not self.found_inf:
            # No gradient reached a hook (nothing trainable was used): a flag of 0, as unscale_ over no grads gives
            # none and GradScaler.step would assert.
            device = self.scaler._scale.device
            self.found_inf[device] = torch.zeros((), dtype=torch.float32, device=device)
        reduce_found_inf(self.found_inf)
        self.reduce_found_inf = reduce_found_inf
        record = self._record()
        if record["stage"] is OptState.UNSCALED and record["found_inf_per_device"] is not self.found_inf:
            raise RuntimeError("GradScaler.unscale_() was called on the layer-wise optimizer during its norm pass.")
        record["found_inf_per_device"] = self.found_inf
        record["stage"] = OptState.UNSCALED
        self.scaler_record = record

    def will_skip(self) -> bool:
        """After a norm pass: some gradient was inf/nan, so GradScaler will skip this step."""
        return any(bool(t.item()) for t in self.found_inf.values())

    def unscale_held(self, optimizer: Any, params: Any) -> None:
        """Held gradients are still scaled: unscale them the way Trainer's clip_grad_norm_ path does."""
        from torch.amp.grad_scaler import OptState

        if self._record()["stage"] is OptState.READY and any(p.grad is not None for p in params):
            self.scaler.unscale_(optimizer)
