"""Host offload's checks and the host steps' wrapping, and what a driver asks of it afterwards.

`check_host_step_base` refuses a base that cannot step on the host; `host_step_factory` wraps each inner optimizer in
a `HostStepOptimizer` when the optimizer is built (`layerwise_offload="optimizer"`); `wait_for_host_steps` waits for
their host steps and copies back. Offload joins the path of a gradient in one place, the pipeline's offload stage
(`layerwise_hf.optim.host_offload`), given to it by `layerwise_hf.optim.optimizer.enable_offload`.
"""

from __future__ import annotations

import logging
from typing import Any

from ..bases.params import LayerwiseFactory
from ..bases.registry import parse_optim_name
from .host_kernel import parse_host_step
from .host_step import HostRunner, HostStepOptimizer, wrap_host_steps

logger = logging.getLogger(__name__)

# Bases whose step cannot run on the host: `layerwise_offload="optimizer"` refuses them before training.
NOT_ON_HOST = {
    "adamw_torch_npu_fused": "its fused step runs on Ascend NPUs only",
    "adamw_torch_xla": "its step runs on XLA devices only",
    "galore_adamw_8bit": (
        "bitsandbytes' CPU 8-bit step fails on GaLore's projected gradients (RuntimeError: mat1 and mat2 shapes "
        "cannot be multiplied; benchmarks/host_step_pace.py)"
    ),
}
# Bases whose host step is slower than the backward it should overlap: layer host step / layer backward, measured
# by benchmarks/host_step_pace.py (one Llama layer, hidden 2048, 1 x 512 tokens, fp32, 2 CPU threads; the host
# worker falls behind and the next forward waits for it).
SLOW_ON_HOST = {
    "adamw_bnb_8bit": 1.16,
    "adamw_8bit": 1.24,
    "ademamix_8bit": 1.82,
    "adamw_torch_4bit": 1.45,
    "muon": 10.98,  # Newton-Schulz iterations: matrix products on the host
}
_warned: set[str] = set()


def check_host_step_base(optimizer_name: str | None) -> None:
    """
    Refuse (`ValueError`) a base whose step cannot run on the host with `layerwise_offload="optimizer"`, and warn
    once per base for one measured slower on the host than the backward it overlaps (`SLOW_ON_HOST`).

    Example:

    ```python
    >>> from layerwise_hf.placement.offloading import check_host_step_base
    >>> check_host_step_base("adamw_torch_layerwise")  # steps on the host faster than backward: nothing to say
    ```
    """
    name = str(optimizer_name or "")
    # A registered custom factory (or an optimizer built without a name): the user knows what it steps.
    if not name.endswith("_layerwise") or not parse_optim_name(name):
        return
    base = name.removesuffix("_layerwise")  # as the user named it: muon_layerwise's Trainer base is adamw_torch
    if base in NOT_ON_HOST:
        raise ValueError(
            f"layerwise_offload='optimizer' cannot step optim={optimizer_name!r} on the host: {NOT_ON_HOST[base]}. "
            "Use layerwise_offload='gradients' (states and the step stay on the device; gradients wait on the "
            "host), or a base that steps on the host: adamw_torch_layerwise, adafactor_layerwise, sgd_layerwise."
        )
    if base in SLOW_ON_HOST and base not in _warned:
        _warned.add(base)
        logger.warning(
            "layerwise_offload='optimizer' with optim=%r: its host (CPU) step measured %.1fx the backward it should "
            "overlap (benchmarks/host_step_pace.py: one Llama layer, hidden 2048, 512 tokens), so the next forward "
            "waits for the host. layerwise_offload='gradients' keeps the step on the device; adamw_torch_layerwise "
            "keeps pace on the host.",
            optimizer_name,
            SLOW_ON_HOST[base],
        )


def check_fsdp2_accumulation(offload: str, gradient_accumulation_steps: int, reduces_each_micro_batch: bool) -> None:
    """
    Warn, before training, that under FSDP2 offload saves no gradient memory in a gradient-accumulation window whose
    micro-batches are not reduced: FSDP2 accumulates them itself, unsharded (every rank holds the whole model's
    gradients), and hands the reduced shards over only after the window's last backward.

    Args:
        offload (`str`): `layerwise_offload`.
        gradient_accumulation_steps (`int`): micro-batches per window.
        reduces_each_micro_batch (`bool`): every micro-batch is reduce-scattered (Accelerate's `sync_each_batch`, as
            the driver honours it: `layerwise_hf.platform.compat.fsdp2_trainer_reduces_each_micro_batch` for Trainer).

    Example:

    ```python
    >>> from layerwise_hf.placement.offloading import check_fsdp2_accumulation
    >>> check_fsdp2_accumulation("gradients", 4, reduces_each_micro_batch=True)  # each shard offloaded as it comes
    ```
    """
    if offload == "none" or gradient_accumulation_steps <= 1 or reduces_each_micro_batch:
        return
    logger.warning(
        "layerwise_offload=%r under FSDP2 with gradient_accumulation_steps=%d: the micro-batches before each window's "
        "last run under accelerator.no_sync, where FSDP2 accumulates unsharded gradients on the device (the whole "
        "model's on every rank), so offload saves no gradient memory there. Reduce-scatter every micro-batch and each "
        "shard goes to host memory as it comes: TrainingArguments(accelerator_config={'gradient_accumulation_kwargs': "
        "{'sync_each_batch': True}}) on transformers >= 5.2 (Accelerator(gradient_accumulation_plugin="
        "GradientAccumulationPlugin(num_steps=..., sync_each_batch=True)) with accelerator.accumulate in a plain "
        "loop), for one reduce-scatter per micro-batch instead of per window.",
        offload,
        gradient_accumulation_steps,
    )


def host_step_factory(
    factory: LayerwiseFactory, mode: str, host_step: str | None = None
) -> tuple[LayerwiseFactory, HostRunner | None]:
    """With `mode="optimizer"`, `factory` wrapped so each optimizer steps on the host, and their shared runner.
    `host_step` (`"auto"`, `"fast"`, `"exact"`; `layerwise_hf.placement.host_kernel`) defaults to the arguments'
    `layerwise_host_step`."""
    if host_step is not None:
        host_step = parse_host_step(host_step, "host_step")
    if mode != "optimizer":
        return factory, None
    runner = HostRunner()
    return wrap_host_steps(factory, runner, host_step), runner


def wait_for_host_steps(optimizer: Any) -> None:
    """
    With `layerwise_offload="optimizer"`: block until every host step has run and its parameter is back on the
    device (the next forward waits by itself; checkpoints, `train()`'s end and a user reading weights, or writing
    them as `model.load_state_dict` does, call this: a copy back still in flight would overwrite what was written).
    `optimizer` is a `LayerwiseOptimizer` (any object with `inner`, its inner optimizers).

    Example:

    ```python
    >>> from layerwise_hf.placement.offloading import wait_for_host_steps
    >>> wait_for_host_steps(optimizer); torch.save(model.state_dict(), "weights.pt")
    ```
    """
    for inner in optimizer.inner:
        if isinstance(inner, HostStepOptimizer):
            inner.wait_host()
            inner.runner.wait()
