"""Trainer integration: `LayerwiseTrainerMixin` (composable with TRL-style Trainer subclasses) and
`LayerwiseTrainer`. The overrides only route Trainer's calls to `LayerwiseOptimizer`."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import warnings

from transformers import Trainer, TrainingArguments

from ..bases.params import canonical_name
from ..bases.registry import is_layerwise_name
from ..bases.support import check_deepspeed, check_fsdp2_optimizers, check_fsdp_version, fsdp_version_of_args
from ..optim.norm_pass import NormPass, backward_with_norm_pass, forward_again, parse_norm_pass, run_with_norm_pass
from ..optim.optimizer import build_layerwise_optimizer, unwrap_layerwise_optimizer
from ..optim.state import standard_groups_names
from ..placement.local_shard import local_shards_of
from ..placement.offloading import check_fsdp2_accumulation, wait_for_host_steps
from ..platform.compat import (
    cpu_map_location,
    create_optimizer_args,
    fsdp2_trainer_reduces_each_micro_batch,
    route_inline_grad_norm,
    set_ddp_handler_early,
)
from ..routes.data_parallel import DataParallelConfig
from .callback import LayerwiseCallback, end_training, learning_rate_logs, memory_logs
from .checkpoint import (
    OPTIMIZER_NAME,
    check_checkpoint,
    check_local_shards,
    convert_scheduler_state,
    first_members,
    is_layerwise_state_dict,
    is_transformers_dummy_state,
    latest_complete_checkpoint,
    layerwise_to_standard,
    load_optimizer_file,
    mark_complete,
    standard_to_layerwise,
    warn_missing_optimizer_state,
)

logger = logging.getLogger(__name__)


class LayerwiseTrainerMixin:
    """
    Put before a `Trainer` subclass in the bases (`class MyTrainer(LayerwiseTrainerMixin, SFTTrainer)`) to give it
    layer-wise optimizers whenever `args.optim` ends in `_layerwise`. Other optimizer names are left to Trainer.
    It adds a `LayerwiseCallback`, logs the memory figures of `memory_logs`, and writes a completion marker into each
    checkpoint; it takes the same arguments as the Trainer it is mixed into.

    Example:

    ```python
    >>> from transformers import Trainer
    >>> from layerwise_hf import LayerwiseTrainerMixin
    >>> class MyTrainer(LayerwiseTrainerMixin, Trainer):  # or TRL's SFTTrainer, DPOTrainer, ...
    ...     pass
    ```
    """

    def __init__(self, *args, **kwargs):
        # NOTE: by type, not position: DPOTrainer's second positional argument is ref_model.
        training_args = kwargs.get("args") or next((a for a in args if isinstance(a, TrainingArguments)), None)
        if training_args is not None and training_args.save_strategy != "no":
            # Trainer creates output_dir in __init__; say clearly why that fails instead of an OSError.
            _check_writable(training_args.output_dir)
        super().__init__(*args, **kwargs)
        if not any(isinstance(cb, LayerwiseCallback) for cb in self.callback_handler.callbacks):
            self.add_callback(LayerwiseCallback(trainer=self))
        if is_layerwise_name(self.args.optim) and (self.optimizer is not None or self.optimizer_cls_and_kwargs):
            # Trainer lets these win over `optim` without a word; here that silently costs the memory asked for.
            given = "optimizers=(optimizer, ...)" if self.optimizer is not None else "optimizer_cls_and_kwargs"
            warnings.warn(
                f"optim={self.args.optim!r} is not used: the optimizer given in {given} takes its place, as with "
                "Trainer, and steps after the whole backward. Leave it out to train layer-wise.",
                stacklevel=2,
            )
        if self._uses_layerwise():
            # At init, before any wrapping: torch's FSDP1 wrap fails first, with an unrelated error, on CPU.
            check_deepspeed(self.args.optim, self.is_deepspeed_enabled)
            check_fsdp_version(self.args.optim, _fsdp_version(self))

    def log(self, logs, *args, **kwargs):
        # NOTE: Trainer.log records and prints before callbacks' on_log run, so the memory figures go in here.
        optimizer = self.layerwise_optimizer
        if optimizer is not None:
            logs = {**logs, **learning_rate_logs(optimizer, logs), **memory_logs(optimizer)}
        return super().log(logs, *args, **kwargs)

    @property
    def layerwise_optimizer(self):
        """
        The `LayerwiseOptimizer` in use (unwrapped from Accelerate's `AcceleratedOptimizer`), or `None` before
        `create_optimizer()` or with a standard optimizer.

        Example:

        ```python
        >>> from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments
        >>> trainer = LayerwiseTrainer(model=model, args=LayerwiseTrainingArguments("out", optim="sgd_layerwise"))
        >>> _ = trainer.create_optimizer()
        >>> trainer.layerwise_optimizer.optimizer_name
        'sgd_layerwise'
        ```
        """
        return unwrap_layerwise_optimizer(self.optimizer)

    def _uses_layerwise(self) -> bool:
        return self.optimizer_cls_and_kwargs is None and is_layerwise_name(self.args.optim)

    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return super().create_optimizer(*create_optimizer_args(model))
        if not self._uses_layerwise():
            return _strip_frozen(super().create_optimizer(*create_optimizer_args(model)))
        check_deepspeed(self.args.optim, self.is_deepspeed_enabled)
        check_fsdp_version(self.args.optim, _fsdp_version(self))
        opt_model = self.model if model is None else model
        # NOTE: Trainer logs grad_norm every step, so the norms are always wanted.
        self.optimizer = build_layerwise_optimizer(
            opt_model,
            self.args,
            decay_parameter_names=self.get_decay_parameter_names(opt_model),
            track_grad_norm=True,
            local_shards=self.is_fsdp_enabled or _sharded_at_load(self),
        )
        set_ddp_handler_early(self)
        if self.is_fsdp_enabled:
            inner = [getattr(i, "host_base", i) for i in self.optimizer.inner]  # layerwise_offload="optimizer"
            check_fsdp2_optimizers(self.optimizer.optimizer_name, inner)  # before any step
            check_fsdp2_accumulation(
                getattr(self.args, "layerwise_offload", "none"),
                self.args.gradient_accumulation_steps,
                fsdp2_trainer_reduces_each_micro_batch(
                    bool(self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False))
                ),
            )
        elif DataParallelConfig.from_accelerator(self.accelerator) is not None:
            # Under a DDP config the gradients are reduced by the layer-wise data-parallel route: DDP's buckets
            # would hold as much memory as all gradients for the whole run.
            _replicate_without_ddp(self.accelerator, opt_model)
        mode = getattr(self.args, "layerwise_clip", "exact")
        self.optimizer.configure_clipping(self.args.max_grad_norm, mode)
        route_inline_grad_norm(self.accelerator, lambda: self.layerwise_optimizer)
        ga = self.args.gradient_accumulation_steps
        offload = getattr(self.args, "layerwise_offload", "none")
        _explain_clipping(self.args.max_grad_norm, mode, ga, self.args.fp16, offload)
        return self.optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        optimizer = self.layerwise_optimizer
        if optimizer is None:
            return super().training_step(model, inputs, num_items_in_batch)
        route = optimizer.pipeline.route
        way = parse_norm_pass(getattr(self.args, "layerwise_norm_pass", "auto"), argument="layerwise_norm_pass")
        # Collectives run once per forward, and a compiled backward cannot run over a retained graph: there a norm
        # pass is a whole second forward+backward. On one process the way is chosen per step from what the graph
        # saves (norm_pass.choose_norm_pass); a 'rerun' choice applies from the next step's forward on.
        rerun = (
            (route is not None and route.collective_per_forward)
            or self._layerwise_compiled(model)
            or way is NormPass.RERUN
            or (way is NormPass.AUTO and forward_again(optimizer))
        )

        def forward_backward():
            with _extra_backwards_accumulate(self, optimizer, None if rerun else way):
                return super(LayerwiseTrainerMixin, self).training_step(model, inputs, num_items_in_batch)

        return run_with_norm_pass(optimizer, forward_backward, model) if rerun else forward_backward()

    def compute_loss_context_manager(self):
        # NOTE: Trainer's training_step (4.55 - 5.24) and TRL's trainers call compute_loss only inside this context, so
        # it marks a backward that compute_loss runs itself, whichever subclass's compute_loss that is (one before the
        # mixin in the bases included, which need not call super()).
        context = super().compute_loss_context_manager()
        marker = getattr(self, "_layerwise_in_compute_loss", None)
        return context if marker is None else _marking(context, marker)

    def _layerwise_compiled(self, model) -> bool:
        cached = getattr(self, "_layerwise_compiled_cache", None)
        if cached is None or cached[0] is not model:
            cached = (model, is_compiled(model) or bool(getattr(self.args, "torch_compile", False)))
            self._layerwise_compiled_cache = cached
        return cached[1]

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # Everything that can be checked before a step is: where checkpoints go, and what we resume from.
        if self.args.save_strategy != "no" and self.args.should_save:
            _check_writable(self.args.output_dir)
        if resume_from_checkpoint is True:
            # Trainer would take the newest checkpoint-N even if a crash interrupted its writing.
            resume_from_checkpoint = latest_complete_checkpoint(self.args.output_dir) or True
        if isinstance(resume_from_checkpoint, str):
            accept = bool(getattr(self.args, "layerwise_accept_nonfinite_state", False))
            check_checkpoint(resume_from_checkpoint, accept_nonfinite=accept)
            warn_missing_optimizer_state(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            # on_train_end does this on success; this covers a train() that raised.
            end_training(self.layerwise_optimizer)

    def _save_checkpoint(self, model, trial):
        if self.layerwise_optimizer is not None:
            wait_for_host_steps(self.layerwise_optimizer)  # layerwise_offload="optimizer": weights saved updated
        super()._save_checkpoint(model, trial)
        # A checkpoint is complete only once everything above is written (all ranks); a run killed mid-write
        # leaves no marker, and resume_from_checkpoint=True then takes the previous one.
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            output_dir = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            info = {"global_step": self.state.global_step, "optim": str(self.args.optim)}
            shards = local_shards_of(self.layerwise_optimizer) if self.layerwise_optimizer is not None else None
            mark_complete(output_dir, info if shards is None else {**info, "local_shards": shards})

    def _load_optimizer_and_scheduler(self, checkpoint):
        # transformers < 5.18 loads a multi-process run's optimizer.pt onto args.device, which torch refuses as cpu:0.
        with cpu_map_location(self.args):
            return self._load_converting(checkpoint)

    def _load_converting(self, checkpoint):
        # The user switched between X and X_layerwise: convert the optimizer and scheduler states on load.
        if checkpoint and self.layerwise_optimizer is not None:
            check_local_shards(checkpoint, self.layerwise_optimizer)
        path = os.path.join(checkpoint, OPTIMIZER_NAME) if checkpoint else None
        if path is None or not os.path.isfile(path) or self.is_fsdp_enabled or self.is_deepspeed_enabled:
            return super()._load_optimizer_and_scheduler(checkpoint)
        state_dict = load_optimizer_file(path)
        layerwise = self.layerwise_optimizer
        saved_layerwise = is_layerwise_state_dict(state_dict)
        if saved_layerwise and layerwise is not None:
            saved = {g["name"]: i for i, g in enumerate(state_dict["param_groups"])}
            if list(saved) == layerwise.names:
                return super()._load_optimizer_and_scheduler(checkpoint)
            # The trainable set changed (the optimizer validates and decides what that means): re-index the
            # scheduler by name; a newly trainable parameter follows the same schedule as the first saved one.
            converted = state_dict
            source_group = [saved.get(n, 0) for n in layerwise.names]
        elif not saved_layerwise and layerwise is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        elif is_transformers_dummy_state(state_dict):
            logger.warning(
                "%s was saved by transformers' own layer-wise optimizer, which saves no optimizer state: the "
                "optimizer starts afresh (as when transformers resumes it); the schedule resumes where it was.",
                checkpoint,
            )
            converted = layerwise.state_dict()  # its own fresh state back: only the schedule is converted
            source_group = [0] * len(layerwise.names)
        elif layerwise is not None:
            groups_names = standard_groups_names(layerwise.names, layerwise.in_decay_group)
            converted = standard_to_layerwise(state_dict, groups_names)
            # Per parameter, the saved group it belonged to (Trainer's decay group 0, no-decay group 1).
            source_group = [0 if d else 1 for d in layerwise.in_decay_group]
        else:
            names = {id(p): canonical_name(n) for n, p in self.model.named_parameters()}
            groups_names = [[names[id(p)] for p in group["params"]] for group in self.optimizer.param_groups]
            converted = layerwise_to_standard(state_dict, groups_names)
            source_group = first_members(state_dict, groups_names)
        logger.warning(
            "Converting the optimizer and scheduler states of %s for optim=%s.", checkpoint, self.args.optim
        )
        num_saved = len(state_dict["param_groups"])
        with (
            _loading(self.optimizer, lambda _: converted),
            _loading(self.lr_scheduler, lambda saved: convert_scheduler_state(saved, source_group, num_saved)),
        ):
            return super()._load_optimizer_and_scheduler(checkpoint)

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


def _sharded_at_load(trainer) -> bool:
    """Whether transformers sharded the model at its load (`from_pretrained(distributed_config=...)`: tensor parallel,
    FSDP2 or HSDP as DTensors, outside Accelerate's FSDP config); transformers < 5.24 has no such loading."""
    return bool(getattr(trainer, "is_distributed_loading_by_transformers", False))


def _fsdp_version(trainer) -> int:
    """2 without FSDP; else the FSDP version Accelerate's plugin, or the arguments, ask for."""
    if trainer.is_fsdp_enabled:
        return int(getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1))
    return fsdp_version_of_args(trainer.args)


@contextlib.contextmanager
def _extra_backwards_accumulate(trainer, optimizer, norm_pass: NormPass | None):
    """
    Within one `training_step`, only Trainer's own `accelerator.backward` of the loss ends the micro-batch (on one
    process, measured the `norm_pass` way when one is given). Any other backward, such as one `compute_loss` runs
    itself for an auxiliary loss (`loss.backward()` or `accelerator.backward`, with `retain_graph=True`), only
    accumulates, as with the standard optimizer: stepping there would change weights that Trainer's backward still
    needs. `LayerwiseTrainerMixin.compute_loss_context_manager` marks the backwards run inside `compute_loss`.
    """
    # NOTE: Trainer's training_step calls self.accelerator.backward(loss) itself, with no method or callback event
    # between the loss and its backward; the norm pass must run that backward (twice, over a retained graph).
    backward = trainer.accelerator.backward
    in_compute_loss = [False]

    def trainer_backward(loss, **kwargs):
        with optimizer.pipeline.sync_gradients.extra_backward(in_compute_loss[0]):
            if norm_pass is not None:
                return backward_with_norm_pass(optimizer, loss, backward, norm_pass=norm_pass, **kwargs)
            return backward(loss, **kwargs)

    trainer.accelerator.backward, trainer._layerwise_in_compute_loss = trainer_backward, in_compute_loss
    try:
        with optimizer.pipeline.sync_gradients.extra_backward():
            yield
    finally:
        del trainer.accelerator.backward
        trainer._layerwise_in_compute_loss = None


@contextlib.contextmanager
def _marking(context, marker: list[bool]):
    """Enter Trainer's `compute_loss_context_manager()` context with `marker[0]` True inside it (nesting kept)."""
    with context as entered:
        previous, marker[0] = marker[0], True
        try:
            yield entered
        finally:
            marker[0] = previous


def _replicate_without_ddp(accelerator, model) -> None:
    """Make Accelerate prepare `model` without wrapping it in DDP (placement, autocast and compile still apply)."""
    original = getattr(accelerator.prepare_model, "_layerwise_original", accelerator.prepare_model)

    def prepare_model(m, device_placement=None, evaluation_mode=False):
        return original(m, device_placement=device_placement, evaluation_mode=evaluation_mode or m is model)

    prepare_model._layerwise_original = original
    accelerator.prepare_model = prepare_model


def is_compiled(model) -> bool:
    """
    Whether `model` or any submodule runs through torch.compile (whose backward refuses `retain_graph=True`).

    Args:
        model (`nn.Module`):
            The model Trainer trains (possibly wrapped).

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.integrations.trainer import is_compiled
    >>> model = torch.nn.Linear(4, 2)
    >>> is_compiled(model), is_compiled(torch.compile(model))
    (False, True)
    ```
    """
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(model, OptimizedModule):
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def _strip_frozen(optimizer):
    """
    No optimizer state or group for frozen parameters with standard optimizers either: Trainer's split leaves an
    empty group when every trainable parameter falls on one side (LoRA: all adapters decay), which DeepSpeed ZeRO
    gets handed as is; parameters passed in through `optimizer_cls_and_kwargs` params are not filtered at all.
    """
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        return optimizer
    for group in groups:
        group["params"] = [p for p in group["params"] if p.requires_grad]
    groups[:] = [g for g in groups if g["params"]]
    return optimizer


def _check_writable(output_dir: str) -> None:
    try:
        os.makedirs(output_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output_dir, prefix=".layerwise_write_check"):
            pass
    except OSError as err:
        raise ValueError(
            f"output_dir={output_dir!r} is not writable ({err}); checkpoints could not be saved. Choose another "
            "output_dir, or save_strategy='no'."
        ) from err


@contextlib.contextmanager
def _loading(obj, convert):
    """Make Trainer's `obj.load_state_dict(torch.load(...))` load `convert(loaded)` instead."""
    original = obj.load_state_dict
    obj.load_state_dict = lambda loaded: original(convert(loaded))
    try:
        yield
    finally:
        del obj.load_state_dict


def _explain_clipping(
    max_grad_norm: float, mode: str, gradient_accumulation_steps: int, fp16: bool = False, offload: str = "none"
) -> None:
    # Never silent: say once what max_grad_norm (and fp16 loss scaling) does here and what it costs.
    clips = bool(max_grad_norm) and max_grad_norm > 0
    # (With layerwise_offload every gradient waits in host memory for the global norm and the inf check: one backward.)
    if fp16 and gradient_accumulation_steps == 1 and not (clips and mode == "exact") and offload == "none":
        logger.warning(
            "fp16 loss scaling with a layer-wise optimizer and no gradient accumulation: every gradient is unscaled "
            "and checked for inf/nan before any layer steps (so an overflowing step changes nothing, as with "
            "GradScaler and a standard optimizer), by a second backward or forward+backward, or by holding every "
            "gradient for step() where activations outweigh the gradients (layerwise_norm_pass)."
        )
    if not clips:
        return
    if mode == "off":
        warnings.warn(
            f"layerwise_clip='off': max_grad_norm={max_grad_norm} is NOT applied. The logged grad_norm is still the "
            "exact pre-clip norm.",
            UserWarning,
            stacklevel=3,
        )
    elif mode == "exact" and gradient_accumulation_steps == 1 and offload == "none":
        logger.warning(
            "max_grad_norm=%s with layerwise_clip='exact' and no gradient accumulation: every gradient is measured "
            "(the global norm%s) before any layer steps, to clip exactly like Trainer: by a second backward over the "
            "retained graph when activations are small next to the gradients, a second forward+backward when they "
            "are not (always under DDP/FSDP2/torch.compile), or one backward holding every gradient when activations "
            "outweigh them (layerwise_norm_pass). %s",
            max_grad_norm,
            " and checks for fp16 inf/nan" if fp16 else "",
            "" if fp16 else "layerwise_clip='previous' clips in one pass with the previous step's norm.",
        )


class LayerwiseTrainer(LayerwiseTrainerMixin, Trainer):
    """
    `Trainer` with layer-wise optimizers: use it with `LayerwiseTrainingArguments(optim="<base>_layerwise")`. It takes
    `Trainer`'s arguments; with any other `optim` it trains exactly like `Trainer`.

    Example:

    ```python
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
    ...                                      num_hidden_layers=2, num_attention_heads=4))
    >>> train_dataset = [{"input_ids": torch.arange(16), "labels": torch.arange(16)}] * 8
    >>> args = LayerwiseTrainingArguments(
    ...     output_dir="out", optim="adamw_torch_layerwise", max_steps=2, report_to="none"
    ... )
    >>> trainer = LayerwiseTrainer(model=model, args=args, train_dataset=train_dataset)
    >>> train_output = trainer.train()
    ```
    """
