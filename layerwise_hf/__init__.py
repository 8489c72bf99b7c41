"""Layer-wise optimizers for Hugging Face Trainer and Accelerate.

One optimizer per trainable parameter, stepped inside backward as soon as that parameter's gradient is ready, the
gradient freed right after: `optim="<base>_layerwise"` (e.g. `"adamw_8bit_layerwise"`) is the only switch.

Example:

```python
>>> from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments
>>> args = LayerwiseTrainingArguments(output_dir="out", optim="adamw_8bit_layerwise")
>>> trainer = LayerwiseTrainer(model=model, args=args, train_dataset=train_dataset)
>>> trainer.train()
```

Or leave a script unchanged: `python -m layerwise_hf train.py --optim adamw_8bit_layerwise ...` (from Python:
`layerwise_hf.install()`) makes transformers' own `TrainingArguments`, `HfArgumentParser` and `Trainer` (and TRL's) do
the same.
"""

import importlib

# NOTE: imported eagerly (it is light): it applies LAYERWISE_HF_FORCE_FSDP_CPU before any Accelerator exists.
from .routes.distributed import force_fsdp_on_cpu as force_fsdp_on_cpu

__version__ = "0.1.0"

# The rest loads on first use: Trainer, peft and bitsandbytes imports take seconds, which the CLI should not pay.
_LAZY = {
    "LayerwiseCallback": "integrations.callback",
    "LayerwiseOptimizer": "optim.optimizer",
    "LayerwiseParam": "bases.params",
    "LayerwiseTrainer": "integrations.trainer",
    "LayerwiseTrainerMixin": "integrations.trainer",
    "LayerwiseTrainingArguments": "integrations.training_args",
    "build_layerwise_optimizer": "optim.optimizer",
    "install": "integrations.patching",
    "is_layerwise_name": "bases.registry",
    "list_layerwise_optimizers": "bases.registry",
    "register_layerwise_optimizer": "bases.registry",
    "uninstall": "integrations.patching",
    "unregister_layerwise_optimizer": "bases.registry",
    "unwrap_layerwise_optimizer": "optim.optimizer",
}

__all__ = sorted([*_LAZY, "force_fsdp_on_cpu"])


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
