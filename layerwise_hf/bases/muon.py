"""`optim="muon_layerwise"`: Muon for the hidden layers' matrices, AdamW for everything else, one optimizer per
parameter.

A mix like this is natural for per-parameter optimizers: each tensor simply gets the optimizer that suits it, with
the same scheduler, clipping and checkpoints as any other layer-wise run. (Trainer takes one optimizer class; a
Muon + AdamW pair there needs a hand-built wrapper.)

- `torch.optim.Muon` for every 2-D parameter that is not an embedding or the output head: Trainer's
  `learning_rate`, momentum 0.95, Nesterov, `adjust_lr_fn="match_rms_adamw"` (Muon's update scaled to AdamW's RMS,
  so one learning rate serves both) and Trainer's weight-decay split.
- AdamW with `adamw_torch`'s settings (betas, epsilon from the arguments) for embeddings, the output head and 1-D
  parameters.
- `optim_args` overrides Muon's settings: `adjust_lr_fn=original`, `muon_lr=0.02`, `momentum=0.9`,
  `nesterov=false`, `ns_steps=5`, `eps=1e-7`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from .params import LayerwiseFactory, LayerwiseParam

NAME = "muon_layerwise"
BASE = "adamw_torch"  # what TrainingArguments validates against, and AdamW's settings
_OPTIONS = {"adjust_lr_fn": str, "muon_lr": float, "momentum": float, "nesterov": bool, "ns_steps": int, "eps": float}


def _parse_options(optim_args: str | None) -> dict[str, Any]:
    options: dict[str, Any] = {"adjust_lr_fn": "match_rms_adamw", "momentum": 0.95, "nesterov": True}
    for item in (optim_args or "").replace(" ", "").split(","):
        if not item:
            continue
        key, _, value = item.partition("=")
        if key not in _OPTIONS:
            raise ValueError(f"optim_args key {key!r} is not a {NAME} setting; choose from {', '.join(_OPTIONS)}.")
        kind = _OPTIONS[key]
        options[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    if options["adjust_lr_fn"] in ("none", "original"):
        options["adjust_lr_fn"] = "original"
    return options


def uses_muon(param: torch.Tensor, excluded: set[int]) -> bool:
    """
    A hidden layer's matrix: 2-D, and neither an embedding nor the output head.

    Args:
        param (`torch.Tensor`):
            The parameter to place.
        excluded (`set[int]`):
            `id()`s of the embeddings' and the output head's weights.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.bases.muon import uses_muon
    >>> embedding = torch.nn.Embedding(16, 4)
    >>> excluded = {id(embedding.weight)}
    >>> uses_muon(torch.nn.Linear(4, 4).weight, excluded), uses_muon(embedding.weight, excluded)
    (True, False)
    ```
    """
    return param.ndim == 2 and id(param) not in excluded


def muon_factory(args: Any, model: nn.Module | None) -> LayerwiseFactory:
    """
    The per-parameter factory of `muon_layerwise` for `model`.

    Args:
        args (`TrainingArguments`):
            Supplies `learning_rate`, the AdamW settings and `optim_args` (Muon's settings).
        model (`torch.nn.Module`):
            Its embeddings and output head get AdamW; required.

    Example:

    ```python
    >>> from layerwise_hf import LayerwiseTrainingArguments, build_layerwise_optimizer
    >>> args = LayerwiseTrainingArguments("out", optim="muon_layerwise", learning_rate=2e-3)
    >>> optimizer = build_layerwise_optimizer(model, args)  # Muon for q/k/v/o and MLP matrices, AdamW elsewhere
    ```
    """
    if model is None:
        raise ValueError(f"{NAME} chooses Muon or AdamW for each tensor from the model: pass the model.")
    from transformers import Trainer
    from transformers.training_args import OptimizerNames

    options = _parse_options(args.optim_args)
    excluded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        excluded.add(id(head.weight))
    adamw_args = copy.copy(args)
    object.__setattr__(adamw_args, "optim", OptimizerNames(BASE))
    object.__setattr__(adamw_args, "optim_args", None)  # they are Muon's
    adamw_cls, adamw_kwargs = Trainer.get_optimizer_cls_and_kwargs(adamw_args, model)
    muon_kwargs = {k: options[k] for k in ("momentum", "nesterov", "adjust_lr_fn", "ns_steps", "eps") if k in options}

    def factory(lp: LayerwiseParam, args: Any) -> torch.optim.Optimizer:
        group = {"params": [lp.param], "weight_decay": lp.weight_decay}
        if uses_muon(lp.param, excluded):
            return torch.optim.Muon([group], lr=options.get("muon_lr", args.learning_rate), **muon_kwargs)
        return adamw_cls([group], **adamw_kwargs)

    return factory
