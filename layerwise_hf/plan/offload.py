"""Host offload (`layerwise_offload`) in a simulated step: the real `GradientOffload` and `HostStepOptimizer`
(`layerwise_hf.placement.offload`, `layerwise_hf.placement.host_step`) run, with stand-ins for the two pieces that
cannot run on fake tensors, and every host-side storage is counted apart from the device's (`LiveBytes.on_host`).

- The transfer (`InlineTransfer`, for `CudaTransfer` / `ThreadTransfer`): a copy runs at once in the calling thread,
  but its source stays alive until someone waits for the copy, as `record_stream` (or the copy thread's queue) keeps
  a freed source alive until the side stream has copied it. Within a backward the copies out of `GradientOffload` are
  waited for only when `max_in_flight` others have started, so the device side holds what it holds on a GPU whose
  link falls behind; the next forward finds them done (a copy of the largest gradient takes milliseconds, the
  forward up to its peak far longer: a real CPU run measures the same). Host buffers are plain tensors allocated on
  the host side: there is no pinned memory on fake tensors (pinned host memory is host memory all the same; it
  counts the same bytes).
- The host worker (`InlineWorker`, for `HostWorker`'s thread): each task runs when it is submitted, on the host side,
  as a worker that keeps pace with backward does (`benchmarks/host_step_pace.py`: true of the torch bases; the bases
  in `SLOW_ON_HOST` fall behind, and their device gradients then wait longer for their copies than planned).
  A `TorchDispatchMode` is thread-local, so a task on another thread would allocate unseen.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

from ..optim import host_offload
from ..placement import host_step, offload
from ..placement.host_step import HostStepOptimizer
from ..placement.transfer import Ticket, Transfer
from .tracker import GRADIENTS, OPTIMIZER_STATE, WEIGHTS, LiveBytes, _state_tensors


class _InlineTicket(Ticket):
    __slots__ = ("source",)

    def __init__(self, source: torch.Tensor | None):
        self.source: torch.Tensor | None = source  # alive until the copy is waited for

    def done(self) -> bool:
        return self.source is None

    def wait_host(self) -> None:
        self.source = None

    wait_device = wait_host


class InlineTransfer(Transfer):
    """
    The simulation's `Transfer`: copies at once, keeps each source alive until its copy is waited for, and allocates
    host buffers on the tracker's host side (see the module docstring).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.plan.offload import InlineTransfer
    >>> from layerwise_hf.plan.tracker import LiveBytes
    >>> tracker = LiveBytes()
    >>> with tracker, torch.no_grad():
    ...     transfer = InlineTransfer(tracker)
    ...     grad = torch.ones(256); host = transfer.host_empty_like(grad)
    ...     ticket = transfer.copy(host, grad); del grad
    ...     (tracker.current, tracker.host_current)
    ...     ticket.wait_host(); (tracker.current, tracker.host_current)
    (1024, 1024)
    (0, 1024)
    ```
    """

    simulated = True

    def __init__(self, tracker: LiveBytes):
        self.tracker = tracker
        self.started: list[_InlineTicket] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Ticket:
        with torch.no_grad():
            dst.copy_(src)
        ticket = _InlineTicket(src)
        self.started = [t for t in self.started if not t.done()] + [ticket]
        return ticket

    def mark(self) -> Ticket:
        return _InlineTicket(None)

    def finish(self) -> None:
        """Every copy started so far is done (its source released)."""
        for ticket in self.started:
            ticket.wait_host()
        self.started = []

    def host_empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        with self.tracker.on_host():
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype)
        # Gradient buffers unless relabelled (`label_host_side`: host parameter copies are weights).
        self.tracker.track(buffer.untyped_storage(), GRADIENTS)
        return buffer

    def host_block(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.host_empty_like(torch.empty(numel, dtype=dtype, device="meta"))


class InlineWorker:
    """The simulation's `HostWorker`: runs each task when submitted, on the tracker's host side."""

    def __init__(self, tracker: LiveBytes):
        self.tracker = tracker

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.tracker.on_host():
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - surfaced to whoever reads the future, as a thread would
                future.set_exception(err)
        return future

    def use(self, transfer: Any) -> None:
        """The tasks run on the calling thread: no thread to bind to a device."""

    def close(self) -> None:
        """Nothing runs in the background."""


@contextlib.contextmanager
def stand_ins(tracker: LiveBytes, mode: str) -> Iterator[None]:
    """While the context lasts, offload's transfers and host workers are the simulation's (`mode` not `"none"`)."""
    if mode == "none":
        yield
        return
    transfers: list[InlineTransfer] = []

    def transfer(device: Any) -> InlineTransfer:
        transfers.append(InlineTransfer(tracker))
        return transfers[-1]

    def before_forward(module: Any, args: Any) -> None:
        for t in transfers:
            t.finish()

    worker = lambda: InlineWorker(tracker)  # noqa: E731
    with contextlib.ExitStack() as stack:
        stack.callback(torch.nn.modules.module.register_module_forward_pre_hook(before_forward).remove)
        for module in (offload, host_step):
            stack.enter_context(mock.patch.object(module, "make_transfer", transfer))
            stack.enter_context(mock.patch.object(module, "HostWorker", worker))
        # NOTE: the warning for offload on a machine without CUDA is about running it, not planning it.
        stack.enter_context(mock.patch.object(host_offload, "offload_simulated", lambda: True))
        yield


def label_host_side(tracker: LiveBytes, layerwise: Any) -> None:
    """Name the host-side storages of `layerwise`'s host steps: the parameter copies weights, the states optimizer
    state (a step from a host gradient buffer, `step_host`, runs no step post-hook that would name them)."""
    for inner in layerwise.inner:
        if isinstance(inner, HostStepOptimizer):
            tracker.track_tensors([inner.host], WEIGHTS)
            tracker.track_tensors(_state_tensors(dict(inner.base.state)), OPTIMIZER_STATE)


def close_offload(layerwise: Any) -> None:
    """Remove what offload registered (the host steps' global forward pre-hook) once the simulation is done."""
    runners = {id(inner.runner): inner.runner for inner in layerwise.inner if isinstance(inner, HostStepOptimizer)}
    for runner in runners.values():
        runner.close()
    if layerwise.pipeline.offload is not None:
        layerwise.pipeline.offload.close()
