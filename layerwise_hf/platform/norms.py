"""torch's own norm kernels, as `clip_grad_norm_` runs them: per-tensor norms with the kernel it picks for the device,
and the total stacked in its (device, dtype) grouping order, so a norm measured one gradient at a time is bit-identical
to the one Trainer's clipping takes over all of them. Gradients on several device meshes (tensor parallel x FSDP2,
tensor parallel beside plain tensors) are totalled as Trainer's `_mixed_mesh_grad_norm` does: one total per mesh, each
made whole, then the norm of the totals; `scale_grad` applies a clip coefficient to plain and DTensor gradients alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def grad_norm_kernel(grad: torch.Tensor) -> torch.Tensor:
    """
    The L2 norm of one gradient with the kernel `clip_grad_norm_` picks for its device.

    Args:
        grad (`torch.Tensor`):
            One parameter's gradient.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.platform.norms import grad_norm_kernel
    >>> grad_norm_kernel(torch.tensor([3.0, 4.0]))
    tensor(5.)
    ```
    """
    from torch.utils._foreach_utils import _device_has_foreach_support

    if _device_has_foreach_support(grad.device):
        return torch._foreach_norm([grad], 2.0)[0]
    return torch.linalg.vector_norm(grad, 2.0)


def total_norm(norms: Sequence[tuple[torch.device, torch.dtype, torch.Tensor]]) -> torch.Tensor | None:
    """
    The global L2 norm from per-tensor norms `(device, gradient dtype, norm)` in parameter order, stacked exactly as
    `clip_grad_norm_` stacks them: in torch's own (device, dtype) grouping order, on the first gradient's device.

    Args:
        norms (`Sequence[tuple[torch.device, torch.dtype, torch.Tensor]]`):
            One `(device, gradient dtype, norm)` per gradient, in parameter order; none at all gives `None`.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.platform.norms import total_norm
    >>> cpu = torch.device("cpu")
    >>> total_norm([(cpu, torch.float32, torch.tensor(3.0)), (cpu, torch.bfloat16, torch.tensor(4.0))])
    tensor(5.)
    ```
    """
    if not norms:
        return None
    meshes: dict[Any, list[int]] = {}
    for k, (_, _, norm) in enumerate(norms):
        meshes.setdefault(mesh_of(norm), []).append(k)
    if len(meshes) == 1:
        return _total_norm_one_mesh(norms)
    # NOTE: the stack of one mesh's DTensor norms cannot take another mesh's (or a plain tensor). transformers 5.24's
    # Trainer._mixed_mesh_grad_norm: meshes in their first gradient's order, each total by get_total_norm (the
    # one-mesh path here), full_tensor() of each, and the default-order norm of the stacked totals.
    totals = [whole(_total_norm_one_mesh([norms[k] for k in ks])) for ks in meshes.values()]
    return torch.linalg.vector_norm(_stack_on(totals, norms[0][0]))


def mesh_of(t: Any) -> Any:
    """
    The device mesh of a DTensor, `None` for a plain tensor: how norms and gradients are grouped when they cannot be
    stacked or multiplied together.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.platform.norms import mesh_of
    >>> mesh_of(torch.tensor(1.0)) is None
    True
    ```
    """
    return getattr(t, "device_mesh", None) if hasattr(t, "to_local") else None


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value as a plain tensor (`full_tensor()`, a collective on its mesh), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def scale_grad(grad: torch.Tensor, coef: torch.Tensor) -> None:
    """
    Multiply `grad` in place by the clip coefficient `coef`, whichever of them is a DTensor: a coefficient on another
    mesh than the gradient (or a DTensor coefficient for a plain gradient, as under tensor parallel alone) is made
    whole first, as the plain coefficient Trainer's `_mixed_mesh_grad_norm` applies to every gradient.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.platform.norms import scale_grad
    >>> grad = torch.tensor([2.0, 4.0])
    >>> scale_grad(grad, torch.tensor(0.5)); grad
    tensor([1., 2.])
    ```
    """
    if mesh_of(coef) is not None and mesh_of(coef) != mesh_of(grad):
        coef = whole(coef)
    grad.mul_(coef.to(grad.device))


def _total_norm_one_mesh(norms: Sequence[tuple[torch.device, torch.dtype, torch.Tensor]]) -> torch.Tensor:
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

    # NOTE: torch groups by (device, dtype) in an order of its own, not first appearance; grouping stand-ins of the
    # gradients' devices and dtypes gives the very order clip_grad_norm_ used, whatever the mix of dtypes.
    stand_ins = [torch.empty(1, dtype=dtype, device=device) for device, dtype, _ in norms]
    grouped = _group_tensors_by_device_and_dtype([stand_ins], with_indices=True)
    flat = [norms[i][2] for _, (_, indices) in grouped.items() for i in indices]
    return torch.linalg.vector_norm(_stack_on(flat, norms[0][0]), 2.0)


def _stack_on(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    # One copy per device the tensors live on, not one per tensor: with host offload the norms of host sums are on
    # the host and the others on the device, and a copy of each scalar would be one host-device transfer per
    # parameter. Copies are exact, so the stacked values (and the norm) are those of stacking each moved alone.
    positions: dict[torch.device, list[int]] = {}
    for k, t in enumerate(tensors):
        positions.setdefault(t.device, []).append(k)
    if list(positions) == [torch.device(device)]:
        return torch.stack(tensors)
    moved: list[Any] = [None] * len(tensors)
    for ks in positions.values():
        for k, t in zip(ks, moved_together([tensors[k] for k in ks], device)):
            moved[k] = t
    return torch.stack(moved)


def moved_together(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """
    `tensors` (scalars of one dtype, on one device) on `device` with one copy: stacked, moved, split. Copies are
    exact, so each is what moving it alone gives.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.platform.norms import moved_together
    >>> moved_together([torch.tensor(1.0), torch.tensor(2.0)], torch.device("meta"))[1].device
    device(type='meta')
    ```
    """
    if not tensors:
        return []
    return list(torch.stack(list(tensors)).to(device).unbind())
