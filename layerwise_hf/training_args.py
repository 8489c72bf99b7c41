"""`LayerwiseTrainingArguments`: `TrainingArguments` that also accept `optim="<base>_layerwise"`."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from .registry import list_layerwise_optimizers, parse_optim_name


@dataclass
class LayerwiseTrainingArguments(TrainingArguments):
    """
    `TrainingArguments` whose `optim` also accepts every name of `list_layerwise_optimizers()`.

    Args:
        optim (`str`, *optional*, defaults to Trainer's default):
            A Trainer optimizer name (`"adamw_torch"`, ...), or its layer-wise form (`"adamw_8bit_layerwise"`): one
            optimizer per trainable parameter, stepped as soon as its gradient is ready, the gradient freed right
            after. transformers' own `galore_*_layerwise` / `apollo_adamw_layerwise` keep working unchanged.
    """

    # NOTE: re-declared as plain `str` so HfArgumentParser does not turn OptimizerNames into argparse `choices`.
    optim: str = field(
        default=TrainingArguments.default_optim,
        metadata={
            "help": "The optimizer: any Trainer name (see OptimizerNames) or its layer-wise form '<name>_layerwise', "
            "e.g. adamw_8bit_layerwise. Layer-wise names: " + ", ".join(list_layerwise_optimizers())
        },
    )

    def __post_init__(self):
        name = getattr(self.optim, "value", self.optim)
        base = parse_optim_name(name)  # raises with the list of valid names
        if base is None:
            super().__post_init__()
            return
        # Let TrainingArguments validate everything else against a real base name, then restore ours.
        self.optim = base or "adamw_torch"
        try:
            super().__post_init__()
        finally:
            self.optim = name

    @property
    def is_layerwise(self) -> bool:
        """Whether `optim` is served by this plugin's layer-wise path."""
        return bool(parse_optim_name(self.optim) is not None)

    def set_optimizer(self, name: str = "adamw_torch", **kwargs):
        base = parse_optim_name(name)
        if base is None:
            return super().set_optimizer(name=name, **kwargs)
        super().set_optimizer(name=base or "adamw_torch", **kwargs)
        self.optim = name
        return self
