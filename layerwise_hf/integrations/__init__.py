"""The Hugging Face side: `LayerwiseTrainer` and its mixin (`trainer`), the callback that connects the route at train
begin (`callback`), `LayerwiseTrainingArguments` (`training_args`), checkpoint files (`checkpoint`), and ready-made
classes for libraries built on `Trainer`, each needing its library installed: `layerwise_hf.integrations.trl` needs TRL
(`pip install "layerwise-hf[trl]"`)."""
