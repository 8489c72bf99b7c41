"""Memory accounting of a layer-wise optimizer: bytes of tensors, and the gradient bytes alive at once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..platform.dtensor import local_tensor


def tensor_bytes(obj: Any) -> int:
    """
    Bytes of every tensor in `obj` (a tensor, or dicts, lists and objects holding tensors), counting only the local
    shard of a DTensor.

    Args:
        obj (`Any`):
            A tensor, or a dict, list, tuple or object holding tensors (e.g. an optimizer's `state`).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.optim.memory import tensor_bytes
    >>> tensor_bytes({"exp_avg": torch.zeros(4, 4), "step": torch.tensor(1.0)})
    68
    ```
    """
    if isinstance(obj, torch.Tensor):
        # A DTensor's numel() is the global size; this rank holds only its local shard.
        local = local_tensor(obj)
        if type(local) is not torch.Tensor and hasattr(local, "__tensor_flatten__"):
            # A tensor subclass (torchao's quantized optimizer states): its own numel and dtype describe the
            # dequantized tensor; what it holds is its inner tensors (codes, scales).
            names, _ = local.__tensor_flatten__()
            return sum(tensor_bytes(getattr(local, name)) for name in names)
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        # Objects kept in optimizer state (GaLore's projector holds its projection matrix).
        return sum(tensor_bytes(v) for v in vars(obj).values())
    return 0


class GradMeter:
    """
    The gradients a layer-wise optimizer holds (accumulating, or waiting for the step) and the most bytes held at
    once. A gradient is counted from the moment its hook sees it until its parameter steps and frees it.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.optim.memory import GradMeter
    >>> meter = GradMeter()
    >>> meter.hold(0, torch.zeros(256))
    >>> meter.release(0)
    >>> meter.held_bytes, meter.peak_bytes
    (0, 1024)
    ```
    """

    def __init__(self) -> None:
        self.held: dict[int, int] = {}
        self.held_bytes = 0
        self.peak_bytes = 0

    def hold(self, i: int, grad: torch.Tensor | None) -> None:
        if grad is None or i in self.held:
            return
        nbytes = tensor_bytes(grad)
        self.held[i] = nbytes
        self.held_bytes += nbytes
        if self.held_bytes > self.peak_bytes:
            self.peak_bytes = self.held_bytes

    def release(self, i: int) -> None:
        self.held_bytes -= self.held.pop(i, 0)

    def clear(self) -> None:
        self.held.clear()
        self.held_bytes = 0


class MemoryReport:
    """
    The memory figures a layer-wise optimizer reports (`LayerwiseOptimizer.pipeline.memory`).

    Args:
        meter (`GradMeter`): the pipeline's gradient meter.
        inner (`Sequence[torch.optim.Optimizer]`): one optimizer per parameter.
        params (`Sequence[torch.Tensor]`): the parameters.
    """

    def __init__(self, meter: GradMeter, inner: Sequence[Any], params: Sequence[torch.Tensor]):
        self.meter, self.inner, self.params = meter, inner, params

    @property
    def peak_grad_bytes(self) -> int:
        """The most gradient bytes this optimizer held at once (accumulating, held, or about to step)."""
        return self.meter.peak_bytes

    def state_bytes(self) -> int:
        """Bytes held by every inner optimizer's state."""
        return sum(tensor_bytes(s) for inner in self.inner for s in inner.state.values())

    def full_grad_bytes(self) -> int:
        """Bytes all trainable gradients take at once (what a standard optimizer holds at its step)."""
        return sum(tensor_bytes(p) for p in self.params)
