"""What the layer-wise path supports, and why not the rest: the one table every refusal is decided from.

Each refusal has one message, written here. Argument validation (`LayerwiseTrainingArguments`), the Trainer
integration, the optimizer, the FSDP2 route and the memory estimator all ask this module, so a decision cannot be
made twice in two ways.

Example:

```python
>>> from layerwise_hf.bases import support
>>> support.fsdp2_supports_base("adamw_torch"), support.fsdp2_supports_base("adafactor")
(True, False)
```
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any

from .params import canonical_name

SUFFIX = "_layerwise"

# Trainer bases whose math is not one independent update per tensor: splitting them per parameter would change
# results.
REFUSED_BASES: dict[str, str] = {
    "lomo": "LOMO fuses the update into backward over the whole model; it is already layer-wise",
    "adalomo": "AdaLomo fuses the update into backward over the whole model; it is already layer-wise",
    "schedule_free_adamw": "schedule-free optimizers swap weights in optimizer.train()/eval() for the whole model",
    "schedule_free_radam": "schedule-free optimizers swap weights in optimizer.train()/eval() for the whole model",
    "schedule_free_sgd": "schedule-free optimizers swap weights in optimizer.train()/eval() for the whole model",
    "grokadamw": (
        "GrokAdamW scales each parameter's momentum by the parameter's position in its param group "
        "(beta1 * (1 - gamma) ** i over the parameters that have a gradient), so one optimizer per parameter would "
        "give every parameter i = 0 and train another model; and it keeps its state in param_groups[k]['state'] "
        "instead of optimizer.state, so a checkpoint would hold none of it. Use grokadamw (standard) for GrokAdamW's "
        "results, or adamw_torch_layerwise for a layer-wise AdamW"
    ),
}

# Low-rank projection optimizers (GaLore, APOLLO): base -> (module, class name, pip package). The model chooses which
# tensors are projected, so their factory is built from the model (layerwise_hf.bases.galore); each tensor's update
# still only reads its own gradient.
LOW_RANK_BASES: dict[str, tuple[str, str, str]] = {
    "galore_adamw": ("galore_torch", "GaLoreAdamW", "galore-torch"),
    "galore_adamw_8bit": ("galore_torch", "GaLoreAdamW8bit", "galore-torch"),
    "galore_adafactor": ("galore_torch", "GaLoreAdafactor", "galore-torch"),
    "apollo_adamw": ("apollo_torch", "APOLLOAdamW", "apollo-torch"),
}

# Served bases that this project cannot run, so their parity with the standard optimizer is not tested.
NOT_INSTALLABLE_BASES: dict[str, str] = {
    "adamw_anyprecision": "torchdistx publishes no wheel (pip finds no version)",
    "adamw_torch_npu_fused": "torch_npu needs an Ascend NPU, and pip would replace torch with its own build",
    "adamw_torch_xla": "torch_xla needs an XLA device, and its wheels are built for another torch",
}
BIT_EXACT = "bit-exact (tested)"
# GaLore / APOLLO apply Trainer's decay / no-decay split; stock Trainer gives the standard forms no weight decay
# (the class default applies).
LOW_RANK_STATUS: dict[str, str] = {
    "galore_adamw": f"{BIT_EXACT} at weight_decay=0; with weight decay, Trainer's split is applied",
    "galore_adafactor": f"{BIT_EXACT} at weight_decay=0; with weight decay, Trainer's split is applied",
    "apollo_adamw": f"{BIT_EXACT} at weight_decay=0 (each projector gets the whole-model optimizer's seed); with "
    "weight decay, Trainer's split is applied",
    "galore_adamw_8bit": f"{BIT_EXACT} against GaLoreAdamW8bit with Trainer's weight-decay split; stock Trainer "
    "applies the class default weight_decay=0.01 to every parameter whatever weight_decay says",
}

# Bases whose update of an element depends only on that element's gradient and state, so stepping the local FSDP2
# shard equals stepping the whole tensor: base -> the optimizer class Trainer builds for it. Adafactor (factored
# row/column moments) and bitsandbytes' blockwise 8-bit state are not in it.
FSDP2_ELEMENTWISE: dict[str, str] = {
    "adamw_torch": "torch.optim.adamw.AdamW",
    "adamw_torch_fused": "torch.optim.adamw.AdamW",
    "sgd": "torch.optim.sgd.SGD",
    "adagrad": "torch.optim.adagrad.Adagrad",
    "rmsprop": "torch.optim.rmsprop.RMSprop",
}
# Bases whose optimizer cannot step a DTensor (bitsandbytes' kernels take plain tensors; transformers' Adafactor mixes
# DTensors with plain tensors): under FSDP2 they step each rank's local shard
# (`layerwise_hf.placement.local_shard`), the optimizer applied to the shard. 8-bit blocks and Adafactor's factored
# moments are the shard's, not the tensor's.
FSDP2_LOCAL_SHARD: frozenset[str] = frozenset(
    {
        "adafactor",
        "adamw_bnb_8bit",
        "adamw_8bit",
        "ademamix",
        "ademamix_8bit",
        "paged_adamw_8bit",
        "paged_adamw_32bit",
        "paged_ademamix_8bit",
        "paged_ademamix_32bit",
        "lion_8bit",
        "lion_32bit",
        "paged_lion_8bit",
        "paged_lion_32bit",
        "rmsprop_bnb",
        "rmsprop_bnb_8bit",
        "rmsprop_bnb_32bit",
    }
)
# torchao's 8-bit AdamW steps a DTensor itself (its states are DTensors laid out like the parameter, quantized per
# local shard), so the layer-wise step of a shard is standard FSDP2's step of it. Not AdamW4bit: standard FSDP2 with
# it fails inside torchao (torchao 0.18, torch 2.13, CPU), so there is no reference to be equal to.
FSDP2_DTENSOR_NATIVE: dict[str, str] = {"adamw_torch_8bit": "torchao.optim.adam.AdamW8bit"}
# torch.optim.Adam is elementwise too; third-party registrations may build it.
_FSDP2_CLASSES = frozenset(
    {
        *FSDP2_ELEMENTWISE.values(),
        *FSDP2_DTENSOR_NATIVE.values(),
        "torch.optim.adam.Adam",
        "layerwise_hf.placement.local_shard.LocalShardOptimizer",
    }
)

ONE_PASS_CLIP_MODES = ("previous", "per_param")


def qualname(obj_or_cls: Any) -> str:
    """
    `module.QualName` of a class or of an object's class.

    Args:
        obj_or_cls (`Any`):
            A class, or an object whose class is named.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.bases.support import qualname
    >>> qualname(torch.optim.AdamW), qualname(torch.nn.Linear(2, 2))
    ('torch.optim.adamw.AdamW', 'torch.nn.modules.linear.Linear')
    ```
    """
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    return f"{cls.__module__}.{cls.__qualname__}"


def base_status(base: str) -> str:
    """
    How `<base>_layerwise` compares with the standard `base` (the README's optimizer table says it per row):
    `BIT_EXACT` for every base this project's parity tests run, `"refused: <why>"` or
    `"not installable here: <why>"`.

    Args:
        base (`str`):
            The Trainer `optim` name without `_layerwise`.

    Example:

    ```python
    >>> from layerwise_hf.bases.support import base_status
    >>> base_status("adamw_torch")
    'bit-exact (tested)'
    >>> base_status("lomo").startswith("refused: LOMO")
    True
    ```
    """
    if base in REFUSED_BASES:
        return f"refused: {REFUSED_BASES[base]}"
    if base in NOT_INSTALLABLE_BASES:
        return f"not installable here: {NOT_INSTALLABLE_BASES[base]}"
    return LOW_RANK_STATUS.get(base, BIT_EXACT)


def fsdp2_supports_base(base: str) -> bool:
    """
    Whether `<base>_layerwise` can step FSDP2 shards (read by the estimator).

    Args:
        base (`str`):
            The Trainer `optim` name without `_layerwise`.

    Example:

    ```python
    >>> from layerwise_hf.bases.support import fsdp2_supports_base
    >>> [base for base in ("sgd", "adafactor", "adamw_8bit") if fsdp2_supports_base(base)]
    ['sgd', 'adamw_8bit']
    ```
    """
    return base in FSDP2_ELEMENTWISE or base in FSDP2_DTENSOR_NATIVE or base in FSDP2_LOCAL_SHARD


def fsdp2_supports_optimizer(optimizer: Any) -> bool:
    """
    Whether this inner optimizer's update of a shard equals its update of the whole tensor.

    Args:
        optimizer (`torch.optim.Optimizer`):
            One parameter's inner optimizer (or its class).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.bases.support import fsdp2_supports_optimizer
    >>> fsdp2_supports_optimizer(torch.optim.Adam), fsdp2_supports_optimizer(torch.optim.Adafactor)
    (True, False)
    ```
    """
    return qualname(optimizer) in _FSDP2_CLASSES


# ---- the refusals, one message each ----


def refused_base_error(name: str, base: str, choices: Iterable[str]) -> ValueError:
    """
    The error for a layer-wise name whose base is in `REFUSED_BASES`.

    Args:
        name (`str`):
            The name asked for, e.g. `"lomo_layerwise"`.
        base (`str`):
            Its base, a key of `REFUSED_BASES`.
        choices (`Iterable[str]`):
            The layer-wise names to suggest instead.

    Example:

    ```python
    >>> from layerwise_hf.bases.support import refused_base_error
    >>> raise refused_base_error("lomo_layerwise", "lomo", ["adamw_torch_layerwise"])
    Traceback (most recent call last):
        ...
    ValueError: 'lomo_layerwise' is not supported: LOMO fuses the update into backward over the whole model; ...
    ```
    """
    return ValueError(f"{name!r} is not supported: {REFUSED_BASES[base]}. Per-tensor choices: {', '.join(choices)}.")


def not_per_tensor_error(name: str, base: str, choices: Iterable[str]) -> ValueError:
    """
    The error for a layer-wise name whose base Trainer builds from the whole model.

    Args:
        name (`str`):
            The name asked for.
        base (`str`):
            Its base.
        choices (`Iterable[str]`):
            The layer-wise names to suggest instead.

    Example:

    ```python
    >>> from layerwise_hf.bases.support import not_per_tensor_error
    >>> print(not_per_tensor_error("x_layerwise", "x", ["sgd_layerwise"]))
    'x_layerwise': Trainer builds 'x' from the whole model, so it has no per-tensor form. Choose one of: sgd_layerwise.
    ```
    """
    return ValueError(
        f"{name!r}: Trainer builds {base!r} from the whole model, so it has no per-tensor form. "
        f"Choose one of: {', '.join(choices)}."
    )


def check_deepspeed(name: str, deepspeed_enabled: Any) -> None:
    """
    DeepSpeed owns the optimizer step: refuse a layer-wise name under it.

    Args:
        name (`str`):
            The layer-wise `optim` name.
        deepspeed_enabled (`Any`):
            Truthy when DeepSpeed runs (e.g. `accelerator.state.deepspeed_plugin`).

    Example:

    ```python
    >>> from layerwise_hf.bases.support import check_deepspeed
    >>> check_deepspeed("adamw_torch_layerwise", deepspeed_enabled=True)
    Traceback (most recent call last):
        ...
    ValueError: optim='adamw_torch_layerwise' cannot run under DeepSpeed, which owns the optimizer step. ...
    ```
    """
    if deepspeed_enabled:
        raise ValueError(
            f"optim={name!r} cannot run under DeepSpeed, which owns the optimizer step. Use the standard "
            f"optim={name.removesuffix(SUFFIX)!r} with DeepSpeed, or run layer-wise with DDP or FSDP2 "
            "(accelerate launch --config_file configs/accelerate/...)."
        )


def fsdp_version_of_args(args: Any) -> int:
    """The FSDP version `TrainingArguments` ask for (`fsdp` with `fsdp_config["version"]`, 2 by default); 2 without
    FSDP, so that only FSDP1 is refused."""
    if not getattr(args, "fsdp", None):
        return 2
    config = args.fsdp_config if isinstance(args.fsdp_config, dict) else {}
    return int(config.get("version", config.get("fsdp_version", 2)))


def check_fsdp_version(name: str, fsdp_version: int) -> None:
    """
    FSDP1 flattens parameters: there is no per-parameter gradient to step.

    Args:
        name (`str`):
            The layer-wise `optim` name.
        fsdp_version (`int`):
            The FSDP plugin's version; only `2` passes.

    Example:

    ```python
    >>> from layerwise_hf.bases.support import check_fsdp_version
    >>> check_fsdp_version("sgd_layerwise", 2)  # FSDP2: nothing to refuse
    >>> check_fsdp_version("sgd_layerwise", 1)
    Traceback (most recent call last):
        ...
    ValueError: optim='sgd_layerwise' needs FSDP2 (fsdp_version: 2) or DDP: FSDP1 flattens parameters, ...
    ```
    """
    if fsdp_version != 2:
        raise ValueError(
            f"optim={name!r} needs FSDP2 (fsdp_version: 2) or DDP: FSDP1 flattens parameters, so there is no "
            "per-parameter gradient to step. Set fsdp_config={'version': 2} / fsdp_version: 2."
        )


def check_bool_argument(argument: str, value: Any) -> bool:
    """
    A switch must be `True` or `False`: a string such as `"no"` or `"false"` is truthy and would turn it on.

    Args:
        argument (`str`):
            The argument's name, for the message.
        value (`Any`):
            What was given.

    Example:

    ```python
    >>> from layerwise_hf.bases.support import check_bool_argument
    >>> check_bool_argument("layerwise_accept_nonfinite_state", False)
    False
    >>> check_bool_argument("layerwise_accept_nonfinite_state", "no")
    Traceback (most recent call last):
        ...
    ValueError: layerwise_accept_nonfinite_state='no' must be True or False (a bool), got str.
    ```
    """
    if not isinstance(value, bool):
        raise ValueError(f"{argument}={value!r} must be True or False (a bool), got {type(value).__name__}.")
    return value


def check_max_grad_norm(max_grad_norm: Any) -> float | None:
    """
    `max_grad_norm` must be a number (`<= 0` or `None`: no clipping); the layer-wise clippers compare and divide by it.

    Example:

    ```python
    >>> from layerwise_hf.bases.support import check_max_grad_norm
    >>> check_max_grad_norm(1.0), check_max_grad_norm(None)
    (1.0, None)
    >>> check_max_grad_norm("1.0")
    Traceback (most recent call last):
        ...
    ValueError: max_grad_norm='1.0' must be a number (a float; <= 0 or None: no clipping), got str.
    ```
    """
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, numbers.Real)):
        raise ValueError(
            f"max_grad_norm={max_grad_norm!r} must be a number (a float; <= 0 or None: no clipping), got "
            f"{type(max_grad_norm).__name__}."
        )
    return max_grad_norm


def check_fp16_clip_mode(clip_mode: str, fp16: bool, max_grad_norm: float | None) -> None:
    """
    One-pass clipping steps layers before later gradients are checked for inf/nan.

    Args:
        clip_mode (`str`):
            The `layerwise_clip` mode.
        fp16 (`bool`):
            Whether fp16 loss scaling is on.
        max_grad_norm (`float`, *optional*):
            Trainer's `max_grad_norm`; `None` or `<= 0` clips nothing, so any mode passes.

    Example:

    ```python
    >>> from layerwise_hf.bases.support import check_fp16_clip_mode
    >>> check_fp16_clip_mode("exact", fp16=True, max_grad_norm=1.0)  # a norm pass checks every gradient first
    >>> check_fp16_clip_mode("previous", fp16=True, max_grad_norm=1.0)
    Traceback (most recent call last):
        ...
    ValueError: fp16=True and layerwise_clip='previous' do not go together: ...
    ```
    """
    if fp16 and clip_mode in ONE_PASS_CLIP_MODES and max_grad_norm and max_grad_norm > 0:
        raise ValueError(
            f"fp16=True and layerwise_clip={clip_mode!r} do not go together: one-pass clipping cannot run with fp16 "
            "loss scaling, since it steps each layer during the single backward, before later gradients are checked "
            "for inf/nan, so an overflowing step would still change parameters. Use layerwise_clip='exact' (the "
            "default) or 'off' with fp16, or bf16=True with any mode."
        )


def check_fp16_weights(named_params: Iterable[tuple[str, Any]]) -> None:
    """
    GradScaler refuses to unscale fp16 gradients: trainable weights must be fp32 under fp16 loss scaling.

    Args:
        named_params (`Iterable[tuple[str, torch.Tensor]]`):
            The trainable parameters with their names.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.bases.support import check_fp16_weights
    >>> check_fp16_weights(torch.nn.Linear(2, 2).half().named_parameters())
    Traceback (most recent call last):
        ...
    ValueError: fp16 loss scaling needs fp32 trainable weights (...); 2 parameter(s) are float16, e.g. weight. ...
    ```
    """
    import torch

    fp16 = [n for n, p in named_params if p.dtype == torch.float16]
    if fp16:
        raise ValueError(
            f"fp16 loss scaling needs fp32 trainable weights (GradScaler refuses to unscale fp16 gradients); "
            f"{len(fp16)} parameter(s) are float16, e.g. {fp16[0]}. Load the model in float32 and let fp16=True "
            "autocast, or use bf16."
        )


def check_ddp_comm_hook(comm_hook: Any) -> None:
    """
    Refuse a DDP communication hook (Accelerate's `DistributedDataParallelKwargs(comm_hook=...)`: fp16/bf16
    compression, PowerSGD) under the DDP config: the layer-wise route reduces the gradients itself and would
    silently not apply it.

    Example:

    ```python
    >>> from layerwise_hf.bases.support import check_ddp_comm_hook
    >>> check_ddp_comm_hook("no")  # none configured: nothing to refuse
    ```
    """
    value = str(getattr(comm_hook, "value", comm_hook) or "no").lower()
    if value != "no":
        raise ValueError(
            f"DistributedDataParallelKwargs(comm_hook={value!r}) cannot apply to layer-wise optimizers under the DDP "
            "config: the model is not wrapped in DDP, and the layer-wise data-parallel route all-reduces each "
            "gradient in its own dtype. Remove the comm hook (the result then equals standard DDP without one), or "
            "use a standard optimizer to keep it."
        )


def check_no_new_trainable(names: Sequence[str], model: Any) -> list[str]:
    """
    A parameter made trainable since the layer-wise optimizer was built has no optimizer: refuse it, since it would
    silently never step (a standard optimizer never trains it either, without a word). A parameter frozen since is
    fine, as with a standard optimizer: it gets no gradient, so it is not stepped, and its optimizer state stays as
    it was.

    Args:
        names (`Sequence[str]`):
            The parameter names the optimizer was built for (`LayerwiseOptimizer.names`).
        model (`torch.nn.Module`):
            The model about to train.

    Returns the names frozen since the optimizer was built.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.bases.support import check_no_new_trainable
    >>> model = torch.nn.Linear(2, 2)
    >>> model.bias.requires_grad = False  # frozen after the optimizer was built: trains on without it
    >>> check_no_new_trainable(["weight", "bias"], model)
    ['bias']
    >>> check_no_new_trainable(["weight"], torch.nn.Linear(2, 2))  # bias made trainable since
    Traceback (most recent call last):
        ...
    ValueError: A parameter was made trainable since the layer-wise optimizer was built (trainable since: ['bias']) ...
    ```
    """
    trainable = {canonical_name(n) for n, p in model.named_parameters() if p.requires_grad}
    built = {canonical_name(n) for n in names}
    new = sorted(trainable - built)
    if new:
        raise ValueError(
            "A parameter was made trainable since the layer-wise optimizer was built "
            f"(trainable since: {new}): it has no optimizer, so it would never step (a standard optimizer would "
            "silently not train it either). Nothing was stepped. To train the new set, build a new optimizer and "
            "scheduler: set trainer.optimizer = None and trainer.lr_scheduler = None before train(), or create a new "
            "Trainer. (Freezing a parameter between train() calls needs none of this.)"
        )
    return sorted(built - trainable)


def check_fsdp2_optimizers(name: str | None, optimizers: Sequence[Any]) -> None:
    """
    Refuse inner optimizers whose update of a shard differs from the update of the whole tensor.

    Args:
        name (`str`, *optional*):
            The layer-wise `optim` name, for the message.
        optimizers (`Sequence[torch.optim.Optimizer]`):
            The inner optimizers, one per parameter.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.bases.support import check_fsdp2_optimizers
    >>> weight = torch.nn.Parameter(torch.zeros(2, 2))
    >>> check_fsdp2_optimizers("sgd_layerwise", [torch.optim.SGD([weight], lr=0.1)])  # elementwise: passes
    ```
    """
    bad = sorted({type(inner).__name__ for inner in optimizers if not fsdp2_supports_optimizer(inner)})
    if bad:
        good = ", ".join(f"{b}{SUFFIX}" for b in sorted(set(FSDP2_ELEMENTWISE) - {"adamw_torch_fused"}))
        raise ValueError(
            f"{name or '/'.join(bad)} ({', '.join(bad)}) cannot step FSDP2 shards: its update is not elementwise "
            f"(factored or blockwise state would be computed per shard). Under FSDP2 use {good}, or "
            "adamw_8bit_layerwise / adafactor_layerwise built for local shards (LayerwiseTrainer does; "
            "build_layerwise_optimizer(..., local_shards=True)), or run this optimizer under DDP / on one process."
        )
