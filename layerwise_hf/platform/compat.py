"""Every difference between the supported transformers / accelerate / torch versions, decided here and nowhere else.

Supported: transformers >= 4.55, accelerate >= 1.10, torch >= 2.6. Older versions are refused (`check_versions`, run
when the Trainer integration is imported and by `install()`); versions newer than the newest tested run, with one
`UntestedVersionWarning` naming the tested range. The range and its check live in `layerwise_hf.platform.versions`.

What the plugin uses that moved between transformers versions (each checked in the released wheels); the function
here that handles it is named in brackets:

    what                                     transformers 4.55 up to ...           ... and from
    ---------------------------------------  ------------------------------------  ------------------------------------
    `_parse_optim_args`,                     5.1: inline in Trainer.get_optimizer  5.2: module
    `is_optimizer_factory`, bitsandbytes /   _cls_and_kwargs; no optimizer         `transformers.trainer_optimizer`
    torchao name lists [`parse_optim_args`,  factories
    `is_optimizer_factory`,
    `optimizer_base_requirements`]
    `safe_globals()`, Trainer's allowlist    5.1: `transformers.trainer`           5.2: `transformers.trainer_pt_utils`
    for `torch.load` [`safe_globals`]
    `Trainer.create_optimizer`               5.2: `(self)`, optimizes self.model   5.3: `(self, model=None)`
    [`create_optimizer_args`,
    `trainer_method_parameters`]
    clipping and the logged `grad_norm`      5.2: inline in the training loop,     5.3: `Trainer._clip_grad_norm` and
    [`route_inline_grad_norm`,               `accelerator.clip_grad_norm_`, only   `Trainer._get_grad_norm`, logged
    `trainer_method_parameters`,             when `max_grad_norm > 0` (else no     at every step
    `trainer_logs_grad_norm`]                `grad_norm` is logged)
    `Trainer.train` parameters               4.57: `(..., ignore_keys_for_eval,    5.0: no `**kwargs`
    [`trainer_method_parameters`]            **kwargs)`
    activation checkpointing arguments       5.22: `gradient_checkpointing`,       5.23: `activation_checkpointing`,
    [`checkpointing_kwargs`,                 `gradient_checkpointing_kwargs`       `..._kwargs` (old names: aliases)
    `checkpointing_kwargs_name`]
    `from_config(config, dtype=...)`         4.55: `torch_dtype=` only             4.56: `dtype=` (`torch_dtype`: old)
    [`dtype_kwargs`]
    meta-device forward (the estimator's     4.x: rotary embeddings open           5.x: no autocast there
    order of use) [`meta_forward`]           `torch.autocast("meta")`, refused
    `map_location` of `optimizer.pt` in a    5.17: `args.device`, which is         5.18: `"cpu"` on CPU ranks
    multi-process run [`cpu_map_location`]   `cpu:0` on CPU ranks: torch refuses
    Accelerate's `sync_each_batch` in the    5.1: ignored (`no_sync`, which leaves  5.2: no `no_sync` when it is set
    loop [`fsdp2_trainer_reduces_each_       FSDP2 alone before accelerate 1.11)
    micro_batch`]
    DDP settings given to Accelerate         5.2: set in `Trainer._wrap_model`,    5.3: when the Accelerator is made
    (`find_unused_parameters`,               after the optimizer is made;
    `bucket_cap_mb`, `broadcast_buffers`)    `find_unused_parameters` defaults
    [`set_ddp_handler_early`]                to `not is_gradient_checkpointing`

Process-wide, transformers < 5 writes TrainingArguments' mixed precision and FSDP settings into `os.environ`
(`ACCELERATE_MIXED_PRECISION`, `ACCELERATE_USE_FSDP`, `FSDP_*`), where every later Accelerator reads them; the
plugin does not change that (the tests restore the environment after each test).

Apart from FSDP2 under `no_sync` (above), accelerate 1.10 - 1.15 and torch 2.13 - 2.15 showed no difference the
plugin depends on (CI tests up to torch
2.14.1, the newest its pip settings allow, so 2.15 warns as untested). The shims decide by what the installed release
has (a module, a parameter, a field) where it can; where the difference is in what a method does
(`trainer_method_parameters`, `dtype_kwargs`, `set_ddp_handler_early`, `cpu_map_location`), by the version.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from packaging.version import Version

from .versions import (
    SUPPORTED_VERSIONS,
    UnsupportedVersionError,
    UntestedVersionWarning,
    check_versions,
    installed_version,
    tested_range,
)

__all__ = [
    "SUPPORTED_VERSIONS",
    "UnsupportedVersionError",
    "UntestedVersionWarning",
    "check_versions",
    "checkpointing_kwargs",
    "enable_activation_checkpointing",
    "checkpointing_kwargs_name",
    "cpu_map_location",
    "create_optimizer_args",
    "create_optimizer_takes_model",
    "dtype_kwargs",
    "meta_forward",
    "is_optimizer_factory",
    "optimizer_base_requirements",
    "parse_optim_args",
    "route_inline_grad_norm",
    "safe_globals",
    "set_ddp_handler_early",
    "tested_range",
    "trainer_logs_grad_norm",
    "trainer_method_parameters",
    "fsdp2_trainer_reduces_each_micro_batch",
]


def _trainer_optimizer():
    """transformers >= 5.2's optimizer-resolution module, `None` before."""
    try:
        return importlib.import_module("transformers.trainer_optimizer")
    except ImportError:
        return None


def parse_optim_args(optim_args: str | None) -> dict[str, str]:
    """
    `TrainingArguments.optim_args` (`"rank=8,scale=0.5"`) as a dict of strings, as Trainer parses it.

    Example:

    ```python
    >>> from layerwise_hf.platform.compat import parse_optim_args
    >>> parse_optim_args("rank=8, scale=0.5")
    {'rank': '8', 'scale': '0.5'}
    ```
    """
    module = _trainer_optimizer()
    if module is not None:
        return module._parse_optim_args(optim_args)
    # NOTE: transformers < 5.2 parses inline in get_optimizer_cls_and_kwargs, the same way.
    parsed = {}
    if optim_args:
        for mapping in optim_args.replace(" ", "").split(","):
            key, value = mapping.split("=")
            parsed[key] = value
    return parsed


def is_optimizer_factory(optimizer_cls: Any) -> bool:
    """Whether `Trainer.get_optimizer_cls_and_kwargs` returned a factory over the whole model instead of an optimizer
    class (transformers >= 5.2's Muon / Dion style; never before, where it is always a class)."""
    module = _trainer_optimizer()
    if module is not None:
        return module.is_optimizer_factory(optimizer_cls)
    return not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer))


# transformers 5.24's `_BITSANDBYTES_OPTIMIZERS` / `_TORCHAO_OPTIMIZERS`, by value, for versions without the lists.
_BITSANDBYTES_BASES = (
    "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit", "ademamix", "ademamix_8bit",
    "paged_ademamix_32bit", "paged_ademamix_8bit", "lion_32bit", "lion_8bit", "paged_lion_32bit", "paged_lion_8bit",
    "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit",
)  # fmt: skip
_TORCHAO_BASES = ("adamw_torch_4bit", "adamw_torch_8bit")


def optimizer_base_requirements() -> dict[str, str]:
    """
    Trainer base name -> the package it needs, for the bitsandbytes and torchao bases.

    Example:

    ```python
    >>> from layerwise_hf.platform.compat import optimizer_base_requirements
    >>> optimizer_base_requirements()["adamw_8bit"], optimizer_base_requirements()["adamw_torch_4bit"]
    ('bitsandbytes', 'torchao')
    ```
    """
    module = _trainer_optimizer()
    if module is not None:
        bnb = [n.value for n in module._BITSANDBYTES_OPTIMIZERS]
        torchao = [n.value for n in module._TORCHAO_OPTIMIZERS]
    else:
        bnb, torchao = list(_BITSANDBYTES_BASES), list(_TORCHAO_BASES)
    return {**dict.fromkeys(bnb, "bitsandbytes"), **dict.fromkeys(torchao, "torchao")}


def safe_globals():
    """
    The context manager Trainer loads `optimizer.pt` / `rng_state.pth` under (`torch.load(weights_only=True)` with
    numpy's reconstruct functions allowed).

    Example:

    ```python
    >>> import io, torch
    >>> from layerwise_hf.platform.compat import safe_globals
    >>> buffer = io.BytesIO(); torch.save({"step": torch.tensor(1)}, buffer); _ = buffer.seek(0)
    >>> with safe_globals():
    ...     torch.load(buffer, weights_only=True)["step"]
    tensor(1)
    ```
    """
    module = importlib.import_module("transformers.trainer_pt_utils")
    if not hasattr(module, "safe_globals"):
        module = importlib.import_module("transformers.trainer")  # transformers < 5.2
    return module.safe_globals()


@contextlib.contextmanager
def cpu_map_location(args) -> Iterator[None]:
    """
    While Trainer resumes from a checkpoint: on transformers < 5.18, which loads `optimizer.pt` of a multi-process
    run with `map_location=args.device`, an indexed CPU device there (`cpu:0` on CPU ranks) is given to `torch.load`
    as plain `"cpu"` (what transformers >= 5.18 passes), because torch refuses to restore a storage to `cpu:0`. The
    checkpoint is read as saved; nothing changes on transformers >= 5.18, on one process or on an accelerator.

    Args:
        args (`TrainingArguments`):
            The Trainer's arguments (their `world_size` and `device`).

    Example:

    ```python
    >>> from layerwise_hf.platform.compat import cpu_map_location
    >>> with cpu_map_location(trainer.args):
    ...     trainer._load_optimizer_and_scheduler(checkpoint)
    ```
    """
    device = args.device
    if _transformers_release() >= (5, 18) or args.world_size <= 1 or device.type != "cpu" or device.index is None:
        yield
        return
    load = torch.load

    @functools.wraps(load)
    def load_on_cpu(*load_args: Any, **kwargs: Any) -> Any:
        location = kwargs.get("map_location")
        if isinstance(location, (str, torch.device)) and torch.device(location).type == "cpu":
            kwargs["map_location"] = "cpu"
        return load(*load_args, **kwargs)

    torch.load = load_on_cpu
    try:
        yield
    finally:
        torch.load = load


@functools.cache
def create_optimizer_takes_model() -> bool:
    """Whether `Trainer.create_optimizer` takes the model to optimize (transformers >= 5.3; before, it optimizes
    `self.model`)."""
    from transformers import Trainer

    return "model" in inspect.signature(Trainer.create_optimizer).parameters


def create_optimizer_args(model) -> tuple:
    """
    The arguments to call the installed `Trainer.create_optimizer` with for `model` (`None`: the Trainer's model).
    Before transformers 5.3 it takes none and optimizes `self.model`; another model raises `TypeError` there.

    Example:

    ```python
    >>> from layerwise_hf.platform.compat import create_optimizer_args
    >>> optimizer = trainer.create_optimizer(*create_optimizer_args(None))
    ```
    """
    if create_optimizer_takes_model():
        return (model,)
    if model is not None:
        raise TypeError(
            "Trainer.create_optimizer() takes no model before transformers 5.3: it optimizes trainer.model. "
            "Call it without a model, or upgrade transformers."
        )
    return ()


def trainer_method_parameters() -> dict[str, tuple[str, ...]]:
    """
    The parameters that the Trainer methods whose signature differs between the supported versions have in the
    installed transformers release (a method absent from that release is left out). `install()` refuses to patch
    when the installed methods differ (integrations/patching.py).

    Example:

    ```python
    >>> from layerwise_hf.platform.compat import trainer_method_parameters
    >>> trainer_method_parameters()["create_optimizer"]  # transformers >= 5.3
    ('self', 'model')
    ```
    """
    release = _transformers_release()
    train = ("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval")
    expected = {"train": train + ("kwargs",) if release < (5, 0) else train}
    if release < (5, 3):
        expected["create_optimizer"] = ("self",)  # _clip_grad_norm / _get_grad_norm do not exist yet
    else:
        expected["create_optimizer"] = ("self", "model")
        expected["_clip_grad_norm"] = ("self", "model")
        expected["_get_grad_norm"] = ("self", "model", "grad_norm")
    return expected


@functools.cache
def _trainer_clips_inline() -> bool:
    from transformers import Trainer

    return not hasattr(Trainer, "_clip_grad_norm")


def trainer_logs_grad_norm(max_grad_norm: float) -> bool:
    """
    Whether Trainer logs `grad_norm` with this `max_grad_norm`: always from transformers 5.3, only when it clips
    (`max_grad_norm > 0`) before.

    Example:

    ```python
    >>> from layerwise_hf.platform.compat import trainer_logs_grad_norm
    >>> trainer_logs_grad_norm(1.0)
    True
    ```
    """
    return bool(max_grad_norm and max_grad_norm > 0) or not _trainer_clips_inline()


def route_inline_grad_norm(accelerator, layerwise_optimizer: Callable[[], Any]) -> None:
    """
    On transformers < 5.3, whose training loop clips inline with `accelerator.clip_grad_norm_(model.parameters(),
    max_grad_norm)` and logs what it returns, make that call return the layer-wise optimizer's `grad_norm()` (the
    norm measured in backward; the gradients are freed by then), as the Trainer mixin's `_clip_grad_norm` override
    does from 5.3 on. Nothing is changed on transformers >= 5.3.

    Args:
        accelerator (`accelerate.Accelerator`): the Trainer's; only this instance is changed.
        layerwise_optimizer (`Callable[[], LayerwiseOptimizer | None]`): the Trainer's at the time of the call;
            `None` (a standard optimizer) leaves the call to accelerate.

    Example:

    ```python
    >>> from layerwise_hf.platform.compat import route_inline_grad_norm
    >>> route_inline_grad_norm(trainer.accelerator, lambda: trainer.layerwise_optimizer)
    ```
    """
    if not _trainer_clips_inline() or getattr(accelerator.clip_grad_norm_, "_layerwise_routed", False):
        return
    original = accelerator.clip_grad_norm_

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        optimizer = layerwise_optimizer()
        if optimizer is None:
            return original(parameters, max_norm, norm_type=norm_type)
        return optimizer.grad_norm()

    clip_grad_norm_._layerwise_routed = True
    accelerator.clip_grad_norm_ = clip_grad_norm_


def fsdp2_trainer_reduces_each_micro_batch(sync_each_batch: bool) -> bool:
    """
    Whether Trainer reduce-scatters every micro-batch of an accumulation window under FSDP2 (else FSDP2 sums the
    window unsharded): accelerate < 1.11's `no_sync` leaves FSDP2 alone (no `no_sync` method), later ones turn its
    gradient sync off; Trainer skips `no_sync` for Accelerate's `sync_each_batch` from transformers 5.2.

    Example:

    ```python
    >>> from layerwise_hf.platform.compat import fsdp2_trainer_reduces_each_micro_batch
    >>> fsdp2_trainer_reduces_each_micro_batch(sync_each_batch=True)  # transformers 5.24, accelerate 1.15
    True
    ```
    """
    if Version(installed_version("accelerate") or "0").release < (1, 11):
        return True
    return sync_each_batch and _transformers_release() >= (5, 2)


def _transformers_release() -> tuple[int, ...]:
    return Version(installed_version("transformers") or "0").release


def dtype_kwargs(dtype) -> dict[str, Any]:
    """
    The keyword that sets a model's dtype in `from_config` / `from_pretrained` on the installed transformers
    (`dtype` from 4.56, `torch_dtype` before).

    Example:

    ```python
    >>> import torch
    >>> from transformers import AutoModelForCausalLM, LlamaConfig
    >>> from layerwise_hf.platform.compat import dtype_kwargs
    >>> config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    >>> AutoModelForCausalLM.from_config(config, **dtype_kwargs(torch.bfloat16)).dtype
    torch.bfloat16
    ```
    """
    return {"dtype" if _transformers_release() >= (4, 56) else "torch_dtype": dtype}


def set_ddp_handler_early(trainer) -> None:
    """
    On transformers < 5.3, which gives Accelerate its DDP settings only in `Trainer._wrap_model` (after the optimizer
    is created), set the same `DistributedDataParallelKwargs` now, so that the layer-wise data-parallel route reads
    what DDP would be given (`_wrap_model` later sets an equal one). Nothing is changed on transformers >= 5.3, whose
    Accelerator has them from the start, or without data parallelism.

    Args:
        trainer (`Trainer`): the Trainer whose optimizer is being created.

    Example:

    ```python
    >>> from layerwise_hf.platform.compat import set_ddp_handler_early
    >>> set_ddp_handler_early(trainer)  # before DataParallelConfig.from_accelerator(trainer.accelerator)
    ```
    """
    from transformers import PreTrainedModel
    from transformers.training_args import ParallelMode

    args, accelerator = trainer.args, trainer.accelerator
    if _transformers_release() >= (5, 3) or accelerator.ddp_handler is not None:
        return
    if args.parallel_mode != ParallelMode.DISTRIBUTED:
        return
    from accelerate.utils import DistributedDataParallelKwargs

    # NOTE: as transformers 4.55 - 5.2's Trainer._wrap_model builds them.
    kwargs: dict[str, Any] = {}
    if args.ddp_find_unused_parameters is not None:
        kwargs["find_unused_parameters"] = args.ddp_find_unused_parameters
    elif isinstance(trainer.model, PreTrainedModel):
        kwargs["find_unused_parameters"] = not trainer.model.is_gradient_checkpointing
    else:
        kwargs["find_unused_parameters"] = True
    if args.ddp_bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = args.ddp_bucket_cap_mb
    if args.ddp_broadcast_buffers is not None:
        kwargs["broadcast_buffers"] = args.ddp_broadcast_buffers
    accelerator.ddp_handler = DistributedDataParallelKwargs(**kwargs)


@functools.cache
def _checkpointing_field() -> str:
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


@contextlib.contextmanager
def meta_forward() -> Iterator[None]:
    """
    Lets a model's forward run on the meta device: transformers 4.x's rotary embeddings open
    `torch.autocast(device_type=x.device.type, enabled=False)`, which torch refuses for "meta" ("unsupported
    scalarType"); inside this context such an autocast is made for "cpu" instead (disabled either way, so nothing is
    computed differently). Where torch accepts it (the rotary embeddings of transformers 5.x do not open one), nothing
    is changed.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.platform.compat import meta_forward
    >>> with meta_forward(), torch.autocast(device_type="meta", enabled=False):
    ...     pass
    ```
    """
    original = torch.autocast
    try:
        original(device_type="meta", enabled=False)
    except RuntimeError:
        pass
    else:
        yield
        return

    class _MetaAsCpu(original):
        def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
            super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)

    torch.autocast = _MetaAsCpu
    try:
        yield
    finally:
        torch.autocast = original


def checkpointing_kwargs_name() -> str:
    """
    The installed transformers' name of the `TrainingArguments` field for activation checkpointing's keyword
    arguments (`activation_checkpointing_kwargs` from 5.23, `gradient_checkpointing_kwargs` before), for messages.

    Example:

    ```python
    >>> from layerwise_hf.platform.compat import checkpointing_kwargs_name
    >>> checkpointing_kwargs_name() in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")
    True
    ```
    """
    return f"{_checkpointing_field()}_kwargs"


def checkpointing_kwargs(enabled: bool = True, kwargs: dict | None = None) -> dict[str, Any]:
    """
    `TrainingArguments` keyword arguments that turn activation checkpointing on, under the installed transformers'
    names (`activation_checkpointing` from 5.23, `gradient_checkpointing` before).

    Example:

    ```python
    >>> from transformers import TrainingArguments
    >>> from layerwise_hf.platform.compat import checkpointing_kwargs
    >>> args = TrainingArguments("out", **checkpointing_kwargs(True, {"use_reentrant": False}))
    ```
    """
    field = _checkpointing_field()
    return {field: enabled, **({f"{field}_kwargs": kwargs} if kwargs is not None else {})}


def enable_activation_checkpointing(model: Any, kwargs: dict | None = None) -> None:
    """
    Turn activation checkpointing on as Trainer does, under the installed transformers' method name
    (`activation_checkpointing_enable` from 5.23, `gradient_checkpointing_enable` before); non-reentrant by default.

    Example:

    ```python
    >>> from transformers import AutoModelForCausalLM, LlamaConfig
    >>> from layerwise_hf.platform.compat import enable_activation_checkpointing
    >>> config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    >>> model = AutoModelForCausalLM.from_config(config)
    >>> enable_activation_checkpointing(model)
    ```
    """
    kwargs = {"use_reentrant": False} if kwargs is None else kwargs
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
