"""One device's share of the estimate: DDP's buckets, FSDP2's division, HSDP's replicas (`dp_replicate`)."""

from __future__ import annotations

from typing import Any

from .optimizers import fsdp2_refusal
from .units import EstimateError, format_bytes

NOT_LAYERS = ("root", "tail", "embed")  # FSDP2 units that are not decoder layers (`core._fsdp2_unit`)


def check_replicas(world_size: int, sharding: str, dp_replicate: Any) -> None:
    """
    Refuse an HSDP layout no run could have: `dp_replicate` replicas need FSDP2 and a world of at least two shards
    per replica. `estimate()` and `layerwise-hf plan` both check with it.

    Example:

    ```python
    >>> from layerwise_hf.estimate.sharding import check_replicas
    >>> check_replicas(16, "fsdp2", 2)  # 2 replicas x 8 shards
    ```
    """
    if isinstance(dp_replicate, bool) or not isinstance(dp_replicate, int) or dp_replicate < 1:
        raise EstimateError(f"dp_replicate={dp_replicate!r}: HSDP's replicas, a whole number >= 1.")
    if dp_replicate > 1 and (sharding != "fsdp2" or world_size % dp_replicate or world_size == dp_replicate):
        raise EstimateError(
            f"dp_replicate={dp_replicate} with world_size={world_size} and sharding={sharding!r}: HSDP is FSDP2 "
            "(sharding='fsdp2') with world_size a multiple of dp_replicate, at least 2 shards per replica (with one, "
            "every device holds the whole model: sharding='ddp')."
        )


def per_device(
    counts: Any, grads: int, state: int, base: str, layerwise: bool, opts: Any, notes: list[str], in_flight: Any
) -> tuple[int, int, int]:
    """
    Step 3 of `estimate()` (its `_Counts` and `_Options`): DDP (standard: persistent buckets; layer-wise: the
    buckets in flight), or FSDP2's division (HSDP: over one replica's devices). Returns `(gradient_bytes,
    total_bytes, per_gpu_bytes)`.
    """
    if opts.sharding == "ddp":
        if layerwise and in_flight is not None:
            grads = in_flight
            if opts.gradient_as_bucket_view:
                notes.append("gradient_as_bucket_view: ignored layer-wise (no DDP wrapper, no DDP buckets).")
        elif layerwise:
            notes.append(
                "DDP layer-wise with gradient accumulation: gradients accumulate in .grad during the window and are "
                "bucketed, reduced and freed only on its last micro-batch, so every gradient is held."
            )
        else:
            # The reducer allocates flat buckets for every gradient at wrap time and keeps them for the whole run;
            # `.grad` is a second copy unless it is a view of them.
            grads = counts.all_grads + (0 if opts.gradient_as_bucket_view else counts.all_grads)
            notes.append(
                "DDP (standard): the reducer's bucket buffers hold all gradients for the whole run"
                + ("; .grad are views of them." if opts.gradient_as_bucket_view else ", and .grad is a second copy "
                   "(--gradient-as-bucket-view makes it a view).")
            )  # fmt: skip
    total = counts.weight_bytes + grads + state
    if opts.sharding != "fsdp2":
        return grads, total, total
    layer_bytes = max((v for k, v in counts.unit_weights.items() if k not in NOT_LAYERS), default=0)
    layer = f" ({format_bytes(layer_bytes)} per decoder layer)" if layer_bytes else ""
    notes.append(
        f"FSDP2: also not included, the unsharded weights of the unit being computed{layer}, all-gathered "
        "for its forward and backward."
    )
    refusal = fsdp2_refusal(base) if layerwise else None
    if refusal:
        notes.append(f"Layer-wise training is refused under FSDP2: {refusal}")
    if opts.dp_replicate > 1:
        notes.append(
            f"HSDP: {opts.dp_replicate} replicas x {opts.shards} shards; each device holds 1/{opts.shards} (its "
            "replica's share), the all-reduce across replicas adds no buffer."
        )
    return grads, total, -(-total // opts.shards)


# ---- the estimate ----
