"""Types shared by the registry, the low-rank (GaLore / APOLLO) factories and the optimizer. A leaf: it imports
nothing from the package, so every module can depend on it without an import circle."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class LayerwiseParam:
    """
    One trainable parameter as a factory sees it.

    Args:
        name (`str`):
            The parameter's name in `model.named_parameters()`.
        param (`torch.nn.Parameter`):
            The parameter the returned optimizer must own (and only it).
        weight_decay (`float`):
            The weight decay Trainer's decay / no-decay split gives this parameter.
        is_embedding (`bool`):
            Whether the parameter is the weight of an `nn.Embedding` (bitsandbytes keeps those in 32-bit state).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf import LayerwiseParam
    >>> weight = torch.nn.Parameter(torch.zeros(4, 4))
    >>> lp = LayerwiseParam("layer.weight", weight, weight_decay=0.1)
    >>> optimizer = torch.optim.AdamW([{"params": [lp.param], "weight_decay": lp.weight_decay}], lr=1e-3)
    ```
    """

    name: str
    param: nn.Parameter
    weight_decay: float
    is_embedding: bool = False


# (parameter, TrainingArguments) -> the optimizer of that one parameter.
LayerwiseFactory = Callable[[LayerwiseParam, Any], torch.optim.Optimizer]

# Wrappers that insert themselves into parameter names without changing the parameter: activation checkpointing
# (accelerate's `fsdp_activation_checkpointing`, torch's `checkpoint_wrapper`), torch.compile, FSDP1.
_WRAPPER_PREFIXES = re.compile(r"(?:^|(?<=\.))(?:_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")


def canonical_name(name: str) -> str:
    """
    A parameter's name without the wrappers' segments, as torch's distributed checkpoint names it: the name the
    layer-wise optimizer keys states and checks by, whether the model was wrapped before or after it was built.

    Example:

    ```python
    >>> from layerwise_hf.bases.params import canonical_name
    >>> canonical_name("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight")
    'model.layers.0.mlp.up_proj.weight'
    ```
    """
    return _WRAPPER_PREFIXES.sub("", name)


def isolate_bnb_overrides(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """
    Give a bitsandbytes optimizer a private override manager. bitsandbytes consults a process-wide
    GlobalOptimManager keyed by (group, index), which is (0, 0) for every per-parameter optimizer, so another
    run's overrides (Trainer registers one per embedding) would leak into all of them.

    Args:
        optimizer (`torch.optim.Optimizer`):
            One parameter's optimizer; returned as it is unless it is a bitsandbytes one.

    Example:

    ```python
    >>> import bitsandbytes as bnb, torch
    >>> from layerwise_hf.bases.params import isolate_bnb_overrides
    >>> optimizer = isolate_bnb_overrides(bnb.optim.AdamW8bit([torch.nn.Parameter(torch.zeros(64))]))
    >>> optimizer.mng is bnb.optim.GlobalOptimManager.get_instance()
    False
    ```
    """
    if hasattr(optimizer, "mng"):
        from bitsandbytes.optim import GlobalOptimManager

        private = GlobalOptimManager.__new__(GlobalOptimManager)
        private.initialize()
        optimizer.mng = private
    return optimizer


def share_quantization_maps(optimizer: torch.optim.Optimizer, device: torch.device, shared: dict) -> None:
    """
    Give a bitsandbytes 8-bit optimizer the quantization maps already made for `device` (`shared`, one dict per
    factory), made and moved there now, before training. Each bitsandbytes optimizer makes its maps on the host at its
    first step and copies them to the parameter's device: one standard optimizer does that once, but one optimizer
    per parameter did it per parameter, inside backward, two host-to-device copies and two device syncs each (seen on
    an H200: 310 syncs in the first backward of a 1.1B Llama). The maps are read-only (one standard optimizer shares
    them across its parameters too), so the steps are unchanged. On the meta device nothing is shared: a map there
    could not be copied to where the model goes later.

    Args:
        optimizer (`torch.optim.Optimizer`): one parameter's optimizer; only bitsandbytes' get the maps.
        device (`torch.device`): where its parameter is now (a plain loop may move it later: bitsandbytes then copies
            the maps itself, as before).
        shared (`dict`): the maps made so far, by device; filled here.

    Example:

    ```python
    >>> import bitsandbytes as bnb, torch
    >>> from layerwise_hf.bases.params import share_quantization_maps
    >>> shared, params = {}, [torch.nn.Parameter(torch.zeros(4096)) for _ in range(2)]
    >>> optimizers = [bnb.optim.AdamW8bit([p]) for p in params]
    >>> for optimizer, p in zip(optimizers, params):
    ...     share_quantization_maps(optimizer, p.device, shared)
    >>> optimizers[0].name2qmap["dynamic"] is optimizers[1].name2qmap["dynamic"]
    True
    ```
    """
    if not (hasattr(optimizer, "name2qmap") and hasattr(optimizer, "fill_qmap")):
        return
    device = torch.device(device)
    if device.type == "meta":
        return
    maps = shared.get(device)
    if maps is None:
        optimizer.fill_qmap()
        maps = shared[device] = {name: qmap.to(device) for name, qmap in optimizer.name2qmap.items()}
    optimizer.name2qmap = dict(maps)


class StateView:
    """
    An optimizer whose `state` is a view of the states of the optimizers it wraps (`LayerwiseOptimizer`: one per
    parameter; a local-shard or host-step wrapper: its base), built by `_state_view()`. It stays a view: assigning a
    non-empty state is refused (torch's `Optimizer.__init__` assigns an empty one).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.bases.params import StateView
    >>> class Wrapper(StateView, torch.optim.Optimizer):
    ...     def __init__(self, base):
    ...         self.base = base
    ...         super().__init__(base.param_groups, base.defaults)
    ...     def _state_view(self):
    ...         return self.base.state
    >>> Wrapper(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)).state
    defaultdict(<class 'dict'>, {})
    ```
    """

    def _state_view(self) -> dict[torch.Tensor, dict]:
        raise NotImplementedError

    @property
    def state(self) -> dict[torch.Tensor, dict]:
        return self._state_view()

    @state.setter
    def state(self, value) -> None:
        if value:
            raise AttributeError(f"{type(self).__name__}.state is a view of the wrapped optimizers' states.")
