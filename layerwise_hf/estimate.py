"""Training-memory estimates with and without a layer-wise optimizer: `estimate()` and `layerwise-hf estimate-memory`.

Parameters are counted exactly from the architecture (embeddings, attention q/k/v/o with grouped-query heads, MLP
gate/up/down, norms, lm_head tied or not); optimizer state is counted per tensor with the rules the optimizers
themselves follow (bitsandbytes keeps tensors under 4096 elements and embeddings in 32-bit, Adafactor factors
matrices, ...). What is counted is what stays allocated across a step: weights, gradients and optimizer state.
Activations, autocast weight copies, FSDP2's all-gathered layer, CUDA context and allocator fragmentation are not
(they depend on batch, sequence length and kernels, not on the optimizer).

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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# ---- units and dtypes ----

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
    """A bad model, optimizer or option; the command line prints it without a traceback."""


def normalize_dtype(name: str, allowed: Iterable[str] = DTYPE_BYTES) -> str:
    key = _DTYPE_ALIASES.get(str(name).lower().removeprefix("torch."), str(name).lower())
    allowed = tuple(allowed)
    if key not in allowed:
        raise EstimateError(f"Unknown dtype {name!r}; choose one of {', '.join(allowed)} (or fp32/bf16/fp16).")
    return key


def format_bytes(n: float, units: str = "binary") -> str:
    """`n` bytes in the largest unit below 1024 (binary: KiB, MiB, GiB) or 1000 (decimal: kB, MB, GB)."""
    base, names = (
        (1024.0, ("B", "KiB", "MiB", "GiB", "TiB")) if units == "binary" else (1000.0, ("B", "kB", "MB", "GB", "TB"))
    )
    for name in names:
        if abs(n) < base or name == names[-1]:
            return f"{n:.0f} B" if name == "B" else f"{n:.2f} {name}"
        n /= base
    raise AssertionError("unreachable")


def accelerate_format_bytes(size: float) -> str:
    """`accelerate.utils.convert_bytes`, copied so the accelerate mode prints exactly what accelerate prints."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def format_count(n: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(int(n))


# ---- model description ----


@dataclass(frozen=True)
class TensorSpec:
    """
    One parameter tensor, or `count` tensors of the same shape (one per decoder layer).

    Args:
        name (`str`):
            The name in `model.named_parameters()`; `*` stands for the layer index of per-layer tensors.
        shape (`tuple[int, ...]`):
            The tensor's shape.
        count (`int`, *optional*, defaults to `1`):
            How many tensors of this shape the model holds.
        module (`str`, *optional*, defaults to `""`):
            The owning module's short name (`"q_proj"`, `"embed_tokens"`, ...): what LoRA targets and
            quantization match.
        is_embedding (`bool`, *optional*, defaults to `False`):
            The weight of an `nn.Embedding` (bitsandbytes 8-bit keeps it in 32-bit state, as Trainer asks).
        tied (`bool`, *optional*, defaults to `False`):
            Shared by the input embedding and the lm_head.
        trainable (`bool`, *optional*):
            Fixed by a real model's `requires_grad`; `None` lets `estimate()` decide from its options.
        dtype (`str`, *optional*):
            Fixed by a real model (with its `element_size`); `None` means the estimate's `dtype`.
        element_size (`int`, *optional*):
            Bytes per element of `dtype`.
    """

    name: str
    shape: tuple[int, ...]
    count: int = 1
    module: str = ""
    is_embedding: bool = False
    tied: bool = False
    trainable: bool | None = None
    dtype: str | None = None
    element_size: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelSpec:
    """
    A decoder-only transformer of the Llama family (Llama, Mistral, Qwen2, Qwen3), described by its config values.

    Args:
        name (`str`):
            Shown in tables.
        model_type (`str`):
            `"llama"`, `"mistral"`, `"qwen2"` or `"qwen3"`: decides the biases and norms.
        vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads (`int`):
            As in the model's config.json.
        num_key_value_heads (`int`):
            Fewer than `num_attention_heads` for grouped-query attention (k/v projections shrink accordingly).
        head_dim (`int`):
            Per-head width; `hidden_size // num_attention_heads` unless the config says otherwise.
        tie_word_embeddings (`bool`, *optional*, defaults to `False`):
            lm_head shares the input embedding's weight.
        attention_bias (`bool`, *optional*, defaults to `False`):
            Biases on q/k/v/o (Llama's and Qwen3's `attention_bias`).
        qkv_bias (`bool`, *optional*, defaults to `False`):
            Biases on q/k/v only (Qwen2).
        mlp_bias (`bool`, *optional*, defaults to `False`):
            Biases on gate/up/down (Llama's `mlp_bias`).
        qk_norm (`bool`, *optional*, defaults to `False`):
            RMSNorm over `head_dim` on queries and keys (Qwen3).
        source (`str`, *optional*, defaults to `""`):
            Where the dimensions come from.
    """

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    source: str = ""

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """`(in_features, out_features)` of every per-layer linear module."""
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        return {
            "q_proj": (self.hidden_size, q_out),
            "k_proj": (self.hidden_size, kv_out),
            "v_proj": (self.hidden_size, kv_out),
            "o_proj": (q_out, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }

    def tensors(self, include_lm_head: bool = True) -> list[TensorSpec]:
        """Every parameter tensor, in `named_parameters()` order; without lm_head it is the base model."""
        n = self.num_hidden_layers
        out = [
            TensorSpec(
                "model.embed_tokens.weight",
                (self.vocab_size, self.hidden_size),
                module="embed_tokens",
                is_embedding=True,
                tied=self.tie_word_embeddings,
            )
        ]
        attention = {"q_proj", "k_proj", "v_proj", "o_proj"}
        biased = {m: self.attention_bias for m in attention}
        if self.qkv_bias:
            biased.update(q_proj=True, k_proj=True, v_proj=True)
        biased.update({m: self.mlp_bias for m in ("gate_proj", "up_proj", "down_proj")})
        for module, (fan_in, fan_out) in self.linear_shapes().items():
            if module == "gate_proj" and self.qk_norm:
                # Qwen3's per-head norms are defined after o_proj, so they come before the MLP in named_parameters().
                for norm in ("q_norm", "k_norm"):
                    out.append(TensorSpec(f"model.layers.*.self_attn.{norm}.weight", (self.head_dim,), n, norm))
            block = "self_attn" if module in attention else "mlp"
            out.append(TensorSpec(f"model.layers.*.{block}.{module}.weight", (fan_out, fan_in), n, module))
            if biased[module]:
                out.append(TensorSpec(f"model.layers.*.{block}.{module}.bias", (fan_out,), n, module))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out.append(TensorSpec(f"model.layers.*.{norm}.weight", (self.hidden_size,), n, norm))
        out.append(TensorSpec("model.norm.weight", (self.hidden_size,), module="norm"))
        if include_lm_head and not self.tie_word_embeddings:
            out.append(TensorSpec("lm_head.weight", (self.vocab_size, self.hidden_size), module="lm_head"))
        return out

    def num_parameters(self, include_lm_head: bool = True) -> int:
        """Exact parameter count (a tied lm_head counted once, as `model.parameters()` does)."""
        return sum(t.numel * t.count for t in self.tensors(include_lm_head))

    def rotary_buffer_numel(self) -> int:
        # transformers 5 registers `inv_freq` and `original_inv_freq` (head_dim / 2 floats each) on the base model.
        return 2 * ((self.head_dim + 1) // 2)

    @classmethod
    def from_config(cls, config: Any, name: str | None = None, source: str = "") -> ModelSpec:
        """From a `PretrainedConfig` (or anything with its attributes) of a supported `model_type`."""
        model_type = getattr(config, "model_type", "llama")
        if model_type not in FORMULA_MODEL_TYPES:
            raise EstimateError(
                f"model_type {model_type!r} has no formula; supported: {', '.join(FORMULA_MODEL_TYPES)}"
            )
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            name=name or getattr(config, "_name_or_path", "") or model_type,
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(config, "attention_bias", False)) and model_type != "qwen2",
            qkv_bias=model_type == "qwen2",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            source=source,
        )


@dataclass(frozen=True)
class ModuleSpec:
    """
    The parameters of a real (or meta-device) model, as `ModelSpec.tensors()` would list them; from
    `ModuleSpec.from_module(model)`. Each tensor carries its dtype and `requires_grad`.
    """

    name: str
    parameters: tuple[TensorSpec, ...]
    source: str = ""

    def tensors(self, include_lm_head: bool = True) -> list[TensorSpec]:
        return list(self.parameters)

    def num_parameters(self, include_lm_head: bool = True) -> int:
        return sum(t.numel * t.count for t in self.parameters)

    @classmethod
    def from_module(cls, model: Any, name: str | None = None, source: str = "") -> ModuleSpec:
        from torch import nn

        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        seen: dict[int, int] = {}
        tensors: list[TensorSpec] = []
        for pname, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                # A second name for the same tensor: the tie (embedding / lm_head); counted once.
                tensors[seen[id(p)]] = dataclasses.replace(tensors[seen[id(p)]], tied=True)
                continue
            seen[id(p)] = len(tensors)
            tensors.append(
                TensorSpec(
                    pname,
                    tuple(p.shape),
                    module=pname.rsplit(".", 2)[-2] if "." in pname else pname,
                    is_embedding=id(p) in embeddings,
                    trainable=p.requires_grad,
                    dtype=str(p.dtype).removeprefix("torch."),
                    element_size=p.element_size(),
                )
            )
        return cls(name=name or type(model).__name__, parameters=tuple(tensors), source=source)


FORMULA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# Published dimensions, from each model's config.json on the Hugging Face Hub (the key is the repository).
# Parameter counts follow from them exactly, e.g. Llama-2-7B 6,738,415,616 and Llama-3-8B 8,030,261,248.
_LLAMA2_VOCAB = 32000
_LLAMA3_VOCAB = 128256
_QWEN_VOCAB = 151936
PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": dict(
        source="meta-llama/Llama-2-7b-hf",
        model_type="llama",
        vocab_size=_LLAMA2_VOCAB,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "llama-2-13b": dict(
        source="meta-llama/Llama-2-13b-hf",
        model_type="llama",
        vocab_size=_LLAMA2_VOCAB,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "llama-2-70b": dict(
        source="meta-llama/Llama-2-70b-hf",
        model_type="llama",
        vocab_size=_LLAMA2_VOCAB,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "llama-3-8b": dict(
        source="meta-llama/Meta-Llama-3-8B",
        model_type="llama",
        vocab_size=_LLAMA3_VOCAB,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "llama-3-70b": dict(
        source="meta-llama/Meta-Llama-3-70B",
        model_type="llama",
        vocab_size=_LLAMA3_VOCAB,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "llama-3.1-405b": dict(
        source="meta-llama/Llama-3.1-405B",
        model_type="llama",
        vocab_size=_LLAMA3_VOCAB,
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        source="meta-llama/Llama-3.2-1B",
        model_type="llama",
        vocab_size=_LLAMA3_VOCAB,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "llama-3.2-3b": dict(
        source="meta-llama/Llama-3.2-3B",
        model_type="llama",
        vocab_size=_LLAMA3_VOCAB,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "mistral-7b": dict(
        source="mistralai/Mistral-7B-v0.1",
        model_type="mistral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "qwen2.5-0.5b": dict(
        source="Qwen/Qwen2.5-0.5B",
        model_type="qwen2",
        vocab_size=_QWEN_VOCAB,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        source="Qwen/Qwen2.5-7B",
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "qwen3-8b": dict(
        source="Qwen/Qwen3-8B",
        model_type="qwen3",
        vocab_size=_QWEN_VOCAB,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
}


def list_presets() -> list[str]:
    """The built-in model names, sorted."""
    return sorted(PRESETS)


def _preset_key(name: str) -> str | None:
    key = name.strip().lower()
    if key in PRESETS:
        return key
    for preset, values in PRESETS.items():
        if values["source"].lower() == key:
            return preset
    return None


def _config_from_dict(values: dict[str, Any], name: str) -> Any:
    values = {k: v for k, v in values.items() if k != "source"}
    model_type = values.get("model_type")
    if not model_type:
        raise EstimateError(f"{name}: no `model_type` in the config.")
    if "text_config" in values and "vocab_size" not in values:
        raise EstimateError(f"{name}: a multimodal config (text_config); pass the text model's config.json.")
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**values)
    except (ValueError, KeyError, TypeError) as e:
        raise EstimateError(f"{name}: transformers cannot build a {model_type!r} config: {e}") from e


def resolve_config(model: Any) -> tuple[Any, str, str]:
    """
    `(PretrainedConfig, name, source)` for a preset name (or its Hub repository), a local config.json or a directory
    holding one, a config dict or a `PretrainedConfig`. Nothing is downloaded.
    """
    if isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
        path = os.path.join(text, "config.json") if os.path.isdir(text) else text
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    values = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise EstimateError(f"{path} is not a JSON config: {e}") from e
            if not isinstance(values, dict):
                raise EstimateError(f"{path} is not a JSON config (not an object).")
            name = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
            return _config_from_dict(values, path), name, path
        key = _preset_key(text)
        if key is None:
            raise EstimateError(
                f"Unknown model {text!r}: not a config.json file or directory, and not a preset. "
                f"Presets: {', '.join(list_presets())}."
            )
        return _config_from_dict(PRESETS[key], key), key, PRESETS[key]["source"]
    if isinstance(model, dict):
        name = model.get("_name_or_path") or model.get("model_type") or "model"
        return _config_from_dict(model, name), name, ""
    if hasattr(model, "to_dict") and hasattr(model, "model_type"):
        return model, getattr(model, "_name_or_path", "") or model.model_type, ""
    raise EstimateError(f"Cannot estimate from a {type(model).__name__}.")


def load_model_spec(model: Any) -> ModelSpec | ModuleSpec:
    """
    Resolve what `estimate()` accepts into a model description.

    Args:
        model (`str`, `os.PathLike`, `dict`, `PretrainedConfig`, `ModelSpec`, `ModuleSpec` or `nn.Module`):
            A preset name (`list_presets()`, or its Hub repository such as `"meta-llama/Llama-2-70b-hf"`), a local
            config.json or a directory holding one, a config dict or object, or a model (its parameters, dtypes and
            `requires_grad` are read as they are). Nothing is downloaded.
    """
    if isinstance(model, (ModelSpec, ModuleSpec)):
        return model
    if hasattr(model, "named_parameters"):
        return ModuleSpec.from_module(model)
    config, name, source = resolve_config(model)
    if config.model_type in FORMULA_MODEL_TYPES:
        return ModelSpec.from_config(config, name=name, source=source)
    # Any other architecture transformers knows: build it on the meta device (no memory, no download) and read its
    # parameters, which is exact by construction.
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(config)
    return ModuleSpec.from_module(module, name=name, source=source)


# ---- optimizers ----


@dataclass(frozen=True)
class OptimizerRule:
    """
    Per-tensor optimizer state of one Trainer optimizer.

    Args:
        states (`int`):
            Full-size state buffers per parameter (AdamW: exp_avg and exp_avg_sq).
        bits (`int`):
            `0`: the parameter's dtype (torch optimizers); `32`: float32; `8` / `4`: quantized (blockwise).
        family (`str`):
            `"torch"`, `"bnb"`, `"torchao"` or `"adafactor"`: how small tensors, embeddings and scalars are kept.
        qmaps (`int`, *optional*, defaults to `0`):
            bitsandbytes 8-bit quantization maps referenced per state (256 float32 each).
        fsdp2 (`bool`, *optional*, defaults to `False`):
            Elementwise: the layer-wise path can step FSDP2 shards with it (see `distributed.ELEMENTWISE_OPTIMIZERS`).
        exact (`bool`, *optional*, defaults to `True`):
            Checked against the optimizer's real state here; `False` for packages not installed in the tests.
    """

    states: int
    bits: int
    family: str
    qmaps: int = 0
    fsdp2: bool = False
    exact: bool = True


OPTIMIZER_RULES: dict[str, OptimizerRule] = {
    "adamw_torch": OptimizerRule(2, 0, "torch", fsdp2=True),
    "adamw_torch_fused": OptimizerRule(2, 0, "torch", fsdp2=True),
    "adamw_torch_xla": OptimizerRule(2, 0, "torch", exact=False),
    "adamw_torch_npu_fused": OptimizerRule(2, 0, "torch", exact=False),
    "adamw_anyprecision": OptimizerRule(2, 32, "torch", exact=False),
    "stable_adamw": OptimizerRule(2, 0, "torch", exact=False),
    "grokadamw": OptimizerRule(3, 0, "torch", exact=False),
    "adafactor": OptimizerRule(1, 32, "adafactor"),
    "sgd": OptimizerRule(0, 0, "torch", fsdp2=True),
    "adagrad": OptimizerRule(1, 0, "torch", fsdp2=True),
    "rmsprop": OptimizerRule(1, 0, "torch", fsdp2=True),
    "adamw_8bit": OptimizerRule(2, 8, "bnb", qmaps=2),
    "adamw_bnb_8bit": OptimizerRule(2, 8, "bnb", qmaps=2),
    "paged_adamw_8bit": OptimizerRule(2, 8, "bnb", qmaps=2),
    "paged_adamw_32bit": OptimizerRule(2, 32, "bnb"),
    "lion_8bit": OptimizerRule(1, 8, "bnb", qmaps=1),
    "paged_lion_8bit": OptimizerRule(1, 8, "bnb", qmaps=1),
    "lion_32bit": OptimizerRule(1, 32, "bnb"),
    "paged_lion_32bit": OptimizerRule(1, 32, "bnb"),
    "rmsprop_bnb": OptimizerRule(1, 32, "bnb"),
    "rmsprop_bnb_32bit": OptimizerRule(1, 32, "bnb"),
    "rmsprop_bnb_8bit": OptimizerRule(1, 8, "bnb", qmaps=1),
    "ademamix": OptimizerRule(3, 32, "bnb"),
    "paged_ademamix_32bit": OptimizerRule(3, 32, "bnb"),
    "ademamix_8bit": OptimizerRule(3, 8, "bnb", qmaps=2),
    "paged_ademamix_8bit": OptimizerRule(3, 8, "bnb", qmaps=2),
    "adamw_torch_8bit": OptimizerRule(2, 8, "torchao", exact=False),
    "adamw_torch_4bit": OptimizerRule(2, 4, "torchao", exact=False),
}
"""State per trainable tensor, from each optimizer's source (torch 2.13, transformers 5.24, bitsandbytes 0.50):

- torch AdamW/Adagrad/RMSprop: moments in the parameter's dtype plus a float32 `step` scalar; SGD (Trainer's default
  momentum 0) keeps nothing. stable_adamw (torch-optimi) adds a Kahan buffer for 16-bit parameters; grokadamw keeps
  a third EMA; adamw_anyprecision keeps float32 moments by default.
- transformers' Adafactor (no first moment by default): float32 row + column second moments for matrices, a full
  one for vectors, and a float32 `RMS` scalar.
- bitsandbytes: float32 state (`step` is a Python int). 8-bit variants store one byte per element plus a float32
  absmax per 256-element block (AdEMAMix: two for its double first state), except tensors under 4096 elements and
  embeddings (Trainer's override), which stay 32-bit.
- torchao AdamW8bit/4bit: one byte / half a byte per element plus a float32 scale per 256-element block, for tensors
  of at least 4096 elements divisible into blocks; others stay in the parameter's dtype.
"""


def parse_optimizer(name: str) -> tuple[str, bool]:
    """`("adamw_torch", True)` for `"adamw_torch_layerwise"`; raises `EstimateError` listing the known names."""
    name = str(getattr(name, "value", name))
    layerwise = name.endswith("_layerwise")
    base = name.removesuffix("_layerwise")
    if base not in OPTIMIZER_RULES:
        raise EstimateError(
            f"Unknown optimizer {name!r} for the estimate; choose one of {', '.join(sorted(OPTIMIZER_RULES))} "
            "(each also as <name>_layerwise)."
        )
    return base, layerwise


def _blocks(numel: int, blocksize: int) -> int:
    return -(-numel // blocksize)


def tensor_state_bytes(rule: OptimizerRule, tensor: TensorSpec, param_bytes: int, is_embedding: bool) -> int:
    """State bytes of one tensor (quantization maps excluded: they are shared, see `estimate`)."""
    numel = tensor.numel
    if rule.family == "torch":
        element = param_bytes if rule.bits == 0 else rule.bits // 8
        states = rule.states + (1 if rule is OPTIMIZER_RULES["stable_adamw"] and param_bytes < 4 else 0)
        step = SCALAR_BYTES if rule.states else 0
        return states * numel * element + step
    if rule.family == "adafactor":
        if len(tensor.shape) >= 2:
            rows = math.prod(tensor.shape[:-1])
            cols = math.prod(tensor.shape[:-2]) * tensor.shape[-1]
            return 4 * (rows + cols) + SCALAR_BYTES
        return 4 * numel + SCALAR_BYTES
    if rule.family == "bnb":
        if rule.bits == 32 or numel < BNB_MIN_8BIT_SIZE or is_embedding:
            return 4 * rule.states * numel
        return rule.states * (numel + 4 * _blocks(numel, BNB_BLOCKSIZE))
    if rule.family == "torchao":
        if numel < 4096 or numel % TORCHAO_BLOCKSIZE:
            return rule.states * numel * param_bytes + SCALAR_BYTES
        return rule.states * (numel * rule.bits // 8 + 4 * _blocks(numel, TORCHAO_BLOCKSIZE)) + SCALAR_BYTES
    raise AssertionError(rule.family)


def _uses_qmaps(rule: OptimizerRule, tensor: TensorSpec, is_embedding: bool) -> bool:
    return rule.family == "bnb" and rule.bits == 8 and tensor.numel >= BNB_MIN_8BIT_SIZE and not is_embedding


# ---- the estimate ----


@dataclass
class MemoryEstimate:
    """
    Memory of one training configuration. Byte fields are exact integers; the components are for one full replica
    of the model (unsharded) and `per_gpu_bytes` is what one device holds.

    Args:
        model (`str`):
            The model's name.
        optimizer (`str`):
            As asked (`"adamw_torch_layerwise"`); `base_optimizer` is without the suffix.
        layerwise (`bool`):
            One optimizer per parameter, stepped in backward (gradients freed as they are used).
        dtype (`str`):
            The trainable weights' dtype (gradients share it).
        num_parameters, num_trainable_parameters (`int`):
            With LoRA, the parameters include the adapters.
        largest_parameter (`str`), largest_parameter_bytes (`int`):
            The largest trainable tensor: the layer-wise gradient term on one process (two of it for a tied
            embedding; the largest FSDP2 unit under FSDP2).
        weight_bytes, gradient_bytes, optimizer_state_bytes (`int`):
            The three terms. Under DDP `gradient_bytes` includes the reducer's bucket buffers.
        total_bytes (`int`):
            Their sum.
        per_gpu_bytes (`int`):
            What each of `world_size` devices holds: `total_bytes`, or its share under FSDP2.
        all_gradient_bytes (`int`):
            Every trainable gradient at once (what the standard optimizer holds at its step), for comparison.
        notes (`list[str]`):
            What the figures assume or leave out for this configuration.
    """

    model: str
    optimizer: str
    base_optimizer: str
    layerwise: bool
    dtype: str
    world_size: int
    sharding: str
    gradient_accumulation_steps: int
    num_parameters: int
    num_trainable_parameters: int
    largest_parameter: str
    largest_parameter_bytes: int
    weight_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    total_bytes: int
    per_gpu_bytes: int
    all_gradient_bytes: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _lora_tensors(spec: ModelSpec, rank: int, targets: Sequence[str]) -> list[TensorSpec]:
    shapes = spec.linear_shapes()
    if "all-linear" in targets:
        targets = LINEAR_MODULES
    unknown = sorted(set(targets) - set(shapes))
    if unknown:
        raise EstimateError(
            f"Unknown LoRA target module(s) {', '.join(unknown)}; "
            f"choose from {', '.join(LINEAR_MODULES)} or all-linear."
        )
    out = []
    for module in LINEAR_MODULES:
        if module in targets:
            fan_in, fan_out = shapes[module]
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"model.layers.*.{block}.{module}"
            layers = spec.num_hidden_layers
            out.append(TensorSpec(f"{prefix}.lora_A.weight", (rank, fan_in), layers, "lora_A", trainable=True))
            out.append(TensorSpec(f"{prefix}.lora_B.weight", (fan_out, rank), layers, "lora_B", trainable=True))
    return out


def _frozen_bytes(tensor: TensorSpec, frozen_dtype: str, dtype: str) -> int:
    quantizable = tensor.module in LINEAR_MODULES and len(tensor.shape) == 2
    if frozen_dtype == "int8" and quantizable:
        return tensor.numel + 4 * tensor.shape[0]  # LLM.int8(): one float32 scale per output row
    if frozen_dtype == "nf4" and quantizable:
        return tensor.numel // 2 + 4 * _blocks(tensor.numel, NF4_BLOCKSIZE)
    if frozen_dtype in DTYPE_BYTES:
        return tensor.numel * DTYPE_BYTES[frozen_dtype]
    return tensor.numel * DTYPE_BYTES[dtype]


def estimate(
    model: Any,
    *,
    optimizer: str = "adamw_torch_layerwise",
    dtype: str = "bfloat16",
    layerwise: bool | None = None,
    trainable_fraction: float | None = None,
    lora_rank: int | None = None,
    lora_target_modules: Sequence[str] = DEFAULT_LORA_TARGETS,
    adapter_dtype: str = "float32",
    frozen_dtype: str | None = None,
    gradient_accumulation_steps: int = 1,
    world_size: int = 1,
    sharding: str | None = None,
    gradient_as_bucket_view: bool = False,
) -> MemoryEstimate:
    """
    Estimate the weights, gradients and optimizer state of training `model`.

    Args:
        model (`str`, `os.PathLike`, `dict`, `PretrainedConfig`, `ModelSpec` or `nn.Module`):
            See `load_model_spec`. With a real model, each parameter's dtype and `requires_grad` are used as they are
            (a PEFT model estimates its adapters): `dtype` and `frozen_dtype` are ignored, LoRA and
            `trainable_fraction` are not allowed.
        optimizer (`str`, *optional*, defaults to `"adamw_torch_layerwise"`):
            A Trainer optimizer name (`OPTIMIZER_RULES`), or its `_layerwise` form.
        dtype (`str`, *optional*, defaults to `"bfloat16"`):
            The dtype the weights are stored in (`float32`/`bfloat16`/`float16`, or `fp32`/`bf16`/`fp16`).
            Trainer's `bf16=True` autocasts a float32 model: its weights, gradients and state stay float32.
        layerwise (`bool`, *optional*):
            Overrides what the `_layerwise` suffix of `optimizer` says.
        trainable_fraction (`float`, *optional*):
            Train this fraction of every tensor (an approximation of freezing some layers); the layer-wise gradient
            term stays the largest tensor, the worst case.
        lora_rank (`int`, *optional*):
            Train LoRA adapters of this rank on `lora_target_modules` and freeze the rest.
        lora_target_modules (`Sequence[str]`, *optional*, defaults to `("q_proj", "v_proj")`):
            Among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or `"all-linear"`.
        adapter_dtype (`str`, *optional*, defaults to `"float32"`):
            PEFT keeps adapters in float32 on a 16-bit base (`autocast_adapter_dtype=True`).
        frozen_dtype (`str`, *optional*):
            Storage of frozen weights, defaults to `dtype`; `"int8"` or `"nf4"` quantize the decoder's linear weights
            (QLoRA-style; no double quantization).
        gradient_accumulation_steps (`int`, *optional*, defaults to `1`):
            Above 1, a layer-wise optimizer holds every gradient during the window, like the standard one.
        world_size (`int`, *optional*, defaults to `1`):
            Number of devices.
        sharding (`str`, *optional*):
            `"none"` (one device), `"ddp"` or `"fsdp2"`; defaults to `"none"` for one device, `"ddp"` otherwise.
            FSDP2 divides weights, gradients and state by `world_size` (layer-wise, the gradient term becomes the
            largest FSDP2 unit: one reduce-scatter delivers a unit's shards together). DDP replicates them and its
            reducer keeps bucket buffers as large as all gradients, so a layer-wise optimizer under DDP does not save
            gradient memory.
        gradient_as_bucket_view (`bool`, *optional*, defaults to `False`):
            DDP's option making `.grad` a view of its buckets (one copy of the gradients instead of two).
    """
    spec = load_model_spec(model)
    base, suffix_layerwise = parse_optimizer(optimizer)
    layerwise = suffix_layerwise if layerwise is None else bool(layerwise)
    rule = OPTIMIZER_RULES[base]
    dtype = normalize_dtype(dtype)
    adapter_dtype = normalize_dtype(adapter_dtype)
    frozen_dtype = dtype if frozen_dtype is None else normalize_dtype(frozen_dtype, FROZEN_DTYPES)
    sharding = sharding or ("none" if world_size == 1 else "ddp")
    if sharding not in SHARDINGS:
        raise EstimateError(f"Unknown sharding {sharding!r}; choose one of {', '.join(SHARDINGS)}.")
    if world_size < 1 or (sharding == "none" and world_size != 1):
        raise EstimateError(
            f"world_size={world_size} with sharding={sharding!r}: use ddp or fsdp2 for several devices."
        )
    if gradient_accumulation_steps < 1:
        raise EstimateError("gradient_accumulation_steps must be at least 1.")
    if lora_rank is not None and trainable_fraction is not None:
        raise EstimateError("Give either lora_rank or trainable_fraction, not both.")
    if trainable_fraction is not None and not 0 < trainable_fraction <= 1:
        raise EstimateError(f"trainable_fraction must be in (0, 1], got {trainable_fraction}.")
    if lora_rank is not None and lora_rank < 1:
        raise EstimateError(f"lora_rank must be positive, got {lora_rank}.")
    notes: list[str] = []

    if isinstance(spec, ModuleSpec):
        if lora_rank is not None or trainable_fraction is not None:
            raise EstimateError("A real model's requires_grad decides what trains; apply LoRA to it (peft) instead.")
        entries = [(t, t.element_size or DTYPE_BYTES[dtype], bool(t.trainable), 1.0) for t in spec.tensors()]
        dtype = _dominant_dtype(spec.tensors()) or dtype
    else:
        tensors = spec.tensors()
        if lora_rank is not None:
            entries = [(t, None, False, 1.0) for t in tensors]
            adapters = _lora_tensors(spec, lora_rank, lora_target_modules)
            entries += [(t, DTYPE_BYTES[adapter_dtype], True, 1.0) for t in adapters]
        else:
            fraction = 1.0 if trainable_fraction is None else float(trainable_fraction)
            entries = [(t, DTYPE_BYTES[dtype], True, fraction) for t in tensors]
            if fraction < 1:
                notes.append(f"{fraction:g} of every tensor trains: an approximation of freezing whole layers.")

    weight_bytes = 0
    all_grads = 0
    state = 0
    qmap_users = 0
    trainable_params = 0
    total_params = 0
    largest: tuple[int, str] = (0, "")
    largest_untied = 0
    tied: tuple[int, str] = (0, "")
    bnb_fp32_tensors = 0
    # Trainable gradient bytes per FSDP2 unit: one decoder layer each, the rest (embeddings, norm, lm_head) the root.
    unit_grads: dict[str, int] = {}
    unit_weights: dict[str, int] = {}
    for tensor, elem_bytes, trainable, fraction in entries:
        count = tensor.count
        total_params += tensor.numel * count
        unit = _fsdp2_unit(tensor.name)
        per_unit = 1 if "*" in unit else count  # a `*` tensor is one per layer, so once in each layer's unit
        if not trainable:
            # A real model's frozen tensors are counted as stored; a config's follow frozen_dtype.
            stored = tensor.numel * elem_bytes if elem_bytes else _frozen_bytes(tensor, frozen_dtype, dtype)
            weight_bytes += count * stored
            unit_weights[unit] = unit_weights.get(unit, 0) + per_unit * stored
            continue
        weight_bytes += count * tensor.numel * elem_bytes
        grad = tensor.numel * elem_bytes
        unit_weights[unit] = unit_weights.get(unit, 0) + per_unit * grad
        unit_grads[unit] = unit_grads.get(unit, 0) + round(per_unit * grad * fraction)
        trainable_params += round(tensor.numel * count * fraction)
        all_grads += round(count * grad * fraction)
        state += round(count * tensor_state_bytes(rule, tensor, elem_bytes, tensor.is_embedding) * fraction)
        if _uses_qmaps(rule, tensor, tensor.is_embedding):
            qmap_users += count
        elif rule.family == "bnb" and rule.bits == 8:
            bnb_fp32_tensors += count
        largest = max(largest, (grad, tensor.name), key=lambda x: x[0])
        if tensor.tied:
            tied = max(tied, (grad, tensor.name), key=lambda x: x[0])
        else:
            largest_untied = max(largest_untied, grad)
    if trainable_params == 0:
        raise EstimateError(f"{spec.name}: nothing is trainable.")
    if qmap_users:
        # Each layer-wise inner optimizer builds its own maps; one standard optimizer shares one set.
        state += rule.qmaps * BNB_QMAP_BYTES * (qmap_users if layerwise else 1)
    if bnb_fp32_tensors:
        notes.append(
            f"{base}: {bnb_fp32_tensors} tensor(s) keep 32-bit state (embeddings, and tensors under "
            f"{BNB_MIN_8BIT_SIZE} elements)."
        )
    if not rule.exact:
        notes.append(f"{base}: its state size follows the package's source, not checked here (not installed).")

    largest_bytes, largest_name = largest
    if not layerwise:
        grads = all_grads
    elif gradient_accumulation_steps > 1:
        grads = all_grads
        notes.append("Gradient accumulation > 1: the layer-wise optimizer holds every gradient during the window.")
    elif tied[0]:
        # The lm_head half of a tied weight's gradient waits in autograd's input buffer through the whole backward,
        # until the embedding's backward adds its half: it is alive next to every other gradient, then next to that
        # second half.
        grads = min(all_grads, tied[0] + max(tied[0], largest_untied))
        notes.append(
            f"Tied embeddings: the lm_head part of {tied[1]}'s gradient is held through the whole backward, so the "
            "layer-wise gradient term is that tensor plus the larger of itself and the largest other tensor."
        )
    else:
        grads = min(all_grads, largest_bytes)
    if sharding == "fsdp2" and layerwise and gradient_accumulation_steps == 1:
        # FSDP2 reduce-scatters a unit's gradients together and calls the hooks on the local shards afterwards, so the
        # shards of a whole unit are alive at once (before being divided across devices below).
        grads = max(grads, max(unit_grads.values(), default=0))
        notes.append(
            "FSDP2 layer-wise: a unit's gradient shards arrive together from one reduce-scatter, so the gradient "
            "term is the largest unit (a decoder layer, or the embeddings with lm_head)."
        )

    per_gpu = None
    if sharding == "ddp":
        # The reducer allocates flat buckets for every gradient at wrap time; `.grad` is a second copy unless it is
        # a view of them. The layer-wise comm hook steps from the buckets and frees `.grad`.
        buckets = all_grads
        if layerwise or gradient_as_bucket_view:
            grads = buckets + (grads if layerwise and not gradient_as_bucket_view else 0)
        else:
            grads = buckets + all_grads
        notes.append(
            "DDP: gradients include the reducer's bucket buffers (as large as all gradients), so layer-wise saves no "
            "gradient memory under DDP; FSDP2 or one process does."
        )
    total = weight_bytes + grads + state
    if sharding == "fsdp2":
        per_gpu = -(-total // world_size)
        layer_bytes = max((v for k, v in unit_weights.items() if k != "root"), default=0)
        layer = f" ({format_bytes(layer_bytes)} per decoder layer)" if layer_bytes else ""
        notes.append(
            f"FSDP2: also not included, the unsharded weights of the unit being computed{layer}, all-gathered "
            "for its forward and backward."
        )
        if layerwise and not rule.fsdp2:
            notes.append(
                f"{base}_layerwise is refused under FSDP2 (its update is not elementwise); use adamw_torch, sgd, "
                "rmsprop or adagrad."
            )
    if per_gpu is None:
        per_gpu = total
    notes.append("Not included: activations, autocast copies, temporary buffers, CUDA context.")
    return MemoryEstimate(
        model=spec.name,
        optimizer=f"{base}_layerwise" if layerwise else base,
        base_optimizer=base,
        layerwise=layerwise,
        dtype=dtype,
        world_size=world_size,
        sharding=sharding,
        gradient_accumulation_steps=gradient_accumulation_steps,
        num_parameters=total_params,
        num_trainable_parameters=trainable_params,
        largest_parameter=largest_name,
        largest_parameter_bytes=largest_bytes,
        weight_bytes=weight_bytes,
        gradient_bytes=grads,
        optimizer_state_bytes=state,
        total_bytes=total,
        per_gpu_bytes=per_gpu,
        all_gradient_bytes=all_grads,
        notes=notes,
    )


def _fsdp2_unit(name: str) -> str:
    # accelerate's FSDP2 wrapping makes each decoder layer (`_no_split_modules`) a unit; everything else is the root.
    match = re.search(r"(^|\.)layers\.(\d+|\*)\.", name)
    return match.group(0) if match else "root"


def _dominant_dtype(tensors: Sequence[TensorSpec]) -> str | None:
    sizes: dict[str, int] = {}
    for t in tensors:
        if t.trainable and t.dtype:
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel * t.count
    return max(sizes, key=sizes.get) if sizes else None


# ---- accelerate's convention ----


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
    What `accelerate estimate-memory` prints for `model`, computed without the Hub (see the module docstring for its
    conventions).

    Args:
        model (`str`, `os.PathLike`, `dict` or `PretrainedConfig`):
            As `resolve_config` takes it (accelerate builds `AutoModel` from a config, so not a model).
        dtypes (`Sequence[str]`, *optional*, defaults to `("float32", "float16", "int8", "int4")`):
            accelerate's `--dtypes`.
    """
    config, _, _ = resolve_config(model)
    if config.model_type in FORMULA_MODEL_TYPES:
        spec = ModelSpec.from_config(config)
        per_layer = sum(t.numel for t in spec.tensors(include_lm_head=False) if t.name.startswith("model.layers.*."))
        fp32_total = 4 * (spec.num_parameters(include_lm_head=False) + spec.rotary_buffer_numel())
        # accelerate's "layer": a decoder block (`_no_split_modules`) or a leaf module such as the embedding.
        fp32_largest = 4 * max(per_layer, spec.vocab_size * spec.hidden_size)
    else:
        # Any other architecture: accelerate's own computation on the meta-device base model.
        import torch
        from accelerate.utils import calculate_maximum_sizes
        from transformers import AutoModel

        with torch.device("meta"):
            base = AutoModel.from_config(config, dtype=torch.float32)
        fp32_total, (fp32_largest, _) = calculate_maximum_sizes(base)
    rows = []
    divisors = {"float32": 1, "float16": 2, "int8": 4, "int4": 8}
    for dtype in dtypes:
        key = {"fp32": "float32", "fp16": "float16"}.get(dtype, dtype)
        if key not in divisors:
            raise EstimateError(f"accelerate's dtypes are {', '.join(ACCELERATE_DTYPES)}; got {dtype!r}.")
        # accelerate's estimate_training_usage: the max of model / gradients / optimizer / step, from float32 bytes.
        training = {"float32": 4 * fp32_total, "float16": 2 * fp32_total}.get(key)
        rows.append(AccelerateRow(key, fp32_largest / divisors[key], fp32_total / divisors[key], training))
    return rows


# ---- table and command line ----


def render_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A box-drawn table in the style of `accelerate estimate-memory`."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) + 2 for i, h in enumerate(headers)]
    inner = sum(widths) + len(widths) - 1
    if len(title) + 2 > inner:
        widths[-1] += len(title) + 2 - inner
        inner = len(title) + 2

    def line(cells: Sequence[str]) -> str:
        return "│" + "│".join(c.center(w) for c, w in zip(cells, widths)) + "│"

    out = ["┌" + "─" * inner + "┐", "│" + title.center(inner) + "│", "├" + "┬".join("─" * w for w in widths) + "┤"]
    out += [line(headers), "├" + "┼".join("─" * w for w in widths) + "┤"]
    out += [line(r) for r in rows]
    out.append("└" + "┴".join("─" * w for w in widths) + "┘")
    return "\n".join(out)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `estimate-memory` subcommand."""
    parser = subparsers.add_parser(
        "estimate-memory",
        help="Estimate training memory (weights, gradients, optimizer state) with and without layer-wise optimizers.",
        description="Estimate the weights, gradients and optimizer state of training a model, with and without a "
        "layer-wise optimizer, from a preset or a local config.json (nothing is downloaded). Activations are not "
        "included. --accelerate prints `accelerate estimate-memory`'s table instead.",
    )
    parser.add_argument(
        "model",
        nargs="?",
        help=f"A preset ({', '.join(list_presets())}), its Hub repository name, or a local config.json / directory.",
    )
    parser.add_argument(
        "--dtypes",
        "--dtype",
        nargs="+",
        default=None,
        help="Weight dtype(s): fp32, bf16, fp16 (default bf16). With --accelerate: float32 float16 int8 int4.",
    )
    parser.add_argument(
        "--optim",
        nargs="+",
        default=["adamw_torch", "adamw_torch_layerwise"],
        help="Optimizer name(s), one row each; <name>_layerwise for the layer-wise form. "
        f"Known: {', '.join(sorted(OPTIMIZER_RULES))}. Default: adamw_torch adamw_torch_layerwise.",
    )
    trainable = parser.add_mutually_exclusive_group()
    trainable.add_argument("--trainable-fraction", type=float, help="Fraction of every tensor that trains.")
    trainable.add_argument("--lora-rank", type=int, help="Train LoRA adapters of this rank, the base frozen.")
    parser.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=list(DEFAULT_LORA_TARGETS),
        help="LoRA targets among q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all-linear.",
    )
    parser.add_argument("--adapter-dtype", default="float32", help="LoRA adapter dtype (PEFT's default: float32).")
    parser.add_argument("--frozen-dtype", help=f"Frozen weights' storage: {', '.join(FROZEN_DTYPES)}.")
    parser.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=1,
        help="Above 1, a layer-wise optimizer holds every gradient during the window, like the standard one.",
    )
    parser.add_argument("--world-size", type=int, default=1, help="Number of devices.")
    parser.add_argument("--sharding", choices=SHARDINGS, help="Default: none on one device, ddp on several.")
    parser.add_argument("--gradient-as-bucket-view", action="store_true", help="DDP's gradient_as_bucket_view=True.")
    parser.add_argument(
        "--units",
        choices=("binary", "decimal"),
        default="binary",
        help="binary: KiB/MiB/GiB (2**30 bytes; what accelerate prints as 'GB'); decimal: kB/MB/GB (10**9 bytes).",
    )
    parser.add_argument("--json", action="store_true", help="Print JSON (exact bytes) instead of a table.")
    parser.add_argument(
        "--accelerate", action="store_true", help="Reproduce `accelerate estimate-memory`'s table and conventions."
    )
    parser.add_argument("--list-presets", action="store_true", help="List the presets and their parameter counts.")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        print(_run(args))
    except EstimateError as e:
        print(f"layerwise-hf estimate-memory: error: {e}", file=sys.stderr)
        return 2
    return 0


def _run(args: argparse.Namespace) -> str:
    if args.list_presets:
        return _presets_table(args.json)
    if not args.model:
        raise EstimateError(f"give a model: a preset ({', '.join(list_presets())}) or a config.json path.")
    if args.accelerate:
        ignored = [
            flag
            for flag, value, default in (
                ("--lora-rank", args.lora_rank, None),
                ("--trainable-fraction", args.trainable_fraction, None),
                ("--world-size", args.world_size, 1),
                ("--sharding", args.sharding, None),
                ("--gradient-accumulation-steps", args.gradient_accumulation_steps, 1),
                ("--frozen-dtype", args.frozen_dtype, None),
            )
            if value != default
        ]
        if ignored:
            raise EstimateError(f"--accelerate reproduces accelerate's table, which has no {', '.join(ignored)}.")
        rows = accelerate_estimate(args.model, args.dtypes or ACCELERATE_DTYPES)
        if args.json:
            return json.dumps({"model": args.model, "rows": [dataclasses.asdict(r) for r in rows]}, indent=2)
        headers = ["dtype", "Largest Layer", "Total Size", "Training using Adam"]
        return render_table(f"Memory Usage for loading `{args.model}`", headers, [r.format() for r in rows])

    spec = load_model_spec(args.model)
    estimates = []
    for dtype in args.dtypes or ["bfloat16"]:
        for optim in args.optim:
            estimates.append(
                estimate(
                    spec,
                    optimizer=optim,
                    dtype=dtype,
                    trainable_fraction=args.trainable_fraction,
                    lora_rank=args.lora_rank,
                    lora_target_modules=args.lora_target_modules,
                    adapter_dtype=args.adapter_dtype,
                    frozen_dtype=args.frozen_dtype,
                    gradient_accumulation_steps=args.gradient_accumulation_steps,
                    world_size=args.world_size,
                    sharding=args.sharding,
                    gradient_as_bucket_view=args.gradient_as_bucket_view,
                )
            )
    if args.json:
        payload = {"model": spec.name, "source": spec.source, "estimates": [e.to_dict() for e in estimates]}
        return json.dumps(payload, indent=2)
    return _estimates_table(spec, estimates, args.units)


def _estimates_table(spec: ModelSpec | ModuleSpec, estimates: list[MemoryEstimate], units: str) -> str:
    first = estimates[0]
    setup = "1 device" if first.world_size == 1 else f"{first.world_size} devices, {first.sharding}"
    if first.gradient_accumulation_steps > 1:
        setup += f", gradient accumulation {first.gradient_accumulation_steps}"
    title = (
        f"Training memory for `{spec.name}`: {format_count(first.num_parameters)} parameters, "
        f"{format_count(first.num_trainable_parameters)} trainable, {setup}"
    )
    headers = ["dtype", "optimizer", "Weights", "Gradients", "Optimizer state", "Total", "Per GPU"]
    rows = [
        [
            e.dtype,
            e.optimizer,
            format_bytes(e.weight_bytes, units),
            format_bytes(e.gradient_bytes, units),
            format_bytes(e.optimizer_state_bytes, units),
            format_bytes(e.total_bytes, units),
            format_bytes(e.per_gpu_bytes, units),
        ]
        for e in estimates
    ]
    lines = [render_table(title, headers, rows)]
    lw = next((e for e in estimates if e.layerwise), None)
    if lw is not None and lw.sharding != "ddp" and lw.gradient_accumulation_steps == 1:
        lines.append(
            f"Layer-wise gradients: at most {format_bytes(lw.gradient_bytes, units)} alive at once (the largest "
            f"trainable tensor is {lw.largest_parameter}, {format_bytes(lw.largest_parameter_bytes, units)}) instead "
            f"of all {format_bytes(lw.all_gradient_bytes, units)}"
            + (f"; each device holds 1/{lw.world_size} of it." if lw.sharding == "fsdp2" else ".")
        )
    notes = list(dict.fromkeys(note for e in estimates for note in e.notes))
    # The caveat that applies to every row reads best after the ones specific to this configuration.
    notes.sort(key=lambda note: note.startswith("Not included"))
    lines += [f"Note: {note}" for note in notes]
    if spec.source:
        lines.append(f"Dimensions from: {spec.source}")
    return "\n".join(lines)


def _presets_table(as_json: bool) -> str:
    specs = {name: load_model_spec(name) for name in list_presets()}
    if as_json:
        return json.dumps(
            {n: {"source": s.source, "num_parameters": s.num_parameters()} for n, s in specs.items()}, indent=2
        )
    rows = [[n, s.source, f"{s.num_parameters():,}"] for n, s in specs.items()]
    return render_table("Presets", ["preset", "dimensions from", "parameters"], rows)
