"""Preflight (`layerwise_preflight=True`): plan the run's own step with `layerwise_hf.plan.plan()` before the first
step, warn when it will not fit, and on CUDA set the measured peak of the first step next to the plan.

What is planned, and where each figure comes from:

- the model: its own config (a deep copy), the dtype of its weights, LoRA's rank and targets when it is a peft model;
- the batch: the first training batch's `input_ids` (or `inputs_embeds`): micro-batch x sequence length as the
  collator made it. A run's sequence length is set by its data and collator, not by an argument, so the batch is the
  only place it is known; with dynamic padding later batches can be longer (pad to a fixed length, or plan the
  longest yourself with `layerwise-hf plan`). A plain loop passes `seq_len` (and `micro_batch`) itself;
- the arguments: `optim`, `gradient_accumulation_steps`, `max_grad_norm`, `layerwise_clip`, `bf16` / `fp16`,
  `gradient_checkpointing`, `layerwise_offload` (the device peak is compared; the host peak is named);
- the processes: world size and sharding (`ddp`, `fsdp2`) from the accelerator, when `plan()` takes them (else one
  process is planned, and the message says so);
- the memory it is compared with (`available_memory`): on CUDA the device's free memory (`torch.cuda.mem_get_info`)
  plus what this process's caching allocator already holds (the weights among it, which the plan counts too); on CPU
  the memory the OS reports available (`MemAvailable`) plus the model's own tensors. A CPU comparison is coarse: the
  OS, other processes and the Python process itself share that memory.

A preflight never stops training: a configuration the planner cannot simulate (an optimizer it does not know, a
non-LoRA peft method) logs a warning with the reason, and training goes on. Only a bad `layerwise_preflight` value
raises. It plans on the local main process only (one plan per machine, compared with that process's device). The
plan runs on fake tensors on the CPU with the CPU's random number generator saved and restored, so the run trains
exactly as without it. `layerwise_hf.plan` is imported only when a preflight runs.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..bases.support import check_bool_argument
from ..platform.dtensor import local_storage_tensor

logger = logging.getLogger(__name__)

# Above the plan by more than this share, the measured first step is worth a warning (the plan missed something).
UNDER_PLANNED = 0.10


def _gib(n: int | None) -> str:
    from ..estimate.units import format_bytes

    return "-" if n is None else format_bytes(n)


@dataclass
class Budget:
    """The memory a run can use on its device: `total_bytes`, and how that figure was made (`detail`)."""

    total_bytes: int
    detail: str


@dataclass
class PreflightReport:
    """
    What a preflight found.

    Args:
        optimizer (`str`): the optimizer planned (`args.optim`).
        seq_len, micro_batch (`int`): the batch planned.
        peak_bytes (`int`): the planned peak of one steady-state step (`layerwise_hf.plan.PlanRow.peak_bytes`).
        categories (`dict[str, int]`): the peak split into weights / gradients / optimizer state / activations /
            temporaries.
        when (`str`): where in the step the planned peak falls.
        budget (`Budget`, *optional*): the memory compared with (`None`: nothing to compare with).
        fits (`bool`, *optional*): `peak_bytes <= budget.total_bytes`.
        advice (`list[str]`): what would lower the peak.
        world_size (`int`), sharding (`str`): the processes planned (figures are per rank).
        note (`str`): what the plan could not follow (e.g. several processes planned as one).
        measured_peak_bytes (`int`, *optional*): CUDA: `torch.cuda.max_memory_allocated()` over the first step.
        offload (`str`): `layerwise_offload` planned; `peak_bytes` is then the device side's.
        host_peak_bytes (`int`): with offload, the most host memory the plan holds at once (0 without).
    """

    optimizer: str
    seq_len: int
    micro_batch: int
    peak_bytes: int
    categories: dict[str, int]
    when: str
    budget: Budget | None
    fits: bool | None
    advice: list[str]
    world_size: int = 1
    sharding: str = "none"
    note: str = ""
    measured_peak_bytes: int | None = None
    offload: str = "none"
    host_peak_bytes: int = 0


def check_preflight_argument(args: Any) -> bool:
    """`args.layerwise_preflight` (`False` when absent), refused unless `True` or `False`."""
    return check_bool_argument("layerwise_preflight", getattr(args, "layerwise_preflight", False))


def available_memory(device: torch.device, model: torch.nn.Module | None = None) -> Budget | None:
    """
    The memory a run on `device` can use: see the module docstring. `None` when it cannot be told.

    Example:

    ```python
    >>> import torch
    >>> from layerwise_hf.integrations.preflight import available_memory
    >>> available_memory(torch.device("cpu")).detail  # doctest: +SKIP
    '20.31 GiB available (MemAvailable) + 0.00 GiB of the model already in memory'
    ```
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)
        return Budget(free + held, f"{_gib(free)} free on {device} + {_gib(held)} this process already holds")
    if device.type != "cpu":
        return None
    available = _mem_available()
    if available is None:
        return None
    resident = _model_bytes(model) if model is not None else 0
    return Budget(available + resident, f"{_gib(available)} available (MemAvailable) + {_gib(resident)} of the model")


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return None


def _model_bytes(model: torch.nn.Module) -> int:
    storages = {}
    for t in [*model.parameters(), *model.buffers()]:
        local = local_storage_tensor(t)  # an FSDP2 DTensor holds its shard
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return local_storage_tensor(p).device
    return torch.device("cpu")


def _weights_dtype(model: torch.nn.Module) -> str:
    # The trained weights' dtype; a peft model's frozen base has the same.
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    dtype = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
    return str(dtype).removeprefix("torch.")


def _lora(model: torch.nn.Module) -> dict[str, Any]:
    """`lora_r` / `lora_targets` for a peft model (`{}` for any other model); a non-LoRA peft method is refused."""
    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        return {}
    adapter = getattr(model, "active_adapter", None)
    config = peft_config.get(adapter) if isinstance(adapter, str) else next(iter(peft_config.values()))
    if getattr(config, "r", None) is None or str(getattr(config, "peft_type", "")).split(".")[-1] != "LORA":
        raise ValueError(f"the model is a peft {getattr(config, 'peft_type', '?')} model; the planner knows LoRA only")
    targets = config.target_modules
    if isinstance(targets, str):
        raise ValueError(f"LoRA target_modules={targets!r} is a pattern; the planner needs module names")
    return {"lora_r": int(config.r), "lora_targets": tuple(sorted(targets))}


def _base_config(model: torch.nn.Module) -> Any:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None:
        raise ValueError(f"{type(base).__name__} has no transformers config to plan from")
    return copy.deepcopy(config)  # the simulation sets use_cache on its config


def parallelism(accelerator: Any = None) -> tuple[int, str]:
    """`(world_size, sharding)` of a prepared run: sharding `"none"`, `"ddp"` (any replicated multi-process setup)
    or `"fsdp2"` (`"fsdp1"` for FSDP1, which the planner refuses)."""
    if accelerator is None:
        from accelerate import PartialState

        if not PartialState._shared_state:
            return 1, "none"
        state = PartialState()
        world, kind = state.num_processes, str(state.distributed_type)
        fsdp2 = kind.endswith("FSDP")
    else:
        world, kind = accelerator.num_processes, str(accelerator.distributed_type)
        fsdp2 = bool(getattr(accelerator, "is_fsdp2", False))
    if kind.endswith("FSDP"):
        return world, "fsdp2" if fsdp2 else "fsdp1"
    return world, "ddp" if world > 1 else "none"


def _plan_kwargs(model: torch.nn.Module, args: Any, seq_len: int, micro_batch: int, device: torch.device) -> dict:
    max_grad_norm = getattr(args, "max_grad_norm", None)
    return dict(
        seq_len=int(seq_len),
        micro_batch=int(micro_batch),
        grad_accum=int(getattr(args, "gradient_accumulation_steps", 1)),
        max_grad_norm=float(max_grad_norm or 0.0),
        clip_mode=getattr(args, "layerwise_clip", "exact"),
        bf16=bool(getattr(args, "bf16", False)),
        fp16=bool(getattr(args, "fp16", False)),
        torch_dtype=_weights_dtype(model),
        gradient_checkpointing=_checkpointing(model, args),
        device="cuda" if device.type == "cuda" else "cpu",
        offload=str(getattr(args, "layerwise_offload", None) or "none"),
        **_lora(model),
    )


def _checkpointing(model: torch.nn.Module, args: Any) -> bool:
    # NOTE: transformers 5.23 renamed gradient_checkpointing to activation_checkpointing (the old names are aliases
    # that warn); Trainer turns it on at train start, after the model was handed over.
    if getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", None):
        return True
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or hasattr(model, "get_base_model"):
            return bool(getattr(model, name, False))
    return False


@contextlib.contextmanager
def _apart_from_training():
    # The plan runs its own forward and backward inside a training step: not under the run's autocast, and without
    # moving the CPU generator the run's dropout and data order draw from. `plan()` itself hides the launcher's
    # rendezvous variables and keeps accelerate's process-wide state (`layerwise_hf.plan.isolation`).
    with torch.random.fork_rng(devices=[]), torch.autocast("cpu", enabled=False), contextlib.ExitStack() as stack:
        if torch.cuda.is_available():
            stack.enter_context(torch.autocast("cuda", enabled=False))
        with torch.enable_grad():
            yield


def preflight(
    model: torch.nn.Module,
    args: Any,
    *,
    seq_len: int,
    micro_batch: int | None = None,
    accelerator: Any = None,
) -> PreflightReport | None:
    """
    Plan one step of this run (`layerwise_hf.plan.plan()`) and log a warning naming the planned peak and the memory
    available when it will not fit. Returns the report, or `None` when the run could not be planned (a warning says
    why). Usable from a plain loop, before its first step.

    Args:
        model (`nn.Module`):
            The model about to be trained (a transformers causal LM, or a peft LoRA model of one), on its device.
        args (`TrainingArguments` or any object with its fields):
            `optim`, `gradient_accumulation_steps`, `max_grad_norm`, `layerwise_clip`, `bf16`, `fp16`,
            `gradient_checkpointing` (absent fields take Trainer's defaults).
        seq_len (`int`):
            Tokens per sequence of the batches the run trains on.
        micro_batch (`int`, *optional*, defaults to `args.per_device_train_batch_size`):
            Sequences per forward.
        accelerator (`Accelerator`, *optional*):
            Gives the world size and sharding (else accelerate's `PartialState`, when initialised).

    Example:

    ```python
    >>> from layerwise_hf.integrations.preflight import preflight
    >>> report = preflight(model, args, seq_len=2048, accelerator=accelerator)  # before the first step
    >>> report.fits, report.peak_bytes  # doctest: +SKIP
    (True, 9813757952)
    ```
    """
    if micro_batch is None:
        micro_batch = int(getattr(args, "per_device_train_batch_size", 8))
    optimizer = str(getattr(getattr(args, "optim", "adamw_torch"), "value", getattr(args, "optim", "adamw_torch")))
    device = model_device(model)
    try:
        from ..plan import plan

        kwargs = _plan_kwargs(model, args, seq_len, micro_batch, device)
        world, sharding = parallelism(accelerator)
        note = ""
        if world > 1 or sharding != "none":
            if {"world_size", "sharding"} <= set(inspect.signature(plan).parameters):
                kwargs.update(world_size=world, sharding=sharding)
            else:
                note = f"one process planned; this run has {world} ({sharding})"
        config = _base_config(model)
        with _apart_from_training():
            result = plan(config, [optimizer], counterparts=False, **kwargs)
    except Exception as err:  # noqa: BLE001 - a preflight must not stop training; it says what it could not do
        logger.warning("layerwise_preflight: could not plan this run (%s: %s); training goes on.", optim_of(args), err)
        return None
    row = result.rows[0]
    budget = available_memory(device, model)
    report = PreflightReport(
        optimizer=optimizer,
        seq_len=int(seq_len),
        micro_batch=int(micro_batch),
        peak_bytes=row.peak_bytes,
        categories=dict(row.categories),
        when=row.when,
        budget=budget,
        fits=None if budget is None else row.peak_bytes <= budget.total_bytes,
        advice=list(row.advice),
        world_size=kwargs.get("world_size", 1),
        sharding=kwargs.get("sharding", "none"),
        note=note,
        offload=row.offload,
        host_peak_bytes=row.host_peak_bytes,
    )
    _log_plan(report)
    return report


def optim_of(args: Any) -> str:
    optim = getattr(args, "optim", "adamw_torch")
    return str(getattr(optim, "value", optim))


def describe(report: PreflightReport) -> str:
    split = ", ".join(f"{k.replace('_', ' ')} {_gib(v)}" for k, v in report.categories.items())
    ranks = f", per rank of {report.world_size} ({report.sharding})" if report.world_size > 1 else ""
    text = (
        f"{report.optimizer}, micro-batch {report.micro_batch} x {report.seq_len} tokens{ranks}: planned peak "
        f"{_gib(report.peak_bytes)} ({split}; at {report.when})"
    )
    if report.offload != "none":
        text += f"; offload {report.offload}: host peak {_gib(report.host_peak_bytes)} apart from the device's"
    return text + (f" [{report.note}]" if report.note else "")


def _log_plan(report: PreflightReport) -> None:
    if report.budget is None:
        logger.info("layerwise_preflight: %s; no device memory to compare with.", describe(report))
    elif report.fits:
        logger.info("layerwise_preflight: %s fits in %s (%s).", describe(report), _gib(report.budget.total_bytes),
                    report.budget.detail)  # fmt: skip
    else:
        advice = "".join(f" To lower it: {a}." for a in report.advice)
        logger.warning(
            "layerwise_preflight: %s will not fit: %s available (%s), short by %s.%s Training goes on; it may run "
            "out of memory.",
            describe(report),
            _gib(report.budget.total_bytes),
            report.budget.detail,
            _gib(report.peak_bytes - report.budget.total_bytes),
            advice,
        )


class Preflight:
    """
    Trainer's preflight: plans at the first training forward (whose batch gives micro-batch and sequence length),
    and on CUDA compares the plan with `torch.cuda.max_memory_allocated()` after the first step.
    `LayerwiseCallback` creates one at `on_train_begin` when `args.layerwise_preflight` is on.

    Example:

    ```python
    >>> from layerwise_hf.integrations.preflight import Preflight
    >>> check = Preflight(model, args, accelerator=accelerator)  # before training: plans at the first forward
    >>> ...  # the first step
    >>> check.after_step()  # CUDA: logs the measured peak next to the plan
    >>> check.report.measured_peak_bytes  # doctest: +SKIP
    ```
    """

    def __init__(self, model: torch.nn.Module, args: Any, accelerator: Any = None):
        check_preflight_argument(args)
        self.model, self.args, self.accelerator = model, args, accelerator
        self.report: PreflightReport | None = None
        self.compared = False
        self.handle = None
        if getattr(args, "torch_compile", False):
            # NOTE: a compiled model traces its forward pre-hooks; a plan inside dynamo's tracing cannot run.
            logger.warning("layerwise_preflight: not planned under torch_compile; run `layerwise-hf plan` instead.")
            return
        self.handle = model.register_forward_pre_hook(self._first_forward, with_kwargs=True)

    def _first_forward(self, module, args, kwargs):
        if not module.training:  # an evaluation before training: wait for a training batch
            return
        self.close()
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor):
            ids = kwargs.get("inputs_embeds")
        if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
            logger.warning("layerwise_preflight: the first batch has no input_ids or inputs_embeds; not planned.")
            return
        if _local_main(self.args):
            micro_batch, seq_len = ids.shape[:2]
            self.report = preflight(module, self.args, seq_len=seq_len, micro_batch=micro_batch,
                                    accelerator=self.accelerator)  # fmt: skip
        device = model_device(module)
        if device.type == "cuda":
            # The first step's own peak, not the model loading's.
            torch.cuda.reset_peak_memory_stats(device)

    def after_step(self) -> None:
        """After the first optimizer step: on CUDA, log the measured peak next to the plan (once)."""
        report = self.report
        if report is None or self.compared:
            return
        self.compared = True
        device = model_device(self.model)
        if device.type != "cuda":
            return
        report.measured_peak_bytes = measured = torch.cuda.max_memory_allocated(device)
        ratio = measured / max(report.peak_bytes, 1)
        level = logging.WARNING if ratio > 1 + UNDER_PLANNED else logging.INFO
        logger.log(
            level,
            "layerwise_preflight: first step measured max_memory_allocated %s, planned %s (measured / planned %.3f; "
            "the plan is of a steady-state step).",
            _gib(measured),
            _gib(report.peak_bytes),
            ratio,
        )

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def _local_main(args: Any) -> bool:
    index = getattr(args, "local_process_index", None)
    if index is None:
        index = int(os.environ.get("LOCAL_RANK", 0))
    return index == 0
