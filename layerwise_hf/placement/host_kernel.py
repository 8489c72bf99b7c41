"""Which kernel the host step runs (`layerwise_host_step`), and how many host threads it gets.

With `layerwise_offload="optimizer"` the host steps every trainable parameter, so on a GPU the host, not the device,
can set the step time. torch's optimizers on a CPU tensor run their per-tensor loop by default (`foreach` and
`fused` default to off there), about 9x above what the host's memory allows (docs/offload.md, "How fast the host
steps"). torch has fused CPU kernels (one vectorized pass over the parameter and its states) for every optimizer
whose `__init__` takes `fused` (Adam, AdamW, SGD and Adagrad in torch 2.13); they round differently from the loop in
the last bits.

- `"fast"`: a torch optimizer that has a fused kernel steps with it (`fused=True`, `foreach=False`); every other
  base steps as built. The default when the model lives on an accelerator: the device's own kernels were never
  bit-identical to the host's either.
- `"exact"`: the base exactly as Trainer builds it, bit for bit the standard optimizer on the same (CPU) tensors.
  The default on a CPU model, where the parity tests compare with stock Trainer.

Only the host step's own group is changed: the wrapper's `param_groups` and checkpoints keep the flags the factory
built, so a checkpoint resumes the same with offload off.
"""

from __future__ import annotations

import inspect
import os
import threading
from typing import Any

import torch

HOST_STEPS = ("auto", "fast", "exact")
_thread_share = threading.local()


def parse_host_step(value: Any, argument: str = "layerwise_host_step") -> str:
    """
    `value` as a host step kernel choice (`"auto"`, `"fast"`, `"exact"`), or a `ValueError` naming `argument`.

    Example:

    ```python
    >>> from layerwise_hf.placement.host_kernel import parse_host_step
    >>> parse_host_step("fast")
    'fast'
    ```
    """
    if value is None:
        return "auto"
    value = getattr(value, "value", value)
    if isinstance(value, str) and value in HOST_STEPS:
        return value
    raise ValueError(
        f"{argument}={value!r} is not a host step kernel: choose one of {', '.join(HOST_STEPS)} ('fast': torch's "
        "fused CPU kernel where the base has one; 'exact': the base as Trainer builds it, bit for bit; 'auto': fast "
        "for a model on an accelerator, exact for a CPU model)."
    )


def device_is_accelerator(device: torch.device) -> bool:
    """Whether a parameter on `device` lives on an accelerator (not the host's memory)."""
    return torch.device(device).type not in ("cpu", "meta")


def has_fused_kernel(base: torch.optim.Optimizer) -> bool:
    """Whether `base` is one of torch's own optimizers with a fused kernel for CPU tensors."""
    cls = type(base)
    if not cls.__module__.startswith("torch.optim.") or "fused" not in inspect.signature(cls.__init__).parameters:
        return False
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return "cpu" in _get_fused_kernels_supported_devices()


def host_kernel_flags(base: torch.optim.Optimizer, device: torch.device, host_step: str = "auto") -> dict[str, Any]:
    """
    The group settings the host step of `base` (built for a parameter on `device`) runs with on top of the factory's
    own: `{"fused": True, "foreach": False}` for the fast kernel, `{}` for the base as built (see the module
    docstring).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.placement.host_kernel import host_kernel_flags
    >>> base = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    >>> host_kernel_flags(base, torch.device("cpu")), host_kernel_flags(base, torch.device("cpu"), "fast")
    ({}, {'fused': True, 'foreach': False})
    ```
    """
    host_step = parse_host_step(host_step)
    if host_step == "auto":
        host_step = "fast" if device_is_accelerator(device) else "exact"
    if host_step == "exact" or not has_fused_kernel(base):
        return {}
    group = base.param_groups[0]
    # NOTE: torch refuses fused with differentiable (and with a tensor lr on some versions' CPU path): keep those as
    # built rather than fail at the first step.
    if group.get("differentiable") or group.get("fused"):
        return {}
    return {"fused": True, "foreach": False}


def host_threads(cores: int | None = None, local_world_size: int | None = None) -> int:
    """
    The intra-op threads one host worker gets: the cores this process may run on, divided among the node's ranks
    (`LOCAL_WORLD_SIZE`), less one per rank for the training thread (it launches the device's kernels). At least 1.
    `LAYERWISE_HF_HOST_THREADS` overrides it.

    Example:

    ```python
    >>> from layerwise_hf.placement.host_kernel import host_threads
    >>> host_threads(cores=32, local_world_size=4)
    7
    ```
    """
    override = os.environ.get("LAYERWISE_HF_HOST_THREADS")
    if override:
        return max(1, int(override))
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, cores // max(1, local_world_size) - 1)


def host_threads_for(device: torch.device) -> int | None:
    """The host worker's threads for a parameter on `device` (`host_threads`), or `None` on a CPU model: there the
    worker shares the cores with backward and keeps torch's count, as the parity tests run it."""
    return host_threads() if device_is_accelerator(device) else None


def claim_thread_share(threads: int) -> None:
    """Give the calling thread (the host worker) `threads` intra-op threads, once per thread.

    NOTE: `torch.set_num_threads` is per OS thread for the running thread (OpenMP's nthreads ICV: the training thread
    keeps its own count), but it also sets the count threads created afterwards start with (checked on torch 2.13:
    main 2 -> worker sets 1 -> main still 2, a new thread 1)."""
    if getattr(_thread_share, "threads", None) != threads:
        torch.set_num_threads(threads)
        _thread_share.threads = threads
