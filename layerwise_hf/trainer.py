"""Trainer integration: `LayerwiseTrainerMixin` (composable with TRL-style Trainer subclasses) and
`LayerwiseTrainer`. The overrides only route Trainer's calls to `LayerwiseOptimizer`."""

from __future__ import annotations

import logging
import warnings

from transformers import Trainer

from .callback import LayerwiseCallback, memory_logs
from .distributed import check_fsdp2_supported
from .optimizer import build_layerwise_optimizer, unwrap_layerwise_optimizer
from .registry import is_layerwise_name

logger = logging.getLogger(__name__)


class LayerwiseTrainerMixin:
    """
    Put before a `Trainer` subclass in the bases (`class MyTrainer(LayerwiseTrainerMixin, SFTTrainer)`) to give it
    layer-wise optimizers whenever `args.optim` ends in `_layerwise`. Other optimizer names are left to Trainer.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not any(isinstance(cb, LayerwiseCallback) for cb in self.callback_handler.callbacks):
            self.add_callback(LayerwiseCallback(trainer=self))

    def log(self, logs, *args, **kwargs):
        # NOTE: Trainer.log records and prints before callbacks' on_log run, so the memory figures go in here.
        optimizer = self.layerwise_optimizer
        if optimizer is not None:
            logs = {**logs, **memory_logs(optimizer)}
        return super().log(logs, *args, **kwargs)

    @property
    def layerwise_optimizer(self):
        """The `LayerwiseOptimizer` in use, or `None`."""
        return unwrap_layerwise_optimizer(self.optimizer)

    def _uses_layerwise(self) -> bool:
        return self.optimizer_cls_and_kwargs is None and is_layerwise_name(self.args.optim)

    def create_optimizer(self, model=None):
        if not self._uses_layerwise() or self.optimizer is not None:
            return super().create_optimizer(model)
        if self.is_deepspeed_enabled:
            raise ValueError(
                f"optim={self.args.optim!r} cannot run under DeepSpeed, which owns the optimizer step. Use the "
                f"standard optim={self.args.optim.removesuffix('_layerwise')!r} with DeepSpeed, or run layer-wise "
                "without DeepSpeed."
            )
        if self.is_fsdp_enabled and getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1) != 2:
            raise ValueError(
                f"optim={self.args.optim!r} needs FSDP2 (fsdp_version: 2) or DDP: FSDP1 flattens parameters, so "
                "there is no per-parameter gradient to step. Set fsdp_config={'version': 2} / fsdp_version: 2."
            )
        opt_model = self.model if model is None else model
        self.optimizer = build_layerwise_optimizer(
            opt_model, self.args, decay_parameter_names=self.get_decay_parameter_names(opt_model)
        )
        if self.is_fsdp_enabled:
            check_fsdp2_supported(self.optimizer)  # before any step, not at the first hook
        mode = getattr(self.args, "layerwise_clip", "exact")
        self.optimizer.configure_clipping(self.args.max_grad_norm, mode)
        _explain_clipping(self.args.max_grad_norm, mode, self.args.gradient_accumulation_steps)
        return self.optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        optimizer = self.layerwise_optimizer
        if optimizer is None:
            return super().training_step(model, inputs, num_items_in_batch)
        return optimizer.run_with_norm_pass(
            lambda: super(LayerwiseTrainerMixin, self).training_step(model, inputs, num_items_in_batch)
        )

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            # on_train_end detaches on success; this covers a train() that raised.
            optimizer = self.layerwise_optimizer
            if optimizer is not None:
                optimizer.detach()

    # NOTE: Trainer computes the norm with clip_grad_norm_ over .grad after backward; the hooks have freed those
    # gradients by then, so the norm accumulated inside the hooks is returned instead.
    def _clip_grad_norm(self, model):
        optimizer = self.layerwise_optimizer
        if optimizer is None:
            return super()._clip_grad_norm(model)
        return optimizer.grad_norm()

    def _get_grad_norm(self, model, grad_norm=None):
        optimizer = self.layerwise_optimizer
        if optimizer is None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        return grad_norm if grad_norm is not None else optimizer.grad_norm()


def _explain_clipping(max_grad_norm: float, mode: str, gradient_accumulation_steps: int) -> None:
    # Never silent: say once what max_grad_norm does here and what it costs.
    if not max_grad_norm or max_grad_norm <= 0:
        return
    if mode == "off":
        warnings.warn(
            f"layerwise_clip='off': max_grad_norm={max_grad_norm} is NOT applied. The logged grad_norm is still the "
            "exact pre-clip norm.",
            UserWarning,
            stacklevel=3,
        )
    elif mode == "exact" and gradient_accumulation_steps == 1:
        logger.warning(
            "max_grad_norm=%s with layerwise_clip='exact' and no gradient accumulation: each step runs forward and "
            "backward twice (the first pass measures the global norm) to clip exactly like Trainer. "
            "layerwise_clip='previous' clips in one pass with the previous step's norm.",
            max_grad_norm,
        )


class LayerwiseTrainer(LayerwiseTrainerMixin, Trainer):
    """`Trainer` with layer-wise optimizers: use it with `LayerwiseTrainingArguments(optim="<base>_layerwise")`."""
