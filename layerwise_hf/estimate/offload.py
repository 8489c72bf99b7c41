"""The device and host terms of a layer-wise run with host offload (`layerwise_offload`,
`layerwise_hf.placement.offload` and `layerwise_hf.placement.host_step`), for `estimate(offload=...)`.

- `"gradients"`: the optimizer states stay on the device; each gradient that waits for the step (gradient
  accumulation, exact clipping) waits in a host buffer of its own, so the host holds every trainable gradient and the
  device only the copies in flight: at most `MAX_IN_FLIGHT` gradients (`GradientOffload`'s default), the largest.
- `"optimizer"`: nothing of the optimizer stays on the device. The host holds each parameter's states, a copy of the
  parameter in its dtype (`HostStepOptimizer.host`) and one gradient buffer per parameter (`host_grad`, or the
  `GradientOffload` buffer when the gradient waits for the step); the device again only the copies in flight.
- With gradient accumulation, both: `MAX_STAGED` staging buffers of the largest gradient's size, where a later
  micro-batch's gradient waits until the host worker has added it into its sum (`StagingBuffers`).

On CUDA the gradient buffers, the staging buffers and the parameter copies are pinned (`pinned_bytes`); the optimizer
states, created by the optimizer like any CPU tensor, and the host step's temporaries are pageable (`pageable_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .units import EstimateError, format_bytes

OFFLOAD_MODES = ("none", "gradients", "optimizer")
MAX_IN_FLIGHT = 2  # NOTE: GradientOffload's max_in_flight default: copies to the host that may run at once
MAX_STAGED = 2  # NOTE: GradientOffload's max_staged default: staging buffers in use at once under accumulation


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
    divisor = opts.shards if opts.sharding == "fsdp2" else 1  # each rank: its own shards
    sizes = gradient_sizes(entries)
    grads, state, host = offload_terms(opts.offload, sizes, state, notes, opts.gradient_accumulation_steps)
    pinned = pinned_bytes(opts.offload, sizes, opts.gradient_accumulation_steps) // divisor
    notes.append(
        f"Offload ({opts.offload}), host memory on CUDA: {format_bytes(pinned)} pinned (gradient buffers"
        + (", staging buffers" if opts.gradient_accumulation_steps > 1 else "")
        + (", parameter copies" if opts.offload == "optimizer" else "")
        + f"), {format_bytes(host // divisor - pinned)} pageable"
        + (" (optimizer states; the host step's temporaries come on top)." if opts.offload == "optimizer" else ".")
    )
    return grads, state, host // divisor


def staging_bytes(sizes: list[int], grad_accum: int) -> int:
    """
    The staging buffers' bytes (`StagingBuffers`): `MAX_STAGED` of the largest gradient's size with gradient
    accumulation, else none; `sizes` from `gradient_sizes`.

    Example:

    ```python
    >>> from layerwise_hf.estimate.offload import staging_bytes
    >>> staging_bytes([400, 100, 300], grad_accum=4), staging_bytes([400, 100, 300], grad_accum=1)
    (800, 0)
    ```
    """
    return MAX_STAGED * max(sizes, default=0) if grad_accum > 1 else 0


def pinned_bytes(offload: str, sizes: list[int], grad_accum: int = 1) -> int:
    """
    The pinned host bytes of `offload` on CUDA, `sizes` from `gradient_sizes`: one block per dtype holds every
    gradient buffer (`HostArena`), and with gradient accumulation the staging buffers are `MAX_STAGED` blocks of the
    largest gradient's size; with `"optimizer"` another block holds the host parameter copies, and each gradient lands
    in one of `host_grad` (stepped in backward) and the waiting buffers (the first is made only when a gradient steps
    at once, the second only when one waits). The optimizer states are pageable (`pageable_bytes`).

    Example:

    ```python
    >>> from layerwise_hf.estimate.offload import pinned_bytes
    >>> pinned_bytes("optimizer", [400, 100, 300]), pinned_bytes("optimizer", [400, 100, 300], grad_accum=4)
    (1600, 2400)
    ```
    """
    if offload == "none":
        return 0
    return sum(sizes) * (1 if offload == "gradients" else 2) + staging_bytes(sizes, grad_accum)


def pageable_bytes(offload: str, state: int) -> int:
    """
    The pageable host bytes of `offload` that live for the run, `state` the optimizer-state term: with `"optimizer"`
    the states (the optimizer creates them like any CPU tensor, not in the pinned blocks); the host step's
    temporaries come and go on top.

    Example:

    ```python
    >>> from layerwise_hf.estimate.offload import pageable_bytes
    >>> pageable_bytes("optimizer", 1600), pageable_bytes("gradients", 1600)
    (1600, 0)
    ```
    """
    return state if offload == "optimizer" else 0


def offload_terms(
    offload: str, sizes: list[int], state: int, notes: list[str], grad_accum: int = 1
) -> tuple[int, int, int]:
    """
    `(device gradient bytes, device optimizer-state bytes, host bytes)` of one unsharded replica with `offload`
    (not `"none"`); `sizes` from `gradient_sizes`, `state` the optimizer-state term. The host bytes are
    `pinned_bytes + pageable_bytes`.

    Example:

    ```python
    >>> from layerwise_hf.estimate.offload import offload_terms
    >>> offload_terms("optimizer", [400, 100, 300], state=1600, notes=[])
    (700, 0, 3200)
    >>> offload_terms("optimizer", [400, 100, 300], state=1600, notes=[], grad_accum=4)
    (700, 0, 4000)
    ```
    """
    in_flight = sum(sorted(sizes, reverse=True)[:MAX_IN_FLIGHT])
    notes.append(
        f"Offload ({offload}): the device holds only the gradients being copied to the host, at most {MAX_IN_FLIGHT} "
        "(the largest), at any gradient accumulation; the host holds one buffer per trainable gradient (with "
        f"gradient accumulation also {MAX_STAGED} staging buffers of the largest gradient's size, where a "
        "micro-batch's gradient waits until the host worker has added it: a worker that falls behind holds the "
        "backward back, not more memory)."
    )
    host = pinned_bytes(offload, sizes, grad_accum) + pageable_bytes(offload, state)
    if offload == "gradients":
        notes.append(
            "Offload (gradients): gradients wait on the host only when the step cannot take them at once (gradient "
            "accumulation, exact clipping); otherwise they step in backward as without offload."
        )
        return in_flight, state, host
    notes.append(
        "Offload (optimizer): the optimizer states and a copy of each trainable parameter (its dtype) are on the "
        "host; the host steps them during backward and copies each parameter back before the next forward."
    )
    return in_flight, 0, host
