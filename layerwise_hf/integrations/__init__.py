"""The Hugging Face side: `LayerwiseTrainer` and its mixin (`trainer`), the callback that connects the route at train
begin (`callback`), `LayerwiseTrainingArguments` (`training_args`), checkpoint files (`checkpoint`), and ready-made
classes for libraries built on `Trainer`, each needing its library installed: `layerwise_hf.integrations.trl` needs TRL
(`pip install "layerwise-hf[trl]"`)."""

from ..platform.compat import check_versions

# Before any integration module is imported: an unsupported transformers / accelerate / torch is refused here, with
# the versions, instead of failing further in with a less clear error.
check_versions()
