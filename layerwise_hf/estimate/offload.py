"""The device and host terms of a layer-wise run with host offload (`layerwise_offload`,
`layerwise_hf.placement.offload` and `layerwise_hf.placement.host_step`), for `estimate(offload=...)`.

- `"gradients"`: the optimizer states stay on the device; each gradient that waits for the step (gradient
  accumulation, exact clipping) waits in a host buffer of its own, so the host holds every trainable gradient and the
  device only the copies in flight: at most `MAX_IN_FLIGHT` gradients (`GradientOffload`'s default), the largest.
- `"optimizer"`: nothing of the optimizer stays on the device. The host holds each parameter's states, a copy of the
  parameter in its dtype (`HostStepOptimizer.host`) and one gradient buffer per parameter (`host_grad`, or the
  `GradientOffload` buffer when the gradient waits for the step); the device again only the copies in flight.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .units import EstimateError

OFFLOAD_MODES = ("none", "gradients", "optimizer")
MAX_IN_FLIGHT = 2  # NOTE: GradientOffload's max_in_flight default: copies to the host that may run at once


def check_offload(offload: str, layerwise: bool) -> None:
    """An `EstimateError` for an unknown mode, or offload asked of a standard optimizer."""
    if offload not in OFFLOAD_MODES:
        raise EstimateError(f"offload={offload!r}: choose one of {', '.join(OFFLOAD_MODES)}.")
    if offload != "none" and not layerwise:
        raise EstimateError(f"offload={offload!r} needs a layer-wise optimizer (an `_layerwise` name).")


def gradient_sizes(entries: Iterable) -> list[int]:
    """Each trainable tensor's gradient bytes, one per tensor (a `*` tensor once per layer), from core's entries."""
    sizes = []
    for tensor, elem_bytes, trainable, fraction in entries:
        if trainable:
            sizes += [round(tensor.numel * elem_bytes * fraction)] * tensor.count
    return sizes


def apply_offload(
    opts: Any, layerwise: bool, entries: Iterable, grads: int, state: int, notes: list[str]
) -> tuple[int, int, int]:
    """`(gradient term, state term, host bytes)` after `opts.offload`, from core's unsharded terms (`_Options`)."""
    check_offload(opts.offload, layerwise)
    if opts.offload == "none":
        return grads, state, 0
    # Gradient accumulation no longer holds the window's gradients on the device: they wait on the host.
    notes[:] = [note for note in notes if not note.startswith("Gradient accumulation > 1")]
    grads, state, host = offload_terms(opts.offload, gradient_sizes(entries), state, notes)
    return grads, state, host // (opts.world_size if opts.sharding == "fsdp2" else 1)  # each rank: its own shards


def pinned_bytes(offload: str, sizes: list[int]) -> int:
    """
    The pinned host bytes of `offload` on CUDA, `sizes` from `gradient_sizes`: one block per dtype holds every
    gradient buffer (`HostArena`); with `"optimizer"` another holds the host parameter copies, and the gradients land
    in the one or the other of `host_grad` (stepped in backward) and the waiting buffers (the first is only made when
    a gradient steps at once). The optimizer states are not pinned.

    Example:

    ```python
    >>> from layerwise_hf.estimate.offload import pinned_bytes
    >>> pinned_bytes("optimizer", [400, 100, 300])
    1600
    ```
    """
    if offload == "none":
        return 0
    return sum(sizes) * (1 if offload == "gradients" else 2)


def offload_terms(offload: str, sizes: list[int], state: int, notes: list[str]) -> tuple[int, int, int]:
    """
    `(device gradient bytes, device optimizer-state bytes, host bytes)` of one unsharded replica with `offload`
    (not `"none"`); `sizes` from `gradient_sizes`, `state` the optimizer-state term.

    Example:

    ```python
    >>> from layerwise_hf.estimate.offload import offload_terms
    >>> offload_terms("optimizer", [400, 100, 300], state=1600, notes=[])
    (700, 0, 3200)
    ```
    """
    in_flight = sum(sorted(sizes, reverse=True)[:MAX_IN_FLIGHT])
    every = sum(sizes)
    notes.append(
        f"Offload ({offload}): the device holds only the gradients being copied to the host, at most {MAX_IN_FLIGHT} "
        "(the largest), at any gradient accumulation; the host holds one buffer per trainable gradient, pinned "
        "where the device supports it (with gradient accumulation each micro-batch also stages a temporary copy)."
    )
    if offload == "gradients":
        notes.append(
            "Offload (gradients): gradients wait on the host only when the step cannot take them at once (gradient "
            "accumulation, exact clipping); otherwise they step in backward as without offload."
        )
        return in_flight, state, every
    notes.append(
        "Offload (optimizer): the optimizer states and a copy of each trainable parameter (its dtype) are on the "
        "host; the host steps them during backward and copies each parameter back before the next forward."
    )
    return in_flight, 0, state + 2 * every
