"""Memory accounting of a layer-wise optimizer: bytes of tensors, and the figures it reports (the gradient bytes alive
at once are counted by the pipeline's meter, `layerwise_hf.optim.pipeline.GradMeter`)."""

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


class MemoryReport:
    """
    The memory figures a layer-wise optimizer reports (`LayerwiseOptimizer.pipeline.memory`).

    Args:
        meter (`GradMeter`): the pipeline's gradient meter.
        inner (`Sequence[torch.optim.Optimizer]`): one optimizer per parameter.
        params (`Sequence[torch.Tensor]`): the parameters.
    """

    def __init__(self, meter: Any, inner: Sequence[Any], params: Sequence[torch.Tensor]):
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
