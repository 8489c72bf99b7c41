"""Ready-made layer-wise classes for libraries built on `Trainer`. Each submodule needs its library installed:
`layerwise_hf.integrations.trl` needs TRL (`pip install "layerwise-hf[trl]"`)."""
