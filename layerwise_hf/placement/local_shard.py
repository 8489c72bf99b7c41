"""Optimizers that cannot step a DTensor (bitsandbytes' 8-bit and 32-bit optimizers, transformers' Adafactor),
stepped on FSDP2's local shards.

Under FSDP2 each parameter is a DTensor. `LocalShardOptimizer` steps the wrapped optimizer on the rank's local shard
as a plain tensor (sharing its storage), with the local shard of the reduced gradient. The result is the optimizer
applied to the shard, a well-defined optimizer but not the unsharded one wherever the update of an element depends on
other elements: bitsandbytes quantizes its 8-bit states in blocks of 256 elements of the shard, and a shard under its
`min_8bit_size` (4096 elements) keeps a 32-bit state where the unsharded run keeps an 8-bit one; Adafactor factors
the second moment into the shard's rows and columns, and its relative step and update clipping use the shard's RMS.
It is bit-identical to the same optimizer run by hand on the same local shards and gradients.

Checkpoints: states shaped like the shard are saved as DTensors laid out like the parameter; every other tensor (block
scales, factored moments) under a key of its own shard (`absmax1@shard0`), so DCP writes every rank's own. They
resume bit-exactly on the same number of shards; on another number the shards would not match and resume is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..bases.params import LayerwiseFactory, LayerwiseParam, StateView
from ..bases.support import qualname
from ..platform.dtensor import is_dtensor as _is_dtensor
from ..platform.dtensor import local_tensor, sharded_dims
from ..platform.dtensor import shard_count as _shard_count
from ..platform.dtensor import state_to_global as _to_global
from ..platform.dtensor import state_to_local as _to_local
from ..platform.streams import step_in_backward

# Optimizers outside bitsandbytes whose step cannot take a DTensor (transformers' Adafactor mixes it with plain
# tensors); bitsandbytes' are recognized by their module.
_LOCAL_SHARD_CLASSES = frozenset({"transformers.optimization.Adafactor"})

_SHARDS_KEY = "local_shards"  # saved per parameter state: the number of shards its state was computed for
_LAYOUT_KEY = "local_shard_layout"  # and how the parameter was cut into them (`_layout`)


class LocalShardOptimizer(StateView, torch.optim.Optimizer):
    """
    Steps `base`, an optimizer over one plain tensor, on the local shard of its parameter (a DTensor under FSDP2;
    a plain parameter steps as is).

    Args:
        base (`torch.optim.Optimizer`):
            The optimizer, built over the parameter before FSDP2 sharded it (one group, one parameter).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.placement.local_shard import LocalShardOptimizer
    >>> weight = torch.nn.Parameter(torch.ones(4))
    >>> optimizer = LocalShardOptimizer(torch.optim.SGD([weight], lr=0.5))
    >>> weight.grad = torch.ones(4); optimizer.step(); weight.data
    tensor([0.5000, 0.5000, 0.5000, 0.5000])
    ```
    """

    takes_steps = True  # the pipeline hands it the FSDP2 hook's `GroupSteps`, for its base's step

    def __init__(self, base: torch.optim.Optimizer):
        (param,) = base.param_groups[0]["params"]
        self.base = base
        # A stable plain parameter for `base` to key its state by; bound to the current local shard before each use.
        local = local_tensor(param)
        self.local = torch.nn.Parameter(local.detach(), requires_grad=False)
        base.param_groups[0]["params"] = [self.local]
        group = {k: v for k, v in base.param_groups[0].items() if k != "params"}
        super().__init__([{**group, "params": [param]}], base.defaults)

    def _state_view(self) -> dict[torch.Tensor, dict]:
        s = self.base.state.get(self.local)
        return {self.param_groups[0]["params"][0]: s} if s else {}

    def _bind(self) -> torch.Tensor:
        """Point the plain parameter at the local shard and hand the wrapped optimizer the current hyperparameters."""
        param = self.param_groups[0]["params"][0]
        local = local_tensor(param)
        if self.local.data_ptr() != local.data_ptr() or self.local.shape != local.shape:
            self.local.data = local.detach()
        base_group = self.base.param_groups[0]
        base_group.update({k: v for k, v in self.param_groups[0].items() if k != "params"})
        return param

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, steps: Any = None):
        """Step the local shard; `steps`: the FSDP2 hook's `GroupSteps`, which may defer the base's step."""
        param = self._bind()
        grad = param.grad
        if grad is None:
            return None
        local_grad = _local_grad(param, grad)
        if closure is None:
            # FSDP2 calls this from its hook with the reduce-scatter stream current: bitsandbytes' kernels are ordered
            # after it, and deferred by `steps` to the next group's hooks (`streams.step_in_backward`).
            return step_in_backward(self.base, self.local, local_grad, steps)
        self.local.grad = local_grad
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
            layout = {_SHARDS_KEY: _shard_count(param), _LAYOUT_KEY: _layout(param)}
            out["state"][0] = {**_to_global(param, _unwrap(self.base, state)), **layout}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        param = self._bind()
        state = dict(state_dict["state"].get(0) or {})
        shards, layout = state.pop(_SHARDS_KEY, _shard_count(param)), state.pop(_LAYOUT_KEY, _layout(param))
        if state and shards != _shard_count(param):
            raise ValueError(
                f"This {type(self.base).__name__} state was saved on {shards} FSDP2 shards and cannot resume on "
                f"{_shard_count(param)}: bitsandbytes' quantization blocks follow the shards. Resume on {shards} "
                "ranks, or train on from the model weights alone."
            )
        if state and layout != _layout(param):
            # NOTE: the same number of shards cut another way (FSDP2 over tensor parallel 2 against tensor parallel 4)
            # would hand each rank the block scales of another shard's elements.
            raise ValueError(
                f"This {type(self.base).__name__} state was saved on shards cut as {layout} and cannot resume on "
                f"shards cut as {_layout(param)}: bitsandbytes' quantization blocks follow the shards. Resume on the "
                "mesh that saved it, or train on from the model weights alone."
            )
        local = _to_local(param, state)
        group = {k: v for k, v in state_dict["param_groups"][0].items() if k != "params"}
        self.base.load_state_dict({"state": {0: local} if local else {}, "param_groups": [{**group, "params": [0]}]})
        self.param_groups[0].update(group)


def _layout(param) -> str:
    """How a parameter is cut into its local shards, whatever replicates it (HSDP's replicas, a tensor-parallel dim a
    weight is not split over): each cutting mesh dim's size and placement, in mesh order (`"Shard(dim=0)x2"`)."""
    if not _is_dtensor(param):
        return "whole"
    mesh, placements = param.device_mesh, param.placements
    return ", ".join(f"{placements[d]!r}x{mesh.size(d)}" for d in sharded_dims(param)) or "whole"


def _local_grad(param, grad: torch.Tensor) -> torch.Tensor:
    """The gradient's part that matches the parameter's local shard."""
    if not _is_dtensor(grad):
        return grad
    # NOTE: under tensor parallel a gradient can arrive laid out unlike its parameter (transformers' rowwise embedding
    # under TP alone: a Shard(0) weight with a Replicate gradient); torch's optimizers on DTensors redistribute it to
    # the parameter's placements inside their ops, so the shard steps with the same slice here (from a Replicate one a
    # local slice, no collective).
    if grad.placements != param.placements or grad.device_mesh != param.device_mesh:
        grad = grad.redistribute(param.device_mesh, param.placements)
    return local_tensor(grad)


def _unwrap(base, state: dict[str, Any]) -> dict[str, Any]:
    # bitsandbytes nests its quantization tensors under one key in state_dict() (to hide them from FSDP1).
    state = dict(state)
    nested = state.pop(getattr(base, "_FSDP_WRAPPED_QUANT_STATE_KEY", None), None)
    return {**state, **(nested or {})}


def local_shards_of(optimizer) -> int | None:
    """The number of shards the `LocalShardOptimizer`s of a `LayerwiseOptimizer` step (`None` without any); saved in
    the checkpoint marker so that a resume on another number is refused before anything loads."""
    counts = {_shard_count(inner.param_groups[0]["params"][0]) for inner in optimizer.inner if _wrapped(inner)}
    return max(counts) if counts else None


def _wrapped(inner) -> bool:
    return isinstance(inner, LocalShardOptimizer)


def wrap_local_shards(factory: LayerwiseFactory) -> LayerwiseFactory:
    """
    The factory whose optimizers that cannot step a DTensor (bitsandbytes', Adafactor) step FSDP2's local shards
    (`LocalShardOptimizer`); others unchanged. `support.FSDP2_LOCAL_SHARD` lists the Trainer bases this covers.

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
        if type(inner).__module__.startswith("bitsandbytes.") or qualname(inner) in _LOCAL_SHARD_CLASSES:
            return LocalShardOptimizer(inner)
        return inner

    return build


__all__ = ["LocalShardOptimizer", "local_shards_of", "wrap_local_shards"]
