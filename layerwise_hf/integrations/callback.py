"""`LayerwiseCallback`: attaches the hooks for the length of `train()` and reports memory in Trainer's logs."""

from __future__ import annotations

import logging

import torch
from transformers import TrainerCallback
from transformers.utils import logging as hf_logging

from ..bases.support import check_no_new_trainable
from ..optim.optimizer import unwrap_layerwise_optimizer
from ..placement.offloading import wait_for_host_steps
from .preflight import Preflight, check_preflight_argument
from .report import StepPeaks, describe_training, memory_summary

logger = logging.getLogger(__name__)
# NOTE: the run's own account goes through Trainer's logger, so it shows wherever Trainer's "***** Running training
# *****" shows (axolotl and LLaMA-Factory turn transformers' INFO on; other processes than the main one stay at
# log_level_replica) and nowhere else.
trainer_logger = hf_logging.get_logger("transformers.trainer")

MIB = 2**20


class LayerwiseCallback(TrainerCallback):
    """
    Lifecycle of a `LayerwiseOptimizer` inside `Trainer`: gradients are routed to it at `on_train_begin` (local
    hooks, or a DDP comm hook when the prepared model is DDP) and the hooks are removed at `on_train_end`.

    `LayerwiseTrainer` (and any `LayerwiseTrainerMixin` subclass) adds one itself; add it by hand only to a Trainer
    that builds its `LayerwiseOptimizer` another way.

    Args:
        trainer (`Trainer`, *optional*):
            Gives access to the prepared (DDP / FSDP2) model and Accelerate's fp16 `GradScaler`; without it the
            callback uses the `model` Trainer passes.

    Example:

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from layerwise_hf import LayerwiseCallback, LayerwiseTrainer, LayerwiseTrainingArguments
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
    ...                                      num_hidden_layers=2, num_attention_heads=4))
    >>> args = LayerwiseTrainingArguments(output_dir="out", optim="adamw_torch_layerwise")
    >>> trainer = LayerwiseTrainer(model=model, args=args)
    >>> any(isinstance(cb, LayerwiseCallback) for cb in trainer.callback_handler.callbacks)
    True
    ```
    """

    def __init__(self, trainer=None):
        self.trainer = trainer
        self.optimizer = None
        self.preflight = None
        self.steps = StepPeaks()
        # Where the start line and the memory summary go; a framework that filters Trainer's INFO out names its own.
        self.report_logger = trainer_logger

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._end_preflight()
        if model is not None and check_preflight_argument(args):
            # Plans at the first training forward: its batch gives the micro-batch and the sequence length.
            self.preflight = Preflight(model, args, accelerator=getattr(self.trainer, "accelerator", None))
        self.optimizer = unwrap_layerwise_optimizer(optimizer)
        if self.optimizer is not None:
            if model is not None:
                frozen = check_no_new_trainable(self.optimizer.names, model)
                if frozen:
                    logger.info(
                        "%d parameter(s) frozen since the optimizer was built get no gradient, so they are not "
                        "stepped and keep their optimizer state, as with a standard optimizer: %s",
                        len(frozen),
                        frozen,
                    )
            # Follow the arguments of this train() call, as Trainer does for a standard optimizer.
            self.optimizer.configure_clipping(args.max_grad_norm, getattr(args, "layerwise_clip", "exact"))
            # NOTE: `is None`, not `or`: truth-testing a torch.compile'd module calls len(), which it refuses.
            wrapped = getattr(self.trainer, "model_wrapped", None)
            accelerator = getattr(self.trainer, "accelerator", None)
            # auto_find_batch_size reruns training at a smaller batch after an out-of-memory error, from the weights
            # as they are; the first step is the one that finds the batch too large. Held until its backward is done,
            # an OOM there leaves every weight as stock Trainer leaves it: untouched.
            hold = bool(getattr(args, "auto_find_batch_size", False))
            self.optimizer.connect(
                model if wrapped is None else wrapped, accelerator=accelerator, hold_first_step=hold
            )
            # fp16: Accelerate's GradScaler decides skips and the scale from what the hooks find (None otherwise).
            self.optimizer.use_grad_scaler(getattr(accelerator, "scaler", None))
            self.steps = StepPeaks()
            if state.is_world_process_zero:
                self.report_logger.info(describe_training(self.optimizer, args))

    def on_step_begin(self, args, state, control, **kwargs):
        if self.optimizer is not None:
            self.steps.step_begin(self.optimizer)

    def on_step_end(self, args, state, control, **kwargs):
        if self.optimizer is not None:
            self.steps.step_end(self.optimizer)
        if self.preflight is not None:
            self._end_preflight()

    def on_train_end(self, args, state, control, **kwargs):
        self._end_preflight()
        if self.optimizer is not None and state.is_world_process_zero:
            self.report_logger.info(memory_summary(self.optimizer, args, self.steps))
        end_training(self.optimizer)

    def _end_preflight(self) -> None:
        if self.preflight is not None:
            self.preflight.after_step()
            self.preflight.close()
            self.preflight = None


def end_training(optimizer) -> None:
    """
    After `train()`, a `LayerwiseOptimizer` (or `None`) behaves as a torch optimizer in the user's own loop: no
    hooks, and no clipping or fp16 unscaling of Trainer's (`step()` never clips); the next `train()` sets them again.

    Example:

    ```python
    >>> from layerwise_hf.integrations.callback import end_training
    >>> end_training(trainer.layerwise_optimizer)
    >>> trainer.layerwise_optimizer.pipeline.clipper.mode.value, trainer.layerwise_optimizer.attached
    ('off', False)
    ```
    """
    if optimizer is not None:
        wait_for_host_steps(optimizer)  # layerwise_offload="optimizer": the last host steps are in the weights
        optimizer.detach()
        optimizer.use_grad_scaler(None)
        optimizer.configure_clipping(None)


def memory_logs(optimizer) -> dict[str, float]:
    """
    What a layer-wise run adds to each log line, in MiB: the most gradient memory alive at once, the optimizer state,
    and on CUDA the allocator's peak.

    Args:
        optimizer (`LayerwiseOptimizer`):
            The optimizer whose figures are reported.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf import LayerwiseOptimizer, LayerwiseParam
    >>> from layerwise_hf.integrations.callback import memory_logs
    >>> model = torch.nn.Linear(4, 2)
    >>> params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
    >>> optimizer = LayerwiseOptimizer(params, lambda lp, args: torch.optim.AdamW([lp.param], lr=1e-3))
    >>> sorted(memory_logs(optimizer))[:2]
    ['layerwise_optimizer_state_mib', 'layerwise_peak_grad_mib']
    ```
    """
    logs = {
        "layerwise_peak_grad_mib": round(optimizer.pipeline.memory.peak_grad_bytes / MIB, 3),
        "layerwise_optimizer_state_mib": round(optimizer.pipeline.memory.state_bytes() / MIB, 3),
    }
    if torch.cuda.is_available():
        logs["max_memory_allocated_mib"] = round(torch.cuda.max_memory_allocated() / MIB, 1)
    return logs


def learning_rate_logs(optimizer, logs: dict) -> dict[str, float]:
    """
    When the per-parameter optimizers run at different learning rates (`muon_layerwise` with `muon_lr`), the lr each
    optimizer class applied in the latest step, next to Trainer's `learning_rate` (only the first parameter's).

    Example:

    ```python
    >>> from layerwise_hf.integrations.callback import learning_rate_logs
    >>> learning_rate_logs(trainer.layerwise_optimizer, {"learning_rate": 0.001})
    {'learning_rate_adamw': 0.001, 'learning_rate_muon': 0.02}
    ```
    """
    applied = dict(optimizer.pipeline.applied_lr)
    configured = {float(i.param_groups[0].get("initial_lr", i.param_groups[0]["lr"])) for i in optimizer.inner}
    if "learning_rate" not in logs or len(configured) < 2 or len(applied) < 2:
        return {}
    return {f"learning_rate_{name.lower()}": float(lr) for name, lr in sorted(applied.items())}
