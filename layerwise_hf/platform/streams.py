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
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
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


def step_in_backward(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> Any:
    """
    Step one parameter's optimizer from a gradient hook: a bitsandbytes optimizer runs ordered on the default stream
    and, unless paged, without its per-parameter device sync; any other optimizer steps as is.

    Args:
        optimizer (`torch.optim.Optimizer`):
            The optimizer of `param` alone.
        param (`torch.Tensor`):
            The tensor it updates (its device decides the streams).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.platform.streams import step_in_backward
    >>> w = torch.nn.Parameter(torch.ones(2)); w.grad = torch.ones(2)
    >>> step_in_backward(torch.optim.SGD([w], lr=0.5), w); w.data
    tensor([0.5000, 0.5000])
    ```
    """
    if not launches_on_default_stream(optimizer):
        return optimizer.step()
    with ordered_on_default_stream(param.device), without_device_sync(optimizer):
        return optimizer.step()
