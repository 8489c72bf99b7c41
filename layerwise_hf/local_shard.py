"""Optimizers whose kernels take plain tensors (bitsandbytes' 8-bit and 32-bit optimizers), stepped on FSDP2's local
shards.

bitsandbytes cannot step a DTensor, and under FSDP2 each parameter is one. `LocalShardOptimizer` steps the wrapped
optimizer on the rank's local shard as a plain tensor (sharing its storage), with the local shard of the reduced
gradient. An 8-bit state is quantized in blocks of 256 elements of the tensor it steps, so the blocks follow the
shard: the update of an element depends on the other elements of its block, which are not the same as for the
whole tensor. The result is bit-identical to the same optimizer run by hand on the same local shards and gradients,
and close to, not equal to, the unsharded run. For the same reason a tensor whose local shard has fewer elements than
bitsandbytes' `min_8bit_size` (4096) keeps a 32-bit state where the unsharded run would keep an 8-bit one.

Checkpoints: the shard-shaped states are saved as DTensors laid out like the parameter, and each rank's block
scales (`absmax*`) as a DTensor of equal-sized, padded pieces, so DCP writes every rank's own state. They resume
bit-exactly on the same number of shards; on another number the blocks would no longer match and resume is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .params import LayerwiseFactory, LayerwiseParam
from .support import FSDP2_LOCAL_SHARD

_SHARDS_KEY = "local_shards"  # saved per parameter state: the number of shards its blocks were cut for


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def _shard_count(param) -> int:
    """How many local shards the parameter is cut into (the product of the mesh dims it is sharded over)."""
    from torch.distributed.tensor import Shard

    if not _is_dtensor(param):
        return 1
    mesh = param.device_mesh
    return math.prod(mesh.size(d) for d, p in enumerate(param.placements) if isinstance(p, Shard))


def _padded_blocks(param, blocksize: int = 256) -> int:
    """Block scales per rank, padded to the largest shard's count so every rank's piece has the same size."""
    n = _shard_count(param)
    rows = math.ceil(param.shape[0] / n) if param.dim() else 1
    return max(1, math.ceil(rows * math.prod(param.shape[1:]) / blocksize))


class LocalShardOptimizer(torch.optim.Optimizer):
    """
    Steps `base`, an optimizer over one plain tensor, on the local shard of its parameter (a DTensor under FSDP2;
    a plain parameter steps as is).

    Args:
        base (`torch.optim.Optimizer`):
            The optimizer, built over the parameter before FSDP2 sharded it (one group, one parameter).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.local_shard import LocalShardOptimizer
    >>> weight = torch.nn.Parameter(torch.ones(4))
    >>> optimizer = LocalShardOptimizer(torch.optim.SGD([weight], lr=0.5))
    >>> weight.grad = torch.ones(4); optimizer.step(); weight.data
    tensor([0.5000, 0.5000, 0.5000, 0.5000])
    ```
    """

    def __init__(self, base: torch.optim.Optimizer):
        (param,) = base.param_groups[0]["params"]
        self.base = base
        # A stable plain parameter for `base` to key its state by; bound to the current local shard before each use.
        local = param.to_local() if _is_dtensor(param) else param
        self.local = torch.nn.Parameter(local.detach(), requires_grad=False)
        base.param_groups[0]["params"] = [self.local]
        group = {k: v for k, v in base.param_groups[0].items() if k != "params"}
        super().__init__([{**group, "params": [param]}], base.defaults)

    @property
    def state(self) -> dict[torch.Tensor, dict]:
        s = self.base.state.get(self.local)
        return {self.param_groups[0]["params"][0]: s} if s else {}

    @state.setter
    def state(self, value) -> None:
        if value:
            raise AttributeError("LocalShardOptimizer.state is a view of the wrapped optimizer's state.")

    def _bind(self) -> torch.Tensor:
        """Point the plain parameter at the local shard and hand the wrapped optimizer the current hyperparameters."""
        param = self.param_groups[0]["params"][0]
        local = param.to_local() if _is_dtensor(param) else param
        if self.local.data_ptr() != local.data_ptr() or self.local.shape != local.shape:
            self.local.data = local.detach()
        base_group = self.base.param_groups[0]
        base_group.update({k: v for k, v in self.param_groups[0].items() if k != "params"})
        return param

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        param = self._bind()
        grad = param.grad
        if grad is None:
            return None
        self.local.grad = grad.to_local() if _is_dtensor(grad) else grad
        try:
            return self.base.step(closure)
        finally:
            self.local.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.param_groups[0]["params"][0].grad = None

    def state_dict(self) -> dict[str, Any]:
        param = self._bind()
        saved = self.base.state_dict()
        state = saved["state"].get(0)
        group = {**{k: v for k, v in self.param_groups[0].items() if k != "params"}, "params": [0]}
        out = {"state": {}, "param_groups": [group]}
        if state:
            out["state"][0] = {**_to_global(param, _unwrap(self.base, state)), _SHARDS_KEY: _shard_count(param)}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        param = self._bind()
        state = dict(state_dict["state"].get(0) or {})
        shards = state.pop(_SHARDS_KEY, _shard_count(param))
        if state and shards != _shard_count(param):
            raise ValueError(
                f"This {type(self.base).__name__} state was saved on {shards} FSDP2 shards and cannot resume on "
                f"{_shard_count(param)}: bitsandbytes' quantization blocks follow the shards. Resume on {shards} "
                "ranks, or train on from the model weights alone."
            )
        local = _to_local(param, state)
        group = {k: v for k, v in state_dict["param_groups"][0].items() if k != "params"}
        self.base.load_state_dict({"state": {0: local} if local else {}, "param_groups": [{**group, "params": [0]}]})
        self.param_groups[0].update(group)


def _unwrap(base, state: dict[str, Any]) -> dict[str, Any]:
    # bitsandbytes nests its quantization tensors under one key in state_dict() (to hide them from FSDP1).
    state = dict(state)
    nested = state.pop(getattr(base, "_FSDP_WRAPPED_QUANT_STATE_KEY", None), None)
    return {**state, **(nested or {})}


def _to_global(param, state: dict[str, Any]) -> dict[str, Any]:
    """Shard-shaped tensors as DTensors laid out like `param`; block scales as equal padded pieces of a DTensor."""
    if not _is_dtensor(param):
        return state
    from torch.distributed.tensor import DTensor

    local_shape = param.to_local().shape
    pieces = _padded_blocks(param)
    out = {}
    for key, value in state.items():
        if key.startswith("qmap") or not isinstance(value, torch.Tensor):
            pass  # the quantization maps are the same on every rank
        elif value.shape == local_shape and value.dim():
            value = DTensor.from_local(
                value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        elif key.startswith("absmax"):
            padded = value.new_zeros(pieces)
            padded[: value.numel()] = value
            n = _shard_count(param)
            value = DTensor.from_local(
                padded, param.device_mesh, param.placements, run_check=False, shape=(n * pieces,), stride=(1,)
            )
        out[key] = value
    return out


def _to_local(param, state: dict[str, Any]) -> dict[str, Any]:
    local_numel = param.to_local().numel() if _is_dtensor(param) else param.numel()
    out = {}
    for key, value in state.items():
        if _is_dtensor(value):
            value = value.to_local()
            if key.startswith("absmax"):
                value = value[: math.ceil(local_numel / 256)].clone()
        out[key] = value
    return out


def local_shards_of(optimizer) -> int | None:
    """The number of shards the `LocalShardOptimizer`s of a `LayerwiseOptimizer` step (`None` without any); saved in
    the checkpoint marker so that a resume on another number is refused before anything loads."""
    counts = {_shard_count(inner.param_groups[0]["params"][0]) for inner in optimizer.inner if _wrapped(inner)}
    return max(counts) if counts else None


def check_local_shards(checkpoint_dir: str, optimizer) -> None:
    """
    Refuse to resume 8-bit local-shard states saved on another number of shards (their blocks would not match), with
    what would work, before DCP loads anything.

    Example:

    ```python
    >>> from layerwise_hf.local_shard import check_local_shards
    >>> check_local_shards("out/checkpoint-500", trainer.layerwise_optimizer)  # ValueError if saved on other ranks
    ```
    """
    from .checkpoint import read_marker

    saved, current = read_marker(checkpoint_dir).get("local_shards"), local_shards_of(optimizer)
    if saved is not None and current is not None and saved != current:
        raise ValueError(
            f"{checkpoint_dir} holds {optimizer.optimizer_name} states saved on {saved} FSDP2 shards; this run has "
            f"{current}. bitsandbytes' quantization blocks follow the shards, so they cannot be resharded. Resume "
            f"with {saved} processes, or start a new run from the checkpoint's model weights."
        )


def _wrapped(inner) -> bool:
    return isinstance(inner, LocalShardOptimizer)


def wrap_local_shards(factory: LayerwiseFactory) -> LayerwiseFactory:
    """
    The factory whose bitsandbytes optimizers step FSDP2's local shards (`LocalShardOptimizer`); others unchanged.

    Args:
        factory (`LayerwiseFactory`):
            Builds one parameter's optimizer.

    Example:

    ```python
    >>> from layerwise_hf import LayerwiseTrainingArguments, build_layerwise_optimizer
    >>> args = LayerwiseTrainingArguments("out", optim="adamw_8bit_layerwise")
    >>> optimizer = build_layerwise_optimizer(model, args, local_shards=True)  # before FSDP2 shards the model
    >>> type(optimizer.inner[0]).__name__
    'LocalShardOptimizer'
    ```
    """

    def build(lp: LayerwiseParam, args: Any) -> torch.optim.Optimizer:
        inner = factory(lp, args)
        if type(inner).__module__.startswith("bitsandbytes."):
            return LocalShardOptimizer(inner)
        return inner

    return build


__all__ = ["FSDP2_LOCAL_SHARD", "LocalShardOptimizer", "check_local_shards", "local_shards_of", "wrap_local_shards"]
