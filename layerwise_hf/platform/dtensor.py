"""FSDP2's DTensors seen from one rank: the local shard of a parameter, gradient or state, which shard it is, and a
state dict moved between shard-shaped tensors and DTensors laid out like its parameter.

Duck-typed (`to_local`, `device_mesh`): a plain tensor passes through, and nothing here imports torch.distributed
until a DTensor is actually met.
"""

from __future__ import annotations

import math
from typing import Any

import torch

PIECE = "@shard"  # a state tensor of one shard only is saved under `<key>@shard<index>`


def is_dtensor(t: Any) -> bool:
    """
    Whether `t` is a DTensor (or quacks like one).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.platform.dtensor import is_dtensor
    >>> is_dtensor(torch.zeros(2))
    False
    ```
    """
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """
    The tensor itself, or a DTensor's local shard (what this rank holds, copies, steps and counts), through autograd's
    `to_local`.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.platform.dtensor import local_tensor
    >>> local_tensor(torch.ones(2))
    tensor([1., 1.])
    ```
    """
    return t.to_local() if hasattr(t, "to_local") else t


def local_storage_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding a DTensor's local storage (`_local_tensor`, no autograd view: for counting storages, also of
    fake tensors), or the tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


def shard_count(param: Any) -> int:
    """How many local shards the parameter is cut into (the product of the mesh dims it is sharded over)."""
    if not is_dtensor(param):
        return 1
    return math.prod(param.device_mesh.size(d) for d in sharded_dims(param))


def shard_index(param: Any) -> int:
    """This rank's shard among `shard_count` (ranks that replicate one shard, as under HSDP, share the index)."""
    if not is_dtensor(param):
        return 0
    mesh, coordinate, index = param.device_mesh, param.device_mesh.get_coordinate(), 0
    for d in sharded_dims(param):
        index = index * mesh.size(d) + coordinate[d]
    return index


def sharded_dims(param: Any) -> list[int]:
    """The mesh dims a DTensor is cut over."""
    from torch.distributed.tensor import Shard

    # NOTE: FSDP2 over a tensor-parallel weight places it `_StridedShard` on the FSDP dim, which in torch 2.13 is no
    # Shard (nor `is_shard()`), yet cuts the tensor: left out, two ranks' different shards would share one index.
    return [d for d, p in enumerate(param.placements) if isinstance(p, Shard) or type(p).__name__ == "_StridedShard"]


def state_to_global(param: Any, state: dict[str, Any]) -> dict[str, Any]:
    """A local shard's optimizer state for saving: shard-shaped tensors as DTensors laid out like `param` (DCP keeps
    every rank's), any other tensor under its shard's own key (`<key>@shard<index>`)."""
    if not is_dtensor(param):
        return state
    from torch.distributed.tensor import DTensor

    local_shape, shard = param.to_local().shape, shard_index(param)
    out = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or key.startswith("qmap"):
            out[key] = value  # plain values, and bitsandbytes' quantization maps, are the same on every rank
        elif value.dim() and value.shape == local_shape:
            out[key] = DTensor.from_local(
                value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        else:
            out[f"{key}{PIECE}{shard}"] = value
    return out


def state_to_local(param: Any, state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `state_to_global` for loading: this rank's shard of every tensor, its own pieces only."""
    own = f"{PIECE}{shard_index(param)}"
    out = {}
    for key, value in state.items():
        if PIECE in key:
            if key.endswith(own):
                out[key.removesuffix(own)] = value
            continue
        out[key] = value.to_local() if is_dtensor(value) else value
    return out
