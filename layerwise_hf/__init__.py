"""Layer-wise optimizers for Hugging Face Trainer and Accelerate."""

from .callback import LayerwiseCallback
from .distributed import force_fsdp_on_cpu
from .optimizer import LayerwiseOptimizer, build_layerwise_optimizer, unwrap_layerwise_optimizer
from .registry import (
    LayerwiseParam,
    is_layerwise_name,
    list_layerwise_optimizers,
    register_layerwise_optimizer,
    unregister_layerwise_optimizer,
)
from .trainer import LayerwiseTrainer, LayerwiseTrainerMixin
from .training_args import LayerwiseTrainingArguments

__version__ = "0.1.0"

__all__ = [
    "LayerwiseCallback",
    "LayerwiseOptimizer",
    "LayerwiseParam",
    "LayerwiseTrainer",
    "LayerwiseTrainerMixin",
    "LayerwiseTrainingArguments",
    "build_layerwise_optimizer",
    "force_fsdp_on_cpu",
    "is_layerwise_name",
    "list_layerwise_optimizers",
    "register_layerwise_optimizer",
    "unregister_layerwise_optimizer",
    "unwrap_layerwise_optimizer",
]
