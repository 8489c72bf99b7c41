"""Where host offload joins the path of a gradient: the pipeline's offload stage. `enable_offload` gives the
pipeline an `OffloadStage` around a `GradientOffload` (`layerwise_hf.placement.offload`), through which accumulated and
held gradients wait on the host; without offload the stage is `NoOffload`, which keeps every gradient on the device.
The mechanism (buffers, transfers, host steps) lives in `layerwise_hf.placement`.
"""

from __future__ import annotations

import enum
import logging

import torch

from ..placement.host_step import HostRunner, HostStepOptimizer
from ..placement.offload import GradientOffload, parse_offload
from ..placement.offloading import check_host_step_base
from ..placement.transfer import Transfer, check_one_device, offload_simulated
from ..platform.dtensor import local_tensor
from ..platform.norms import whole
from .window import Action, StageContext

logger = logging.getLogger(__name__)


class HostCoefficient:
    """
    A clip coefficient moved to the host for host steps: exact clipping gives every parameter the window's one
    coefficient, moved once per step, not once per parameter (each move is a device-to-host copy that waits for the
    device). A new coefficient (the next step's, or a per-parameter one) is moved again.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.optim.host_offload import HostCoefficient
    >>> on_host, coef = HostCoefficient(), torch.tensor(0.5)
    >>> on_host(coef, torch.device("cpu")) is on_host(coef, torch.device("cpu"))
    True
    ```
    """

    def __init__(self) -> None:
        self._cached: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, coef: torch.Tensor, device: torch.device) -> torch.Tensor:
        cached = self._cached
        if cached is None or cached[0] is not coef or cached[1].device != device:
            # Under FSDP2 the coefficient is a replicated DTensor; the host buffer is a plain local shard.
            cached = self._cached = (coef, whole(coef).to(device))
        return cached[1]


class Where(enum.Enum):
    """Where a gradient the offload stage takes is: whole on the device (checked and measured there before its copy),
    or added to its parameter's host sum (checked by the host worker)."""

    DEVICE = "device"
    HOST_SUM = "host_sum"


class OffloadStage:
    """
    The offload stage (`layerwise_offload="gradients"` or `"optimizer"`): a gradient that would wait on the device for
    the step (accumulated, or held for exact clipping or fp16's checks) is copied into its host buffer of `buffers` and
    freed; `step()` steps it from there, copied back (`"gradients"`) or on the host (`"optimizer"`). It runs after loss
    scaling: under fp16 it is handed the gradient unscaled, or the inverse scale for the host worker, never the scaler.

    Args:
        buffers (`GradientOffload`): the host buffers, transfers and host worker.
    """

    enabled = True

    def __init__(self, buffers: GradientOffload):
        self.buffers = buffers
        self.coefficient = HostCoefficient()  # the window's clip coefficient on the host, moved once a step

    @property
    def active(self) -> bool:
        """Some gradient of this window waits on the host, so the window's gradients step at `step()`."""
        return self.buffers.active

    def pending(self) -> list[int]:
        return self.buffers.pending()

    def where(self, i: int, action: Action) -> Where | None:
        """Whether this stage takes parameter `i`'s gradient, and where it then is; `None`: it stays on the device."""
        # Accumulated and held gradients wait on the host; a gradient stepping at once with nothing on the host
        # (no accumulation, no clipping) steps as without offload.
        summed = self.buffers.has_sum(i)
        if action not in (Action.ACCUMULATE, Action.HOLD) and not (action is Action.STEP and summed):
            return None
        return Where.HOST_SUM if summed else Where.DEVICE

    def take(self, ctx: StageContext, i: int, final: bool, measure: bool, inv_scale: torch.Tensor | None) -> None:
        """Copy parameter `i`'s gradient to the host and free it. `final`: the window's last micro-batch; `measure`:
        measure the host sum's norm; `inv_scale`: fp16's inverse scale on the host, for the host worker to unscale a
        host sum (a whole gradient comes unscaled)."""
        buffers, param = self.buffers, ctx.params[i]
        inner = ctx.inner[i]
        if not buffers.has_sum(i) and isinstance(inner, HostStepOptimizer):
            inner.wait_host()  # its last host step may still read the buffer this gradient is copied into
            if i not in buffers.host:
                # One host gradient buffer per parameter, whether its gradient steps at once or waits for the step.
                buffers.host[i] = inner.host_grad_like(local_tensor(param.grad))
        buffers.stash(i, param, measure, final, inv_scale)

    def unfinished(self) -> bool:
        """Some host sum got no gradient in the window's last micro-batch: it is still to be finished (and, under
        fp16, unscaled)."""
        return bool(self.buffers.unfinished())

    def host_device(self, i: int) -> torch.device:
        """Where parameter `i`'s host sum is (its inverse scale is made there)."""
        return self.buffers.host[i].device

    def host_flag(self, ctx: StageContext, at_end: bool, measure: bool, inv_scale: torch.Tensor | None):
        """fp16, at the end of the window's last backward: finish the host sums the last micro-batch did not reach
        (still scaled: unscaled with `inv_scale`, on the host), wait for the host checks, and return the host's
        found-inf flag."""
        buffers = self.buffers
        if at_end and buffers.unfinished():
            buffers.finish(measure, inv_scale)
        buffers.settle(ctx.window, ctx.params)
        return buffers.found_inf

    def merge_waiting(self, ctx: StageContext, i: int) -> None:
        """Add parameter `i`'s host sum of this window into its `.grad`, before a route's reduction."""
        if self.buffers.has_sum(i):
            self.buffers.merge_into(i, ctx.params[i])

    def step(self, ctx: StageContext, indices: list[int]) -> None:
        """`step()`: step the parameters `indices` whose gradients wait on the host."""
        buffers = self.buffers
        if not indices:
            return
        if not buffers.host_steps:
            buffers.restore_each(indices, ctx.params, ctx.step, ctx.window)
            return
        buffers.settle(ctx.window, ctx.params)
        for i in indices:
            # layerwise_offload="optimizer": stepped on the host from its host gradient, clipped there.
            coef = ctx.coef(i)
            buffer = buffers.host[i]
            if coef is not None:
                coef = self.coefficient(coef, buffer.device)
            ctx.inner[i].step_host(buffer, [], coef)
            ctx.stepped(i)
            buffers.filled[i] = False

    def before_norm(self, ctx: StageContext, finish: bool, measure: bool) -> None:
        """The window's norms include the host sums: finish those the last micro-batch did not reach (`finish`: not
        under fp16, whose end of backward finished them, and the window's last backward)."""
        if finish:
            # A sum whose parameter got no gradient in the window's last micro-batch counts in the norm too.
            self.buffers.finish(measure)
        self.buffers.settle(ctx.window, ctx.params)

    def new_route(self, ctx: StageContext) -> None:
        # Training (re)begins: host copies are taken again from the device's parameters.
        for inner in ctx.inner:
            if isinstance(inner, HostStepOptimizer):
                inner.stale = True

    def end_window(self) -> None:
        self.buffers.end_window()

    def close(self) -> None:
        self.buffers.close()


def _warn_without_cuda(mode: str, transfer: Transfer | None) -> None:
    if torch.cuda.is_available() or offload_simulated() or transfer is not None:
        return
    logger.warning(
        "layerwise_offload=%r on a machine without CUDA: the device and the host are the same memory, so offload "
        "saves none. It runs the same path as on a GPU, with a copy thread for the side stream "
        "(LAYERWISE_HF_OFFLOAD_SIMULATE=1 says this is intended and silences this warning).",
        mode,
    )


def offload_stage(
    mode: str,
    optimizer_name: str | None,
    params: list[torch.Tensor],
    inner: list[torch.optim.Optimizer],
    transfer: Transfer | None = None,
    max_in_flight: int = 2,
    runner: HostRunner | None = None,
) -> OffloadStage | None:
    """
    The offload stage for `mode` (`layerwise_offload`), or `None` for `"none"`; `enable_offload`
    (`layerwise_hf.optim.optimizer`) gives it to an optimizer's pipeline and says what each mode does.

    Args:
        mode (`str`): `"none"`, `"gradients"` or `"optimizer"`.
        optimizer_name (`str`, *optional*): the optimizer's Trainer name (which bases may step on the host).
        params (`list[torch.Tensor]`): the pipeline's parameters (the list it keeps across rebinding).
        inner (`list[torch.optim.Optimizer]`): one optimizer per parameter.
        transfer, max_in_flight, runner: see `enable_offload`.
    """
    mode = parse_offload(mode, "mode")
    if mode == "none":
        return None
    if mode == "optimizer":
        check_host_step_base(optimizer_name)
    hosted = all(isinstance(o, HostStepOptimizer) for o in inner)
    if (mode == "optimizer") != hosted or (hosted and runner is None):
        raise ValueError(
            "layerwise_offload='optimizer' must be chosen when the optimizer is built (its states are created on the "
            "host): pass offload='optimizer' to build_layerwise_optimizer, or set args.layerwise_offload."
        )
    check_one_device(params)
    _warn_without_cuda(mode, transfer)
    if runner is not None and transfer is not None and runner.transfer is None:
        runner.transfer = transfer
    # NOTE: the transfer is chosen at the first copy, from the gradient's device, not from the parameters' now: a
    # plain Accelerate loop builds the optimizer before accelerator.prepare moves the model to the GPU.
    hosted = runner is not None
    worker, choose = (runner.worker, runner.transfer_for) if hosted else (None, None)
    buffers = GradientOffload(transfer, max_in_flight, worker=worker, host_steps=hosted, choose=choose)

    def reserve() -> list[torch.Tensor]:
        # NOTE: asked at the first host buffer, after Accelerate's FSDP2 prepare swapped in the DTensors (rebind).
        return [local_tensor(p) for p in params]

    # Host buffers are views into one pinned block per dtype, sized for every parameter: pinned bytes equal the plan.
    buffers.reserve = reserve
    if runner is not None:
        runner.reserve = reserve
    return OffloadStage(buffers)
