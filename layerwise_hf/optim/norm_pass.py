"""Norm passes: how a driver gets every gradient measured (and fp16-checked) before any layer steps.

Exact clipping needs the global gradient norm, and fp16 loss scaling every gradient's inf/nan check, before the
first layer steps. Without gradient accumulation the driver therefore runs a first, measuring pass inside
`LayerwiseOptimizer.norm_pass()`, whose hooks only measure and free, then the real one, whose hooks clip and step:
`backward_with_norm_pass` (one forward, two backwards over the retained graph) on one process, or
`run_with_norm_pass` (forward+backward twice, RNG replayed) where collectives run once per forward (DDP, FSDP2) or
the backward is compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from torch import nn

    from .optimizer import LayerwiseOptimizer

T = TypeVar("T")


def backward_with_norm_pass(
    optimizer: LayerwiseOptimizer, loss: torch.Tensor, backward: Callable[..., Any] | None = None, **kwargs
):
    """
    `backward(loss)`, preceded (when exact clipping or fp16 needs every gradient first) by a measuring backward
    over the same graph, kept with `retain_graph=True`: one forward, two backwards. Only for a single process and
    an uncompiled model: DDP and FSDP2 run their collectives once per forward, and a torch.compile'd backward
    refuses `retain_graph`, so use `run_with_norm_pass` there.

    Args:
        optimizer (`LayerwiseOptimizer`):
            The attached layer-wise optimizer.
        loss (`torch.Tensor`):
            The micro-batch's loss.
        backward (`Callable[..., Any]`, *optional*):
            Runs the backward, e.g. `accelerator.backward`; defaults to `loss.backward`.
        **kwargs:
            Passed to `backward`.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf import LayerwiseOptimizer, LayerwiseParam
    >>> from layerwise_hf.optim.norm_pass import backward_with_norm_pass
    >>> w = torch.nn.Parameter(torch.ones(4))
    >>> optimizer = LayerwiseOptimizer([LayerwiseParam("w", w, 0.0)], lambda lp, _: torch.optim.SGD([lp.param], lr=1))
    >>> optimizer.configure_clipping(1.0, "exact"); optimizer.attach()
    >>> backward_with_norm_pass(optimizer, (2 * w).sum())  # measures the norm (4), then clips and steps
    >>> w.data
    tensor([0.5000, 0.5000, 0.5000, 0.5000])
    ```
    """
    backward = backward or (lambda tensor, **kw: tensor.backward(**kw))
    # First: a window GradScaler skipped must be closed before this one notes its accumulation.
    optimizer.close_skipped_window()
    if not optimizer.sync_gradients():
        optimizer.note_accumulation()
        return backward(loss, **kwargs)
    if not optimizer.needs_norm_pass():
        return backward(loss, **kwargs)
    with optimizer.norm_pass():
        result = backward(loss, retain_graph=True, **kwargs)
    if optimizer.step_will_be_skipped:
        return result  # nothing will step: the second backward would be wasted
    return backward(loss, **kwargs)


def run_with_norm_pass(
    optimizer: LayerwiseOptimizer, forward_backward: Callable[[], T], model: nn.Module | None = None
) -> T:
    """
    Run `forward_backward` (forward + backward of one micro-batch) twice when exact clipping or fp16 needs every
    gradient before any layer steps: first to measure, then to clip and step. The RNG state is replayed so
    dropout draws the same masks, and `model`'s buffers are put back so that running statistics (BatchNorm) count
    the micro-batch once. Otherwise run it once.

    Args:
        optimizer (`LayerwiseOptimizer`):
            The connected layer-wise optimizer.
        forward_backward (`Callable[[], T]`):
            Runs forward and backward of one micro-batch; what it returns (e.g. the loss) is returned.
        model (`nn.Module`, *optional*):
            The model `forward_backward` runs, whose buffers the measuring pass must leave as they were.

    Example:

    ```python
    >>> # a plain Accelerate loop under DDP or FSDP2 with exact clipping
    >>> from layerwise_hf.optim.norm_pass import run_with_norm_pass
    >>> def forward_backward():
    ...     loss = model(**batch).loss
    ...     accelerator.backward(loss)
    ...     return loss
    >>> loss = run_with_norm_pass(unwrap_layerwise_optimizer(optimizer), forward_backward, model)
    >>> optimizer.step(); optimizer.zero_grad()
    ```
    """
    # First: a window GradScaler skipped must be closed before this one notes its accumulation (under DDP's
    # no_sync no hook fires that would close it).
    optimizer.close_skipped_window()
    if not optimizer.sync_gradients():
        # Under DDP's no_sync no hook fires on this micro-batch, so note the accumulation here.
        optimizer.note_accumulation()
        return forward_backward()
    if not optimizer.needs_norm_pass():
        return forward_backward()
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    buffers = list(model.buffers()) if model is not None else []
    saved = [b.detach().clone() for b in buffers]
    with optimizer.norm_pass():
        result = forward_backward()
    if optimizer.step_will_be_skipped:
        return result  # every rank agrees (reduced gradients): no second pass anywhere
    with torch.no_grad():
        for buffer, value in zip(buffers, saved):
            buffer.copy_(value)
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    return forward_backward()
