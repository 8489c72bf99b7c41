"""Trainer integration: `LayerwiseTrainerMixin` (composable with TRL-style Trainer subclasses) and
`LayerwiseTrainer`. The overrides only route Trainer's calls to `LayerwiseOptimizer`."""

from __future__ import annotations

import logging
import warnings

from transformers import Trainer

from .callback import LayerwiseCallback
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
            self.add_callback(LayerwiseCallback())

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
        opt_model = self.model if model is None else model
        if self.args.max_grad_norm and self.args.max_grad_norm > 0:
            warnings.warn(
                f"max_grad_norm={self.args.max_grad_norm} is NOT applied with optim={self.args.optim!r}: each layer "
                "is stepped before the global gradient norm is known. The logged grad_norm is still the exact "
                "pre-clip norm. Set max_grad_norm=0 to silence this warning.",
                UserWarning,
                stacklevel=2,
            )
        self.optimizer = build_layerwise_optimizer(
            opt_model, self.args, decay_parameter_names=self.get_decay_parameter_names(opt_model)
        )
        return self.optimizer

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


class LayerwiseTrainer(LayerwiseTrainerMixin, Trainer):
    """`Trainer` with layer-wise optimizers: use it with `LayerwiseTrainingArguments(optim="<base>_layerwise")`."""
