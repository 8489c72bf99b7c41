"""Name -> per-parameter optimizer factory.

Every per-tensor optimizer that `Trainer` knows gets a `<base>_layerwise` name for free: the base is resolved
through `Trainer.get_optimizer_cls_and_kwargs`, so betas, eps, `optim_args` and the bitsandbytes settings are
exactly the ones Trainer would use. Third-party optimizers join with `register_layerwise_optimizer`.
"""

from __future__ import annotations

import copy
import difflib
import re

import torch
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.training_args import OptimizerNames

from ..platform.compat import is_optimizer_factory, optimizer_base_requirements
from .galore import low_rank_factory
from .muon import muon_factory
from .params import LayerwiseFactory, LayerwiseParam, isolate_bnb_overrides, share_quantization_maps
from .support import LOW_RANK_BASES, REFUSED_BASES, SUFFIX, not_per_tensor_error, refused_base_error

# Low-rank projection optimizers (GaLore, APOLLO) are served by layerwise_hf.bases.galore: transformers defines their
# `_layerwise` names itself; this plugin serves them (scheduled lr, weight decay, grad_norm, state).
_LOW_RANK_REQUIRES = {base: package for base, (_, _, package) in LOW_RANK_BASES.items()}

_REGISTRY: dict[str, LayerwiseFactory] = {}

# Layer-wise names of this plugin with no Trainer optimizer of that name: name -> the Trainer base the arguments are
# validated against. Mixes of optimizers per tensor are natural here (layerwise_hf.bases.muon).
PLUGIN_NAMES = {"muon_layerwise": "adamw_torch"}


def _builtin_bases() -> list[str]:
    return sorted(n.value for n in OptimizerNames if not n.value.endswith(SUFFIX) and n.value not in REFUSED_BASES)


# Layer-wise names transformers defines itself that still go through transformers' own code path (none at present:
# this plugin serves galore_*_layerwise and apollo_adamw_layerwise).
TRANSFORMERS_LAYERWISE_NAMES = tuple(
    sorted(
        n.value
        for n in OptimizerNames
        if n.value.endswith(SUFFIX) and n.value.removesuffix(SUFFIX) not in set(_builtin_bases())
    )
)


def list_layerwise_optimizers() -> list[str]:
    """
    All names `LayerwiseTrainingArguments(optim=...)` accepts for this plugin's layer-wise path, sorted: a
    `<base>_layerwise` name for every per-tensor Trainer optimizer, plus the names added with
    `register_layerwise_optimizer`.

    Example:

    ```python
    >>> from layerwise_hf import list_layerwise_optimizers
    >>> "adamw_8bit_layerwise" in list_layerwise_optimizers()
    True
    ```
    """
    return sorted({f"{b}{SUFFIX}" for b in _builtin_bases()} | set(PLUGIN_NAMES) | set(_REGISTRY))


# What a base needs beyond torch/transformers (Trainer raises an ImportError naming it when missing).
_BASE_REQUIRES = {
    "adamw_anyprecision": "torchdistx",
    "adamw_torch_npu_fused": "torch_npu",
    "adamw_torch_xla": "torch_xla",
    "grokadamw": "grokadamw",
    "stable_adamw": "torch-optimi",
}


def describe_layerwise_optimizers() -> list[tuple[str, str, str]]:
    """
    `(layer-wise name, Trainer base name, extra package)` for every built-in layer-wise name, sorted by base name.
    The extra package is `""` when torch and transformers suffice. docs/optimizers.md's table is generated from it.

    Example:

    ```python
    >>> from layerwise_hf.bases.registry import describe_layerwise_optimizers
    >>> ("adamw_8bit_layerwise", "adamw_8bit", "bitsandbytes") in describe_layerwise_optimizers()
    True
    ```
    """
    requires = dict(_BASE_REQUIRES)
    requires.update(_LOW_RANK_REQUIRES)
    requires.update(optimizer_base_requirements())
    return [(f"{base}{SUFFIX}", base, requires.get(base, "")) for base in _builtin_bases()]


def register_layerwise_optimizer(name: str, factory: LayerwiseFactory, *, overwrite: bool = False) -> None:
    """
    Add a third-party optimizer under `name`.

    Args:
        name (`str`):
            Lower-case, ends in `_layerwise`, not already a Trainer optimizer name.
        factory (`Callable[[LayerwiseParam, TrainingArguments], torch.optim.Optimizer]`):
            Builds the optimizer of one parameter; it must own exactly `LayerwiseParam.param`. Use
            `args.learning_rate` as the initial lr: the scheduler drives it afterwards.
        overwrite (`bool`, *optional*, defaults to `False`):
            Replace an earlier registration of the same name.

    Raises `ValueError` for a malformed, built-in or (without `overwrite`) already registered name, and `TypeError`
    when `factory` is not callable.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf import LayerwiseTrainingArguments, register_layerwise_optimizer
    >>> def my_sgd(lp, args):
    ...     return torch.optim.SGD([{"params": [lp.param], "weight_decay": lp.weight_decay}], lr=args.learning_rate)
    >>> register_layerwise_optimizer("my_sgd_layerwise", my_sgd)
    >>> args = LayerwiseTrainingArguments(output_dir="out", optim="my_sgd_layerwise")
    ```
    """
    if not re.fullmatch(r"[a-z0-9_]+", name) or not name.endswith(SUFFIX) or name == SUFFIX:
        raise ValueError(f"Layer-wise optimizer names are lower-case [a-z0-9_] and end in '{SUFFIX}'; got {name!r}.")
    builtin = {f"{b}{SUFFIX}" for b in _builtin_bases()} | {n.value for n in OptimizerNames} | set(PLUGIN_NAMES)
    if name in builtin:
        raise ValueError(f"{name!r} is a built-in optimizer name and cannot be registered.")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"{name!r} is already registered; pass overwrite=True to replace it.")
    if not callable(factory):
        raise TypeError(f"factory for {name!r} must be callable, got {type(factory).__name__}.")
    _REGISTRY[name] = factory


def unregister_layerwise_optimizer(name: str) -> None:
    """
    Remove a name added with `register_layerwise_optimizer` (tests and notebooks re-register). A name that is not
    registered is ignored.

    Args:
        name (`str`):
            The registered layer-wise name.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf import list_layerwise_optimizers, register_layerwise_optimizer
    >>> from layerwise_hf import unregister_layerwise_optimizer
    >>> register_layerwise_optimizer("scratch_sgd_layerwise", lambda lp, args: torch.optim.SGD([lp.param], lr=0.1))
    >>> unregister_layerwise_optimizer("scratch_sgd_layerwise")
    >>> "scratch_sgd_layerwise" in list_layerwise_optimizers()
    False
    ```
    """
    _REGISTRY.pop(name, None)


def _unknown_name_error(name: str) -> ValueError:
    layerwise = list_layerwise_optimizers()
    # transformers' galore_*/apollo_* layer-wise names are served here, so they are listed once, as layer-wise.
    standard = sorted(n.value for n in OptimizerNames if n.value not in layerwise)
    own = f"transformers' own layer-wise names: {', '.join(TRANSFORMERS_LAYERWISE_NAMES)}. "
    # A typo is the usual cause, and the full lists run to some 70 names.
    close = difflib.get_close_matches(str(name).lower(), [*layerwise, *standard], n=3, cutoff=0.75)
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    return ValueError(
        f"Unknown optimizer {name!r}.{hint} "
        f"Layer-wise names: {', '.join(layerwise)}. "
        f"{own if TRANSFORMERS_LAYERWISE_NAMES else ''}"
        f"Standard names: {', '.join(standard)}."
    )


def parse_optim_name(name) -> str | None:
    """
    Return the base optimizer of a layer-wise name handled by this plugin, or `None` for a name Trainer handles.

    The base is the standard Trainer name the layer-wise one trains like (`"galore_adamw"` for
    `"galore_adamw_layerwise"`), so `TrainingArguments` validates the arguments against it. Registered third-party
    names return `""` (they have no Trainer base). Raises `ValueError` naming the valid choices for an unknown or
    refused name.

    Args:
        name (`str` or `OptimizerNames`):
            An `optim` value.

    Example:

    ```python
    >>> from layerwise_hf.bases.registry import parse_optim_name
    >>> parse_optim_name("adamw_8bit_layerwise")
    'adamw_8bit'
    >>> parse_optim_name("adamw_torch") is None
    True
    ```
    """
    name = getattr(name, "value", name)
    if not isinstance(name, str):
        raise ValueError(f"optim must be a string, got {type(name).__name__}.")
    if name in _REGISTRY:
        return ""
    if name in PLUGIN_NAMES:
        return PLUGIN_NAMES[name]
    # NOTE: before the check against OptimizerNames, which also holds transformers' galore_*_layerwise names.
    if name.endswith(SUFFIX) and name not in TRANSFORMERS_LAYERWISE_NAMES:
        base = name[: -len(SUFFIX)]
        if base in REFUSED_BASES:
            raise refused_base_error(name, base, list_layerwise_optimizers())
        if base in _builtin_bases():
            return base
    if name in TRANSFORMERS_LAYERWISE_NAMES or name in {n.value for n in OptimizerNames}:
        return None
    raise _unknown_name_error(name)


def is_layerwise_name(name) -> bool:
    """
    Whether `name` is served by this plugin's layer-wise path (not transformers' own). Raises `ValueError` for an
    unknown name, like `parse_optim_name`.

    Args:
        name (`str` or `OptimizerNames`):
            An `optim` value.

    Example:

    ```python
    >>> from layerwise_hf import is_layerwise_name
    >>> is_layerwise_name("adamw_torch_layerwise"), is_layerwise_name("adamw_torch")
    (True, False)
    ```
    """
    return parse_optim_name(name) is not None


def resolve_factory(args: TrainingArguments, model: nn.Module | None = None) -> LayerwiseFactory:
    """
    The per-parameter factory for `args.optim`, resolving built-in bases through Trainer (so the optimizer class and
    its settings are exactly Trainer's). Raises `ValueError` when `args.optim` is not a layer-wise name of this
    plugin, or its base does not build one optimizer per tensor.

    Args:
        args (`TrainingArguments`):
            Supplies `optim` and the optimizer's settings (`learning_rate`, betas, `optim_args`, ...).
        model (`nn.Module`, *optional*):
            Needed by the low-rank names (GaLore, APOLLO), which select the projected tensors from it.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf import LayerwiseParam, LayerwiseTrainingArguments
    >>> from layerwise_hf.bases.registry import resolve_factory
    >>> args = LayerwiseTrainingArguments(output_dir="out", optim="adamw_torch_layerwise")
    >>> factory = resolve_factory(args)
    >>> weight = torch.nn.Parameter(torch.zeros(4, 4))
    >>> type(factory(LayerwiseParam("weight", weight, weight_decay=0.0), args)).__name__
    'AdamW'
    ```
    """
    name = getattr(args.optim, "value", args.optim)
    base = parse_optim_name(name)
    if base is None:
        raise ValueError(f"{name!r} is not a layer-wise optimizer of this plugin.")
    if base == "":
        return _REGISTRY[name]
    if name in PLUGIN_NAMES:
        return muon_factory(args, model)
    if base in _LOW_RANK_REQUIRES:
        return low_rank_factory(name, base, args, model)

    base_args = copy.copy(args)
    # NOTE: a shallow copy is enough: only `optim` changes, and Trainer's handlers read `args` without mutating it.
    object.__setattr__(base_args, "optim", OptimizerNames(base))
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(base_args, model)
    if is_optimizer_factory(optimizer_cls) or {"params", "model", "optimizer_dict"} & set(kwargs):
        raise not_per_tensor_error(name, base, list_layerwise_optimizers())
    # Trainer's "embeddings keep 32-bit state" rule for bitsandbytes 8-bit, applied per parameter instead of
    # through GlobalOptimManager, whose (group, index) keys are (0, 0) for every per-parameter optimizer.
    bnb_8bit = "bitsandbytes" in str(optimizer_cls) and kwargs.get("optim_bits") == 8
    return _ClassFactory(optimizer_cls, dict(kwargs), bnb_8bit)


class _ClassFactory:
    def __init__(self, optimizer_cls: type[torch.optim.Optimizer], kwargs: dict, bnb_8bit: bool):
        self.optimizer_cls = optimizer_cls
        self.kwargs = kwargs
        self.bnb_8bit = bnb_8bit
        self.quantization_maps: dict = {}

    def __call__(self, lp: LayerwiseParam, args: TrainingArguments) -> torch.optim.Optimizer:
        kwargs = dict(self.kwargs)
        if self.bnb_8bit and lp.is_embedding:
            kwargs["optim_bits"] = 32
        optimizer = self.optimizer_cls([{"params": [lp.param], "weight_decay": lp.weight_decay}], **kwargs)
        share_quantization_maps(optimizer, lp.param.device, self.quantization_maps)
        return isolate_bnb_overrides(optimizer)

    def __repr__(self) -> str:
        return f"{self.optimizer_cls.__module__}.{self.optimizer_cls.__qualname__}({self.kwargs})"
