"""`layerwise-hf plan`: simulate one training step on fake tensors (no weights allocated) and say whether it fits.

The model transformers builds from a config runs its own forward and backward under `FakeTensorMode`, with Trainer's
dtype, autocast, activation checkpointing, gradient accumulation and clipping, once with the standard optimizer
Trainer builds and once with the real `LayerwiseOptimizer` (`build_layerwise_optimizer` + `attach()`). `LiveBytes`
(`tracker`) counts every live storage over the second (steady-state) step and splits its peak into weights,
gradients, optimizer state, activations and temporaries. Optimizers whose kernels cannot run on fake tensors
(bitsandbytes, torchao) take their state from the estimator's rules (`rules`). Identical decoder layers are simulated
2-4 at a time and extended when that is exact (`extrapolate`).

With `offload=` (`layerwise_offload`) the layer-wise rows run the real host offload code (`offload`), and each row
gives the device peak and the host peak apart.

Layout: `tracker` (live storage bytes), `rules` (the stand-in for rule-only optimizers), `simulate` (model, optimizer,
step), `offload` (host offload's stand-ins), `extrapolate`, `advice`, `core` (`plan()`, validation, results),
`isolation` (a plan inside a launched run), `batch` (the largest micro-batch that fits), `options` (the choices the
command line lists), `cli` (the `plan` subcommand). Only `layerwise_hf.cli` imports this package.

Example:

```python
>>> from layerwise_hf.plan import plan
>>> result = plan("llama-2-70b", ["adamw_8bit"], seq_len=4096, bf16=True, torch_dtype="bfloat16",
...               gradient_checkpointing=True, device_memory="80GiB")  # doctest: +SKIP
>>> print(result.format())  # doctest: +SKIP
```
"""

import importlib

# NOTE: `layerwise_hf.cli` imports `plan.cli` for every subcommand; torch and transformers load only when a plan runs.
_LAZY = {
    "CATEGORIES": "tracker",
    "LiveBytes": "tracker",
    "Plan": "core",
    "PlanRow": "core",
    "StepSetup": "simulate",
    "max_micro_batch": "batch",
    "parse_size": "core",
    "plan": "core",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
