"""Training-memory estimates with and without a layer-wise optimizer: `estimate()` and `layerwise-hf estimate-memory`.

Parameters are counted exactly from the model transformers builds from the config, on the meta device (nothing is
allocated or downloaded; any architecture `AutoModelForCausalLM` knows); optimizer state is counted per tensor with the
rules the optimizers themselves follow (bitsandbytes keeps tensors under 4096 elements and embeddings in 32-bit,
Adafactor factors matrices, ...). What is counted is what stays allocated across a step: weights, gradients and
optimizer state. Activations, autocast weight copies, FSDP2's all-gathered layer, CUDA context and allocator
fragmentation are not (they depend on batch, sequence length and kernels, not on the optimizer).

Two conventions, because the numbers people compare against come from `accelerate estimate-memory`:

- **this package's** (default): the model as trained (`*ForCausalLM`, so lm_head counts unless tied), parameters
  only, weights + gradients + optimizer state summed, bytes shown in binary units named as such (GiB = 2**30 bytes;
  `--units decimal` for GB = 10**9 bytes).
- **accelerate's** (`--accelerate`, `accelerate_estimate()`): what `accelerate estimate-memory` prints, reproduced
  without the Hub. It builds `AutoModel` (the base model: `LlamaModel`, no lm_head) in float32, counts parameters and
  buffers, and divides the float32 bytes by 2 / 4 / 8 for float16 / int8 / int4. Its sizes are binary (divided by
  1024) but labelled "GB". Its "Training using Adam" is the *largest* of its model / gradients / optimizer / step
  terms, not their sum: 4x the float32 size for float32 (16 B/param) and 2x the float32 size for float16 (8 B/param,
  i.e. 4x the float16 size), int8/int4 "N/A". For Llama-2-70B it printed 128.15 GB (float16) and 512.59 GB (Adam)
  with the transformers of its time, whose every attention layer held float32 rotary caches (80 x (2 x 4096 x 128 +
  64) elements); today's transformers keeps only two 64-element `inv_freq` buffers, which gives 127.99 / 511.96 GB
  (0.12% lower). This package's float16 + `adamw_torch` estimate of the same model is 128.48 GiB of weights and
  513.92 GiB in all: 0.26% above the published figures and 0.38% above today's, by a different route (lm_head
  included; pure float16 weights, gradients and AdamW moments, 2 + 2 + 4 B/param, summed).

Layout: `units` (dtypes, byte sizes, formatting), `models` (parameter tensors from a config or a model, the presets in
`presets/*.json`), `optimizers` (state per tensor, rules in `optimizer_rules.txt`), `buckets` (the layer-wise
data-parallel route's gradient buckets under DDP and the bytes it holds in flight), `core` (`estimate()`),
`accelerate_mode` (`accelerate_estimate()`), `cli` (the `estimate-memory` subcommand and its tables), `offload`
(device and host bytes under `layerwise_offload`), `offload_choice` (norm pass or gradients offload for exact clipping
at GA 1, from a cost model).

Example:

```python
>>> from layerwise_hf.estimate import estimate, format_bytes
>>> est = estimate("llama-2-7b", optimizer="adamw_torch_layerwise", dtype="bf16")
>>> format_bytes(est.total_bytes), format_bytes(est.all_gradient_bytes - est.gradient_bytes)
('37.90 GiB', '12.31 GiB')
```
"""

from .accelerate_mode import AccelerateRow, accelerate_estimate
from .core import MemoryEstimate, estimate
from .models import PRESETS, ModelSpec, ModuleSpec, TensorSpec, list_presets, load_model_spec, resolve_config
from .optimizers import OPTIMIZER_RULES, OptimizerRule, parse_optimizer, tensor_state_bytes
from .units import (
    ACCELERATE_DTYPES,
    BNB_BLOCKSIZE,
    BNB_MIN_8BIT_SIZE,
    BNB_QMAP_BYTES,
    DEFAULT_LORA_TARGETS,
    DTYPE_BYTES,
    FROZEN_DTYPES,
    LINEAR_MODULES,
    NF4_BLOCKSIZE,
    SCALAR_BYTES,
    SHARDINGS,
    TORCHAO_BLOCKSIZE,
    EstimateError,
    accelerate_format_bytes,
    format_bytes,
    format_count,
    normalize_dtype,
)

# NOTE: last, so `layerwise_hf.cli` registers the subcommand from here (`estimate.run` is `estimate.cli.run`).
from .cli import register, render_table, run  # noqa: E402  isort: skip

__all__ = [
    "ACCELERATE_DTYPES",
    "AccelerateRow",
    "BNB_BLOCKSIZE",
    "BNB_MIN_8BIT_SIZE",
    "BNB_QMAP_BYTES",
    "DEFAULT_LORA_TARGETS",
    "DTYPE_BYTES",
    "EstimateError",
    "FROZEN_DTYPES",
    "LINEAR_MODULES",
    "MemoryEstimate",
    "ModelSpec",
    "ModuleSpec",
    "NF4_BLOCKSIZE",
    "OPTIMIZER_RULES",
    "OptimizerRule",
    "PRESETS",
    "SCALAR_BYTES",
    "SHARDINGS",
    "TORCHAO_BLOCKSIZE",
    "TensorSpec",
    "accelerate_estimate",
    "accelerate_format_bytes",
    "estimate",
    "format_bytes",
    "format_count",
    "list_presets",
    "load_model_spec",
    "normalize_dtype",
    "parse_optimizer",
    "register",
    "render_table",
    "resolve_config",
    "run",
    "tensor_state_bytes",
]
