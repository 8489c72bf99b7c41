"""`LayerwiseTrainingArguments`: `TrainingArguments` that also accept `optim="<base>_layerwise"`."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from ..bases.registry import list_layerwise_optimizers, parse_optim_name
from ..bases.support import (
    check_bool_argument,
    check_deepspeed,
    check_fp16_clip_mode,
    check_fsdp_version,
    check_max_grad_norm,
    fsdp_version_of_args,
)
from ..optim.clipping import CLIP_MODES, ClipMode
from ..optim.optimizer import check_layerwise_arguments
from ..placement.host_kernel import parse_host_step
from ..placement.offloading import check_host_step_base


@dataclass
class LayerwiseTrainingArguments(TrainingArguments):
    """
    `TrainingArguments` whose `optim` also accepts every name of `list_layerwise_optimizers()`.

    Args:
        optim (`str`, *optional*, defaults to Trainer's default):
            A Trainer optimizer name (`"adamw_torch"`, ...), or its layer-wise form (`"adamw_8bit_layerwise"`): one
            optimizer per trainable parameter, stepped as soon as its gradient is ready, the gradient freed right
            after. transformers' own `galore_*_layerwise` / `apollo_adamw_layerwise` names are served here too (with
            the scheduled lr, weight decay and checkpoints transformers' built-in path lacks).
        layerwise_clip (`str`, *optional*, defaults to `"exact"`):
            How `max_grad_norm` is applied with a layer-wise optimizer: `"exact"` (Trainer's global clipping, bit for
            bit; without gradient accumulation each step runs forward+backward twice), `"previous"` (one pass,
            scaled by the previous step's global norm, bounded on spikes), `"per_param"` (one pass, each tensor
            clipped alone) or `"off"`. With `fp16=True` only `"exact"` and `"off"` run: fp16 loss scaling checks every
            gradient for inf/nan before any layer steps, which costs the same second backward as `"exact"` (none
            with gradient accumulation).
        layerwise_preflight (`bool`, *optional*, defaults to `False`):
            Plan this run's step before the first one (`layerwise_hf.integrations.preflight`) and warn, naming the
            planned peak and the device's free memory, when it will not fit; on CUDA log the first step's
            `max_memory_allocated` next to the plan. It never stops training.
        layerwise_offload (`str`, *optional*, defaults to `"none"`):
            `"gradients"`: gradients that wait for the step (every micro-batch's under gradient accumulation, every
            one under exact clipping) wait in host memory, copied out during backward and back one at a time for the
            step: exact clipping in one backward, and only the gradients in flight on the device at any GA
            (`layerwise_hf.placement.offload`). `"optimizer"`: besides, each parameter's optimizer state and a copy
            of the parameter live in host memory, stepped there by a host thread while backward goes on and copied
            back before the next forward (`layerwise_hf.placement.host_step`). With fp16 (a GradScaler) both modes
            work: every gradient waits on the host until GradScaler's inf check, and a skipped step changes no weight
            and no state. Without CUDA it saves nothing and warns.
        layerwise_host_step (`str`, *optional*, defaults to `"auto"`):
            The host step's kernel with `layerwise_offload="optimizer"` (`layerwise_hf.placement.host_kernel`):
            `"fast"` (torch's fused CPU kernel where the base has one, AdamW, Adam, SGD and Adagrad; last-bit
            differences from the per-tensor loop), `"exact"` (the base as Trainer builds it, bit for bit) or `"auto"`
            (fast for a model on an accelerator, exact for a CPU model).

    Every other argument is `TrainingArguments`'; an unknown `optim` raises `ValueError` listing the valid names.

    Example:

    ```python
    >>> from layerwise_hf import LayerwiseTrainingArguments
    >>> args = LayerwiseTrainingArguments(output_dir="out", optim="adamw_8bit_layerwise", layerwise_clip="previous")
    >>> args.is_layerwise
    True
    ```
    """

    # NOTE: re-declared as plain `str` so HfArgumentParser does not turn OptimizerNames into argparse `choices`.
    optim: str = field(
        default=TrainingArguments.default_optim,
        metadata={
            "help": "The optimizer: any Trainer name (see OptimizerNames) or its layer-wise form '<name>_layerwise', "
            "e.g. adamw_8bit_layerwise. Layer-wise names: " + ", ".join(list_layerwise_optimizers())
        },
    )

    layerwise_clip: str = field(
        default="exact",
        metadata={
            "help": "How max_grad_norm is applied with a layer-wise optimizer: 'exact' (Trainer's global clipping; "
            "without gradient accumulation forward+backward run twice per step), 'previous' (one pass, previous "
            "step's global norm, bounded on spikes), 'per_param' (one pass, per tensor) or 'off'.",
            "choices": list(CLIP_MODES),
        },
    )

    layerwise_norm_pass: str = field(
        default="auto",
        metadata={
            "help": "With layerwise_clip='exact' (or fp16) and no gradient accumulation, how every gradient is "
            "measured before any layer steps: 'auto' (per step, the fastest way whose peak stays at or below the "
            "standard optimizer's), 'retain' (a second backward over the retained graph), 'rerun' (a second "
            "forward+backward) or 'hold' (one backward holding every gradient, as a standard optimizer). DDP, FSDP2 "
            "and torch.compile always rerun.",
            "choices": ["auto", "retain", "rerun", "hold"],
        },
    )

    layerwise_offload: str = field(
        default="none",
        metadata={
            "help": "'gradients': gradients waiting for the step (gradient accumulation, exact clipping, fp16 loss "
            "scaling) wait in host memory instead of on the device; exact clipping and fp16's inf check then need no "
            "norm pass. 'optimizer': besides, optimizer states and the step live on the host, stepped during "
            "backward. fp16 with a GradScaler works in both modes (a skipped step changes no weight and no state). "
            "'none': off.",
            "choices": ["none", "gradients", "optimizer"],
        },
    )

    layerwise_host_step: str = field(
        default="auto",
        metadata={
            "help": "The kernel of the host step with layerwise_offload='optimizer': 'fast' (torch's fused CPU kernel "
            "where the base has one: AdamW, Adam, SGD, Adagrad; last-bit differences from the per-tensor loop), "
            "'exact' (the base as Trainer builds it, bit for bit) or 'auto' (fast for a model on an accelerator, "
            "exact for a CPU model).",
            "choices": ["auto", "fast", "exact"],
        },
    )

    layerwise_accept_nonfinite_state: bool = field(
        default=False,
        metadata={
            "help": "Resume from an optimizer.pt whose state holds NaN or inf (refused by default: the weights would "
            "turn NaN a few steps later while the logged loss stays finite)."
        },
    )

    layerwise_preflight: bool = field(
        default=False,
        metadata={
            "help": "Before the first step, plan this run's step (layerwise_hf.plan: the model's config, the first "
            "batch's size, optim, GA, clipping, bf16/fp16, activation checkpointing, LoRA, world size and sharding) "
            "and log a warning naming the planned peak and the device's free memory when it will not fit; on CUDA, "
            "log the first step's max_memory_allocated next to the plan. Never stops training."
        },
    )

    def __post_init__(self):
        check_layerwise_arguments(self)
        check_bool_argument("layerwise_preflight", self.layerwise_preflight)
        self.layerwise_host_step = parse_host_step(self.layerwise_host_step)
        self.layerwise_clip = ClipMode.parse(self.layerwise_clip).value
        _check_arguments_trainer_uses_late(self)
        name = getattr(self.optim, "value", self.optim)
        base = parse_optim_name(name)  # raises with the list of valid names
        if base is not None:
            self._refuse_unsupported(name)
        if base is None:
            super().__post_init__()
            return
        # Let TrainingArguments validate everything else against a real base name, then restore ours.
        self.optim = base or "adamw_torch"
        try:
            super().__post_init__()
        finally:
            self.optim = name

    def _refuse_unsupported(self, name: str) -> None:
        check_max_grad_norm(self.max_grad_norm)  # the layer-wise clippers compare and divide by it
        check_fp16_clip_mode(self.layerwise_clip, self.fp16, self.max_grad_norm)
        check_deepspeed(name, self.deepspeed)
        check_fsdp_version(name, fsdp_version_of_args(self))
        if self.layerwise_offload == "optimizer":
            check_host_step_base(name)  # a base that cannot step on the host is refused here, before training

    @property
    def is_layerwise(self) -> bool:
        """
        Whether `optim` is served by this plugin's layer-wise path.

        Example:

        ```python
        >>> from layerwise_hf import LayerwiseTrainingArguments
        >>> LayerwiseTrainingArguments(output_dir="out", optim="adamw_torch").is_layerwise
        False
        ```
        """
        return bool(parse_optim_name(self.optim) is not None)

    def set_optimizer(self, name: str = "adamw_torch", **kwargs):
        """
        `TrainingArguments.set_optimizer`, also accepting the layer-wise names of `list_layerwise_optimizers()`.

        Args:
            name (`str`, *optional*, defaults to `"adamw_torch"`):
                A Trainer optimizer name or its layer-wise form (`"adamw_8bit_layerwise"`).
            kwargs (*optional*):
                `learning_rate`, `weight_decay`, `beta1`, `beta2`, `epsilon` and `args`, as in
                `TrainingArguments.set_optimizer`.

        Example:

        ```python
        >>> from layerwise_hf import LayerwiseTrainingArguments
        >>> args = LayerwiseTrainingArguments(output_dir="out")
        >>> args = args.set_optimizer("adamw_torch_layerwise", learning_rate=1e-4)
        >>> args.optim, args.learning_rate
        ('adamw_torch_layerwise', 0.0001)
        ```
        """
        base = parse_optim_name(name)
        if base is None:
            return super().set_optimizer(name=name, **kwargs)
        super().set_optimizer(name=base or "adamw_torch", **kwargs)
        self.optim = name
        return self


def _check_arguments_trainer_uses_late(args) -> None:
    # Trainer reads these only once training starts, and then fails far from the cause (ZeroDivisionError, "not
    # enough values to unpack"): say what is wrong while the arguments are being made.
    steps = args.gradient_accumulation_steps
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"gradient_accumulation_steps={steps!r}: it must be a whole number >= 1 (1: no accumulation)."
        )
    if args.optim_args:
        for item in str(args.optim_args).replace(" ", "").split(","):
            # NOTE: Trainer splits on "," then on "=", and expects exactly two parts each time.
            if item.count("=") != 1 or not item.split("=", 1)[0]:
                raise ValueError(
                    f"optim_args={args.optim_args!r}: {item!r} is not key=value. optim_args is a comma-separated "
                    "list of key=value pairs, e.g. 'rank=128,scale=0.25,update_proj_gap=200'."
                )
