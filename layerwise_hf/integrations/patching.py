"""`install()` / `uninstall()`: stock `TrainingArguments`, `HfArgumentParser` and `Trainer` (and every subclass, TRL's
included) take `optim="<base>_layerwise"` unchanged.

What `install()` changes, on the classes themselves (the objects a script gets from `transformers`, whatever module
object it reached them through):

- `TrainingArguments.__post_init__` and `.set_optimizer`: a layer-wise name is checked as `LayerwiseTrainingArguments`
  checks it, the parent validates the base name, the layer-wise name is restored. Other names: untouched.
- `TrainingArguments.optim` is typed `str` (as `LayerwiseTrainingArguments` re-declares it), so `HfArgumentParser` (and
  TRL's copy of it) no longer turns it into argparse `choices` without the layer-wise names; `__post_init__` validates
  the name, from the command line, YAML or JSON alike (a wrong name: `ValueError` listing the valid ones, where
  argparse said "invalid choice").
- `Trainer.__new__`: a `Trainer` (or subclass `T`) created with a layer-wise `optim` is made an instance of
  `(LayerwiseTrainerMixin, T)`, the class the explicit API is made of, so it trains exactly like `LayerwiseTrainer` /
  `LayerwiseSFTTrainer`. With any other `optim` it stays a `T`.
- `Trainer.get_optimizer_cls_and_kwargs`: a layer-wise name reaching it (a Trainer created before `install()`) keeps
  Trainer's error and says how to fix it.

Before changing anything, `install()` checks every method it replaces or the mixin overrides against the parameters of
the tested versions, and refuses with `UnsupportedVersionError` when one is missing or different.

`uninstall()` puts every original back, then leaves a thin check on `TrainingArguments.__post_init__`,
`.set_optimizer` and `Trainer.get_optimizer_cls_and_kwargs` that calls the original and, only when it raises its
`ValueError` for a layer-wise name, adds how to fix it (`install()` again, or the explicit classes); every other name
and every result reach the caller exactly as from the original.
"""

from __future__ import annotations

import functools
import inspect
import threading
import types

from ..bases.registry import parse_optim_name
from ..bases.support import check_bool_argument
from ..optim.clipping import CLIP_MODES, ClipMode
from ..platform.compat import (
    UnsupportedVersionError,
    check_versions,
    installed_version,
    tested_range,
    trainer_method_parameters,
)

__all__ = ["CLIP_MODES", "UnsupportedVersionError", "install", "is_installed", "uninstall"]

# The parameters each method has in the supported versions: the mixin's overrides call them with these, and the
# patches below wrap them. Those that differ between versions come from platform.compat.trainer_method_parameters().
_TRAINER_METHODS = {
    "__init__": ("self", "model", "args"),  # a prefix: the rest are passed through by keyword
    "log": ("self", "logs", "start_time"),
    "training_step": ("self", "model", "inputs", "num_items_in_batch"),
    "_save_checkpoint": ("self", "model", "trial"),
    "_load_optimizer_and_scheduler": ("self", "checkpoint"),
    "get_optimizer_cls_and_kwargs": ("args", "model"),
    # The mixin marks the backwards run inside compute_loss by overriding this public method (Trainer's
    # training_step calls compute_loss only inside it).
    "compute_loss_context_manager": ("self",),
    "get_decay_parameter_names": ("self", "model"),
    "_get_output_dir": ("self", "trial"),
}
_ARGS_METHODS = {
    "__post_init__": ("self",),
    "set_optimizer": ("self", "name", "learning_rate", "weight_decay", "beta1", "beta2", "epsilon", "args"),
}
_ACCELERATOR_METHODS = {
    "prepare_model": ("self", "model", "device_placement", "evaluation_mode"),
    "backward": ("self", "loss", "kwargs"),
}

_LOCK = threading.Lock()
# What uninstall() runs, in reverse order: each puts back one thing install() changed.
_UNDO: list = []
_ABSENT = object()
_STATE = {"installed": False}
# install(layerwise_clip=..., layerwise_preflight=...): given to stock arguments made with a layer-wise name (they
# have no such fields).
_SETTINGS: dict[str, str | bool | None] = {"layerwise_clip": None, "layerwise_preflight": None}
_LAYERWISE_CLASSES: dict[type, type] = {}
_FIX = (
    "This Trainer was created before layerwise_hf.install() (or after uninstall()), so it was not made layer-wise: "
    "create it after install() (or run the script with `python -m layerwise_hf SCRIPT ARGS`), or use "
    "layerwise_hf.LayerwiseTrainer."
)
_FIX_AFTER_UNINSTALL = (
    "layerwise_hf.uninstall() was called, so stock TrainingArguments and Trainer take no layer-wise name: call "
    "layerwise_hf.install() again (or run the script with `python -m layerwise_hf SCRIPT ARGS`), or use "
    "layerwise_hf.LayerwiseTrainingArguments with layerwise_hf.LayerwiseTrainer."
)


def is_installed() -> bool:
    """
    Whether `install()` is in effect.

    Example:

    ```python
    >>> import layerwise_hf
    >>> from layerwise_hf.integrations.patching import is_installed
    >>> layerwise_hf.install(); is_installed()
    True
    >>> layerwise_hf.uninstall(); is_installed()
    False
    ```
    """
    return _STATE["installed"]


def install(*, layerwise_clip: str | None = None, layerwise_preflight: bool | None = None) -> None:
    """
    Make stock `TrainingArguments`, `HfArgumentParser` and `Trainer` (and every subclass: TRL's `SFTConfig` /
    `SFTTrainer`, a script's own `Trainer` subclass) accept `optim="<base>_layerwise"` and train layer-wise with it,
    exactly like `LayerwiseTrainingArguments` + `LayerwiseTrainer`. Any other `optim` trains as before. Idempotent;
    `uninstall()` undoes it. Nothing changes at import time: this is what `python -m layerwise_hf SCRIPT` calls before
    it runs the script.

    Trainers created before `install()` are not made layer-wise: give one a layer-wise name and it raises Trainer's
    error, with how to fix it.

    Args:
        layerwise_clip (`str`, *optional*):
            `LayerwiseTrainingArguments.layerwise_clip` for stock arguments made from now on with a layer-wise
            `optim` (`"exact"`, `"previous"`, `"per_param"` or `"off"`); unset, they clip `"exact"`ly. A later call
            changes it (`python -m layerwise_hf --layerwise_clip previous SCRIPT`).
        layerwise_preflight (`bool`, *optional*):
            `LayerwiseTrainingArguments.layerwise_preflight` for those arguments: plan the run before its first step
            and warn when it will not fit (`python -m layerwise_hf --layerwise_preflight SCRIPT`).

    Raises:
        UnsupportedVersionError: a method it replaces is missing or has other parameters than in the tested
            transformers / accelerate versions, or one is older than supported; nothing is changed. The message
            names the tested range (`layerwise_hf.platform.compat.tested_range()`).

    Example:

    ```python
    >>> import layerwise_hf
    >>> from transformers import Trainer, TrainingArguments
    >>> layerwise_hf.install()
    >>> args = TrainingArguments(output_dir="out", optim="adamw_8bit_layerwise")
    >>> trainer = Trainer(model=model, args=args, train_dataset=train_dataset)  # trains layer-wise
    >>> isinstance(trainer, layerwise_hf.LayerwiseTrainerMixin)
    True
    ```
    """
    with _LOCK:
        if layerwise_clip is not None:
            _SETTINGS["layerwise_clip"] = ClipMode.parse(layerwise_clip).value
        if layerwise_preflight is not None:
            _SETTINGS["layerwise_preflight"] = check_bool_argument("layerwise_preflight", layerwise_preflight)
        if _STATE["installed"]:
            return
        from transformers import Trainer, TrainingArguments

        check_replaced_methods()
        _remove_hints()
        _replace(TrainingArguments, "__post_init__", _wrap_post_init(TrainingArguments.__post_init__))
        _replace(TrainingArguments, "set_optimizer", _wrap_set_optimizer(TrainingArguments.set_optimizer))
        _accept_any_optim_string(TrainingArguments)
        _replace(
            Trainer,
            "get_optimizer_cls_and_kwargs",
            staticmethod(_wrap_get_optimizer_cls_and_kwargs(Trainer.get_optimizer_cls_and_kwargs)),
        )
        # NOTE: CPython cannot give a class back its inherited object.__new__: after `del Trainer.__new__`,
        # `Trainer(model=...)` raises "object.__new__() takes exactly one argument". So __new__ is set once and
        # stays; uninstall() turns it into a plain object.__new__(cls).
        if "__new__" not in vars(Trainer):
            Trainer.__new__ = _trainer_new
        _STATE["installed"] = True


def uninstall() -> None:
    """
    Undo `install()`: every replaced method is the original again, and Trainers created from now on are stock ones
    (those created while installed stay layer-wise). Does nothing when not installed. A layer-wise name then gets
    transformers' own `ValueError`, to which a thin check left in place adds how to fix it (the module docstring).

    Example:

    ```python
    >>> import layerwise_hf
    >>> from transformers import TrainingArguments
    >>> layerwise_hf.install()
    >>> layerwise_hf.uninstall()
    >>> TrainingArguments(output_dir="out", optim="adamw_8bit_layerwise")
    Traceback (most recent call last):
    ValueError: adamw_8bit_layerwise is not a valid OptimizerNames, ... layerwise_hf.uninstall() was called, ...
    ```
    """
    with _LOCK:
        if not _STATE["installed"]:
            return
        _STATE["installed"] = False
        _SETTINGS.update(layerwise_clip=None, layerwise_preflight=None)
        while _UNDO:
            _UNDO.pop()()
        _leave_hints()


def _hinted_methods():
    from transformers import Trainer, TrainingArguments

    return [
        (TrainingArguments, "__post_init__", lambda self, *a, **k: getattr(self, "optim", None), _FIX_AFTER_UNINSTALL),
        (TrainingArguments, "set_optimizer", _optimizer_name_argument, _FIX_AFTER_UNINSTALL),
        (Trainer, "get_optimizer_cls_and_kwargs", lambda args, *a, **k: getattr(args, "optim", None), _FIX),
    ]


def _optimizer_name_argument(self, name="adamw_torch", *args, **kwargs):
    return name


def _leave_hints() -> None:
    """After uninstall(): each original wrapped in a check adding the fix to its error for a layer-wise name only."""
    for owner, name, read_name, fix in _hinted_methods():
        raw = vars(owner).get(name, _ABSENT)
        if raw is _ABSENT or getattr(raw, "_layerwise_hint", False):
            continue
        static = isinstance(raw, staticmethod)
        function = raw.__func__ if static else raw
        hint = _hint(function, read_name, fix)
        setattr(owner, name, staticmethod(hint) if static else hint)


def _remove_hints() -> None:
    """Before install() replaces them: the originals back, so uninstall() restores them and not a check."""
    for owner, name, _, _ in _hinted_methods():
        raw = vars(owner).get(name, _ABSENT)
        static = isinstance(raw, staticmethod)
        function = raw.__func__ if static else raw
        if getattr(function, "_layerwise_hint", False):
            original = function._layerwise_original
            setattr(owner, name, staticmethod(original) if static else original)


def _hint(original, read_name, fix: str):
    @functools.wraps(original)
    def check(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except ValueError as err:
            if _STATE["installed"] or not _stock_refuses(read_name(*args, **kwargs)):
                raise
            raise ValueError(f"{err} {fix}") from None

    check._layerwise_original = original
    check._layerwise_hint = True
    return check


def check_replaced_methods() -> None:
    """
    Raise `UnsupportedVersionError` naming every method `install()` replaces (or `LayerwiseTrainerMixin` overrides)
    that is missing or whose parameters differ from what the installed transformers / accelerate release has in the
    tested versions (`layerwise_hf.platform.compat`), or when one is older than supported; warn once
    (`UntestedVersionWarning`) for one newer than the newest tested.

    Example:

    ```python
    >>> from layerwise_hf.integrations.patching import check_replaced_methods
    >>> check_replaced_methods()  # silent with the tested versions
    ```
    """
    from accelerate import Accelerator
    from transformers import Trainer, TrainingArguments

    check_versions()
    problems = []
    for owner, methods in (
        (Trainer, {**_TRAINER_METHODS, **trainer_method_parameters()}),
        (TrainingArguments, _ARGS_METHODS),
        (Accelerator, _ACCELERATOR_METHODS),
    ):
        for name, expected in methods.items():
            problem = _method_problem(owner, name, expected)
            if problem:
                problems.append(f"{owner.__module__.split('.')[0]}.{owner.__name__}.{name} {problem}")
    optim = TrainingArguments.__dataclass_fields__.get("optim")
    annotation = vars(TrainingArguments).get("__annotations__", {}).get("optim")
    if optim is None or annotation is None:
        problems.append("transformers.TrainingArguments has no `optim` field")
    elif annotation is not str and "OptimizerNames" not in str(annotation):
        problems.append(f"transformers.TrainingArguments.optim is typed {annotation!r}, expected OptimizerNames | str")
    if "__new__" in vars(Trainer) and vars(Trainer)["__new__"] is not _trainer_new:
        problems.append("transformers.Trainer defines its own __new__")
    if problems:
        raise UnsupportedVersionError(_version_message(problems))


def _method_problem(owner: type, name: str, expected: tuple[str, ...]) -> str | None:
    raw = inspect.getattr_static(owner, name, None)
    if raw is None:
        return "is missing"
    function = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    function = getattr(function, "_layerwise_original", function)
    try:
        names = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return "has no readable signature"
    actual = names[: len(expected)] if name == "__init__" else names
    if actual != expected:
        return f"has parameters ({', '.join(names)}), expected ({', '.join(expected)})"
    return None


def _version_message(problems: list[str]) -> str:
    installed = ", ".join(f"{p} {installed_version(p) or '(not found)'}" for p in ("transformers", "accelerate"))
    return (
        "layerwise_hf.install() refused to patch, nothing was changed: "
        + "; ".join(problems)
        + f". layerwise_hf is tested with {tested_range()} (installed: {installed}). Install a tested version, "
        "or use the explicit classes (layerwise_hf.LayerwiseTrainer with LayerwiseTrainingArguments), which do not "
        "patch anything."
    )


def _replace(owner: type, name: str, value) -> None:
    original = vars(owner).get(name, _ABSENT)
    setattr(owner, name, value)
    _UNDO.append(lambda: delattr(owner, name) if original is _ABSENT else setattr(owner, name, original))


def _accept_any_optim_string(training_arguments: type) -> None:
    """
    `optim` typed `str`, as `LayerwiseTrainingArguments` re-declares it. Every parser (HfArgumentParser, TRL's own
    copy of it in `trl.scripts`) reads the type from the annotations (`typing.get_type_hints`), which subclasses
    inherit unless they re-declare the field; `__post_init__` still validates the name.
    """
    # NOTE: HfArgumentParser turns `optim: OptimizerNames | str` into argparse `choices` without the layer-wise names.
    annotations = vars(training_arguments)["__annotations__"]
    field = training_arguments.__dataclass_fields__["optim"]
    annotation, metadata = annotations["optim"], field.metadata
    help_text = metadata.get("help", "The optimizer to use.")
    annotations["optim"] = str
    extra = "With layerwise_hf: also '<name>_layerwise' (see list_layerwise_optimizers)."
    field.metadata = types.MappingProxyType({**metadata, "help": f"{help_text} {extra}"})

    def undo():
        annotations["optim"] = annotation
        field.metadata = metadata

    _UNDO.append(undo)


def _layerwise_base(name) -> str | None:
    """The base of a name this plugin serves, `None` for every other name (left to transformers, as before)."""
    name = getattr(name, "value", name)
    if not isinstance(name, str) or not name.endswith("_layerwise"):
        return None
    return parse_optim_name(name)  # raises, listing the valid names, for an unknown layer-wise name


def _wrap_post_init(original):
    from .training_args import LayerwiseTrainingArguments, _check_arguments_trainer_uses_late

    def __post_init__(self):
        name = getattr(self.optim, "value", self.optim)
        base = _layerwise_base(name)
        if base is None:
            return original(self)
        for field, value in _SETTINGS.items():  # read by the Trainer mixin and the callback
            if value is not None and field not in self.__dataclass_fields__:
                setattr(self, field, value)
        # The checks LayerwiseTrainingArguments makes, written once there; its layerwise_* fields at their defaults.
        view = _WithLayerwiseDefaults(self, LayerwiseTrainingArguments)
        _check_arguments_trainer_uses_late(view)
        LayerwiseTrainingArguments._refuse_unsupported(view, name)
        self.optim = base or "adamw_torch"
        try:
            return original(self)
        finally:
            self.optim = name

    __post_init__._layerwise_original = original
    return __post_init__


class _WithLayerwiseDefaults:
    """Stock `TrainingArguments` read as `LayerwiseTrainingArguments`: its `layerwise_*` fields at their defaults."""

    def __init__(self, args, layerwise_cls: type):
        self._args, self._fields = args, layerwise_cls.__dataclass_fields__

    def __getattr__(self, name):
        if hasattr(self._args, name) or not name.startswith("layerwise_") or name not in self._fields:
            return getattr(self._args, name)
        return self._fields[name].default


def _wrap_set_optimizer(original):
    def set_optimizer(self, name="adamw_torch", **kwargs):
        base = _layerwise_base(name)
        if base is None:
            return original(self, name=name, **kwargs)
        original(self, name=base or "adamw_torch", **kwargs)
        self.optim = name
        return self

    set_optimizer._layerwise_original = original
    return set_optimizer


def _wrap_get_optimizer_cls_and_kwargs(original):
    def get_optimizer_cls_and_kwargs(args, model=None):
        try:
            return original(args, model)
        except ValueError as err:
            if _serves(getattr(args, "optim", None)):
                raise ValueError(f"{err} {_FIX}") from None
            raise

    get_optimizer_cls_and_kwargs._layerwise_original = original
    return get_optimizer_cls_and_kwargs


def _serves(name) -> bool:
    try:
        return _layerwise_base(name) is not None
    except ValueError:
        return False


def _stock_refuses(name) -> bool:
    # A layer-wise name stock Trainer does not know itself: transformers' own galore_*_layerwise names are served by
    # stock Trainer after uninstall(), and their errors (a missing optim_target_modules) are transformers' alone.
    from transformers.training_args import OptimizerNames

    name = getattr(name, "value", name)
    return _serves(name) and name not in {n.value for n in OptimizerNames}


def _trainer_new(cls, *args, **kwargs):
    if _STATE["installed"]:
        cls = layerwise_class_for(cls, _training_args_of(args, kwargs))
    return object.__new__(cls)


def _training_args_of(args, kwargs):
    from transformers import TrainingArguments

    # NOTE: by type, not position, as LayerwiseTrainerMixin does: DPOTrainer's second positional is ref_model.
    return kwargs.get("args") or next((a for a in args if isinstance(a, TrainingArguments)), None)


def layerwise_class_for(cls: type, training_args) -> type:
    """
    The class an installed `Trainer` subclass `cls` is created as: `(LayerwiseTrainerMixin, cls)` when
    `training_args.optim` is a layer-wise name, `cls` itself otherwise (and for classes that already have the mixin).

    Args:
        cls (`type`):
            A `Trainer` subclass.
        training_args (`TrainingArguments`, *optional*):
            The arguments it is created with.

    Example:

    ```python
    >>> from transformers import Trainer
    >>> from layerwise_hf import LayerwiseTrainingArguments
    >>> from layerwise_hf.integrations.patching import layerwise_class_for
    >>> args = LayerwiseTrainingArguments(output_dir="out", optim="adamw_torch_layerwise")
    >>> [c.__name__ for c in layerwise_class_for(Trainer, args).__mro__[:3]]
    ['Trainer', 'LayerwiseTrainerMixin', 'Trainer']
    ```
    """
    from .trainer import LayerwiseTrainerMixin

    if issubclass(cls, LayerwiseTrainerMixin) or not _serves(getattr(training_args, "optim", None)):
        return cls
    made = _LAYERWISE_CLASSES.get(cls)
    if made is None:
        # Same name and module, so logs, model cards and `type(trainer).__name__` read as the script wrote them.
        made = type(cls.__name__, (LayerwiseTrainerMixin, cls), {"__module__": cls.__module__})
        made.__qualname__ = cls.__qualname__
        made.__doc__ = cls.__doc__
        _LAYERWISE_CLASSES[cls] = made
    return made
