"""`LayerwiseCallback`: attaches the hooks for the length of `train()` and reports memory in Trainer's logs."""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from .optimizer import unwrap_layerwise_optimizer

MIB = 2**20


class LayerwiseCallback(TrainerCallback):
    """
    Lifecycle of a `LayerwiseOptimizer` inside `Trainer`: hooks are registered at `on_train_begin` and removed at
    `on_train_end`; every log line gets `layerwise_peak_grad_mib` (the most gradient memory alive at once) and
    `layerwise_optimizer_state_mib`, plus `max_memory_allocated_mib` on CUDA.
    """

    def __init__(self):
        self.optimizer = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.optimizer = unwrap_layerwise_optimizer(optimizer)
        if self.optimizer is not None:
            self.optimizer.attach()

    def on_train_end(self, args, state, control, **kwargs):
        if self.optimizer is not None:
            self.optimizer.detach()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.optimizer is None or logs is None:
            return
        logs["layerwise_peak_grad_mib"] = round(self.optimizer.peak_grad_bytes / MIB, 3)
        logs["layerwise_optimizer_state_mib"] = round(self.optimizer.state_bytes() / MIB, 3)
        if torch.cuda.is_available():
            logs["max_memory_allocated_mib"] = round(torch.cuda.max_memory_allocated() / MIB, 1)
