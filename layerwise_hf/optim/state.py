"""Optimizer state of a layer-wise optimizer: its `state_dict` / `load_state_dict`, and the conversions between the
standard (Trainer's two param groups) and layer-wise (one named group per parameter) layouts.

A standard Trainer optimizer state has two param groups (Trainer's weight-decay group, then the no-decay group),
each listing its parameters in `model.named_parameters()` order; a layer-wise state has one named group per
parameter. Both hold the same per-parameter state for the same optimizer class, so either converts to the other
and training continues identically. Only tensors and plain values are written: `torch.load(weights_only=True)`,
which Trainer uses, loads them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..bases.support import qualname
from ..placement.host_step import unwrap_host_step
from ..platform.dtensor import local_tensor as _local
from ..platform.dtensor import state_to_global as _to_global
from ..platform.dtensor import state_to_local as _to_local

logger = logging.getLogger(__name__)

STATE_DICT_KEY = "layerwise_hf"
# Checkpoints name the plugin's own optimizer classes by module path: those of 0.1 by the paths before the package had
# folders, later ones by where LocalShardOptimizer lived before `placement/`.
_RENAMED_MODULES = {
    "layerwise_hf.galore.": "layerwise_hf.bases.galore.",
    "layerwise_hf.local_shard.": "layerwise_hf.placement.local_shard.",
    "layerwise_hf.routes.local_shard.": "layerwise_hf.placement.local_shard.",
}
STATE_DICT_VERSION = 1


def layerwise_state_dict(optimizer: Any) -> dict[str, Any]:
    """
    The standard layout (integer keys, one param group per parameter) with each group's parameter `name`, plus a
    `layerwise_hf` entry (names, shapes, inner optimizer classes) for validated, name-keyed loading. This is what
    `LayerwiseOptimizer.state_dict()` returns.

    Args:
        optimizer (`LayerwiseOptimizer`):
            The optimizer to save.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf import LayerwiseOptimizer, LayerwiseParam
    >>> model = torch.nn.Linear(4, 2)
    >>> params = [LayerwiseParam("weight", model.weight, 0.1), LayerwiseParam("bias", model.bias, 0.0)]
    >>> optimizer = LayerwiseOptimizer(params, lambda lp, args: torch.optim.SGD([lp.param], lr=0.1))
    >>> from layerwise_hf.optim.state import layerwise_state_dict
    >>> state_dict = layerwise_state_dict(optimizer)
    >>> [group["name"] for group in state_dict["param_groups"]]
    ['weight', 'bias']
    ```
    """
    state: dict[int, Any] = {}
    groups = []
    for i, inner in enumerate(optimizer.inner):
        sd = inner.state_dict()
        (saved_id,) = sd["param_groups"][0]["params"]
        if sd["state"].get(saved_id):
            state[i] = _shards_as_dtensors(optimizer, i, sd["state"][saved_id])
        groups.append({**sd["param_groups"][0], "params": [i]})
    last = optimizer.pipeline.last_grad_norm
    meta = {
        "version": STATE_DICT_VERSION,
        "optimizer_name": optimizer.optimizer_name,
        "names": list(optimizer.names),
        "shapes": [list(p.shape) for p in optimizer.params],
        "optimizer_classes": [qualname(unwrap_host_step(inner)) for inner in optimizer.inner],
        "in_decay_group": list(optimizer.in_decay_group),
        # layerwise_clip="previous" scales the first step after a resume by it.
        "last_grad_norm": None if last is None else _local(last).detach().clone(),
    }
    return {"state": state, "param_groups": groups, STATE_DICT_KEY: meta}


def _host_stepped(optimizer: Any, i: int) -> bool:
    return unwrap_host_step(optimizer.inner[i]) is not optimizer.inner[i]


def _shards_as_dtensors(optimizer: Any, i: int, state: dict[str, Any]) -> dict[str, Any]:
    # NOTE: a host-stepped parameter (layerwise_offload="optimizer") keeps its states on the host as plain tensors of
    # its FSDP2 local shard. Saved as they are, DCP takes them for whole tensors, every rank writes its shard under
    # the same key and all but one shard is lost; laid out like the parameter, each rank's shard is written.
    if not _host_stepped(optimizer, i) or not hasattr(optimizer.params[i], "device_mesh"):
        return state
    # Scalars (AdamW's step) are the same on every rank and keep their key, as in a checkpoint without offload.
    scalars = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 0}
    rest = {k: v for k, v in state.items() if k not in scalars}
    return {**_to_global(optimizer.params[i], rest), **scalars}


def _host_shards(optimizer: Any, i: int, state: dict[str, Any] | None) -> dict[str, Any] | None:
    """The inverse of `_shards_as_dtensors` for loading: a host-stepped parameter's own shards as plain tensors."""
    return _to_local(optimizer.params[i], state) if state and _host_stepped(optimizer, i) else state


def _check_fits(optimizer: Any, state_dict: dict[str, Any]) -> tuple[dict[str, int], list[str]]:
    """Name -> saved group index, and the names with no saved state; raises before anything is loaded."""
    saved_names = [g["name"] for g in state_dict["param_groups"]]
    by_name = {n: i for i, n in enumerate(saved_names)}
    ours = set(optimizer.names)
    unexpected = [n for n in saved_names if n not in ours]
    missing = [n for n in optimizer.names if n not in by_name]
    if unexpected or len(missing) == len(optimizer.names):
        raise ValueError(
            "Optimizer state does not match the trainable parameters (another model, or a changed set of "
            f"trainable parameters). Saved but not trainable here: {unexpected or 'none'}. "
            f"Trainable here but not saved: {missing or 'none'}."
        )
    meta = state_dict.get(STATE_DICT_KEY, {})
    shapes = meta.get("shapes")
    classes = meta.get("optimizer_classes")
    errors = []
    for name, param, inner in zip(optimizer.names, optimizer.params, optimizer.inner):
        j = by_name.get(name)
        if j is None:
            continue
        if shapes is not None and list(shapes[j]) != list(param.shape):
            errors.append(f"{name}: saved shape {list(shapes[j])}, parameter shape {list(param.shape)}")
        # A host-stepped optimizer (layerwise_offload="optimizer") saves and loads its wrapped optimizer's state.
        current = qualname(unwrap_host_step(inner))
        if classes is not None and _current_name(classes[j]) != current:
            errors.append(f"{name}: saved optimizer {classes[j]}, current optimizer {current}")
    if errors:
        raise ValueError("Optimizer state does not fit this optimizer: " + "; ".join(errors))
    return by_name, missing


def _current_name(saved: str) -> str:
    for old, new in _RENAMED_MODULES.items():
        if saved.startswith(old):
            return new + saved[len(old) :]
    return saved


def load_layerwise_state_dict(optimizer: Any, state_dict: dict[str, Any]) -> Any:
    """
    Load `state_dict` (layer-wise, or a standard one, converted first) into `optimizer`'s inner optimizers by
    parameter name. Everything is checked before anything is loaded, and a failure while loading restores the
    previous state. Returns the saved `last_grad_norm` (or `None`). The caller re-links the param groups; use
    `LayerwiseOptimizer.load_state_dict()`, which does.

    Args:
        optimizer (`LayerwiseOptimizer`):
            The optimizer to load into.
        state_dict (`dict`):
            A layer-wise state (`LayerwiseOptimizer.state_dict()`) or a standard one of Trainer's two param groups.

    Raises `ValueError` naming the parameters when the saved names, shapes or optimizer classes do not fit.

    Example:

    ```python
    >>> # optimizer: the two-parameter LayerwiseOptimizer of `layerwise_state_dict`'s example
    >>> from layerwise_hf.optim.state import layerwise_state_dict, load_layerwise_state_dict
    >>> last_grad_norm = load_layerwise_state_dict(optimizer, layerwise_state_dict(optimizer))
    ```
    """
    if not is_layerwise_state_dict(state_dict):
        state_dict = standard_to_layerwise(
            state_dict, standard_groups_names(optimizer.names, optimizer.in_decay_group)
        )
        logger.warning(
            "Converted a standard optimizer state to the layer-wise layout (%d parameters).", len(optimizer.names)
        )
    by_name, missing = _check_fits(optimizer, state_dict)
    if missing:
        logger.warning(
            "No saved optimizer state for %d newly trainable parameter(s); they start fresh: %s", len(missing), missing
        )
    groups = state_dict["param_groups"]
    previous = [inner.state_dict() for inner in optimizer.inner]
    loaded = []
    try:
        for i, name in enumerate(optimizer.names):
            if name not in by_name:
                continue
            group = groups[by_name[name]]
            (saved_id,) = group["params"]
            saved_state = _host_shards(optimizer, i, state_dict["state"].get(saved_id))
            inner_sd = {"state": {0: saved_state} if saved_state else {}, "param_groups": [{**group, "params": [0]}]}
            optimizer.inner[i].load_state_dict(inner_sd)
            loaded.append(i)
    except Exception as err:
        for i in loaded:
            optimizer.inner[i].load_state_dict(previous[i])
        raise ValueError(
            f"Loading the optimizer state of {optimizer.names[len(loaded)]} failed; nothing was loaded: {err}"
        ) from err
    return state_dict.get(STATE_DICT_KEY, {}).get("last_grad_norm")


# ---- conversions between the standard and the layer-wise layouts ----


def standard_groups_names(names: list[str], in_decay_group: list[bool]) -> list[list[str]]:
    """
    The names in each param group of Trainer's standard optimizer: the weight-decay group, then the rest.

    Args:
        names (`list[str]`):
            The trainable parameter names, in `model.named_parameters()` order.
        in_decay_group (`list[bool]`):
            Per name, whether it is in Trainer's weight-decay group.

    Example:

    ```python
    >>> from layerwise_hf.optim.state import standard_groups_names
    >>> standard_groups_names(["weight", "bias"], [True, False])
    [['weight'], ['bias']]
    ```
    """
    return [[n for n, d in zip(names, in_decay_group) if d], [n for n, d in zip(names, in_decay_group) if not d]]


def is_layerwise_state_dict(state_dict: dict[str, Any]) -> bool:
    """
    Whether `state_dict` has the layer-wise layout (every param group has a parameter `name`).

    Args:
        state_dict (`dict`):
            An optimizer state, as saved in `optimizer.pt`.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.optim.state import is_layerwise_state_dict
    >>> standard = torch.optim.AdamW(torch.nn.Linear(4, 2).parameters(), lr=1e-3)
    >>> is_layerwise_state_dict(standard.state_dict())
    False
    ```
    """
    groups = state_dict.get("param_groups", [])
    return bool(groups) and all("name" in g for g in groups)


def standard_to_layerwise(state_dict: dict[str, Any], groups_names: list[list[str]]) -> dict[str, Any]:
    """
    Convert a standard optimizer state to the layer-wise layout.

    Args:
        state_dict (`dict`):
            `optimizer.state_dict()` of a standard optimizer.
        groups_names (`list[list[str]]`):
            The parameter names of each of its param groups, in order (Trainer: decay group, then no-decay group).

    Raises `ValueError` when the group sizes do not match `groups_names`.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.optim.state import standard_to_layerwise
    >>> model = torch.nn.Linear(4, 2)
    >>> groups = [{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias], "weight_decay": 0.0}]
    >>> standard = torch.optim.AdamW(groups, lr=1e-3)
    >>> converted = standard_to_layerwise(standard.state_dict(), [["weight"], ["bias"]])
    >>> [(group["name"], group["weight_decay"]) for group in converted["param_groups"]]
    [('weight', 0.1), ('bias', 0.0)]
    ```
    """
    groups = state_dict["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    expected = [len(names) for names in groups_names]
    if sizes != expected:
        raise ValueError(
            f"The standard optimizer state has param groups of sizes {sizes}, but this model's trainable parameters "
            f"form groups of sizes {expected} (Trainer's weight-decay split): it was saved for another model or "
            "another set of trainable parameters."
        )
    state, out_groups, names = {}, [], []
    for group, group_names in zip(groups, groups_names):
        hyper = {k: v for k, v in group.items() if k != "params"}
        for saved_id, name in zip(group["params"], group_names):
            i = len(out_groups)
            if saved_id in state_dict["state"]:
                state[i] = state_dict["state"][saved_id]
            out_groups.append({**hyper, "name": name, "params": [i]})
            names.append(name)
    return {"state": state, "param_groups": out_groups, STATE_DICT_KEY: {"converted_from": "standard", "names": names}}


def standard_groups_of(state_dict: dict[str, Any]) -> list[list[str]]:
    """
    Trainer's (decay, no-decay) name lists recorded in a layer-wise state. Raises `ValueError` when the state does
    not record them (a state converted from the standard layout).

    Args:
        state_dict (`dict`):
            `LayerwiseOptimizer.state_dict()`.

    Example:

    ```python
    >>> # optimizer: the two-parameter LayerwiseOptimizer of `layerwise_state_dict`'s example
    >>> from layerwise_hf.optim.state import standard_groups_of
    >>> standard_groups_of(optimizer.state_dict())
    [['weight'], ['bias']]
    ```
    """
    groups = state_dict["param_groups"]
    decay = state_dict.get(STATE_DICT_KEY, {}).get("in_decay_group")
    if decay is None:
        raise ValueError("This layer-wise state does not record Trainer's weight-decay split; pass groups_names.")
    return [[g["name"] for g, d in zip(groups, decay) if d], [g["name"] for g, d in zip(groups, decay) if not d]]


def first_members(state_dict: dict[str, Any], groups_names: list[list[str]]) -> list[int]:
    """
    For each target group, the index of the saved per-parameter group of its first member (`0` for an empty
    group): the source of each group's scheduler values in `convert_scheduler_state`.

    Args:
        state_dict (`dict`):
            A layer-wise state.
        groups_names (`list[list[str]]`):
            The names in each param group of the target optimizer.

    Example:

    ```python
    >>> # optimizer: the two-parameter LayerwiseOptimizer of `layerwise_state_dict`'s example
    >>> from layerwise_hf.optim.state import first_members
    >>> first_members(optimizer.state_dict(), [["weight"], ["bias"]])
    [0, 1]
    ```
    """
    index = {g["name"]: i for i, g in enumerate(state_dict["param_groups"])}
    return [index[names[0]] if names else 0 for names in groups_names]


def layerwise_to_standard(state_dict: dict[str, Any], groups_names: list[list[str]] | None = None) -> dict[str, Any]:
    """
    Convert a layer-wise optimizer state to a standard optimizer's layout.

    Args:
        state_dict (`dict`):
            `LayerwiseOptimizer.state_dict()`.
        groups_names (`list[list[str]]`, *optional*):
            The names in each param group of the target optimizer, in order. Defaults to Trainer's split recorded in
            the checkpoint (weight-decay group, then no-decay group).

    Raises `ValueError` naming the missing and unexpected parameters when the names do not match.

    Example:

    ```python
    >>> # optimizer: the two-parameter LayerwiseOptimizer of `layerwise_state_dict`'s example
    >>> from layerwise_hf.optim.state import layerwise_to_standard
    >>> standard = layerwise_to_standard(optimizer.state_dict())
    >>> [group["params"] for group in standard["param_groups"]]
    [[0], [1]]
    ```
    """
    groups = state_dict["param_groups"]
    by_name = {g["name"]: g for g in groups}
    if groups_names is None:
        groups_names = standard_groups_of(state_dict)
    wanted = [n for names in groups_names for n in names]
    missing = sorted(set(wanted) - set(by_name))
    unexpected = sorted(set(by_name) - set(wanted))
    if missing or unexpected:
        raise ValueError(
            f"The layer-wise state does not match the standard optimizer's parameters. Missing: {missing or 'none'}. "
            f"Unexpected: {unexpected or 'none'}."
        )
    state, out_groups, k = {}, [], 0
    for names in groups_names:
        ids = []
        for name in names:
            (saved_id,) = by_name[name]["params"]
            if saved_id in state_dict["state"]:
                state[k] = state_dict["state"][saved_id]
            ids.append(k)
            k += 1
        # Every member of a Trainer group shares its hyperparameters; take them from the first.
        hyper = {key: v for key, v in by_name[names[0]].items() if key not in ("params", "name")} if names else {}
        out_groups.append({**hyper, "params": ids})
    return {"state": state, "param_groups": out_groups}


def convert_scheduler_state(state_dict: dict[str, Any], source_group: list[int], num_source_groups: int):
    """
    Re-index the per-param-group lists of an LR scheduler state (`base_lrs`, `_last_lr`, `lr_lambdas`, ...) for an
    optimizer whose group `k` takes the values of the saved group `source_group[k]`.

    Args:
        state_dict (`dict`):
            `lr_scheduler.state_dict()` of the saved run.
        source_group (`list[int]`):
            For each param group of the new optimizer, the saved group whose values it takes.
        num_source_groups (`int`):
            The number of saved param groups; only lists of that length are re-indexed.

    Example:

    ```python
    >>> from layerwise_hf.optim.state import convert_scheduler_state
    >>> saved = {"base_lrs": [1e-3, 5e-4], "last_epoch": 7}
    >>> convert_scheduler_state(saved, source_group=[0, 0, 1], num_source_groups=2)
    {'base_lrs': [0.001, 0.001, 0.0005], 'last_epoch': 7}
    ```
    """
    out = {}
    for key, value in state_dict.items():
        if isinstance(value, list) and len(value) == num_source_groups:
            value = [value[g] for g in source_group]
        out[key] = value
    return out
