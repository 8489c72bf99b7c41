"""What would lower a simulated peak: read from its largest term besides the weights and from where it fell."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..bases.support import SUFFIX

# A category this large a share of the peak is worth a suggestion.
SIGNIFICANT = 0.2

if TYPE_CHECKING:
    from .simulate import StepSetup

# A row of `plan.core.PlanRow`: read by attribute here, not imported (core imports this module).
PlanRow = Any


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
    # NOTE: accelerate >= 1.11's no_sync turns FSDP2's gradient sync off: the window is summed unsharded.
    unsharded_window = setup.sharding == "fsdp2" and setup.grad_accum > 1 and not setup.sync_each_batch
    candidates = [  # (applies, bytes behind it, suggestion)
        (large("activations") and not setup.gradient_checkpointing, cats["activations"],
         act + "turn on activation checkpointing (--gradient-checkpointing)"),
        (large("activations"), cats["activations"] - 1,
         act + f"a smaller micro-batch (now {setup.micro_batch}) with more gradient accumulation, or shorter "
         "sequences"),
        (large("gradients") and not layerwise, cats["gradients"],
         grads + f"a layer-wise optimizer ({row.optimizer}{SUFFIX}) frees each gradient after its step"),
        (large("gradients") and unsharded_window, cats["gradients"] + 1,
         grads + "under FSDP2 the micro-batches before each window's last are summed unsharded (Accelerate's "
         "no_sync); --sync-each-batch (Accelerate's sync_each_batch) reduce-scatters every micro-batch, so only "
         "shards wait (in host memory with layerwise_offload)"),
        (large("gradients") and layerwise and setup.grad_accum > 1 and row.offload == "none" and not unsharded_window,
         cats["gradients"],
         grads + "gradient accumulation keeps every gradient until the last micro-batch; fewer, larger "
         "micro-batches let layer-wise free them, or layerwise_offload='gradients' keeps the sums in host memory "
         "(--offload gradients plans it)"),
        (large("optimizer_state"), cats["optimizer_state"],
         f"optimizer state dominates: {_smaller_state(layerwise, setup)}LoRA (--lora-r)"
         + (", or layerwise_offload='optimizer' (states on the host; --offload optimizer plans it)"
            if layerwise and row.offload == "none" else "")),
        (large("temporaries"), cats["temporaries"],
         "temporaries dominate (the loss's float32 logits and their gradient, or a step's scratch): a smaller "
         "micro-batch or shorter sequences"),
        (layerwise and setup.clip_mode == "exact" and row.when.startswith("norm pass"), row.peak_bytes,
         "the peak is in exact clipping's norm pass, whose graph stays alive: --clip-mode previous or per_param "
         "avoids it, and so does layerwise_offload='gradients' (exact clipping in one backward)"),
        (large("weights", 0.5), cats["weights"], _weights_advice(setup)),
    ]  # fmt: skip
    return [text for _, _, text in sorted((c for c in candidates if c[0]), key=lambda c: -c[1])]


def _smaller_state(layerwise: bool, setup: StepSetup) -> str:
    # Only what the plan itself would run: under FSDP2 a standard optimizer whose kernels take no DTensor is refused
    # (ranks.fsdp2_refusal), and its layer-wise form, which steps each rank's local shard, is named instead (under
    # tensor parallel too).
    from .ranks import fsdp2_refusal

    def refused(name: str) -> bool:
        return setup.sharding == "fsdp2" and fsdp2_refusal(name, setup.tp) is not None

    names = []
    for base in ("adamw_8bit", "adafactor"):
        name = base + SUFFIX if layerwise else base
        if refused(name):
            name = base + SUFFIX
            if refused(name):
                continue
        names.append(name)
    return f"an 8-bit optimizer or a factored one ({' or '.join(names)}), or " if names else ""


def _weights_advice(setup: StepSetup) -> str:
    text = "weights are half the peak or more: "
    if setup.sharding == "fsdp2":
        if setup.bf16 or setup.fp16:
            # NOTE: accelerate's fsdp2_prepare_model upcasts trainable weights to float32 under mixed precision.
            text += ("under mixed precision Accelerate keeps float32 master shards (bfloat16 weights without --bf16 "
                     "keep bfloat16 shards), ")  # fmt: skip
        return text + "more ranks, or LoRA on an 8-bit or 4-bit base"
    dtype = "bfloat16 weights (--torch-dtype bfloat16), " if setup.torch_dtype == "float32" else ""
    return text + dtype + "LoRA on an 8-bit or 4-bit base, or FSDP2 across devices"


def choose_offload(rows: list[PlanRow], device_memory: int | None, host_memory: int | None) -> list[str]:
    """
    For each layer-wise optimizer planned with several offload modes, which mode to use, from the simulated bytes
    only: among the modes whose device peak fits (and host peak, with `host_memory`), the one with the least host
    memory (no offload needs none; "gradients" less than "optimizer"); without a device memory, or when none fits,
    the one with the lowest device peak. Speed is not weighed here: the host step must keep pace with backward
    (`layerwise_hf.placement.offloading.SLOW_ON_HOST`) and every mode moves gradients over the host link.

    Example:

    ```python
    >>> from layerwise_hf.plan.core import PlanRow
    >>> from layerwise_hf.plan.advice import choose_offload
    >>> cats = dict(weights=0, gradients=0, optimizer_state=0, activations=0, temporaries=0)
    >>> rows = [PlanRow("sgd_layerwise", 30, cats, "", False, offload="none"),
    ...         PlanRow("sgd_layerwise", 20, cats, "", False, offload="gradients", host_peak_bytes=10)]
    >>> choose_offload(rows, device_memory=24, host_memory=None)[0]
    'sgd_layerwise: offload gradients (device peak 20 B, host 10 B): the least host memory among the modes that fit'
    ```
    """
    from ..estimate.units import format_bytes

    out = []
    by_name: dict[str, list[PlanRow]] = {}
    for row in rows:
        if row.optimizer.endswith(SUFFIX):
            by_name.setdefault(row.optimizer, []).append(row)
    for name, candidates in by_name.items():
        if len(candidates) < 2:
            continue

        def fits(r: PlanRow) -> bool:
            device_ok = device_memory is not None and r.peak_bytes <= device_memory
            return device_ok and (host_memory is None or r.host_peak_bytes <= host_memory)

        fitting = [r for r in candidates if fits(r)]
        if fitting:
            best = min(fitting, key=lambda r: (r.host_peak_bytes, r.peak_bytes))
            why = "the least host memory among the modes that fit"
        else:
            best = min(candidates, key=lambda r: (r.peak_bytes, r.host_peak_bytes))
            why = "the lowest device peak" + (", and no mode fits" if device_memory is not None else "")
        out.append(
            f"{name}: offload {best.offload} (device peak {format_bytes(best.peak_bytes)}, host "
            f"{format_bytes(best.host_peak_bytes)}): {why}"
        )
        modes = {r.offload: r for r in candidates}
        if {"none", "gradients"} <= set(modes) and modes["gradients"].peak_bytes >= 0.99 * modes["none"].peak_bytes:
            out.append(
                f"{name}: offload gradients lowers no device peak here; with exact clipping at GA 1 it saves the "
                "norm pass's second backward for two transfers of the gradients, which is faster only on a fast "
                "enough link (layerwise_hf.estimate.offload_choice.crossover_tokens says from how many tokens)"
            )
    return out
