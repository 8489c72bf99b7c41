"""`LayerwiseCallback`: attaches the hooks for the length of `train()` and reports memory in Trainer's logs."""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from .optimizer import unwrap_layerwise_optimizer

MIB = 2**20


class LayerwiseCallback(TrainerCallback):
    """
    Lifecycle of a `LayerwiseOptimizer` inside `Trainer`: gradients are routed to it at `on_train_begin` (local
    hooks, or a DDP comm hook when the prepared model is DDP) and the hooks are removed at `on_train_end`.

    Args:
        trainer (`Trainer`, *optional*):
            Gives access to the prepared (DDP / FSDP2) model; without it the callback uses the `model` Trainer passes.
    """

    def __init__(self, trainer=None):
        self.trainer = trainer
        self.optimizer = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.optimizer = unwrap_layerwise_optimizer(optimizer)
        if self.optimizer is not None:
            # NOTE: `is None`, not `or`: truth-testing a torch.compile'd module calls len(), which it refuses.
            wrapped = getattr(self.trainer, "model_wrapped", None)
            self.optimizer.connect(model if wrapped is None else wrapped)
            # fp16: Accelerate's GradScaler decides skips and the scale from what the hooks find (None otherwise).
            accelerator = getattr(self.trainer, "accelerator", None)
            self.optimizer.use_grad_scaler(getattr(accelerator, "scaler", None))

    def on_train_end(self, args, state, control, **kwargs):
        if self.optimizer is not None:
            self.optimizer.detach()


def memory_logs(optimizer) -> dict[str, float]:
    """What a layer-wise run adds to each log line: the most gradient memory alive at once, the optimizer state,
    and on CUDA the allocator's peak."""
    logs = {
        "layerwise_peak_grad_mib": round(optimizer.peak_grad_bytes / MIB, 3),
        "layerwise_optimizer_state_mib": round(optimizer.state_bytes() / MIB, 3),
    }
    if torch.cuda.is_available():
        logs["max_memory_allocated_mib"] = round(torch.cuda.max_memory_allocated() / MIB, 1)
    return logs
