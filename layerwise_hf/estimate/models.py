"""What a model is made of: its parameter tensors, read from the model transformers builds (on the meta device for a
config, so nothing is allocated or downloaded), and the presets, config.json files shipped under `presets/`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..platform.compat import meta_forward
from .units import LINEAR_MODULES, EstimateError

PRESETS_DIR = Path(__file__).with_name("presets")


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

    Example:

    ```python
    >>> from layerwise_hf.estimate import TensorSpec
    >>> TensorSpec("model.layers.*.mlp.up_proj.weight", (11008, 4096), count=32, module="up_proj").numel
    45088768
    ```
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


def module_tensors(model: Any) -> list[TensorSpec]:
    """
    Every parameter of `model` once, in `named_parameters()` order, with its dtype and `requires_grad`.

    Args:
        model (`torch.nn.Module`):
            A real or meta-device model.

    Example:

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from layerwise_hf.estimate.models import module_tensors
    >>> config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                      num_attention_heads=4)
    >>> module_tensors(LlamaForCausalLM(config))[0].name
    'model.embed_tokens.weight'
    ```
    """
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
    return tensors


_LAYER = re.compile(r"^(?P<stack>(?:.*\.)?layers)\.(?P<index>\d+)\.(?P<rest>.+)$")


def collapse_layers(tensors: list[TensorSpec]) -> list[TensorSpec]:
    """
    Fold the per-layer tensors of identical decoder layers into one `layers.*.` entry with a `count`.

    A name is folded only when every layer of its stack has it with the same shape, so a model whose layers differ
    keeps them apart (the FSDP2 unit of a `*` entry is one decoder layer).

    Args:
        tensors (`list[TensorSpec]`):
            From `module_tensors`, each with `count` 1.

    Example:

    ```python
    >>> from layerwise_hf.estimate.models import TensorSpec, collapse_layers
    >>> rows = [TensorSpec(f"model.layers.{i}.norm.weight", (8,)) for i in range(3)]
    >>> [(t.name, t.count) for t in collapse_layers(rows)]
    [('model.layers.*.norm.weight', 3)]
    ```
    """
    groups: dict[str, list[TensorSpec]] = {}
    layers: dict[str, set[str]] = {}
    for t in tensors:
        match = _LAYER.match(t.name)
        if match:
            groups.setdefault(f"{match['stack']}.*.{match['rest']}", []).append(t)
            layers.setdefault(match["stack"], set()).add(match["index"])
    folded = {
        key: dataclasses.replace(group[0], name=key, count=len(group))
        for key, group in groups.items()
        if len({dataclasses.replace(g, name=key) for g in group}) == 1
        and len(group) == len(layers[_LAYER.match(group[0].name)["stack"]])
    }
    out: list[TensorSpec] = []
    for t in tensors:
        match = _LAYER.match(t.name)
        key = f"{match['stack']}.*.{match['rest']}" if match else ""
        if key not in folded:
            out.append(t)
        elif match["index"] == _LAYER.match(groups[key][0].name)["index"]:
            out.append(folded[key])
    return out


def forward_use_order(model: Any) -> tuple[str, ...]:
    """
    The names of `model`'s parameters in the order one forward first uses them, from a two-token forward on the
    meta device (nothing computed); `()` when the model cannot run that forward.

    Example:

    ```python
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from layerwise_hf.estimate.models import forward_use_order
    >>> with torch.device("meta"):
    ...     model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...                                          num_hidden_layers=1, num_attention_heads=2))
    >>> order = forward_use_order(model)
    >>> order[:2], order[-1]
    (('model.embed_tokens.weight', 'model.layers.0.input_layernorm.weight'), 'lm_head.weight')
    ```
    """
    import torch

    names = {id(p): n for n, p in model.named_parameters()}
    order: dict[str, None] = {}

    def note(module, args):
        for p in module.parameters(recurse=False):
            if id(p) in names:
                order.setdefault(names[id(p)])

    handles = [m.register_forward_pre_hook(note) for m in model.modules() if any(True for _ in m.parameters(False))]
    try:
        # NOTE: a config with use_cache=False (Trainer sets it) takes transformers' mask path that calls .item(),
        # which meta tensors refuse; with a cache the forward runs, and the order of use is the same.
        for kwargs in ({"use_cache": True}, {}):
            order.clear()
            try:
                with torch.no_grad(), meta_forward():
                    model(input_ids=torch.zeros(1, 2, dtype=torch.long, device="meta"), **kwargs)
                return tuple(order)
            except Exception:  # noqa: BLE001  any architecture that will not run on meta keeps parameter order
                continue
        return ()
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class ModelSpec:
    """
    A model described by its config: the parameters of the `*ForCausalLM` transformers builds from it (on the meta
    device, so exact by construction and free), identical decoder layers folded into `layers.*.` entries. Dtypes and
    what trains are left to `estimate()`'s options. The config's values read through (`spec.num_key_value_heads`).

    Args:
        name (`str`):
            Shown in tables.
        config (`PretrainedConfig`):
            The config the model was built from.
        parameters (`tuple[TensorSpec, ...]`):
            Every parameter tensor once (a tied lm_head is the embedding's), in `named_parameters()` order.
        head (`frozenset[str]`, *optional*):
            The names of the output head's own parameters (absent from the base model `AutoModel` builds).
        source (`str`, *optional*, defaults to `""`):
            Where the dimensions come from.
        use_order (`tuple[str, ...]`, *optional*):
            Parameter names in the order a forward first uses them (from a forward on the meta device; empty when
            that forward fails): gradients become ready in the reverse order, which decides DDP's buckets.
        tp_plan (`dict[str, str]`, *optional*):
            The model's tensor-parallel plan as transformers applies it (`model.tp_plan`: module pattern -> style).

    Example:

    ```python
    >>> from layerwise_hf.estimate import ModelSpec, resolve_config
    >>> config, name, source = resolve_config("llama-2-7b")
    >>> spec = ModelSpec.from_config(config, name=name, source=source)
    >>> spec.num_parameters(), spec.num_parameters(include_lm_head=False)
    (6738415616, 6607343616)
    ```
    """

    name: str
    config: Any = field(repr=False, compare=False)
    parameters: tuple[TensorSpec, ...] = ()
    head: frozenset[str] = frozenset()
    source: str = ""
    use_order: tuple[str, ...] = field(default=(), repr=False, compare=False)
    tp_plan: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __getattr__(self, name: str) -> Any:
        # NOTE: only reached for names the dataclass does not define; copy and pickle probe before `config` exists.
        config = self.__dict__.get("config")
        if name.startswith("__") or config is None:
            raise AttributeError(name)
        try:
            return getattr(config, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__} (and its config) has no attribute {name!r}") from None

    @property
    def model_type(self) -> str:
        return self.config.model_type

    def tensors(self, include_lm_head: bool = True) -> list[TensorSpec]:
        """Every parameter tensor, in `named_parameters()` order; without lm_head it is the base model."""
        return [t for t in self.parameters if include_lm_head or t.name not in self.head]

    def num_parameters(self, include_lm_head: bool = True) -> int:
        """Exact parameter count (a tied lm_head counted once, as `model.parameters()` does)."""
        return sum(t.numel * t.count for t in self.tensors(include_lm_head))

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """`(in_features, out_features)` of every per-layer linear module among `LINEAR_MODULES`: LoRA's targets."""
        return {
            t.module: (t.shape[1], t.shape[0])
            for t in self.parameters
            if "*" in t.name and t.module in LINEAR_MODULES and t.name.endswith(".weight") and len(t.shape) == 2
        }

    @property
    def num_layers(self) -> int:
        """The number of decoder layers (the `count` of the folded per-layer tensors)."""
        return max((t.count for t in self.parameters if "*" in t.name), default=0)

    @classmethod
    def from_config(cls, config: Any, name: str | None = None, source: str = "") -> ModelSpec:
        """From a `PretrainedConfig` of any architecture transformers builds with `AutoModelForCausalLM`."""
        import torch
        from transformers import AutoModelForCausalLM

        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        except ValueError as e:
            raise EstimateError(f"transformers builds no causal language model from this config: {e}") from e
        module_names = {id(m): n for n, m in model.named_modules()}
        output = model.get_output_embeddings()
        prefix = module_names.get(id(output), "")
        head = frozenset(f"{prefix}.{n}" for n, _ in output.named_parameters()) if output is not None else frozenset()
        tensors = [
            dataclasses.replace(t, trainable=None, dtype=None, element_size=None) for t in module_tensors(model)
        ]
        return cls(
            name=name or getattr(config, "_name_or_path", "") or config.model_type,
            config=config,
            parameters=tuple(collapse_layers(tensors)),
            head=head,
            source=source,
            use_order=forward_use_order(model),
            tp_plan=dict(getattr(model, "tp_plan", None) or {}),
        )


@dataclass(frozen=True)
class ModuleSpec:
    """
    The parameters of a real model, as they are: each tensor carries its dtype and `requires_grad` (a PEFT model
    estimates its adapters).

    Args:
        name (`str`):
            Shown in tables.
        parameters (`tuple[TensorSpec, ...]`):
            Every parameter tensor once, in `named_parameters()` order.
        source (`str`, *optional*, defaults to `""`):
            Where the model comes from.
        tp_plan (`dict[str, str]`, *optional*): the model's tensor-parallel plan (`model.tp_plan`).

    Example:

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from layerwise_hf.estimate import ModuleSpec
    >>> config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                      num_attention_heads=4)
    >>> ModuleSpec.from_module(LlamaForCausalLM(config)).num_parameters()
    115008
    ```
    """

    name: str
    parameters: tuple[TensorSpec, ...]
    source: str = ""
    tp_plan: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def tensors(self, include_lm_head: bool = True) -> list[TensorSpec]:
        return list(self.parameters)

    def num_parameters(self, include_lm_head: bool = True) -> int:
        return sum(t.numel * t.count for t in self.parameters)

    @classmethod
    def from_module(cls, model: Any, name: str | None = None, source: str = "") -> ModuleSpec:
        return cls(name=name or type(model).__name__, parameters=tuple(module_tensors(model)), source=source,
                   tp_plan=dict(getattr(model, "tp_plan", None) or {}))  # fmt: skip


# ---- presets ----


def _load_presets() -> dict[str, dict[str, Any]]:
    presets = {}
    for path in sorted(PRESETS_DIR.glob("*.json")):
        values = json.loads(path.read_text(encoding="utf-8"))
        # NOTE: `source` (the Hub repository) is what this dict held before presets were files; a config.json names
        # its repository in `_name_or_path`.
        presets[path.stem] = {**values, "source": values["_name_or_path"]}
    return presets


PRESETS: dict[str, dict[str, Any]] = _load_presets()
"""Preset name -> its config.json values (from `presets/<name>.json`), plus `source`, the Hub repository."""


def list_presets() -> list[str]:
    """
    The built-in model names, sorted: the files under `layerwise_hf/estimate/presets/`.

    Example:

    ```python
    >>> from layerwise_hf.estimate import list_presets
    >>> "llama-3-8b" in list_presets()
    True
    ```
    """
    return sorted(PRESETS)


def _preset_key(name: str) -> str | None:
    key = name.strip().lower()
    if key in PRESETS:
        return key
    for preset, values in PRESETS.items():
        if values["source"].lower() == key:
            return preset
    return None


def _is_size_field(key: str) -> bool:
    return key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads") or (
        key.startswith("num_") and key.endswith("_layers")
    )


def _config_from_dict(values: dict[str, Any], name: str) -> Any:
    values = {k: v for k, v in values.items() if k != "source"}
    model_type = values.get("model_type")
    if not model_type:
        raise EstimateError(f"{name}: no `model_type` in the config.")
    if "text_config" in values and "vocab_size" not in values:
        raise EstimateError(f"{name}: a multimodal config (text_config); pass the text model's config.json.")
    # A size that is not a positive whole number would build tensors of negative or zero size: say which one.
    for key, value in values.items():
        if (
            value is not None
            and _is_size_field(key)
            and (isinstance(value, bool) or not isinstance(value, int) or value < 1)
        ):
            raise EstimateError(f"{name}: {key}={value!r} must be a whole number >= 1.")
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**values)
    except (ValueError, KeyError, TypeError) as e:
        raise EstimateError(f"{name}: transformers cannot build a {model_type!r} config: {e}") from e


def _config_from_file(path: str) -> tuple[Any, str, str]:
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EstimateError(f"{path} is not a JSON config: {e}") from e
    if not isinstance(values, dict):
        raise EstimateError(f"{path} is not a JSON config (not an object).")
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    return _config_from_dict(values, path), name, path


def resolve_config(model: Any) -> tuple[Any, str, str]:
    """
    `(PretrainedConfig, name, source)` for a preset name (or its Hub repository), a local config.json or a directory
    holding one, a config dict or a `PretrainedConfig`. Nothing is downloaded.

    Args:
        model (`str`, `os.PathLike`, `dict` or `PretrainedConfig`):
            What to resolve.

    Example:

    ```python
    >>> from layerwise_hf.estimate import resolve_config
    >>> config, name, source = resolve_config("meta-llama/Llama-2-70b-hf")
    >>> name, source, config.num_key_value_heads
    ('llama-2-70b', 'meta-llama/Llama-2-70b-hf', 8)
    ```
    """
    if isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
        path = os.path.join(text, "config.json") if os.path.isdir(text) else text
        if os.path.isfile(path):
            return _config_from_file(path)
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

    Example:

    ```python
    >>> from layerwise_hf.estimate import load_model_spec
    >>> load_model_spec("llama-3-8b").num_parameters()
    8030261248
    ```
    """
    if isinstance(model, (ModelSpec, ModuleSpec)):
        return model
    if hasattr(model, "named_parameters"):
        return ModuleSpec.from_module(model)
    config, name, source = resolve_config(model)
    return ModelSpec.from_config(config, name=name, source=source)
