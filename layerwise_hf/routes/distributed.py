"""Picking the route for a prepared model, and FSDP2 and meshes on CPU for tests.

The routes themselves live in `layerwise_hf.routes.hooks` (local hooks, FSDP2), `layerwise_hf.routes.data_parallel`
(the bucketed reducer) and `layerwise_hf.routes.ddp` (the DDP comm hook); what is allowed under FSDP2 is decided in
`layerwise_hf.bases.support`, and checked by the sink a route with `steps_shards` is attached to.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch

from .data_parallel import DataParallelConfig, DataParallelReducer
from .ddp import DDPCommHook, find_ddp
from .hooks import FSDP2Hooks, GradientRoute, LocalHooks


def is_sharded(params) -> bool:
    """
    Whether any of `params` is a DTensor (FSDP2's `fully_shard` made it one).

    Args:
        params (`Iterable[torch.Tensor]`):
            The parameters to look at.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.routes.distributed import is_sharded
    >>> is_sharded(torch.nn.Linear(2, 2).parameters())
    False
    ```
    """
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


def choose_route(
    params: Sequence[torch.Tensor], model: torch.nn.Module | None = None, accelerator: Any = None
) -> GradientRoute:
    """
    The route for `model` as Accelerate prepared it: DDP-wrapped (DDP's comm hook), FSDP2-sharded, replicated
    without DDP under a data-parallel `accelerator` (the bucketed reducer), or plain (local hooks).

    Args:
        params (`Sequence[torch.Tensor]`):
            The parameters the route will hand over (the sink's `params`, after Accelerate's prepare).
        model (`torch.nn.Module`, *optional*):
            The model `accelerator.prepare` returned.
        accelerator (`accelerate.Accelerator`, *optional*):
            Its DDP settings build the data-parallel route for a replicated model not wrapped in DDP.

    Example:

    ```python
    >>> from layerwise_hf.routes.distributed import choose_route
    >>> route = choose_route(layerwise_optimizer.params, model, accelerator)  # one process, no DDP or FSDP2
    >>> type(route).__name__
    'LocalHooks'
    ```
    """
    ddp = find_ddp(model)
    if ddp is not None:
        return DDPCommHook(ddp)
    if is_sharded(params):
        return FSDP2Hooks()
    config = DataParallelConfig.from_accelerator(accelerator) if accelerator is not None else None
    if config is not None and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        return DataParallelReducer(model, config)
    return LocalHooks()


# ---- FSDP2 on CPU (tests and CPU demos) ----

FORCE_FSDP_CPU_ENV = "LAYERWISE_HF_FORCE_FSDP_CPU"


def force_fsdp_on_cpu() -> None:
    """
    Let Accelerate run its FSDP path on CPU / gloo, which it otherwise silently turns into DDP: accelerate 1.15's
    `AcceleratorState.__init__` only keeps an FSDP plugin for accelerator device types. Call before the first
    `Accelerator` / `Trainer` of the process, or set `LAYERWISE_HF_FORCE_FSDP_CPU=1` (applied on import).
    Meant for CPU tests of the FSDP2 path; GPUs need none of this.

    Example:

    ```python
    >>> from layerwise_hf import force_fsdp_on_cpu
    >>> force_fsdp_on_cpu()  # before the first Accelerator / Trainer of the process
    >>> # launched with `accelerate launch --config_file configs/accelerate/cpu_fsdp2.yaml train.py`, the
    >>> # Accelerator's distributed_type is now DistributedType.FSDP instead of MULTI_CPU
    ```
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if getattr(AcceleratorState.__init__, "_layerwise_fsdp_cpu", False):
        return
    original = AcceleratorState.__init__

    @functools.wraps(original)
    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        fresh = not self.__class__._shared_state
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fresh and fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            # What state.py does for the accelerator device types.
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            # Later `AcceleratorState()` calls copy PartialState's shared dict: keep the two in step.
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    __init__._layerwise_fsdp_cpu = True
    AcceleratorState.__init__ = __init__


# ---- meshes (ParallelismConfig) on CPU (tests and CPU demos) ----

FORCE_MESH_CPU_ENV = "LAYERWISE_HF_FORCE_MESH_CPU"


class _MultiDeviceView:
    # What `ParallelismConfig._validate_accelerator` reads of the Accelerator, with gloo CPU ranks counted as the
    # multi-device case; every other attribute is the Accelerator's own.
    multi_device = True

    def __init__(self, accelerator: Any):
        self._accelerator = accelerator

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)


def force_mesh_on_cpu() -> None:
    """
    Let Accelerate take a `ParallelismConfig` (HSDP, tensor parallel, a model loaded with transformers'
    `DistributedConfig`) on CPU / gloo ranks: accelerate 1.15's `ParallelismConfig._validate_accelerator` accepts
    FSDP2, DeepSpeed and multi-device runs only, and refuses `DistributedType.MULTI_CPU`. This widens that one check
    (the CPU ranks count as the multi-device case there) and changes nothing else: Accelerate's wrapping, its meshes
    and its other checks run as on GPUs. Call before the first `Accelerator` / `Trainer` of the process, or set
    `LAYERWISE_HF_FORCE_MESH_CPU=1` (applied on import); with the FSDP2 config, `force_fsdp_on_cpu` (or
    `LAYERWISE_HF_FORCE_FSDP_CPU=1`) too. Meant for CPU tests of meshes; GPUs need none of this.

    Example:

    ```python
    >>> from layerwise_hf.routes.distributed import force_mesh_on_cpu
    >>> force_mesh_on_cpu()  # before the first Accelerator / Trainer of the process
    >>> # 4 gloo ranks: TrainingArguments(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))
    >>> # under the FSDP2 config (with force_fsdp_on_cpu), or a model from `from_pretrained(...,
    >>> # distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))`, now trains instead of raising ValueError
    ```
    """
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    if getattr(ParallelismConfig._validate_accelerator, "_layerwise_mesh_cpu", False):
        return
    original = ParallelismConfig._validate_accelerator

    @functools.wraps(original)
    def _validate_accelerator(self, accelerator):
        # A config of size 1 is what Accelerate makes itself for plain DDP: left as CPU runs always saw it.
        if accelerator.distributed_type == DistributedType.MULTI_CPU and self.total_size > 1:
            accelerator = _MultiDeviceView(accelerator)
        return original(self, accelerator)

    _validate_accelerator._layerwise_mesh_cpu = True
    ParallelismConfig._validate_accelerator = _validate_accelerator


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


if _env_flag(FORCE_FSDP_CPU_ENV):
    force_fsdp_on_cpu()
if _env_flag(FORCE_MESH_CPU_ENV):
    force_mesh_on_cpu()
