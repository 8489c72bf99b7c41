"""Exact clipping at GA 1: a norm pass, or `layerwise_offload="gradients"`? A cost model of the two, in seconds.

Exact clipping needs the global gradient norm before any layer steps. Without offload a layer-wise run gets it from a
norm pass (`layerwise_hf.optim.norm_pass`): a second backward over the retained graph (`retain`), or a second forward
and backward (`rerun`). With `layerwise_offload="gradients"` there is one backward: each gradient is copied to the host
as it is final and freed, and `step()` copies each back and steps it. What each adds to a step:

- norm pass: `backward_s` (`retain`), or `forward_s + backward_s` (`rerun`);
- gradients offload: two transfers of the gradients, `transfer_s = grad_bytes / link_bytes_per_s` each way, less what
  hides behind other work. The copies out run beside backward as the gradients become final, so only
  `max(0, transfer_s - OVERLAP * backward_s)` is left over, plus the last gradient's copy (it is final when backward
  ends). The copies back run beside the device steps (the next one's copy starts before the current step), so
  `max(0, transfer_s - OVERLAP * step_s)` is left over, plus the first gradient's copy. The largest gradient stands
  for both. `OVERLAP` (0.5) is the share of backward and of the steps the copies hide behind: not all of it, as
  gradients come in bursts (a layer's small ones together) and at most two copies out may be in flight (a copy
  slower than backward holds backward up). Measured on CPU with a slow link emulated (a delay on every copy, 20M
  Llama, the table in benchmarks/README.md, `step_time.py`), the hidden share was 0.3-0.6; with 0.5 the model put the
  cost of offload at 0.56 s and 2.9 s where 0.86 s and 2.8 s were measured (with perfect overlap: 0.24 s and 2.2 s),
  and chose as the measurements did at all three delays (0, 10 and 30 ms a copy).

`choose_clipping_offload` picks the cheaper. Backward grows with the tokens of a micro-batch and the transfers do not,
so the norm pass wins at small micro-batches and offload at large ones; `crossover_tokens` says where. With gradient
accumulation (GA > 1) or without exact clipping there is no norm pass to save: gradients offload then costs time and
buys only device memory (every micro-batch's gradient waits on the host, not on the device).

Measured on CPU (`benchmarks/step_time.py --offload`, where the "link" is a memory copy on the copy thread and the
device is the CPU itself): see benchmarks/README.md, `step_time.py`.
"""

from __future__ import annotations

import dataclasses
import math

# Host <-> device bandwidth a pinned, non-blocking copy reaches, bytes per second (PCIe x16, one direction; the
# usual measured figure is ~80% of the link's nominal rate).
PCIE4_BYTES_PER_S = 25e9
PCIE5_BYTES_PER_S = 50e9
OVERLAP = 0.5  # the share of backward / of the device steps that the copies out / back hide behind (module docstring)
NORM_PASSES = ("retain", "rerun")


@dataclasses.dataclass(frozen=True)
class OffloadChoice:
    """
    What `choose_clipping_offload` decided, and the seconds behind it.

    Attributes:
        mode (`str`): `"gradients"` (`layerwise_offload="gradients"`) or `"none"` (the norm pass, or nothing to save).
        norm_pass_s (`float`): what the norm pass adds to a step (0 where none is needed).
        gradients_s (`float`): what gradients offload adds to a step (the part of its transfers not hidden).
        transfer_s (`float`): one transfer of every gradient over the link.
        reason (`str`): one sentence for a user.
    """

    mode: str
    norm_pass_s: float
    gradients_s: float
    transfer_s: float
    reason: str


def backward_seconds(num_params: int, tokens: int, flops_per_s: float, checkpointing: bool = False) -> float:
    """
    Backward of a transformer step from its FLOPs: 4 x parameters x tokens (twice the forward's 2 x parameters x
    tokens), plus one forward more with activation checkpointing, at `flops_per_s` (what the device achieves, not its
    peak).

    Example:

    ```python
    >>> from layerwise_hf.estimate.offload_choice import backward_seconds
    >>> round(backward_seconds(8_000_000_000, 4096, 400e12), 3)
    0.328
    ```
    """
    flops = (6 if checkpointing else 4) * num_params * tokens
    return flops / flops_per_s


def gradients_offload_seconds(
    grad_bytes: int,
    largest_grad_bytes: int,
    backward_s: float,
    step_s: float,
    link_bytes_per_s: float,
    overlap: float = OVERLAP,
) -> float:
    """What `layerwise_offload="gradients"` adds to a step: the transfers out and back not hidden behind `overlap` of
    backward and of the device steps (see the module docstring)."""
    transfer = grad_bytes / link_bytes_per_s
    last = largest_grad_bytes / link_bytes_per_s
    return max(0.0, transfer - overlap * backward_s) + last + max(0.0, transfer - overlap * step_s) + last


def choose_clipping_offload(
    grad_bytes: int,
    backward_s: float,
    *,
    largest_grad_bytes: int = 0,
    forward_s: float = 0.0,
    step_s: float = 0.0,
    link_bytes_per_s: float = PCIE4_BYTES_PER_S,
    norm_pass: str = "retain",
    grad_accum: int = 1,
    exact_clipping: bool = True,
    overlap: float = OVERLAP,
) -> OffloadChoice:
    """
    The faster way to clip exactly: `"gradients"` offload or `"none"` (the norm pass).

    Args:
        grad_bytes (`int`): bytes of every trainable gradient (this rank's shards under FSDP2).
        backward_s (`float`): seconds of one backward of a micro-batch (`backward_seconds` estimates it).
        largest_grad_bytes (`int`, *optional*): the largest gradient (its copy is not hidden); 0 to ignore.
        forward_s (`float`, *optional*): seconds of one forward (a `rerun` norm pass runs it again).
        step_s (`float`, *optional*): seconds of the device steps of every parameter (the copies back hide behind
            them).
        link_bytes_per_s (`float`, *optional*, defaults to PCIe 4 x16, 25e9): host <-> device bandwidth.
        norm_pass (`str`, *optional*, defaults to `"retain"`): the norm pass offload would replace: `"retain"` (a
            second backward) or `"rerun"` (a second forward and backward).
        grad_accum (`int`, *optional*, defaults to 1): gradient accumulation steps (above 1 there is no norm pass).
        exact_clipping (`bool`, *optional*, defaults to `True`): `max_grad_norm > 0` with `layerwise_clip="exact"`.
        overlap (`float`, *optional*, defaults to `OVERLAP`): the share of backward and of the steps the copies hide
            behind.

    Example:

    ```python
    >>> from layerwise_hf.estimate.offload_choice import backward_seconds, choose_clipping_offload
    >>> grads = 16 * 2**30  # Llama-3-8B, bf16 gradients
    >>> small = choose_clipping_offload(grads, backward_seconds(8e9, 4096, 400e12), largest_grad_bytes=2**30)
    >>> large = choose_clipping_offload(grads, backward_seconds(8e9, 8 * 4096, 400e12), largest_grad_bytes=2**30)
    >>> small.mode, large.mode
    ('none', 'gradients')
    ```
    """
    if norm_pass not in NORM_PASSES:
        raise ValueError(f"norm_pass={norm_pass!r}: choose one of {', '.join(NORM_PASSES)}.")
    for name, value in (
        ("grad_bytes", grad_bytes),
        ("backward_s", backward_s),
        ("link_bytes_per_s", link_bytes_per_s),
    ):
        if not value > 0 or not math.isfinite(value):
            raise ValueError(f"{name}={value!r}: it must be a positive number.")
    if grad_accum < 1:
        raise ValueError(f"grad_accum={grad_accum!r}: at least 1.")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap={overlap!r}: a share, from 0 to 1.")
    transfer = grad_bytes / link_bytes_per_s
    offload = gradients_offload_seconds(grad_bytes, largest_grad_bytes, backward_s, step_s, link_bytes_per_s, overlap)
    if not exact_clipping or grad_accum > 1:
        why = "no exact clipping" if not exact_clipping else f"GA {grad_accum} holds the gradients until step()"
        return OffloadChoice(
            "none", 0.0, offload, transfer,
            f"{why}: no norm pass to save; gradients offload would add {offload:.3g} s a step and save only device "
            "memory (the gradients wait on the host)",
        )  # fmt: skip
    norm = backward_s + (forward_s if norm_pass == "rerun" else 0.0)
    if offload < norm:
        return OffloadChoice(
            "gradients", norm, offload, transfer,
            f"layerwise_offload='gradients': its transfers add {offload:.3g} s a step (2 x {transfer:.3g} s, partly "
            f"hidden), the norm pass ({norm_pass}) {norm:.3g} s",
        )  # fmt: skip
    return OffloadChoice(
        "none", norm, offload, transfer,
        f"the norm pass ({norm_pass}) adds {norm:.3g} s a step, gradients offload's transfers {offload:.3g} s "
        f"(2 x {transfer:.3g} s, partly hidden): keep the norm pass",
    )  # fmt: skip


def crossover_tokens(
    num_params: int,
    grad_bytes: int,
    flops_per_s: float,
    *,
    largest_grad_bytes: int = 0,
    step_s: float = 0.0,
    link_bytes_per_s: float = PCIE4_BYTES_PER_S,
    checkpointing: bool = False,
    overlap: float = OVERLAP,
) -> int:
    """
    The fewest tokens per micro-batch from which gradients offload beats a `retain` norm pass (GA 1, exact clipping),
    with backward from `backward_seconds`.

    Example:

    ```python
    >>> from layerwise_hf.estimate.offload_choice import crossover_tokens
    >>> crossover_tokens(8_000_000_000, 16 * 2**30, 400e12, largest_grad_bytes=2**30)
    12170
    ```
    """

    def offload_wins(tokens: int) -> bool:
        backward = backward_seconds(num_params, tokens, flops_per_s, checkpointing)
        offload = gradients_offload_seconds(
            grad_bytes, largest_grad_bytes, backward, step_s, link_bytes_per_s, overlap
        )
        return offload < backward

    high = 1
    while not offload_wins(high):
        high *= 2
        if high > 2**40:
            raise ValueError("gradients offload never beats the norm pass here (no link bandwidth?)")
    low = high // 2
    while high - low > 1:  # offload_wins is monotonic in tokens: backward grows, the transfers shrink with it
        mid = (low + high) // 2
        low, high = (low, mid) if offload_wins(mid) else (mid, high)
    return high
