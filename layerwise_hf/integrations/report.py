"""What a layer-wise run says about itself: one line at the start (the optimizer, how gradients reach it, the clipping
mode and whether gradients are held for the step) and a memory summary at the end (gradients alive at once and the
optimizer state, against what the standard optimizer holds). `LayerwiseCallback` logs both in every Trainer run,
axolotl's and LLaMA-Factory's included; a plain Accelerate loop can print them itself.
"""

from __future__ import annotations

from typing import Any

from ..optim.norm_pass import NormPass

MIB = 2**20

ROUTES = {
    "local": "steps each parameter in its post-accumulate-grad hook",
    "data_parallel": "all-reduces each gradient itself and steps it (DDP config; the model is not wrapped in DDP)",
    "ddp": "steps each bucket in DDP's comm hook, after its all-reduce",
    "fsdp2": "steps each shard after FSDP2's reduce-scatter",
}


def _settings(args: Any) -> tuple[float, str, int, str, str, bool]:
    max_grad_norm = getattr(args, "max_grad_norm", None) or 0.0
    clip = str(getattr(args, "layerwise_clip", "exact"))
    accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    offload = str(getattr(args, "layerwise_offload", "none"))
    norm_pass = str(getattr(args, "layerwise_norm_pass", "auto"))
    return max_grad_norm, clip, accumulation, offload, norm_pass, bool(getattr(args, "fp16", False))


def why_held(args: Any) -> str:
    """Whether this run's settings hold gradients until the step, and why (the part of `describe_training` that says
    so)."""
    max_grad_norm, clip, accumulation, offload, norm_pass, fp16 = _settings(args)
    clips = max_grad_norm > 0 and clip != "off"
    if accumulation > 1 and offload == "none":
        return (
            f"gradient accumulation ({accumulation} micro-batches a step) holds every gradient until the window's "
            "last micro-batch, as the standard optimizer does (layerwise_offload='gradients' keeps them in host "
            "memory)"
        )
    if offload != "none":
        return f"layerwise_offload={offload!r}: gradients that wait for the step wait in host memory"
    if (clips and clip == "exact") or fp16:
        measured = "the global norm" + (" and fp16's inf/nan check" if fp16 else "")
        if norm_pass == NormPass.HOLD.value:
            how = "by holding every gradient until the step (layerwise_norm_pass='hold'), as the standard optimizer"
        elif norm_pass == NormPass.AUTO.value:
            how = (
                "by a second backward or forward+backward, or by holding every gradient when activations outweigh "
                "them (layerwise_norm_pass='auto' picks the lowest peak; the memory summary at the end says which)"
            )
        else:
            how = f"by layerwise_norm_pass={norm_pass!r}, holding no gradient"
        alternative = "" if fp16 else "; layerwise_clip='previous' clips in one backward and holds none"
        return f"{measured} is measured before any layer steps, {how}{alternative}"
    what = "clips each step with the previous step's norm" if clips and clip == "previous" else None
    what = "clips each gradient on its own" if clips and clip == "per_param" else what
    return f"no gradient is held: {what or 'no clipping'}, so at most about one gradient is alive at a time"


def describe_training(optimizer: Any, args: Any) -> str:
    """
    One line saying what trains: the layer-wise optimizer, how gradients reach it, the clipping mode and whether
    gradients are held for the step (`why_held`). Call it once the route is connected.

    Args:
        optimizer (`LayerwiseOptimizer`):
            The optimizer, connected (`route` set).
        args (`TrainingArguments` or any object with its fields):
            `max_grad_norm`, `gradient_accumulation_steps`, `fp16` and the `layerwise_*` fields are read; missing
            ones take their defaults.

    Example:

    ```python
    >>> from layerwise_hf.integrations.report import describe_training
    >>> print(describe_training(trainer.layerwise_optimizer, trainer.args))
    Training layer-wise: adamw_torch_layerwise, one AdamW per trainable parameter (21 parameters, 1.380 MiB of
    gradients, the largest 0.126 MiB); it steps each parameter in its post-accumulate-grad hook. max_grad_norm=1.0,
    layerwise_clip='exact': the global norm is measured before any layer steps, ...
    ```
    """
    max_grad_norm, clip, *_ = _settings(args)
    kinds = "/".join(sorted({type(getattr(inner, "host_base", inner)).__name__ for inner in optimizer.inner}))
    sizes = [p.numel() * p.element_size() for p in optimizer.params] or [0]
    route = ROUTES.get(optimizer.route or "", f"gradients arrive by route {optimizer.route!r}")
    clipping = f"max_grad_norm={max_grad_norm}, layerwise_clip={clip!r}" if max_grad_norm > 0 else "max_grad_norm off"
    return (
        f"Training layer-wise: {optimizer.optimizer_name or kinds}, one {kinds} per trainable parameter "
        f"({len(sizes)} parameters, {sum(sizes) / MIB:.3f} MiB of gradients, the largest {max(sizes) / MIB:.3f} MiB); "
        f"it {route}. {clipping}: {why_held(args)}."
    )


class StepPeaks:
    """
    The most gradient bytes alive at once in a run's first step and in the steps after it. Exact clipping's
    `layerwise_norm_pass="auto"` (and `auto_find_batch_size`) may hold every gradient in the first step only, which
    then sets the whole run's peak; this tells the steps after it apart. The optimizer's own `peak_grad_bytes` (and
    the logged `layerwise_peak_grad_mib`) keep counting the whole run.

    Example:

    ```python
    >>> from layerwise_hf.integrations.report import StepPeaks
    >>> peaks = StepPeaks()
    >>> for batch in loader:  # a plain loop: around each optimizer step
    ...     peaks.step_begin(optimizer)
    ...     accelerator.backward(model(**batch).loss); optimizer.step(); optimizer.zero_grad()
    ...     peaks.step_end(optimizer)
    ```
    """

    def __init__(self) -> None:
        self.first: int | None = None
        self.later: int | None = None
        self._before = 0

    def step_begin(self, optimizer: Any) -> None:
        meter = optimizer.pipeline.meter
        # NOTE: the meter keeps one running peak; it is lowered for the step and put back at its end, so what is
        # logged after the step is the whole run's peak, as without this.
        self._before = meter.peak_bytes
        meter.peak_bytes = meter.alive_bytes

    def step_end(self, optimizer: Any) -> None:
        meter = optimizer.pipeline.meter
        peak = meter.peak_bytes
        if self.first is None:
            self.first = peak
        else:
            self.later = max(self.later or 0, peak)
        meter.peak_bytes = max(self._before, peak)


def memory_summary(optimizer: Any, args: Any, steps: StepPeaks | None = None) -> str:
    """
    The memory a layer-wise run held, against the standard optimizer's: the most gradient bytes alive at once, the
    optimizer state, and their sum (the figures of `examples/train.py`'s table, on this process). When every gradient
    was held, it says why and which setting holds none; with `steps`, when only the first step held them, it gives the
    steps after it apart.

    Args:
        optimizer (`LayerwiseOptimizer`):
            The optimizer after training.
        args (`TrainingArguments` or any object with its fields):
            As for `describe_training`.
        steps (`StepPeaks`, *optional*):
            The peaks per step, when they were followed (`LayerwiseCallback` does).

    Example:

    ```python
    >>> from layerwise_hf.integrations.report import memory_summary
    >>> print(memory_summary(trainer.layerwise_optimizer, trainer.args))
    Layer-wise memory (adamw_torch_layerwise): gradients alive at once 0.126 MiB at most (standard optimizer: all
    1.380 MiB at its step); optimizer state 2.761 MiB (the same); gradients + state 2.887 MiB against 4.141 MiB:
    30.3% less.
    ```
    """
    max_grad_norm, clip, accumulation, offload, norm_pass, fp16 = _settings(args)
    memory = optimizer.pipeline.memory
    peak, full, state = memory.peak_grad_bytes, memory.full_grad_bytes(), memory.state_bytes()
    first_only = steps is not None and steps.later is not None and steps.first is not None and steps.later < peak
    if first_only:
        peak = steps.later
    saving = 100 * (full - peak) / (full + state) if full + state else 0.0
    name = optimizer.optimizer_name or "layer-wise"
    line = (
        f"Layer-wise memory ({name}): gradients alive at once {peak / MIB:.3f} MiB at most"
        + (" after the first step" if first_only else "")
        + f" (standard optimizer: all {full / MIB:.3f} MiB at its step); optimizer state {state / MIB:.3f} MiB "
        f"(the same); gradients + state {(peak + state) / MIB:.3f} MiB against {(full + state) / MIB:.3f} MiB: "
        + (f"{saving:.1f}% less." if saving > 0 else "no less.")
    )
    choice = getattr(optimizer.pipeline.norm_pass_choice, "way", None)
    if first_only:
        why = (
            "while layerwise_norm_pass='auto' measured what the graph saves, and chose a second forward+backward "
            "('rerun') for the steps after it"
            if choice is NormPass.RERUN
            else "(auto_find_batch_size holds it)"
            if getattr(args, "auto_find_batch_size", False)
            else ""
        )
        return f"{line} The first step held {steps.first / MIB:.3f} MiB {why}".rstrip() + "."
    if peak < full or full == 0:
        return line
    if accumulation > 1 and offload == "none":
        return f"{line} Gradient accumulation held every gradient until each window's last micro-batch."
    if ((max_grad_norm > 0 and clip == "exact") or fp16) and (
        choice is NormPass.HOLD or norm_pass == NormPass.HOLD.value
    ):
        why = (
            "the activations outweigh the gradients, so holding them is the lowest peak"
            if norm_pass == NormPass.AUTO.value
            else "layerwise_norm_pass='hold'"
        )
        instead = "" if fp16 else " layerwise_clip='previous' clips with the previous step's norm and holds none."
        return (
            f"{line} Exact clipping held every gradient until the step to measure the global norm ({why}), as "
            f"the standard optimizer holds them.{instead}"
        )
    return line
