"""GaLore (and APOLLO) as layer-wise optimizers: `galore_adamw_layerwise`, `galore_adamw_8bit_layerwise`,
`galore_adafactor_layerwise`, `apollo_adamw_layerwise`.

GaLore's update of one tensor only reads that tensor's gradient (the projection is an SVD of that gradient), so one
GaLore optimizer per parameter trains exactly like one over all of them. The model decides which tensors are
projected; that choice is made here the way transformers makes it (`_setup_low_rank_optimizer`): the weights of the
`nn.Linear` modules that `optim_target_modules` selects get a group with the low-rank keys, every other trainable
parameter a plain group of the same optimizer class, with transformers' `optim_args` keys and defaults. Unlike
transformers' own layer-wise path, each group also gets Trainer's weight decay split, the scheduler drives its lr,
and the checkpoint holds every state. APOLLO seeds each tensor's random projector with the tensor's position in the
optimizer, so each per-parameter optimizer is given the seed the whole-model optimizer would give (`apollo_seeds`).

GaLore keeps a `GaLoreProjector` object in each projected tensor's state, which `torch.load(weights_only=True)` (how
Trainer loads `optimizer.pt`) refuses. The optimizer classes here are thin subclasses whose `state_dict()` writes such
objects as tensors and plain values and whose `load_state_dict()` rebuilds them, so resuming is bit-exact.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
from collections.abc import Iterator
from itertools import chain
from typing import Any

import torch
from torch import nn

from ..platform.compat import parse_optim_args
from ..platform.streams import keeps_device_sync
from .params import LayerwiseParam, isolate_bnb_overrides, share_quantization_maps
from .support import LOW_RANK_BASES

logger = logging.getLogger(__name__)

# Objects a low-rank optimizer keeps in its state are rebuilt on load only from these packages.
_OBJECT_PACKAGES = ("galore_torch", "apollo_torch")
_PACKED = "__layerwise_hf_object__"
_PLAIN = (torch.Tensor, bool, int, float, str, type(None))


# ---- checkpoint-safe state ----


def _plain(value: Any, where: str) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v, where) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(
        f"{where} is a {type(value).__name__}, which cannot be saved so that torch.load(weights_only=True) loads it."
    )


def pack_object(obj: Any, where: str = "state") -> dict[str, Any]:
    """
    `obj` (e.g. a `GaLoreProjector`) as its class path plus its attributes, all tensors and plain values, so that
    `torch.load(weights_only=True)` loads it. Only classes of `galore_torch` and `apollo_torch` are accepted.

    Args:
        obj (`Any`):
            The object kept in an optimizer state.
        where (`str`, *optional*, defaults to `"state"`):
            Where it was found, for the error message.

    Example:

    ```python
    >>> from galore_torch.galore_projector import GaLoreProjector
    >>> from layerwise_hf.bases.galore import pack_object
    >>> packed = pack_object(GaLoreProjector(rank=8), "state[0]['projector']")
    >>> packed["rank"]
    8
    ```
    """
    cls = type(obj)
    if cls.__module__.split(".")[0] not in _OBJECT_PACKAGES:
        raise TypeError(f"{where}: cannot save a {cls.__module__}.{cls.__qualname__} in an optimizer checkpoint.")
    attrs = {k: _plain(v, f"{where}.{k}") for k, v in vars(obj).items()}
    return {_PACKED: f"{cls.__module__}:{cls.__qualname__}", **attrs}


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def unpack_object(packed: dict[str, Any], device: torch.device | None = None) -> Any:
    """
    Rebuild what `pack_object` wrote, with its tensors on `device` (dtypes as saved). Refuses classes outside
    `galore_torch` and `apollo_torch` with a `ValueError`.

    Args:
        packed (`dict[str, Any]`):
            The output of `pack_object`.
        device (`torch.device`, *optional*):
            Where its tensors go; defaults to where they were loaded.

    Example:

    ```python
    >>> from galore_torch.galore_projector import GaLoreProjector
    >>> from layerwise_hf.bases.galore import pack_object, unpack_object
    >>> projector = unpack_object(pack_object(GaLoreProjector(rank=8)))
    >>> type(projector).__name__, projector.rank
    ('GaLoreProjector', 8)
    ```
    """
    module_name, _, qualname = packed[_PACKED].partition(":")
    if module_name.split(".")[0] not in _OBJECT_PACKAGES:
        raise ValueError(f"Refusing to rebuild {packed[_PACKED]!r} from an optimizer checkpoint.")
    cls: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not isinstance(cls, type) or cls.__module__.split(".")[0] not in _OBJECT_PACKAGES:
        raise ValueError(f"Refusing to rebuild {packed[_PACKED]!r} from an optimizer checkpoint.")
    obj = cls.__new__(cls)
    # NOTE: attributes are restored as saved instead of calling __init__, so fields __init__ does not take
    # (ortho_matrix) come back too.
    for key, value in packed.items():
        if key != _PACKED:
            setattr(obj, key, value if device is None else _to_device(value, device))
    return obj


def _is_object(value: Any) -> bool:
    return not isinstance(value, (*_PLAIN, dict, list, tuple))


def _is_packed(value: Any) -> bool:
    return isinstance(value, dict) and _PACKED in value


class CheckpointSafeStateMixin:
    """
    Put before a low-rank optimizer class: `state_dict()` writes the objects it keeps in a parameter's state
    (GaLore's `projector`) as tensors and plain values, `load_state_dict()` rebuilds them.

    Example:

    ```python
    >>> import io, torch
    >>> from galore_torch import GaLoreAdamW
    >>> from layerwise_hf.bases.galore import CheckpointSafeStateMixin
    >>> class SafeGaLoreAdamW(CheckpointSafeStateMixin, GaLoreAdamW):
    ...     pass
    >>> weight = torch.nn.Parameter(torch.randn(16, 16))
    >>> group = {"params": [weight], "rank": 4, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
    >>> optimizer = SafeGaLoreAdamW([group], lr=1e-3, no_deprecation_warning=True)
    >>> weight.grad = torch.randn(16, 16)
    >>> optimizer.step()
    >>> buffer = io.BytesIO()
    >>> torch.save(optimizer.state_dict(), buffer)
    >>> _ = buffer.seek(0)
    >>> optimizer.load_state_dict(torch.load(buffer, weights_only=True))
    ```
    """

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        state = {}
        for key, param_state in sd["state"].items():
            if isinstance(param_state, dict) and any(map(_is_object, param_state.values())):
                # A new dict: torch's state_dict shares the live per-parameter dicts.
                param_state = {
                    k: pack_object(v, f"state[{key}][{k!r}]") if _is_object(v) else v for k, v in param_state.items()
                }
            state[key] = param_state
        sd["state"] = state
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        objects: dict[Any, dict[str, Any]] = {}
        state = {}
        for key, param_state in state_dict["state"].items():
            if isinstance(param_state, dict) and any(_is_packed(v) for v in param_state.values()):
                objects[key] = {k: v for k, v in param_state.items() if _is_packed(v)}
                param_state = {k: v for k, v in param_state.items() if k not in objects[key]}
            state[key] = param_state
        super().load_state_dict({**state_dict, "state": state})
        # Saved ids map to parameters in group order, as in torch.optim.Optimizer.load_state_dict.
        id_map = dict(
            zip(
                chain.from_iterable(g["params"] for g in state_dict["param_groups"]),
                chain.from_iterable(g["params"] for g in self.param_groups),
            )
        )
        for key, packed in objects.items():
            param = id_map[key]
            for name, value in packed.items():
                self.state[param][name] = unpack_object(value, param.device)


@contextlib.contextmanager
def _cuda_synchronize_is_a_no_op() -> Iterator[None]:
    # GaLoreAdamW8bit.step calls torch.cuda.synchronize() after every parameter, which raises without CUDA. Without
    # CUDA there is nothing to wait for; with CUDA the step runs inside backward, ordered by streams
    # (`streams.step_in_backward`), so a whole-device sync per parameter only stalls it. Paged states keep it: their
    # asynchronous page-ins need it. The arithmetic is untouched.
    synchronize = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None
    try:
        yield
    finally:
        torch.cuda.synchronize = synchronize


def _unhooked(step):
    # torch.optim.Optimizer wraps a class's `step` (step hooks, profiling) when the class is first instantiated; our
    # own `step` is wrapped too, so calling the wrapped upstream one would run every step hook twice.
    return step.__wrapped__ if getattr(step, "hooked", False) else step


_CLASSES: dict[str, type[torch.optim.Optimizer]] = {}


def optimizer_class(base: str) -> type[torch.optim.Optimizer]:
    """
    The checkpoint-safe optimizer class for `base`: the upstream class with `CheckpointSafeStateMixin` in front,
    reachable as `layerwise_hf.bases.galore.<ClassName>`. Raises `ImportError` naming the package when it is missing.

    Args:
        base (`str`):
            `"galore_adamw"`, `"galore_adamw_8bit"`, `"galore_adafactor"` or `"apollo_adamw"`.

    Example:

    ```python
    >>> from layerwise_hf.bases.galore import optimizer_class
    >>> cls = optimizer_class("galore_adamw")
    >>> cls.__module__, cls.__name__
    ('layerwise_hf.bases.galore', 'GaLoreAdamW')
    ```
    """
    if base in _CLASSES:
        return _CLASSES[base]
    module_name, class_name, package = LOW_RANK_BASES[base]
    if importlib.util.find_spec(module_name) is None:
        raise ImportError(f"optim={base}_layerwise needs the {package} package: pip install {package}")
    upstream = getattr(importlib.import_module(module_name), class_name)
    namespace: dict[str, Any] = {"__module__": __name__, "__qualname__": class_name, "__doc__": upstream.__doc__}
    if base == "galore_adamw_8bit":

        @torch.no_grad()
        def step(self, closure=None):
            upstream_step = _unhooked(upstream.step)
            if torch.cuda.is_available() and keeps_device_sync(self):
                return upstream_step(self, closure)
            with _cuda_synchronize_is_a_no_op():
                return upstream_step(self, closure)

        namespace["step"] = step
    cls = type(class_name, (CheckpointSafeStateMixin, upstream), namespace)
    _CLASSES[base] = cls
    globals()[class_name] = cls  # reachable by its qualified name, as pickle and the checkpoint metadata expect
    return cls


def __getattr__(name: str) -> Any:
    # `layerwise_hf.bases.galore.GaLoreAdamW` etc. are built on first use (galore_torch is optional); this lets pickle
    # find them in a fresh process too.
    for base, (_, class_name, _) in LOW_RANK_BASES.items():
        if name == class_name:
            return optimizer_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- target selection and the factory ----


def _optim_kwargs(base: str, args: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(constructor kwargs, low-rank group keys) exactly as transformers' `_get_galore_optimizer` /
    `_get_apollo_optimizer` build them for the non-layer-wise name."""
    optim_args = parse_optim_args(args.optim_args)
    kwargs: dict[str, Any] = {"lr": args.learning_rate}
    if base.startswith("galore_"):
        group = {
            "rank": int(optim_args.pop("rank", 128)),
            "update_proj_gap": int(optim_args.pop("update_proj_gap", 200)),
            "scale": float(optim_args.pop("scale", 0.25)),
            "proj_type": optim_args.pop("proj_type", "std"),
        }
        if base == "galore_adafactor":
            # NOTE: transformers sets these for galore_adafactor only; its galore_adafactor_layerwise keeps
            # relative_step=True and so ignores the lr. The layer-wise form here trains like galore_adafactor.
            kwargs.update({"scale_parameter": False, "relative_step": False})
        if base == "galore_adamw":
            kwargs["no_deprecation_warning"] = True  # would warn once per parameter; no effect on the update
    else:
        group = {
            "rank": int(optim_args.pop("rank", 128)),
            "proj": optim_args.pop("proj", "random"),
            "scale_type": optim_args.pop("scale_type", "channel"),
            "update_proj_gap": int(optim_args.pop("update_proj_gap", 200)),
            "scale": float(optim_args.pop("scale", 1.0)),
            "proj_type": optim_args.pop("proj_type", "std"),
            "betas": (args.adam_beta1, args.adam_beta2),
            "eps": args.adam_epsilon,
        }
    return kwargs, group


def target_parameter_names(name: str, args: Any, model: nn.Module | None) -> list[str]:
    """
    The names of the parameters `name` projects, chosen like transformers' `_setup_low_rank_optimizer`: the
    `.weight` of every `nn.Linear` module that `args.optim_target_modules` matches (or all of them for
    `"all-linear"`). Raises transformers' errors when `optim_target_modules` is missing or matches nothing.

    Args:
        name (`str`):
            The optimizer name, for messages (`"galore_adamw_layerwise"`).
        args (`TrainingArguments`):
            Supplies `optim_target_modules` (a list of strings, a regex string, or `"all-linear"`).
        model (`nn.Module`):
            The model whose modules are matched.

    Example:

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
    ...                                      num_hidden_layers=2, num_attention_heads=4))
    >>> from layerwise_hf import LayerwiseTrainingArguments
    >>> from layerwise_hf.bases.galore import target_parameter_names
    >>> args = LayerwiseTrainingArguments(
    ...     output_dir="out", optim="galore_adamw_layerwise", optim_target_modules=["q_proj", "v_proj"]
    ... )
    >>> target_parameter_names("galore_adamw_layerwise", args, model)[:2]
    ['model.layers.0.self_attn.q_proj.weight', 'model.layers.0.self_attn.v_proj.weight']
    ```
    """
    from transformers.trainer_utils import check_target_module_exists

    targets = args.optim_target_modules
    if targets is None:
        raise ValueError(f"You need to define `optim_target_modules` to use {name} optimizers")
    if not isinstance(targets, (list, str)):
        raise TypeError(
            f"`optim_target_modules` must be a list of strings, a regex string, or 'all-linear'. Got: {targets}"
        )
    if model is None:
        raise ValueError(f"You need to pass a model to initialize {name} optimizer.")
    all_linear = isinstance(targets, str) and targets.replace("_", "-") == "all-linear"
    names = []
    for module_name, module in model.named_modules():
        exists, is_regex = check_target_module_exists(targets, module_name, return_is_regex=True)
        if not isinstance(module, nn.Linear):
            if exists and not is_regex:
                logger.warning("%s matched but ignored. %s only supports linear layers.", module_name, name)
            continue
        if not exists and not all_linear:
            continue
        names.append(module_name + ".weight")
    if not names:
        raise ValueError(f"No target modules found for {name} ({targets}).")
    return names


class LowRankFactory:
    """
    Builds one low-rank optimizer per parameter: projected parameters (`target_names`) get a group with the
    low-rank keys (`group_kwargs`), the others a plain group; every group gets the parameter's weight decay.
    `low_rank_factory` builds it from `TrainingArguments` the way transformers does.

    Args:
        optimizer_cls (`type[torch.optim.Optimizer]`):
            The low-rank optimizer class (see `optimizer_class`).
        kwargs (`dict[str, Any]`):
            Its constructor arguments (`lr`, ...).
        group_kwargs (`dict[str, Any]`):
            The low-rank keys of a projected parameter's group (`rank`, `update_proj_gap`, `scale`, `proj_type`, ...).
        target_names (`list[str]`):
            The names of the projected parameters.
        seeds (`dict[str, int]`, *optional*):
            APOLLO's projector seed per parameter name (see `apollo_seeds`); `None` keeps the optimizer's own.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf import LayerwiseParam
    >>> from layerwise_hf.bases.galore import LowRankFactory, optimizer_class
    >>> factory = LowRankFactory(
    ...     optimizer_class("galore_adamw"),
    ...     {"lr": 1e-3, "no_deprecation_warning": True},
    ...     {"rank": 4, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"},
    ...     ["proj.weight"],
    ... )
    >>> weight = torch.nn.Parameter(torch.randn(16, 16))
    >>> optimizer = factory(LayerwiseParam("proj.weight", weight, weight_decay=0.0), None)
    >>> optimizer.param_groups[0]["rank"]
    4
    ```
    """

    def __init__(
        self,
        optimizer_cls: type[torch.optim.Optimizer],
        kwargs: dict[str, Any],
        group_kwargs: dict[str, Any],
        target_names: list[str],
        seeds: dict[str, int] | None = None,
    ):
        self.optimizer_cls = optimizer_cls
        self.kwargs = kwargs
        self.group_kwargs = group_kwargs
        self.target_names = frozenset(target_names)
        self.seeds = dict(seeds or {})
        self.quantization_maps: dict = {}

    def is_target(self, name: str) -> bool:
        """
        Whether the parameter `name` is projected: it is the `.weight` of a selected `nn.Linear`.

        Args:
            name (`str`):
                A name from `model.named_parameters()`.

        Example:

        ```python
        >>> from layerwise_hf.bases.galore import LowRankFactory, optimizer_class
        >>> factory = LowRankFactory(optimizer_class("galore_adamw"), {}, {"rank": 4}, ["proj.weight"])
        >>> factory.is_target("proj.weight"), factory.is_target("proj.bias")
        (True, False)
        ```
        """
        return name in self.target_names

    def __call__(self, lp: LayerwiseParam, args: Any) -> torch.optim.Optimizer:
        group: dict[str, Any] = {"params": [lp.param], "weight_decay": lp.weight_decay}
        if self.is_target(lp.name):
            group.update(self.group_kwargs)
        optimizer = self.optimizer_cls([group], **self.kwargs)
        if lp.name in self.seeds:
            # NOTE: APOLLOAdamW seeds a projector with the parameter's position in the optimizer, 1 for every
            # per-parameter optimizer; the projector is made at the first step, from this value.
            optimizer.state[lp.param]["seed"] = self.seeds[lp.name]
        share_quantization_maps(optimizer, lp.param.device, self.quantization_maps)
        return isolate_bnb_overrides(optimizer)

    def __repr__(self) -> str:
        return (
            f"{self.optimizer_cls.__module__}.{self.optimizer_cls.__qualname__}({self.kwargs}, "
            f"projected={sorted(self.target_names)}, {self.group_kwargs})"
        )


def apollo_seeds(model: nn.Module, target_names: list[str]) -> dict[str, int]:
    """
    The projector seed APOLLOAdamW gives each trainable parameter when Trainer builds it for the whole model:
    its 1-based position in the param groups `[non-projected, projected]` (every parameter of
    `model.named_parameters()` counts, frozen ones too, as in transformers' `_setup_low_rank_optimizer`).

    Args:
        model (`nn.Module`):
            The model Trainer builds the optimizer for.
        target_names (`list[str]`):
            The projected parameters (`target_parameter_names`).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.bases.galore import apollo_seeds
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> apollo_seeds(model, ["0.weight"])
    {'0.bias': 1, '1.weight': 2, '1.bias': 3, '0.weight': 4}
    ```
    """
    targets = set(target_names)
    named = list(model.named_parameters())
    order = [(n, p) for n, p in named if n not in targets] + [(n, p) for n, p in named if n in targets]
    return {n: i for i, (n, p) in enumerate(order, start=1) if p.requires_grad}


def low_rank_factory(name: str, base: str, args: Any, model: nn.Module | None) -> LowRankFactory:
    """
    The per-parameter factory of `name`, with transformers' `optim_target_modules` selection and `optim_args` keys
    and defaults. Raises `ImportError` first when the base's package is missing.

    Args:
        name (`str`):
            The layer-wise name (`"galore_adamw_layerwise"`).
        base (`str`):
            Its base (`"galore_adamw"`).
        args (`TrainingArguments`):
            Supplies `learning_rate`, `optim_args` (`"rank=64,update_proj_gap=100"`, ...) and
            `optim_target_modules`.
        model (`nn.Module`):
            The model whose modules `optim_target_modules` selects.

    Example:

    ```python
    >>> # model: a LlamaForCausalLM, as in `target_parameter_names`' example
    >>> from layerwise_hf import LayerwiseTrainingArguments
    >>> from layerwise_hf.bases.galore import low_rank_factory
    >>> args = LayerwiseTrainingArguments(
    ...     output_dir="out",
    ...     optim="galore_adamw_layerwise",
    ...     optim_target_modules=["q_proj", "v_proj"],
    ...     optim_args="rank=8",
    ... )
    >>> factory = low_rank_factory("galore_adamw_layerwise", "galore_adamw", args, model)
    >>> factory.is_target("model.layers.0.self_attn.q_proj.weight"), factory.group_kwargs["rank"]
    (True, 8)
    ```
    """
    optimizer_cls = optimizer_class(base)  # first, like transformers: a missing package is the first error
    targets = target_parameter_names(name, args, model)
    kwargs, group_kwargs = _optim_kwargs(base, args)
    seeds = apollo_seeds(model, targets) if base == "apollo_adamw" else None
    return LowRankFactory(optimizer_cls, kwargs, group_kwargs, targets, seeds)
