"""How a base's step meets CUDA streams and device syncs when it runs inside backward.

A layer-wise step runs in a gradient hook, on whatever stream is current there: the default stream on one process
and under the data-parallel route, FSDP2's reduce-scatter stream under FSDP2 (it calls the hooks of the sharded
parameters with that stream current). Two facts about bitsandbytes 0.50.2 matter there:

- its CUDA optimizer kernels take no stream argument (`backends/cuda/ops.py`), so they run on the legacy default
  stream whatever stream is current. FSDP2's pool streams do not synchronize with the default stream, so without
  ordering the 8-bit update could read a gradient the reduce-scatter has not written yet, or a state not yet zeroed;
- `Optimizer8bit.step` calls `torch.cuda.synchronize()` after every parameter (GaLore's 8-bit AdamW too). After a
  standard backward that costs one stall per parameter; inside backward it stops the host from queueing ahead, and
  under the data-parallel route it also waits for the all-reduce in flight.

`step_in_backward` handles both: a bitsandbytes step runs on the default stream after the current stream's work, the
current stream waits for it after, and a non-paged optimizer skips the per-parameter device sync.

Under FSDP2 that wait, made in the hook, would stall: FSDP2 calls a group's hooks right after queueing its
reduce-scatter and before the autograd engine queues the backward of the layer before it, so the default stream would
wait for the reduce-scatter (and run the 8-bit update) before that backward, which FSDP2 otherwise overlaps with the
reduce-scatter. `GroupSteps` (set up by the FSDP2 route) defers such a step until the next group's hooks, when that
backward is queued, and orders it after an event recorded in its own hook; the last group's steps run at the end of
backward.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Restores bitsandbytes' own per-parameter device sync (for measuring what removing it saves; see gpu_check).
KEEP_DEVICE_SYNC_ENV = "LAYERWISE_HF_BNB_DEVICE_SYNC"


def launches_on_default_stream(optimizer: Any) -> bool:
    """Whether `optimizer`'s kernels ignore the current stream: bitsandbytes' optimizers and their subclasses
    (GaLore's 8-bit AdamW)."""
    return any(cls.__module__.startswith("bitsandbytes.") for cls in type(optimizer).__mro__)


class CudaStreams:
    """The stream operations `ordered_on_default_stream` needs, from `torch.cuda` (tests record them instead)."""

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def default_stream(self, device: torch.device) -> Any:
        return torch.cuda.default_stream(device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def event(self) -> Any:
        return torch.cuda.Event()


def stream_backend(device: torch.device) -> CudaStreams | None:
    """The stream operations for `device` (`None` where there are no streams to order: CPU)."""
    return CudaStreams() if device.type == "cuda" else None


@contextlib.contextmanager
def ordered_on_default_stream(device: torch.device) -> Iterator[None]:
    """
    Run the body on `device`'s default stream, after the work queued on the current stream, with the current stream's
    later work queued after the body's: what a step needs whose kernels go to the default stream anyway.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.platform.streams import ordered_on_default_stream
    >>> with ordered_on_default_stream(torch.device("cpu")):  # no streams on CPU: runs as is
    ...     x = torch.ones(2) * 2
    ```
    """
    streams = stream_backend(device)
    if streams is None:
        yield
        return
    current, default = streams.current_stream(device), streams.default_stream(device)
    if current == default:
        yield
        return
    default.wait_stream(current)
    # NOTE: torch ops of the step (bitsandbytes' state zeroing on the first step) follow the current stream: making
    # the default stream current puts them in the same order as the kernels. Tensors the step frees are reused only
    # by work the current stream queues after its wait below.
    try:
        with streams.use(default):
            yield
    finally:
        # NOTE: also when the step raised: it may have queued kernels that read the gradient or write a state, and
        # the current stream's next work (the reduce-scatter's next bucket reusing the gradient) must follow them.
        current.wait_stream(default)


def keeps_device_sync(optimizer: Any) -> bool:
    """Whether a bitsandbytes step inside backward keeps its whole-device sync per parameter: paged optimizers, and
    every one while `LAYERWISE_HF_BNB_DEVICE_SYNC=1` (for measuring what removing it saves)."""
    # NOTE: paged states are prefetched and written back asynchronously by the driver; the sync is what makes them
    # consistent before the next use, so paged optimizers keep it.
    return bool(getattr(optimizer, "is_paged", False)) or os.environ.get(KEEP_DEVICE_SYNC_ENV) == "1"


@contextlib.contextmanager
def without_device_sync(optimizer: Any) -> Iterator[None]:
    """
    Skip the whole-device sync a non-paged bitsandbytes optimizer makes after each parameter's update.

    Example:

    ```python
    >>> import bitsandbytes as bnb, torch
    >>> from layerwise_hf.platform.streams import without_device_sync
    >>> w = torch.nn.Parameter(torch.ones(8)); w.grad = torch.ones(8)
    >>> optimizer = bnb.optim.AdamW8bit([w])
    >>> with without_device_sync(optimizer):
    ...     optimizer.step()
    ```
    """
    if keeps_device_sync(optimizer):
        yield
        return
    import bitsandbytes.optim.optimizer as bnb_optimizer

    # NOTE: the hook runs on the stream that produced the gradient (or, with `ordered_on_default_stream`, after it),
    # and the next use of the parameter or its states is queued after the update on the same stream: the device
    # sync orders nothing that stream order does not already order.
    sync_gpu = bnb_optimizer.sync_gpu
    bnb_optimizer.sync_gpu = _no_sync
    try:
        yield
    finally:
        bnb_optimizer.sync_gpu = sync_gpu


def _no_sync(tensor: torch.Tensor) -> None:
    return None


def step_in_backward(
    optimizer: torch.optim.Optimizer,
    param: torch.Tensor,
    grad: torch.Tensor | None = None,
    steps: GroupSteps | None = None,
) -> Any:
    """
    Step one parameter's optimizer from a gradient hook: a bitsandbytes optimizer runs ordered on the default stream
    and, unless paged, without its per-parameter device sync; any other optimizer steps as is.

    Args:
        optimizer (`torch.optim.Optimizer`):
            The optimizer of `param` alone.
        param (`torch.Tensor`):
            The tensor it updates (its device decides the streams).
        grad (`torch.Tensor`, *optional*):
            The gradient to step with, set as `param.grad` for the step alone; the caller may drop its own reference
            to it at once.
        steps (`GroupSteps`, *optional*):
            The FSDP2 route's deferrer of this hook's group's steps (`FSDP2Hooks` hands it to the pipeline, which
            hands it here): given with `grad`, a bitsandbytes step is deferred until the next group's hooks.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.platform.streams import step_in_backward
    >>> w = torch.nn.Parameter(torch.ones(2)); w.grad = torch.ones(2)
    >>> step_in_backward(torch.optim.SGD([w], lr=0.5), w); w.data
    tensor([0.5000, 0.5000])
    ```
    """
    run = optimizer.step if grad is None else _StepWith(optimizer, param, grad)
    if not launches_on_default_stream(optimizer):
        return run()
    if grad is not None and steps is not None and steps.defer(optimizer, param, grad, run):
        return None
    with ordered_on_default_stream(param.device), without_device_sync(optimizer):
        return run()


class _StepWith:
    # A step that owns its gradient, so that it can run after the hook that handed it over has freed `.grad`.
    __slots__ = ("optimizer", "param", "grad")

    def __init__(self, optimizer: torch.optim.Optimizer, param: torch.Tensor, grad: torch.Tensor):
        self.optimizer, self.param, self.grad = optimizer, param, grad

    def __call__(self) -> Any:
        self.param.grad = self.grad
        try:
            return self.optimizer.step()
        finally:
            self.param.grad = None


class GroupSteps:
    """
    Defers the bitsandbytes steps that FSDP2's hooks hand over until the next reduce-scatter group's hooks, so that the
    default stream does not wait for a group's reduce-scatter before the backward of the layer before it.

    FSDP2 calls the hooks of one group (one `fully_shard` module) together, right after queueing the group's
    reduce-scatter and before the autograd engine queues the next layer's backward. A step deferred there records an
    event on the current stream: the reduce-scatter stream, after the reduce-scatter and the hook's own work on the
    gradient. Once a gradient of another group arrives, that backward is queued: the deferred steps run on the default
    stream after waiting on the event, and the current stream then waits for them (as in `ordered_on_default_stream`).
    The last group's steps run at the end of backward, the `shard_steps` stage of the sink's `BackwardEnd`.

    Deferred are only steps on a device with streams, from a hook on another stream than the default one, inside the
    autograd engine; others run at once. A group is told by its gradients' storage: FSDP2 hands a group's gradients as
    views of its reduce-scatter's one output (a group taken for two runs its first steps earlier, still in order).
    With reentrant activation checkpointing each group's hooks run in a backward of their own, whose end runs them.

    Args:
        backward_end (`BackwardEnd`):
            The optimizer's owner of the end of each backward (`layerwise_hf.platform.backward_end.BackwardEnd`):
            anything with `queue(stage, work) -> bool`.

    Example:

    ```python
    >>> from layerwise_hf.platform.streams import GroupSteps
    >>> steps = GroupSteps(sink.backward_end)  # FSDP2Hooks makes one, and hands it with each gradient
    >>> sink.grad_ready(0, steps)  # steps parameter 0: at once, or deferred one group later under FSDP2 on CUDA
    ```
    """

    STAGE = "shard_steps"

    def __init__(self, backward_end: Any):
        self.backward_end = backward_end
        self.deferred: list[tuple[torch.optim.Optimizer, Callable[[], Any]]] = []
        self.group: int | None = None
        self.event: Any = None
        self.device: torch.device | None = None
        backward_end.when_cut_short(self.drop)

    def defer(self, optimizer: Any, param: torch.Tensor, grad: torch.Tensor, run: Callable[[], Any]) -> bool:
        """Defer `run`, `optimizer`'s step of `param` with `grad`; `False`, deferring nothing, where it runs now."""
        streams = stream_backend(param.device)
        if streams is None:
            return False
        current = streams.current_stream(param.device)
        if current == streams.default_stream(param.device):
            return False  # nothing to overlap: the hook runs on the stream the update runs on
        group = grad.untyped_storage().data_ptr()
        if any(o is optimizer for o, _ in self.deferred):
            # The same parameter's step a second time: the backward that deferred the first ended without its callback
            # (cut short by an exception, and no step() or zero_grad() came between); its gradient is stale.
            self.drop()
        if self.deferred and group != self.group:
            self.flush()  # another group's gradient: the backward after the deferred group is queued now
        if not self.backward_end.queue(self.STAGE, self.flush):
            return False  # not inside the autograd engine (a hook called by hand): nothing would run the deferred step
        if not self.deferred:
            self.group, self.event, self.device = group, streams.event(), param.device
        # NOTE: recorded again at each hook of the group: the latest record follows this hook's own work on its
        # gradient (clipping, norms), which the update must see.
        self.event.record(current)
        self.deferred.append((optimizer, run))
        return True

    def drop(self) -> None:
        """Forget the deferred steps without running them: their backward was cut short (`BackwardEnd.forget`), and a
        later backward's hooks must not step the parameters again with the aborted gradients."""
        self.deferred, self.group, self.event = [], None, None

    def flush(self) -> None:
        """Run the deferred steps on the default stream, after the event of their group; the current stream's later
        work (the reduce-scatter stream's next allocation, maybe where the deferred gradients were) waits for them."""
        deferred, event, device = self.deferred, self.event, self.device
        self.deferred, self.group, self.event = [], None, None
        if not deferred:
            return
        streams = stream_backend(device)
        current, default = streams.current_stream(device), streams.default_stream(device)
        default.wait_event(event)
        try:
            with streams.use(default):
                for optimizer, run in deferred:
                    with without_device_sync(optimizer):
                        run()
        finally:
            # NOTE: also when a step raised: it and the ones before it may have queued kernels that read their
            # gradients, whose memory goes back to the current stream's allocations once `deferred` is dropped.
            if current != default:
                current.wait_stream(default)
