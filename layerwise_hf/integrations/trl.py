"""TRL's SFT and DPO trainers with layer-wise optimizers: `LayerwiseSFTConfig` + `LayerwiseSFTTrainer`,
`LayerwiseDPOConfig` + `LayerwiseDPOTrainer`.

Each config keeps every default of TRL's config (TRL's `learning_rate`, `bf16`, `gradient_checkpointing`,
`logging_steps`, ...) and accepts `optim="<base>_layerwise"` and the `layerwise_*` arguments of
`LayerwiseTrainingArguments`. The order of the bases is what keeps TRL's defaults: a dataclass takes each field's
default from the last class in reverse MRO order that declares it, and `LayerwiseTrainingArguments` carries all of
`TrainingArguments`' fields, so with it first they would silently replace TRL's (`learning_rate` 2e-5 -> 5e-5, `bf16`
and `gradient_checkpointing` off, `logging_steps` 10 -> 500). `optim` is declared again here for the same reason in
the other direction: TRL's configs carry `TrainingArguments`' `optim` field, whose `OptimizerNames` type
`HfArgumentParser` turns into `choices` without the layer-wise names.

Example:

```python
>>> from layerwise_hf.integrations.trl import LayerwiseSFTConfig, LayerwiseSFTTrainer
>>> args = LayerwiseSFTConfig(output_dir="out", optim="adamw_8bit_layerwise")
>>> args.learning_rate, args.gradient_checkpointing  # TRL's defaults
(2e-05, True)
>>> trainer = LayerwiseSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
>>> trainer.train()
```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

try:
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "layerwise_hf.integrations.trl needs TRL: pip install 'layerwise-hf[trl]' (or pip install trl). Without "
        "TRL, use layerwise_hf.LayerwiseTrainer with LayerwiseTrainingArguments."
    ) from err
from transformers import TrainingArguments

from .trainer import LayerwiseTrainerMixin
from .training_args import LayerwiseTrainingArguments

__all__ = ["LayerwiseDPOConfig", "LayerwiseDPOTrainer", "LayerwiseSFTConfig", "LayerwiseSFTTrainer"]

_OPTIM = LayerwiseTrainingArguments.__dataclass_fields__["optim"]


def _optim_field() -> Any:
    return field(default=_OPTIM.default, metadata=dict(_OPTIM.metadata))


@dataclass
class LayerwiseSFTConfig(SFTConfig, LayerwiseTrainingArguments):
    """
    TRL's `SFTConfig` whose `optim` also accepts the layer-wise names (`list_layerwise_optimizers()`), with
    `LayerwiseTrainingArguments`' `layerwise_clip` and `layerwise_accept_nonfinite_state`. Every other argument and
    default is `SFTConfig`'s.

    Example:

    ```python
    >>> from layerwise_hf.integrations.trl import LayerwiseSFTConfig
    >>> args = LayerwiseSFTConfig(output_dir="out", optim="adamw_torch_layerwise", layerwise_clip="exact")
    >>> args.is_layerwise, args.learning_rate
    (True, 2e-05)
    ```
    """

    optim: str = _optim_field()


@dataclass
class LayerwiseDPOConfig(DPOConfig, LayerwiseTrainingArguments):
    """
    TRL's `DPOConfig` whose `optim` also accepts the layer-wise names (`list_layerwise_optimizers()`), with
    `LayerwiseTrainingArguments`' `layerwise_clip` and `layerwise_accept_nonfinite_state`. Every other argument and
    default is `DPOConfig`'s.

    Example:

    ```python
    >>> from layerwise_hf.integrations.trl import LayerwiseDPOConfig
    >>> args = LayerwiseDPOConfig(output_dir="out", optim="adamw_torch_layerwise")
    >>> args.is_layerwise, args.learning_rate
    (True, 1e-06)
    ```
    """

    optim: str = _optim_field()


def as_config(args: TrainingArguments | None, config_cls: type) -> TrainingArguments | None:
    """
    `args` as a `config_cls` (`LayerwiseSFTConfig` / `LayerwiseDPOConfig`): TRL's trainers turn any other
    `TrainingArguments` into their own config, whose `optim` refuses the layer-wise names. Arguments `config_cls`
    does not have are dropped, as TRL does; `None` stays `None` (the TRL trainer makes its default config).

    Args:
        args (`TrainingArguments`, *optional*):
            What the user passed as `args`.
        config_cls (`type`):
            The layer-wise config class to convert to.

    Example:

    ```python
    >>> from layerwise_hf import LayerwiseTrainingArguments
    >>> from layerwise_hf.integrations.trl import LayerwiseSFTConfig, as_config
    >>> args = LayerwiseTrainingArguments(output_dir="out", optim="adamw_torch_layerwise", learning_rate=1e-3)
    >>> converted = as_config(args, LayerwiseSFTConfig)
    >>> type(converted).__name__, converted.optim, converted.learning_rate
    ('LayerwiseSFTConfig', 'adamw_torch_layerwise', 0.001)
    ```
    """
    if args is None or isinstance(args, config_cls):
        return args
    values = args.to_dict()
    values["hub_token"] = args.hub_token  # to_dict hides it
    accepted = {name for name, f in config_cls.__dataclass_fields__.items() if f.init}
    return config_cls(**{k: v for k, v in values.items() if k in accepted})


class LayerwiseSFTTrainer(LayerwiseTrainerMixin, SFTTrainer):
    """
    TRL's `SFTTrainer` with layer-wise optimizers whenever `args.optim` ends in `_layerwise`; any other `optim` trains
    exactly like `SFTTrainer`. Takes `SFTTrainer`'s arguments (after `args`, by keyword); `args` that are not a
    `LayerwiseSFTConfig` are converted to one (`as_config`).

    Example:

    ```python
    >>> from layerwise_hf.integrations.trl import LayerwiseSFTConfig, LayerwiseSFTTrainer
    >>> trainer = LayerwiseSFTTrainer(
    ...     model=model,
    ...     args=LayerwiseSFTConfig(output_dir="out", optim="adamw_torch_layerwise"),
    ...     train_dataset=dataset,  # a "text" column, or TRL's conversational formats
    ...     processing_class=tokenizer,
    ... )
    >>> trainer.train()
    ```
    """

    def __init__(self, model, args: TrainingArguments | None = None, **kwargs):
        super().__init__(model, args=as_config(args, LayerwiseSFTConfig), **kwargs)


class LayerwiseDPOTrainer(LayerwiseTrainerMixin, DPOTrainer):
    """
    TRL's `DPOTrainer` with layer-wise optimizers whenever `args.optim` ends in `_layerwise` (the reference model, or
    the adapter-less base with PEFT, gets no optimizer); any other `optim` trains exactly like `DPOTrainer`. Takes
    `DPOTrainer`'s arguments (after `args`, by keyword); `args` that are not a `LayerwiseDPOConfig` are converted to
    one (`as_config`).

    Example:

    ```python
    >>> from layerwise_hf.integrations.trl import LayerwiseDPOConfig, LayerwiseDPOTrainer
    >>> trainer = LayerwiseDPOTrainer(
    ...     model=model,
    ...     args=LayerwiseDPOConfig(output_dir="out", optim="adamw_torch_layerwise"),
    ...     train_dataset=dataset,  # "prompt", "chosen" and "rejected" columns
    ...     processing_class=tokenizer,
    ... )
    >>> trainer.train()
    ```
    """

    def __init__(self, model, ref_model=None, args: TrainingArguments | None = None, **kwargs):
        super().__init__(model, ref_model=ref_model, args=as_config(args, LayerwiseDPOConfig), **kwargs)
