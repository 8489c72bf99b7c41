"""The 0.1 path of `LayerwiseTrainingArguments` (now `layerwise_hf.integrations.training_args`): a 0.1 checkpoint's
`training_args.bin` pickles the class under this module's name."""

from .integrations.training_args import LayerwiseTrainingArguments

__all__ = ["LayerwiseTrainingArguments"]
