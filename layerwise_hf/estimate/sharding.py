"""One device's share of the estimate: DDP's buckets, FSDP2's division, HSDP's replicas (`dp_replicate`), tensor
parallel's division of what the model's tensor-parallel plan shards (`tp`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..bases.support import FSDP2_LOCAL_SHARD, SUFFIX
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


def check_tensor_parallel(world_size: int, sharding: str, dp_replicate: int, tp: Any) -> None:
    """
    Refuse a tensor-parallel size no run could have: `tp` ranks need FSDP2 (transformers' `DistributedConfig` shards
    the model at its load; Accelerate then runs the FSDP2 side) and must divide each replica's ranks.

    Example:

    ```python
    >>> from layerwise_hf.estimate.sharding import check_tensor_parallel
    >>> check_tensor_parallel(16, "fsdp2", 2, 2)  # 2 replicas x 4 FSDP2 shards x tensor parallel 2
    ```
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise EstimateError(f"tp={tp!r}: the tensor-parallel size, a whole number >= 1.")
    if tp > 1 and (sharding != "fsdp2" or world_size % (dp_replicate * tp)):
        raise EstimateError(
            f"tp={tp} with world_size={world_size}, dp_replicate={dp_replicate} and sharding={sharding!r}: tensor "
            "parallel runs with sharding='fsdp2' and world_size a multiple of dp_replicate x tp (world_size / "
            "(dp_replicate x tp) FSDP2 shards; 1: tensor parallel alone)."
        )


# NOTE: transformers 5.24's parallel styles (integrations/tensor_parallel.py): these cut a module's weight (row-wise:
# the weight only, its bias stays whole); every other style (sequence parallel, replicate, expert dispatch) leaves
# the parameters whole on each tensor-parallel rank.
_CUTS_ALL = ("colwise", "embedding_", "packed_colwise", "moe_tp_experts")
_CUTS_WEIGHT = ("rowwise", "packed_rowwise")


def tp_sharded(spec: Any, tp: int) -> Callable[[Any], bool]:
    """
    Whether tensor parallel cuts a tensor (`TensorSpec`), by the model's `tp_plan` (module pattern -> style) as
    transformers applies it at the load; refused for a model without one.

    Example:

    ```python
    >>> from layerwise_hf.estimate import TensorSpec, load_model_spec
    >>> from layerwise_hf.estimate.sharding import tp_sharded
    >>> cut = tp_sharded(load_model_spec("llama-3-8b"), 2)
    >>> q = TensorSpec("model.layers.*.self_attn.q_proj.weight", (4096, 4096))
    >>> cut(q), cut(TensorSpec("model.norm.weight", (4096,)))
    (True, False)
    ```
    """
    plan = getattr(spec, "tp_plan", None) or {}
    if not plan:
        raise EstimateError(
            f"tp={tp}: {spec.name} has no tensor-parallel plan in transformers (its model's tp_plan is empty), so "
            "from_pretrained(distributed_config=DistributedConfig(tp_size=...)) cannot shard it; use tp=1."
        )
    # NOTE: transformers matches a plan's `*` to a layer index; a folded TensorSpec writes the index as `*`.
    rules = [(re.compile(re.escape(k).replace(r"\*", r"(?:\d+|\*)")), v) for k, v in plan.items()]

    def cut(tensor: Any) -> bool:
        module, _, leaf = tensor.name.rpartition(".")
        style = next((v for pattern, v in rules if pattern.fullmatch(module)), "")
        if style.startswith(_CUTS_WEIGHT):
            return leaf != "bias"
        return style.startswith(_CUTS_ALL)

    return cut


def per_device(
    counts: Any, grads: int, state: int, base: str, layerwise: bool, opts: Any, notes: list[str], in_flight: Any
) -> tuple[int, int, int, dict[str, int]]:
    """
    Step 3 of `estimate()` (its `_Counts` and `_Options`): DDP (standard: persistent buckets; layer-wise: the
    buckets in flight), or FSDP2's division (HSDP: over one replica's devices; tensor parallel: what it cuts over all
    of them, the rest over the FSDP2 shards). Returns `(gradient_bytes, total_bytes, per_gpu_bytes, per_gpu_split)`.
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
    split = dict(weights=counts.weight_bytes, gradients=grads, optimizer_state=state)
    if opts.sharding != "fsdp2":
        return grads, total, total, split
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
    if opts.tp > 1:
        _tp_notes(base, layerwise, opts, notes)
        whole = _tp_whole(counts, grads, state)
        split = {
            k: -(-(v - whole[k]) // opts.shards) + -(-whole[k] * opts.tp // opts.shards) for k, v in split.items()
        }
        return grads, total, sum(split.values()), split
    split = {k: -(-v // opts.shards) for k, v in split.items()}
    return grads, total, -(-total // opts.shards), split


def _tp_whole(counts: Any, grads: int, state: int) -> dict[str, int]:
    """What tensor parallel leaves whole of each term: its share of the counted tensors (the state scaled when
    offload moved some of it to the host; a layer-wise gradient term, one unit's, taken as cut throughout)."""
    whole = counts.tp_whole
    return dict(
        weights=whole["weights"],
        gradients=whole["gradients"] if grads == counts.all_grads else 0,
        optimizer_state=round(whole["optimizer_state"] * state / counts.state) if counts.state else 0,
    )


def _tp_notes(base: str, layerwise: bool, opts: Any, notes: list[str]) -> None:
    from .mesh import layout_words

    notes.append(
        f"{layout_words(opts.world_size, opts.dp_replicate, opts.tp)}: what the model's tensor-parallel plan cuts "
        f"(for Llama the projections, the embedding and lm_head) is divided over {opts.shards} devices, the rest "
        f"(norms) over {opts.shards // opts.tp}; activations are cut too (not included)."
    )
    if layerwise and base in FSDP2_LOCAL_SHARD:
        notes.append(
            f"{base}{SUFFIX} is refused under tensor parallel: the model is sharded at its load, not by Accelerate's "
            "FSDP config, and LayerwiseTrainer builds no local-shard optimizer for it."
        )


# ---- the estimate ----
