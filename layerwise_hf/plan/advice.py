"""What would lower a simulated peak: read from its largest term besides the weights and from where it fell."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..bases.support import SUFFIX

# A category this large a share of the peak is worth a suggestion.
SIGNIFICANT = 0.2

if TYPE_CHECKING:
    from .core import PlanRow
    from .simulate import StepSetup


def advise(row: PlanRow, setup: StepSetup) -> list[str]:
    """
    Suggestions for one row, for each category that is a large share of the peak, largest first.

    Example:

    ```python
    >>> from layerwise_hf.plan.core import PlanRow
    >>> from layerwise_hf.plan.simulate import StepSetup
    >>> from layerwise_hf.plan.advice import advise
    >>> cats = dict(weights=4, gradients=4, optimizer_state=8, activations=20, temporaries=1)
    >>> advise(PlanRow("adamw_torch", 37, cats, "backward", False), StepSetup())[0]
    'activations dominate: turn on activation checkpointing (--gradient-checkpointing)'
    ```
    """
    cats = row.categories
    layerwise = row.optimizer.endswith(SUFFIX)

    def large(category: str, share: float = SIGNIFICANT) -> bool:
        return cats[category] >= share * max(row.peak_bytes, 1)

    act = "activations dominate: "
    grads = "gradients dominate: "
    candidates = [  # (applies, bytes behind it, suggestion)
        (large("activations") and not setup.gradient_checkpointing, cats["activations"],
         act + "turn on activation checkpointing (--gradient-checkpointing)"),
        (large("activations"), cats["activations"] - 1,
         act + f"a smaller micro-batch (now {setup.micro_batch}) with more gradient accumulation, or shorter "
         "sequences"),
        (large("gradients") and not layerwise, cats["gradients"],
         grads + f"a layer-wise optimizer ({row.optimizer}{SUFFIX}) frees each gradient after its step"),
        (large("gradients") and layerwise and setup.grad_accum > 1, cats["gradients"],
         grads + "gradient accumulation keeps every gradient until the last micro-batch; fewer, larger "
         "micro-batches let layer-wise free them"),
        (large("optimizer_state"), cats["optimizer_state"],
         "optimizer state dominates: an 8-bit optimizer (adamw_8bit) or adafactor, or LoRA (--lora-r)"),
        (large("temporaries"), cats["temporaries"],
         "temporaries dominate (the loss's float32 logits and their gradient, or a step's scratch): a smaller "
         "micro-batch or shorter sequences"),
        (layerwise and setup.clip_mode == "exact" and row.when.startswith("norm pass"), row.peak_bytes,
         "the peak is in exact clipping's norm pass, whose graph stays alive: --clip-mode previous or per_param "
         "avoids it"),
        (large("weights", 0.5), cats["weights"], _weights_advice(setup)),
    ]  # fmt: skip
    return [text for _, _, text in sorted((c for c in candidates if c[0]), key=lambda c: -c[1])]


def _weights_advice(setup: StepSetup) -> str:
    text = "weights are half the peak or more: "
    if setup.sharding == "fsdp2":
        if setup.bf16 or setup.fp16:
            # NOTE: accelerate's fsdp2_prepare_model upcasts trainable weights to float32 under mixed precision.
            text += ("under mixed precision Accelerate keeps float32 master shards (bfloat16 weights without --bf16 "
                     "keep bfloat16 shards), ")  # fmt: skip
        return text + "more ranks, or LoRA on an 8-bit or 4-bit base"
    return text + "bfloat16 weights (--torch-dtype bfloat16), LoRA on an 8-bit or 4-bit base, or FSDP2 across devices"
