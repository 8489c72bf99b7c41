"""Dtypes, byte sizes and how numbers are printed: the constants every other part of the estimator reads."""

from __future__ import annotations

from collections.abc import Iterable

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
}
# Frozen weights (LoRA bases) may also be quantized; only the decoder's linear weights are, as with bitsandbytes'
# transformers integration (embeddings, norms and lm_head stay in the compute dtype).
FROZEN_DTYPES = (*DTYPE_BYTES, "int8", "nf4")
NF4_BLOCKSIZE = 64  # bitsandbytes' 4-bit default; one float32 absmax per block (no double quantization)

BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps tensors with fewer elements in 32-bit state
BNB_BLOCKSIZE = 256  # blockwise 8-bit state: one float32 absmax per block
BNB_QMAP_BYTES = 256 * 4  # one float32 quantization map per signed / unsigned state
TORCHAO_BLOCKSIZE = 256  # what Trainer passes to torchao's AdamW8bit / AdamW4bit
SCALAR_BYTES = 4  # a float32 scalar tensor per parameter: torch's `step`, Adafactor's `RMS`

ACCELERATE_DTYPES = ("float32", "float16", "int8", "int4")
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_LORA_TARGETS = ("q_proj", "v_proj")  # PEFT's default for Llama-family models
SHARDINGS = ("none", "ddp", "fsdp2")


class EstimateError(ValueError):
    """
    A bad model, optimizer or option; the command line prints it without a traceback.

    Example:

    ```python
    >>> from layerwise_hf.estimate import EstimateError, estimate
    >>> try:
    ...     estimate("llama-9-7b")
    ... except EstimateError as e:
    ...     print(str(e)[:30])
    Unknown model 'llama-9-7b': no
    ```
    """


def normalize_dtype(name: str, allowed: Iterable[str] = DTYPE_BYTES) -> str:
    """
    The canonical name of a dtype (`"bf16"` -> `"bfloat16"`), or `EstimateError` listing the choices.

    Args:
        name (`str` or `torch.dtype`):
            A dtype name, short (`fp32`, `bf16`, `fp16`) or long, with or without `torch.`.
        allowed (`Iterable[str]`, *optional*, defaults to `DTYPE_BYTES`):
            The canonical names accepted.

    Example:

    ```python
    >>> from layerwise_hf.estimate import normalize_dtype
    >>> normalize_dtype("bf16"), normalize_dtype("torch.float16")
    ('bfloat16', 'float16')
    ```
    """
    key = _DTYPE_ALIASES.get(str(name).lower().removeprefix("torch."), str(name).lower())
    allowed = tuple(allowed)
    if key not in allowed:
        raise EstimateError(f"Unknown dtype {name!r}; choose one of {', '.join(allowed)} (or fp32/bf16/fp16).")
    return key


def blocks(numel: int, blocksize: int) -> int:
    """Blocks of `blocksize` elements needed for `numel` elements (the last one may be partial)."""
    return -(-numel // blocksize)


def format_bytes(n: float, units: str = "binary") -> str:
    """
    `n` bytes in the largest unit below 1024 (binary: KiB, MiB, GiB) or 1000 (decimal: kB, MB, GB).

    Args:
        n (`float`):
            A number of bytes.
        units (`str`, *optional*, defaults to `"binary"`):
            `"binary"` (GiB = 2**30 bytes) or `"decimal"` (GB = 10**9 bytes).

    Example:

    ```python
    >>> from layerwise_hf.estimate import format_bytes
    >>> format_bytes(3 * 2**30), format_bytes(3 * 2**30, "decimal")
    ('3.00 GiB', '3.22 GB')
    ```
    """
    base, names = (
        (1024.0, ("B", "KiB", "MiB", "GiB", "TiB")) if units == "binary" else (1000.0, ("B", "kB", "MB", "GB", "TB"))
    )
    for name in names:
        if abs(n) < base or name == names[-1]:
            return f"{n:.0f} B" if name == "B" else f"{n:.2f} {name}"
        n /= base
    raise AssertionError("unreachable")


def accelerate_format_bytes(size: float) -> str:
    """
    `accelerate.utils.convert_bytes`, copied so the accelerate mode prints exactly what accelerate prints (binary
    sizes labelled "GB").

    Args:
        size (`float`):
            A number of bytes.

    Example:

    ```python
    >>> from layerwise_hf.estimate import accelerate_format_bytes
    >>> accelerate_format_bytes(3 * 2**30)
    '3.0 GB'
    ```
    """
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def format_count(n: float) -> str:
    """
    A parameter count with a K / M / B / T suffix.

    Args:
        n (`float`):
            The count.

    Example:

    ```python
    >>> from layerwise_hf.estimate import format_count
    >>> format_count(6_738_415_616)
    '6.74B'
    ```
    """
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(int(n))
