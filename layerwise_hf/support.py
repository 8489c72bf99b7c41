"""What the layer-wise path supports, and why not the rest: the one table every refusal is decided from.

Each refusal has one message, written here. Argument validation (`LayerwiseTrainingArguments`), the Trainer
integration, the optimizer, the FSDP2 route and the memory estimator all ask this module, so a decision cannot be
made twice in two ways.

Example:

```python
>>> from layerwise_hf import support
>>> support.fsdp2_supports_base("adamw_torch"), support.fsdp2_supports_base("adafactor")
(True, False)
```
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

SUFFIX = "_layerwise"

# Trainer bases whose math is not one independent update per tensor: splitting them per parameter would change
# results.
REFUSED_BASES: dict[str, str] = {
    "lomo": "LOMO fuses the update into backward over the whole model; it is already layer-wise",
    "adalomo": "AdaLomo fuses the update into backward over the whole model; it is already layer-wise",
    "schedule_free_adamw": "schedule-free optimizers swap weights in optimizer.train()/eval() for the whole model",
    "schedule_free_radam": "schedule-free optimizers swap weights in optimizer.train()/eval() for the whole model",
    "schedule_free_sgd": "schedule-free optimizers swap weights in optimizer.train()/eval() for the whole model",
}

# Low-rank projection optimizers (GaLore, APOLLO): base -> (module, class name, pip package). The model chooses which
# tensors are projected, so their factory is built from the model (layerwise_hf.galore); each tensor's update still
# only reads its own gradient.
LOW_RANK_BASES: dict[str, tuple[str, str, str]] = {
    "galore_adamw": ("galore_torch", "GaLoreAdamW", "galore-torch"),
    "galore_adamw_8bit": ("galore_torch", "GaLoreAdamW8bit", "galore-torch"),
    "galore_adafactor": ("galore_torch", "GaLoreAdafactor", "galore-torch"),
    "apollo_adamw": ("apollo_torch", "APOLLOAdamW", "apollo-torch"),
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
# torch.optim.Adam is elementwise too; third-party registrations may build it.
_FSDP2_CLASSES = frozenset({*FSDP2_ELEMENTWISE.values(), "torch.optim.adam.Adam"})

ONE_PASS_CLIP_MODES = ("previous", "per_param")


def qualname(obj_or_cls: Any) -> str:
    """`module.QualName` of a class or of an object's class."""
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    return f"{cls.__module__}.{cls.__qualname__}"


def fsdp2_supports_base(base: str) -> bool:
    """Whether `<base>_layerwise` can step FSDP2 shards (read by the estimator)."""
    return base in FSDP2_ELEMENTWISE


def fsdp2_supports_optimizer(optimizer: Any) -> bool:
    """Whether this inner optimizer's update of a shard equals its update of the whole tensor."""
    return qualname(optimizer) in _FSDP2_CLASSES


# ---- the refusals, one message each ----


def refused_base_error(name: str, base: str, choices: Iterable[str]) -> ValueError:
    return ValueError(f"{name!r} is not supported: {REFUSED_BASES[base]}. Per-tensor choices: {', '.join(choices)}.")


def not_per_tensor_error(name: str, base: str, choices: Iterable[str]) -> ValueError:
    return ValueError(
        f"{name!r}: Trainer builds {base!r} from the whole model, so it has no per-tensor form. "
        f"Choose one of: {', '.join(choices)}."
    )


def check_deepspeed(name: str, deepspeed_enabled: Any) -> None:
    """DeepSpeed owns the optimizer step: refuse a layer-wise name under it."""
    if deepspeed_enabled:
        raise ValueError(
            f"optim={name!r} cannot run under DeepSpeed, which owns the optimizer step. Use the standard "
            f"optim={name.removesuffix(SUFFIX)!r} with DeepSpeed, or run layer-wise with DDP or FSDP2 "
            "(accelerate launch --config_file configs/accelerate/...)."
        )


def check_fsdp_version(name: str, fsdp_version: int) -> None:
    """FSDP1 flattens parameters: there is no per-parameter gradient to step."""
    if fsdp_version != 2:
        raise ValueError(
            f"optim={name!r} needs FSDP2 (fsdp_version: 2) or DDP: FSDP1 flattens parameters, so there is no "
            "per-parameter gradient to step. Set fsdp_config={'version': 2} / fsdp_version: 2."
        )


def check_fp16_clip_mode(clip_mode: str, fp16: bool, max_grad_norm: float | None) -> None:
    """One-pass clipping steps layers before later gradients are checked for inf/nan."""
    if fp16 and clip_mode in ONE_PASS_CLIP_MODES and max_grad_norm and max_grad_norm > 0:
        raise ValueError(
            f"fp16=True and layerwise_clip={clip_mode!r} do not go together: one-pass clipping cannot run with fp16 "
            "loss scaling, since it steps each layer during the single backward, before later gradients are checked "
            "for inf/nan, so an overflowing step would still change parameters. Use layerwise_clip='exact' (the "
            "default) or 'off' with fp16, or bf16=True with any mode."
        )


def check_fp16_weights(named_params: Iterable[tuple[str, Any]]) -> None:
    """GradScaler refuses to unscale fp16 gradients: trainable weights must be fp32 under fp16 loss scaling."""
    import torch

    fp16 = [n for n, p in named_params if p.dtype == torch.float16]
    if fp16:
        raise ValueError(
            f"fp16 loss scaling needs fp32 trainable weights (GradScaler refuses to unscale fp16 gradients); "
            f"{len(fp16)} parameter(s) are float16, e.g. {fp16[0]}. Load the model in float32 and let fp16=True "
            "autocast, or use bf16."
        )


def check_trainable_unchanged(names: Sequence[str], model: Any) -> None:
    """
    The parameters a layer-wise optimizer was built for must be the ones that train: a parameter frozen since would
    get a hook it cannot take, and one unfrozen since would silently never step.
    """
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    built = set(names)
    frozen = sorted(built - trainable)
    new = sorted(trainable - built)
    if frozen or new:
        raise ValueError(
            "The trainable parameters changed since the layer-wise optimizer was built "
            f"(frozen since: {frozen or 'none'}; trainable since: {new or 'none'}). Nothing was stepped. To train "
            "the new set, build a new optimizer and scheduler: set trainer.optimizer = None and "
            "trainer.lr_scheduler = None before train(), or create a new Trainer."
        )


def check_fsdp2_optimizers(name: str | None, optimizers: Sequence[Any]) -> None:
    """Refuse inner optimizers whose update of a shard differs from the update of the whole tensor."""
    bad = sorted({type(inner).__name__ for inner in optimizers if not fsdp2_supports_optimizer(inner)})
    if bad:
        good = ", ".join(f"{b}{SUFFIX}" for b in sorted(set(FSDP2_ELEMENTWISE) - {"adamw_torch_fused"}))
        raise ValueError(
            f"{name or '/'.join(bad)} ({', '.join(bad)}) cannot step FSDP2 shards: its update is not elementwise "
            f"(factored or blockwise state would be computed per shard). Under FSDP2 use {good}, or run this "
            "optimizer under DDP / on one process."
        )
