"""accelerate's convention: what `accelerate estimate-memory` prints, reproduced without the Hub (see the package
docstring for how its figures differ from this package's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..platform.compat import dtype_kwargs
from .models import resolve_config
from .units import ACCELERATE_DTYPES, EstimateError, accelerate_format_bytes


@dataclass(frozen=True)
class AccelerateRow:
    """
    One row of `accelerate estimate-memory`'s table, in bytes; `format()` prints it the way accelerate does.

    Args:
        dtype (`str`):
            `float32`, `float16`, `int8` or `int4`.
        largest_layer_bytes (`float`):
            The largest decoder block or leaf module of the base model.
        total_bytes (`float`):
            The base model (no lm_head), parameters and buffers.
        training_bytes (`float`, *optional*):
            accelerate's "Training using Adam"; `None` ("N/A") for int8 / int4.

    Example:

    ```python
    >>> from layerwise_hf.estimate import AccelerateRow
    >>> AccelerateRow("int8", 2**30, 4 * 2**30, None).format()
    ['int8', '1.0 GB', '4.0 GB', 'N/A']
    ```
    """

    dtype: str
    largest_layer_bytes: float
    total_bytes: float
    training_bytes: float | None

    def format(self) -> list[str]:
        training = "N/A" if self.training_bytes is None else accelerate_format_bytes(self.training_bytes)
        return [
            self.dtype,
            accelerate_format_bytes(self.largest_layer_bytes),
            accelerate_format_bytes(self.total_bytes),
            training,
        ]


def accelerate_estimate(model: Any, dtypes: Sequence[str] = ACCELERATE_DTYPES) -> list[AccelerateRow]:
    """
    What `accelerate estimate-memory` prints for `model`, computed without the Hub (see the package docstring for its
    conventions).

    Args:
        model (`str`, `os.PathLike`, `dict` or `PretrainedConfig`):
            As `resolve_config` takes it (accelerate builds `AutoModel` from a config, so not a model).
        dtypes (`Sequence[str]`, *optional*, defaults to `("float32", "float16", "int8", "int4")`):
            accelerate's `--dtypes`.

    Example:

    ```python
    >>> from layerwise_hf.estimate import accelerate_estimate
    >>> (row,) = accelerate_estimate("llama-2-70b", ["float16"])
    >>> row.format()
    ['float16', '1.59 GB', '127.99 GB', '511.96 GB']
    ```
    """
    config, _, _ = resolve_config(model)
    divisors = {"float32": 1, "float16": 2, "int8": 4, "int4": 8}
    keys = [{"fp32": "float32", "fp16": "float16"}.get(dtype, dtype) for dtype in dtypes]
    for dtype, key in zip(dtypes, keys):
        if key not in divisors:
            raise EstimateError(f"accelerate's dtypes are {', '.join(ACCELERATE_DTYPES)}; got {dtype!r}.")
    import torch
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoModel

    # accelerate's own computation on the meta-device base model: its "layer" is a decoder block
    # (`_no_split_modules`) or a leaf module such as the embedding, and its total counts buffers too.
    with torch.device("meta"):
        base = AutoModel.from_config(config, **dtype_kwargs(torch.float32))
    fp32_total, (fp32_largest, _) = calculate_maximum_sizes(base)
    rows = []
    for key in keys:
        # accelerate's estimate_training_usage: the max of model / gradients / optimizer / step, from float32 bytes.
        training = {"float32": 4 * fp32_total, "float16": 2 * fp32_total}.get(key)
        rows.append(AccelerateRow(key, fp32_largest / divisors[key], fp32_total / divisors[key], training))
    return rows
