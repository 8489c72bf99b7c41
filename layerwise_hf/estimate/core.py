"""`estimate()`: weights, gradients and optimizer state of one training configuration, in three steps. Counting walks
the tensors once (what each holds and trains); the gradient term decides how many gradients are alive at once; the
sharding step applies DDP (standard: its persistent buckets; layer-wise: the buckets in flight) or FSDP2's division."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import units
from .buckets import assign_buckets, bucket_size_limits, ddp_in_flight_bound, held_step_bound
from .models import ModelSpec, ModuleSpec, TensorSpec, load_model_spec
from .offload import apply_offload
from .optimizers import OPTIMIZER_RULES, OptimizerRule, parse_optimizer, tensor_state_bytes, uses_qmaps
from .sharding import check_replicas, check_tensor_parallel, per_device, tp_sharded
from .units import DEFAULT_LORA_TARGETS, DTYPE_BYTES, SHARDINGS, EstimateError, blocks, format_bytes, normalize_dtype


@dataclass
class MemoryEstimate:
    """
    Memory of one training configuration. Byte fields are exact integers; the components are for one full replica
    of the model (unsharded) and `per_gpu_bytes` is what one device holds.

    Args:
        model (`str`):
            The model's name.
        optimizer (`str`):
            As asked (`"adamw_torch_layerwise"`); `base_optimizer` is without the suffix.
        layerwise (`bool`):
            One optimizer per parameter, stepped in backward (gradients freed as they are used).
        dtype (`str`):
            The trainable weights' dtype (gradients share it).
        num_parameters, num_trainable_parameters (`int`):
            With LoRA, the parameters include the adapters.
        largest_parameter (`str`), largest_parameter_bytes (`int`):
            The largest trainable tensor: the layer-wise gradient term on one process (two of it for a tied
            embedding; the largest FSDP2 unit under FSDP2).
        weight_bytes, gradient_bytes, optimizer_state_bytes (`int`):
            The three terms. Under DDP `gradient_bytes` includes the standard reducer's bucket buffers, or, layer-wise,
            the gradient buckets in flight (`ddp_in_flight_bytes`). With `offload`: what stays on the device.
        total_bytes (`int`):
            Their sum.
        per_gpu_bytes (`int`):
            What each of `world_size` devices holds: `total_bytes`, or its share under FSDP2.
        all_gradient_bytes (`int`):
            Every trainable gradient at once (what the standard optimizer holds at its step), for comparison.
        notes (`list[str]`):
            What the figures assume or leave out for this configuration.
        bucket_cap_mb (`float`, *optional*):
            DDP's `bucket_cap_mb` (`None`: DDP's default, 25 MiB after a first bucket of 1 MiB).
        ddp_in_flight_bytes (`int`, *optional*):
            Layer-wise under DDP with no gradient accumulation: the most gradient bytes the data-parallel route holds
            at once (see `ddp_in_flight_bound`); `None` otherwise.
        offload (`str`), host_bytes (`int`): `layerwise_offload` and what one device's process holds in host memory.
        dp_replicate (`int`): HSDP's replicas under FSDP2 (1: plain FSDP2); each device holds 1 / (`world_size` /
            `dp_replicate`).
        tp (`int`): tensor parallel under FSDP2: what the model's tensor-parallel plan shards is cut in `world_size /
            dp_replicate` pieces, the rest (norms) in `world_size / (dp_replicate x tp)`.
        per_gpu_split (`dict[str, int]`): `per_gpu_bytes` as weights, gradients and optimizer_state.

    Example:

    ```python
    >>> from layerwise_hf.estimate import estimate
    >>> est = estimate("llama-2-7b", optimizer="adamw_torch_layerwise", dtype="bf16")
    >>> est.gradient_bytes == est.largest_parameter_bytes, est.to_dict()["largest_parameter"]
    (True, 'model.embed_tokens.weight')
    ```
    """

    model: str
    optimizer: str
    base_optimizer: str
    layerwise: bool
    dtype: str
    world_size: int
    sharding: str
    gradient_accumulation_steps: int
    num_parameters: int
    num_trainable_parameters: int
    largest_parameter: str
    largest_parameter_bytes: int
    weight_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    total_bytes: int
    per_gpu_bytes: int
    all_gradient_bytes: int
    notes: list[str] = field(default_factory=list)
    bucket_cap_mb: float | None = None
    ddp_in_flight_bytes: int | None = None
    offload: str = "none"
    host_bytes: int = 0
    dp_replicate: int = 1
    tp: int = 1
    per_gpu_split: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---- what trains, and how it is stored ----

# One row of the count: (tensor, bytes per element or None for "frozen_dtype decides", trainable, fraction trained).
Entry = tuple[TensorSpec, int | None, bool, float]


def _lora_tensors(spec: ModelSpec, rank: int, targets: Sequence[str]) -> list[TensorSpec]:
    linear = spec.linear_shapes()
    weights = {t.module: t for t in spec.parameters if t.module in linear and t.name.endswith(".weight")}
    if "all-linear" in targets:
        targets = units.LINEAR_MODULES
    unknown = sorted(set(targets) - set(weights))
    if unknown:
        raise EstimateError(
            f"Unknown LoRA target module(s) {', '.join(unknown)}; "
            f"choose from {', '.join(units.LINEAR_MODULES)} or all-linear."
        )
    out = []
    for module in units.LINEAR_MODULES:
        if module in targets and module in weights:
            weight = weights[module]
            fan_out, fan_in = weight.shape
            prefix, count = weight.name.removesuffix(".weight"), weight.count
            out.append(TensorSpec(f"{prefix}.lora_A.weight", (rank, fan_in), count, "lora_A", trainable=True))
            out.append(TensorSpec(f"{prefix}.lora_B.weight", (fan_out, rank), count, "lora_B", trainable=True))
    return out


def _frozen_bytes(tensor: TensorSpec, frozen_dtype: str, dtype: str) -> int:
    quantizable = tensor.module in units.LINEAR_MODULES and len(tensor.shape) == 2
    if frozen_dtype == "int8" and quantizable:
        return tensor.numel + 4 * tensor.shape[0]  # LLM.int8(): one float32 scale per output row
    if frozen_dtype == "nf4" and quantizable:
        return tensor.numel // 2 + 4 * blocks(tensor.numel, units.NF4_BLOCKSIZE)
    if frozen_dtype in DTYPE_BYTES:
        return tensor.numel * DTYPE_BYTES[frozen_dtype]
    return tensor.numel * DTYPE_BYTES[dtype]


def _dominant_dtype(tensors: Sequence[TensorSpec]) -> str | None:
    sizes: dict[str, int] = {}
    for t in tensors:
        if t.trainable and t.dtype:
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel * t.count
    return max(sizes, key=sizes.get) if sizes else None


def _entries(spec: ModelSpec | ModuleSpec, opts: _Options, notes: list[str]) -> tuple[list[Entry], str]:
    """Each tensor with its storage and whether it trains; also the trainable weights' dtype."""
    if isinstance(spec, ModuleSpec):
        if opts.lora_rank is not None or opts.trainable_fraction is not None:
            raise EstimateError("A real model's requires_grad decides what trains; apply LoRA to it (peft) instead.")
        entries = [(t, t.element_size or DTYPE_BYTES[opts.dtype], bool(t.trainable), 1.0) for t in spec.tensors()]
        return entries, _dominant_dtype(spec.tensors()) or opts.dtype
    tensors = spec.tensors()
    if opts.lora_rank is not None:
        adapters = _lora_tensors(spec, opts.lora_rank, opts.lora_target_modules)
        entries = [(t, None, False, 1.0) for t in tensors]
        return entries + [(t, DTYPE_BYTES[opts.adapter_dtype], True, 1.0) for t in adapters], opts.dtype
    fraction = 1.0 if opts.trainable_fraction is None else float(opts.trainable_fraction)
    if fraction < 1:
        notes.append(f"{fraction:g} of every tensor trains: an approximation of freezing whole layers.")
    return [(t, DTYPE_BYTES[opts.dtype], True, fraction) for t in tensors], opts.dtype


_LAYER_NAME = re.compile(r"^(?P<stack>(?:.*\.)?layers)\.(?P<index>\d+)\.(?P<rest>.+)$")

# ---- step 1: counting ----


_FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm", "ln_f")


def _fsdp2_unit(tensor: TensorSpec) -> str:
    # accelerate's FSDP2 wrapping (`fsdp2_prepare_model`, accelerate 1.15): each decoder layer (`_no_split_modules`)
    # is a unit, an untied input embedding is one, the final norm with the lm_head (and a tied embedding) is the
    # "tail", and what is left is the root.
    match = re.search(r"(^|\.)layers\.(\d+|\*)\.", tensor.name)
    if match:
        return match.group(0)
    if tensor.tied or tensor.module == "lm_head" or tensor.module in _FINAL_NORMS:
        return "tail"
    return "embed" if tensor.is_embedding else "root"


@dataclass
class _Counts:
    """What one pass over the tensors adds up; every byte figure is for one unsharded replica."""

    weight_bytes: int = 0
    all_grads: int = 0
    state: int = 0
    qmap_users: int = 0
    bnb_fp32_tensors: int = 0
    trainable_params: int = 0
    total_params: int = 0
    largest: tuple[int, str] = (0, "")
    largest_untied: int = 0
    tied: tuple[int, str] = (0, "")
    # Trainable gradient bytes (and all weight bytes) per FSDP2 unit (`_fsdp2_unit`).
    unit_grads: dict[str, int] = field(default_factory=dict)
    unit_weights: dict[str, int] = field(default_factory=dict)
    # What tensor parallel leaves whole on each of its ranks (`sharding.tp_sharded`): weights, gradients, state.
    tp_whole: dict[str, int] = field(default_factory=lambda: dict(weights=0, gradients=0, optimizer_state=0))

    def add_frozen(self, tensor: TensorSpec, stored: int, unit: str, per_unit: int) -> None:
        self.weight_bytes += tensor.count * stored
        self.unit_weights[unit] = self.unit_weights.get(unit, 0) + per_unit * stored

    def add_trainable(self, tensor: TensorSpec, elem_bytes: int, fraction: float, rule: OptimizerRule, unit: str):
        count, grad = tensor.count, tensor.numel * elem_bytes
        per_unit = 1 if "*" in unit else count  # a `*` tensor is one per layer, so once in each layer's unit
        self.weight_bytes += count * grad
        self.unit_weights[unit] = self.unit_weights.get(unit, 0) + per_unit * grad
        self.unit_grads[unit] = self.unit_grads.get(unit, 0) + round(per_unit * grad * fraction)
        self.trainable_params += round(tensor.numel * count * fraction)
        self.all_grads += round(count * grad * fraction)
        self.state += round(count * tensor_state_bytes(rule, tensor, elem_bytes, tensor.is_embedding) * fraction)
        if uses_qmaps(rule, tensor, tensor.is_embedding):
            self.qmap_users += count
        elif rule.family == "bnb" and rule.bits == 8:
            self.bnb_fp32_tensors += count
        self.largest = max(self.largest, (grad, tensor.name), key=lambda x: x[0])
        if tensor.tied:
            self.tied = max(self.tied, (grad, tensor.name), key=lambda x: x[0])
        else:
            self.largest_untied = max(self.largest_untied, grad)


def _count(entries: Sequence[Entry], rule: OptimizerRule, opts: _Options, tp_sharded=None) -> _Counts:
    """
    Step 1: weights, every gradient and the optimizer state, summed over `entries` (from `_entries`); with
    `tp_sharded` (a predicate on a tensor), what tensor parallel leaves whole apart.

    """
    counts = _Counts()
    for tensor, elem_bytes, trainable, fraction in entries:
        before = (counts.weight_bytes, counts.all_grads, counts.state)
        counts.total_params += tensor.numel * tensor.count
        unit = _fsdp2_unit(tensor)
        if trainable:
            counts.add_trainable(tensor, elem_bytes, fraction, rule, unit)
        else:
            # A real model's frozen tensors are counted as stored; a config's follow frozen_dtype.
            stored = tensor.numel * elem_bytes if elem_bytes else _frozen_bytes(tensor, opts.frozen_dtype, opts.dtype)
            counts.add_frozen(tensor, stored, unit, 1 if "*" in unit else tensor.count)
        if tp_sharded is not None and not tp_sharded(tensor):
            after = (counts.weight_bytes, counts.all_grads, counts.state)
            for key, a, b in zip(counts.tp_whole, before, after):
                counts.tp_whole[key] += b - a
    return counts


def _state_notes(counts: _Counts, rule: OptimizerRule, layerwise: bool, notes: list[str]) -> int:
    """The optimizer-state term: per-tensor state plus bitsandbytes' quantization maps."""
    state = counts.state
    if counts.qmap_users:
        # Each layer-wise inner optimizer builds its own maps; one standard optimizer shares one set.
        state += rule.qmaps * units.BNB_QMAP_BYTES * (counts.qmap_users if layerwise else 1)
    if counts.bnb_fp32_tensors:
        notes.append(
            f"{rule.name}: {counts.bnb_fp32_tensors} tensor(s) keep 32-bit state (embeddings, and tensors under "
            f"{units.BNB_MIN_8BIT_SIZE} elements)."
        )
    if not rule.exact:
        notes.append(f"{rule.name}: its state size follows the package's source, not checked against the optimizer.")
    return state


# ---- step 2: the gradient term ----


def _gradient_term(
    counts: _Counts, layerwise: bool, opts: _Options, notes: list[str], entries: Sequence[Entry], use_order=()
) -> int:
    """
    Step 2: the gradient bytes alive at once on one unsharded replica (before DDP's buckets).

    The standard optimizer holds every gradient at its step; a layer-wise one the largest tensor, unless gradient
    accumulation keeps them all, a tied embedding holds its lm_head half through backward, FSDP2 delivers a whole
    unit at once, or, on one process without exact clipping, the route holds a large tensor's step (`_held_step`).

    """
    all_grads, (largest_bytes, _), tied = counts.all_grads, counts.largest, counts.tied
    if not layerwise:
        grads = all_grads
    elif opts.gradient_accumulation_steps > 1:
        grads = all_grads
        notes.append("Gradient accumulation > 1: the layer-wise optimizer holds every gradient during the window.")
    elif tied[0]:
        # The lm_head half of a tied weight's gradient waits in autograd's input buffer through the whole backward,
        # until the embedding's backward adds its half: it is alive next to every other gradient, then next to that
        # second half.
        grads = min(all_grads, tied[0] + max(tied[0], counts.largest_untied))
        notes.append(
            f"Tied embeddings: the lm_head part of {tied[1]}'s gradient is held through the whole backward, so the "
            "layer-wise gradient term is that tensor plus the larger of itself and the largest other tensor."
        )
    else:
        grads = min(all_grads, largest_bytes)
        if opts.sharding == "none":
            grads = _held_step(entries, use_order, grads, notes)
    if opts.sharding == "fsdp2" and layerwise and opts.gradient_accumulation_steps == 1:
        # FSDP2 reduce-scatters a unit's gradients together and calls the hooks on the local shards afterwards, so the
        # shards of a whole unit are alive at once (before being divided across devices below).
        grads = max(grads, max(counts.unit_grads.values(), default=0))
        notes.append(
            "FSDP2 layer-wise: a unit's gradient shards arrive together from one reduce-scatter, so the gradient "
            "term is the largest unit (a decoder layer, the input embedding, or the final norm with lm_head)."
        )
    return grads


def _held_step(entries: Sequence[Entry], use_order: Sequence[str], grads: int, notes: list[str]) -> int:
    # One process, each gradient stepped in its hook (after the norm pass when exact clipping or fp16 measure first):
    # the route holds the step of a large gradient followed by smaller ones (an untied lm_head) until right before
    # the next large one is computed.
    sizes, _ = _ready_order(entries, use_order)
    bound, held = held_step_bound(sizes)
    if not held:
        return grads
    notes.append(
        f"One process: the step of a large gradient followed by smaller ones (an untied lm_head) is held until "
        f"right before the next large one is computed, so its step temporaries meet few activations; the gradient "
        f"term is that held gradient next to the largest of the smaller ones ({format_bytes(held)} + "
        f"{format_bytes(bound - held)})."
    )
    return max(grads, bound)


# ---- step 3: sharding ----


def _ready_order(entries: Sequence[Entry], use_order: Sequence[str] = ()) -> tuple[list[int], list[object]]:
    """
    Each trainable gradient's bytes (per-layer entries expanded, layer by layer) and its bucket key (dtype), in the
    order the data-parallel route buckets them after the first step: the reverse of the order forward first uses the
    parameters (`ModelSpec.use_order`). Without that order (a real model, LoRA adapters), the reverse of
    `named_parameters()` order, the route's order for the first step.

    """
    rows = [(t, elem, fraction) for t, elem, trainable, fraction in entries if trainable]
    by_name = {t.name: (t, elem, fraction) for t, elem, fraction in rows}

    def size(row) -> int:
        t, elem, fraction = row
        return round(t.numel * elem * fraction)

    if use_order:
        picked = []
        for name in use_order:
            match = _LAYER_NAME.match(name)
            row = by_name.get(name) or (by_name.get(f"{match['stack']}.*.{match['rest']}") if match else None)
            if row is not None:
                picked.append(row)
        if len(picked) == sum(t.count for t, _, _ in rows):  # every trainable tensor was used
            return [size(r) for r in picked][::-1], [r[0].dtype or r[1] for r in picked][::-1]
    sizes: list[int] = []
    keys: list[object] = []
    i = 0
    while i < len(rows):
        t = rows[i][0]
        j = i + 1
        if "*" in t.name:
            # A run of per-layer entries is one decoder layer, repeated `count` times.
            while j < len(rows) and "*" in rows[j][0].name and rows[j][0].count == t.count:
                j += 1
        for _ in range(t.count):
            sizes += [size(r) for r in rows[i:j]]
            keys += [r[0].dtype or r[1] for r in rows[i:j]]
        i = j
    return sizes[::-1], keys[::-1]


def _ddp_in_flight(
    entries: Sequence[Entry], spec_use_order: Sequence[str], counts: _Counts, opts: _Options, notes: list[str]
) -> int:
    """The layer-wise data-parallel route's gradient term (no gradient accumulation): see `buckets`."""
    sizes, keys = _ready_order(entries, spec_use_order)
    buckets = assign_buckets(sizes, bucket_size_limits(opts.bucket_cap_mb), keys)
    bound, k, held = ddp_in_flight_bound(buckets)
    cap = "25 MiB after a first bucket of 1 MiB" if opts.bucket_cap_mb is None else f"{opts.bucket_cap_mb:g} MiB"
    flying = bound - held - buckets[k].nbytes - buckets[k].copy_bytes
    where = " + ".join(format_bytes(x) for x in (held, flying, buckets[k].nbytes, buckets[k].copy_bytes) if x)
    notes.append(
        f"DDP layer-wise: no DDP wrapper and no persistent buckets; the route all-reduces gradients in buckets formed "
        f"in the order they become ready (bucket_cap_mb: {cap}; a tensor larger than the cap is a bucket of its own, "
        "reduced in place), one bucket reducing while the next fills, each stepped and freed; a large bucket followed "
        "by smaller ones (an untied lm_head) is held until they are reduced, so its step comes when few activations "
        "are left. The gradient term is the most alive at once: the held bucket, the one reducing, the one filling "
        f"and the gradient being copied into it ({where}, bucket {k + 1} of {len(buckets)}), instead of DDP's buckets "
        "of all gradients."
    )
    if counts.tied[0]:
        notes.append(
            f"Tied embeddings: the lm_head part of {counts.tied[1]}'s gradient is held through the whole backward, "
            "on top of the buckets in flight."
        )
        bound += counts.tied[0]
    return bound


@dataclass(frozen=True)
class _Options:
    """`estimate()`'s keyword arguments, normalized and checked."""

    dtype: str = "bfloat16"
    trainable_fraction: float | None = None
    lora_rank: int | None = None
    lora_target_modules: Sequence[str] = DEFAULT_LORA_TARGETS
    adapter_dtype: str = "float32"
    frozen_dtype: str = "bfloat16"
    gradient_accumulation_steps: int = 1
    world_size: int = 1
    sharding: str = "none"
    gradient_as_bucket_view: bool = False
    bucket_cap_mb: float | None = None
    offload: str = "none"
    dp_replicate: int = 1
    tp: int = 1

    @property
    def shards(self) -> int:
        return self.world_size // self.dp_replicate  # FSDP2's group: all devices, or one replica's (HSDP)

    @classmethod
    def check(cls, frozen_dtype: str | None = None, sharding: str | None = None, **kwargs: Any) -> _Options:
        kwargs["dtype"] = normalize_dtype(kwargs.get("dtype", cls.dtype))
        kwargs["adapter_dtype"] = normalize_dtype(kwargs.get("adapter_dtype", cls.adapter_dtype))
        frozen_dtype = kwargs["dtype"] if frozen_dtype is None else normalize_dtype(frozen_dtype, units.FROZEN_DTYPES)
        world_size = kwargs.get("world_size", 1)
        sharding = sharding or ("none" if world_size == 1 else "ddp")
        opts = cls(frozen_dtype=frozen_dtype, sharding=sharding, **kwargs)
        opts._validate()
        return opts

    def _validate(self) -> None:
        if self.sharding not in SHARDINGS:
            raise EstimateError(f"Unknown sharding {self.sharding!r}; choose one of {', '.join(SHARDINGS)}.")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise EstimateError(f"world_size={self.world_size}: the number of devices, a whole number >= 1.")
        if self.sharding == "none" and self.world_size != 1:
            raise EstimateError(
                f"world_size={self.world_size} with sharding='none': use ddp or fsdp2 for several devices."
            )
        check_replicas(self.world_size, self.sharding, self.dp_replicate)
        check_tensor_parallel(self.world_size, self.sharding, self.dp_replicate, self.tp)
        if self.gradient_accumulation_steps < 1:
            raise EstimateError("gradient_accumulation_steps must be at least 1.")
        if self.lora_rank is not None and self.trainable_fraction is not None:
            raise EstimateError("Give either lora_rank or trainable_fraction, not both.")
        if self.trainable_fraction is not None and not 0 < self.trainable_fraction <= 1:
            raise EstimateError(f"trainable_fraction must be in (0, 1], got {self.trainable_fraction}.")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise EstimateError(f"bucket_cap_mb must be positive, got {self.bucket_cap_mb}.")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise EstimateError(f"lora_rank must be positive, got {self.lora_rank}.")


def estimate(
    model: Any,
    *,
    optimizer: str = "adamw_torch_layerwise",
    dtype: str = "bfloat16",
    layerwise: bool | None = None,
    trainable_fraction: float | None = None,
    lora_rank: int | None = None,
    lora_target_modules: Sequence[str] = DEFAULT_LORA_TARGETS,
    adapter_dtype: str = "float32",
    frozen_dtype: str | None = None,
    gradient_accumulation_steps: int = 1,
    world_size: int = 1,
    sharding: str | None = None,
    gradient_as_bucket_view: bool = False,
    bucket_cap_mb: float | None = None,
    offload: str = "none",
    dp_replicate: int = 1,
    tp: int = 1,
) -> MemoryEstimate:
    """
    Estimate the weights, gradients and optimizer state of training `model`.

    Args:
        model (`str`, `os.PathLike`, `dict`, `PretrainedConfig`, `ModelSpec` or `nn.Module`):
            See `load_model_spec`. With a real model, each parameter's dtype and `requires_grad` are used as they are
            (a PEFT model estimates its adapters): `dtype` and `frozen_dtype` are ignored, LoRA and
            `trainable_fraction` are not allowed.
        optimizer (`str`, *optional*, defaults to `"adamw_torch_layerwise"`):
            A Trainer optimizer name (`OPTIMIZER_RULES`), or its `_layerwise` form.
        dtype (`str`, *optional*, defaults to `"bfloat16"`):
            The dtype the weights are stored in (`float32`/`bfloat16`/`float16`, or `fp32`/`bf16`/`fp16`).
            Trainer's `bf16=True` autocasts a float32 model: its weights, gradients and state stay float32.
        layerwise (`bool`, *optional*):
            Overrides what the `_layerwise` suffix of `optimizer` says.
        trainable_fraction (`float`, *optional*):
            Train this fraction of every tensor (an approximation of freezing some layers); the layer-wise gradient
            term stays the largest tensor, the worst case.
        lora_rank (`int`, *optional*):
            Train LoRA adapters of this rank on `lora_target_modules` and freeze the rest.
        lora_target_modules (`Sequence[str]`, *optional*, defaults to `("q_proj", "v_proj")`):
            Among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or `"all-linear"`.
        adapter_dtype (`str`, *optional*, defaults to `"float32"`):
            PEFT keeps adapters in float32 on a 16-bit base (`autocast_adapter_dtype=True`).
        frozen_dtype (`str`, *optional*):
            Storage of frozen weights, defaults to `dtype`; `"int8"` or `"nf4"` quantize the decoder's linear weights
            (QLoRA-style; no double quantization).
        gradient_accumulation_steps (`int`, *optional*, defaults to `1`):
            Above 1, a layer-wise optimizer holds every gradient during the window, like the standard one.
        world_size (`int`, *optional*, defaults to `1`):
            Number of devices.
        sharding (`str`, *optional*):
            `"none"` (one device), `"ddp"` or `"fsdp2"`; defaults to `"none"` for one device, `"ddp"` otherwise.
            See `layerwise_hf.estimate.buckets` for the DDP gradient terms.
        gradient_as_bucket_view (`bool`, *optional*, defaults to `False`):
            Standard DDP's option making `.grad` a view of its buckets (one copy of the gradients instead of two).
        bucket_cap_mb (`float`, *optional*):
            DDP's `bucket_cap_mb` (Trainer's `ddp_bucket_cap_mb`): the layer-wise route's bucket size under DDP.
            `None`: DDP's default, 25 MiB after a first bucket of 1 MiB.
        offload (`str`, *optional*, defaults to `"none"`): `layerwise_offload`, see `layerwise_hf.estimate.offload`.
        dp_replicate, tp (`int`, *optional*, defaults to `1`):
            Under `"fsdp2"`: HSDP's replicas (`ParallelismConfig(dp_replicate_size, dp_shard_size)`: each device holds
            its replica's share) and tensor parallel (`DistributedConfig(tp_size=tp, ...)`: what the model's
            tensor-parallel plan shards is divided by `tp` too, the rest only by the FSDP2 shards).

    Example:

    ```python
    >>> from layerwise_hf.estimate import estimate, format_bytes
    >>> est = estimate("llama-3-8b", optimizer="adamw_8bit_layerwise", dtype="bf16")
    >>> format_bytes(est.total_bytes), format_bytes(est.gradient_bytes)
    ('34.05 GiB', '1002.00 MiB')
    ```
    """
    spec = load_model_spec(model)
    base, suffix_layerwise = parse_optimizer(optimizer)
    # Every keyword argument but the model and the optimizer is an option, checked by _Options under its name.
    opts = _Options.check(**{k: v for k, v in locals().items() if k in _Options.__dataclass_fields__})
    return _steps(spec, OPTIMIZER_RULES[base], suffix_layerwise if layerwise is None else bool(layerwise), opts)


def _steps(spec: ModelSpec | ModuleSpec, rule: OptimizerRule, layerwise: bool, opts: _Options) -> MemoryEstimate:
    """`estimate()` once its options are checked: what trains, counting, the gradient term, sharding."""
    notes: list[str] = []
    entries, weight_dtype = _entries(spec, opts, notes)
    counts = _count(entries, rule, opts, tp_sharded(spec, opts.tp) if opts.tp > 1 else None)
    if counts.trainable_params == 0:
        raise EstimateError(f"{spec.name}: nothing is trainable.")
    state = _state_notes(counts, rule, layerwise, notes)
    grads = _gradient_term(counts, layerwise, opts, notes, entries, getattr(spec, "use_order", ()))
    grads, state, host = apply_offload(opts, layerwise, entries, grads, state, notes)
    in_flight = None
    if opts.sharding == "ddp" and layerwise and opts.gradient_accumulation_steps == 1:
        in_flight = _ddp_in_flight(entries, getattr(spec, "use_order", ()), counts, opts, notes)
    grads, total, per_gpu, split = per_device(counts, grads, state, rule.name, layerwise, opts, notes, in_flight)
    notes.append("Not included: activations, autocast copies, temporary buffers, CUDA context.")
    return MemoryEstimate(
        model=spec.name,
        optimizer=f"{rule.name}_layerwise" if layerwise else rule.name,
        base_optimizer=rule.name,
        layerwise=layerwise,
        dtype=weight_dtype,
        world_size=opts.world_size,
        sharding=opts.sharding,
        gradient_accumulation_steps=opts.gradient_accumulation_steps,
        num_parameters=counts.total_params,
        num_trainable_parameters=counts.trainable_params,
        largest_parameter=counts.largest[1],
        largest_parameter_bytes=counts.largest[0],
        weight_bytes=counts.weight_bytes,
        gradient_bytes=grads,
        optimizer_state_bytes=state,
        total_bytes=total,
        per_gpu_bytes=per_gpu,
        per_gpu_split=split,
        all_gradient_bytes=counts.all_grads,
        notes=notes,
        bucket_cap_mb=opts.bucket_cap_mb if opts.sharding == "ddp" else None,
        ddp_in_flight_bytes=in_flight,
        offload=opts.offload,
        host_bytes=host,
        dp_replicate=opts.dp_replicate,
        tp=opts.tp,
    )
