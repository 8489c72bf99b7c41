"""`plan()`: will a training run fit? Each optimizer's steady-state step simulated on fake tensors (weights,
gradients, optimizer state, activations and temporaries at the peak), compared with the device's memory."""

from __future__ import annotations

import copy
import functools
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..bases.support import SUFFIX
from ..estimate.mesh import layout_words
from ..estimate.models import resolve_config
from ..estimate.optimizers import LAYERWISE_ONLY, parse_optimizer
from ..estimate.units import DEFAULT_LORA_TARGETS, EstimateError, format_bytes
from .advice import advise, choose_offload
from .extrapolate import simulate_layers, with_layers
from .isolation import single_process
from .options import CLIP_MODES, DEVICES
from .ranks import RANK, check_ranks, fsdp2_refusal, in_fresh_process, needs_fresh_process
from .simulate import DTYPE_ALIASES, DTYPES, SimulatedStep, StepSetup, simulate
from .tracker import CATEGORIES

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?)(b?)|b?)\s*$", re.IGNORECASE)


def parse_size(text: str | int | float, argument: str = "--device-memory") -> int:
    """
    Bytes from `80GiB`, `80GB`, `80G` (binary with an `i` or a bare letter, as `nvidia-smi` sizes read), or a number.

    Example:

    ```python
    >>> from layerwise_hf.plan import parse_size
    >>> parse_size("80GiB"), parse_size("1.5GB"), parse_size(1024)
    (85899345920, 1500000000, 1024)
    ```
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = int(text)
    else:
        match = _SIZE.match(str(text))
        if not match:
            raise EstimateError(f"{argument} {text!r}: give a size such as 80GiB, 80GB or 85899345920.")
        number, letter, binary, byte = match.groups()
        power = "kmgt".index(letter.lower()) + 1 if letter else 0
        # "GB" is decimal; "GiB" and a bare "G" binary.
        value = int(float(number) * (1000**power if byte and not binary else 1024**power))
    if value < 1:
        raise EstimateError(f"{argument} must be above 0 bytes; got {text!r}.")
    return value


@dataclass
class PlanRow:
    """
    One optimizer's simulated step (with one offload mode).

    Args:
        optimizer (`str`): the Trainer name.
        peak_bytes (`int`): the most bytes alive at once on the device during a steady-state step.
        categories (`dict[str, int]`): the peak split into weights, gradients, optimizer_state, activations and
            temporaries (summing to `peak_bytes`).
        when (`str`): where in the step the peak falls.
        optimizer_state_from_rule (`bool`): the optimizer's kernels cannot run on fake tensors; its state comes from
            the estimator's rules; its step temporaries are counted only for bitsandbytes on CPU (a measured rule).
        fits (`bool`, *optional*): `peak_bytes <= device_memory`, when a device memory was given.
        headroom_bytes (`int`, *optional*): `device_memory - peak_bytes` (negative: short by that much).
        saving_bytes (`int`, *optional*): a layer-wise row's peak below its standard optimizer's (zero or negative
            included).
        advice (`list[str]`): what would lower this peak.
        between_steps (`dict[str, int]`): what stays alive after a step's `zero_grad()`, per category: weights
            (this rank's shards under FSDP2), optimizer state, and gradient memory a run keeps (DDP's buckets).
        offload (`str`): `layerwise_offload` of this row (`"none"`, `"gradients"`, `"optimizer"`; standard rows
            `"none"`).
        host_peak_bytes (`int`): the most host-side bytes alive at once (offload's host buffers, host copies of the
            parameters, host optimizer states and the host step's temporaries); 0 without offload.
        host_categories (`dict[str, int]`): that host peak split into the same categories.
        combined_peak_bytes (`int`): the most device + host bytes alive at once: what one memory holds where the
            device is the host (a CPU-only run).
        host_fits (`bool`, *optional*), host_headroom_bytes (`int`, *optional*): against `host_memory`, when given.
        backward_flops (`int`): the FLOPs of the step's backwards that step (every micro-batch's; activation
            checkpointing's recompute included; a norm pass's measuring backward not), counted by torch's
            `FlopCounterMode` on the simulated step; 0 for a standard optimizer's row.
    """

    optimizer: str
    peak_bytes: int
    categories: dict[str, int]
    when: str
    optimizer_state_from_rule: bool
    fits: bool | None = None
    headroom_bytes: int | None = None
    saving_bytes: int | None = None
    advice: list[str] = field(default_factory=list)
    between_steps: dict[str, int] = field(default_factory=dict)
    offload: str = "none"
    host_peak_bytes: int = 0
    host_categories: dict[str, int] = field(default_factory=dict)
    combined_peak_bytes: int = 0
    host_fits: bool | None = None
    host_headroom_bytes: int | None = None
    backward_flops: int = 0

    @property
    def label(self) -> str:
        """The optimizer's name, with its offload mode when it has one."""
        return self.optimizer + (f" +offload {self.offload}" if self.offload != "none" else "")


@dataclass
class Plan:
    """What `plan()` returns: the model, the setup and one `PlanRow` per optimizer; `to_dict()` is `--json`'s."""

    model: str
    source: str
    setup: StepSetup
    device_memory: int | None
    rows: list[PlanRow]
    extrapolated: bool
    seconds: float
    notes: list[str] = field(default_factory=list)
    offload: tuple[str, ...] = ("none",)
    host_memory: int | None = None
    offload_advice: list[str] = field(default_factory=list)  # which mode to use (`advice.choose_offload`)

    def row(self, optimizer: str, offload: str | None = None) -> PlanRow:
        """The row of `optimizer` (with `offload`, or its first)."""
        return next(r for r in self.rows if r.optimizer == optimizer and offload in (None, r.offload))

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "source": self.source,
            "world_size": self.setup.world_size,
            "sharding": self.setup.sharding,
            "rank": RANK if self.setup.sharding != "none" else None,
            "setup": asdict(self.setup),
            "device_memory": self.device_memory,
            "host_memory": self.host_memory,
            "offload": list(self.offload),
            "offload_advice": list(self.offload_advice),
            "extrapolated_layers": self.extrapolated,
            "seconds": round(self.seconds, 3),
            "optimizers": [asdict(r) for r in self.rows],
            "notes": list(self.notes),
        }

    def format(self, units: str = "binary") -> str:
        from ..estimate.cli import render_table

        offloaded = any(r.offload != "none" for r in self.rows)
        headers = ["optimizer", "device peak" if offloaded else "peak", *CATEGORY_TITLES.values()]
        if self.device_memory is not None:
            headers += ["fits", "headroom"]
        if offloaded:
            headers += ["host peak"] + (["host fits"] if self.host_memory is not None else [])
        rows = []
        for r in self.rows:
            cells = [
                r.label + (" (state: rule)" if r.optimizer_state_from_rule else ""),
                format_bytes(r.peak_bytes, units),
            ]
            cells += [format_bytes(r.categories[c], units) for c in CATEGORY_TITLES]
            if self.device_memory is not None:
                cells += ["fits" if r.fits else "does not fit", format_bytes(r.headroom_bytes, units)]
            if offloaded:
                cells.append(format_bytes(r.host_peak_bytes, units) if r.offload != "none" else "-")
                if self.host_memory is not None:
                    cells.append(("fits" if r.host_fits else "does not fit") if r.offload != "none" else "-")
            rows.append(cells)
        s = self.setup
        title = (
            f"Peak memory of one training step of `{self.model}`: micro-batch {s.micro_batch} x {s.seq_len} tokens,"
            f" grad accum {s.grad_accum}"
            + (", activation checkpointing" if s.gradient_checkpointing else "")
            + (f"; per rank, 1 of {s.world_size} ({_layout(s)})" if s.sharding != "none" else "")
            + (f", device {format_bytes(self.device_memory, units)}" if self.device_memory else "")
        )
        lines = [render_table(title, headers, rows)]
        for r in self.rows:
            lines.append(f"{r.label}: peak at {r.when}.")
            if r.saving_bytes is not None:
                lines.append(f"  layer-wise saves {format_bytes(r.saving_bytes, units)} in this run.")
            lines += [f"  to lower it: {a}" for a in r.advice]
        if any(r.optimizer_state_from_rule for r in self.rows):
            lines.append(
                "Note: (state: rule) optimizer state from the estimator's rules; its kernels do not run on "
                "fake tensors; their step temporaries are counted only for bitsandbytes on CPU (--device cpu; a rule "
                "measured on bitsandbytes 0.50: 5 x numel float32 per 8-bit tensor, 3 x in 32 bits; its CUDA kernels "
                "allocate none)."
            )
        lines += [f"Offload: {a}" for a in self.offload_advice]
        lines += [f"Note: {n}" for n in self.notes]
        if offloaded:
            lines.append(
                "Note: offload rows: the categories are the device's (host-side storages apart); host peak: the most "
                "host memory alive at once (gradient buffers; with 'optimizer' also the states, a copy of each "
                "parameter and the host step's temporaries). On a GPU the buffers and copies are pinned, the states "
                "and temporaries pageable. The host worker is planned as keeping pace with backward."
            )
        if self.setup.sharding == "fsdp2":
            lines.append(
                "Note: per rank under FSDP2: weights are this rank's shards plus the all-gathered (unsharded) units "
                "alive at the peak; gradients include unsharded gradients and reduce-scatter buffers."
            )
        elif self.setup.sharding == "ddp":
            lines.append(
                "Note: per rank under DDP: gradients include the buckets (torch DDP's for the standard optimizer, "
                "the layer-wise data-parallel route's in flight for layer-wise)."
            )
        if self.setup.fp16:
            lines.append(
                "Note: fp16 is simulated as autocast without GradScaler: a layer-wise optimizer under fp16 runs a "
                "norm pass for the inf check in training even without clipping, which this plan does not."
            )
        return "\n".join(lines)


CATEGORY_TITLES = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer_state": "opt. state",
    "activations": "activations",
    "temporaries": "temporaries",
}
assert tuple(CATEGORY_TITLES) == CATEGORIES


def expand_optimizers(names: list[str] | tuple[str, ...], counterparts: bool = True) -> list[str]:
    """Each name and (with `counterparts`) its counterpart, standard and `_layerwise`, validated, in order, without
    repeats."""
    if isinstance(names, str):
        names = [names]
    out: list[str] = []
    for name in names:
        base, layerwise = parse_optimizer(name)
        pair = [base + SUFFIX] if base in LAYERWISE_ONLY else [base, base + SUFFIX]
        if not counterparts:
            pair = [base + SUFFIX if layerwise else base]
        out += [n for n in pair if n not in out]
    if not out:
        raise EstimateError("give at least one optimizer.")
    return out


def fsdp2_counterparts(
    names: list[str], asked: list[str] | tuple[str, ...] | str, sharding: str, tp: int = 1
) -> list[str]:
    """Under FSDP2, leave out a counterpart (standard or layer-wise) that FSDP2 cannot step when only the other form
    was asked for (`check_ranks` refuses one asked for by name)."""
    if sharding != "fsdp2":
        return names
    asked = {asked} if isinstance(asked, str) else set(asked)
    return [n for n in names if n in asked or fsdp2_refusal(n, tp) is None]


def make_setup(**options: Any) -> StepSetup:
    """A `StepSetup` from `plan()`'s keywords, each checked with a message naming it and its valid values."""
    for key in ("seq_len", "micro_batch", "grad_accum"):
        value = options[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EstimateError(f"{key}={value!r} must be a whole number >= 1.")
    if options.get("lora_r") is not None and (not isinstance(options["lora_r"], int) or options["lora_r"] < 1):
        raise EstimateError(f"lora_r={options['lora_r']!r} must be a whole number >= 1.")
    if options["max_grad_norm"] is None or options["max_grad_norm"] < 0:
        raise EstimateError(f"max_grad_norm={options['max_grad_norm']!r} must be >= 0 (0: no clipping).")
    if options["clip_mode"] not in CLIP_MODES:
        raise EstimateError(f"clip_mode={options['clip_mode']!r}: choose one of {', '.join(CLIP_MODES)}.")
    if options["bf16"] and options["fp16"]:
        raise EstimateError("bf16 and fp16 are exclusive (Trainer refuses both).")
    dtype = DTYPE_ALIASES.get(str(options["torch_dtype"]), str(options["torch_dtype"]).removeprefix("torch."))
    if dtype not in DTYPES:
        raise EstimateError(f"torch_dtype={options['torch_dtype']!r}: choose one of {', '.join(DTYPES)}.")
    if options["device"] not in DEVICES:
        raise EstimateError(f"device={options['device']!r}: choose cuda or cpu.")
    check_ranks(
        options.setdefault("world_size", 1),
        options.setdefault("sharding", "none"),
        list(options.pop("optimizers", ())),
        options.setdefault("dp_replicate", 1),
        options.setdefault("tp", 1),
    )
    targets = tuple(options["lora_targets"] or DEFAULT_LORA_TARGETS)  # the model's own default: `lora_targets_of`
    return StepSetup(**{**options, "torch_dtype": dtype, "lora_targets": targets})


def check_causal_lm(config: Any, name: str) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise EstimateError(
            f"{name}: transformers builds no causal language model for model_type {config.model_type!r} "
            f"(AutoModelForCausalLM knows e.g. llama, qwen2, mistral, opt, phi, gpt2)."
        )


def _memory_limits(device_memory: str | int | None, host_memory: str | int | None) -> tuple[int | None, int | None]:
    # Each parsed with the flag that names it in an error.
    device = parse_size(device_memory) if device_memory is not None else None
    return device, parse_size(host_memory, "--host-memory") if host_memory is not None else None


def plan(
    model: Any,
    optimizers: list[str] | tuple[str, ...] = ("adamw_torch",),
    *,
    seq_len: int = 512,
    micro_batch: int = 1,
    grad_accum: int = 1,
    max_grad_norm: float = 1.0,
    clip_mode: str = "exact",
    bf16: bool = False,
    fp16: bool = False,
    torch_dtype: str = "float32",
    gradient_checkpointing: bool = False,
    lora_r: int | None = None,
    lora_targets: tuple[str, ...] | None = None,
    device_memory: str | int | None = None,
    device: str = "cuda",
    extrapolate: bool = True,
    counterparts: bool = True,
    world_size: int = 1,
    sharding: str = "none",
    sync_each_batch: bool = False,
    offload: str | list[str] | tuple[str, ...] = "none",
    host_memory: str | int | None = None,
    dp_replicate: int = 1,
    tp: int = 1,
) -> Plan:
    """
    Simulate one steady-state training step per optimizer on fake tensors (nothing allocated) and say whether it fits.

    Args:
        model (`str`, `os.PathLike`, `dict` or `PretrainedConfig`): a preset (`layerwise_hf.estimate.list_presets()`),
            a local config.json or a folder holding one; a config object is copied, never changed.
        optimizers (`list[str]`, *optional*, defaults to `("adamw_torch",)`):
            Trainer optimizer names; each runs standard and layer-wise (`<name>_layerwise`).
        seq_len, micro_batch, grad_accum (`int`): tokens per sequence, sequences per forward, micro-batches per step.
        max_grad_norm (`float`, defaults to `1.0`), clip_mode (`str`, defaults to `"exact"`): Trainer's clipping and
            the layer-wise `layerwise_clip` mode (exact clipping runs the norm pass, whose graph stays alive).
        bf16, fp16 (`bool`): Trainer's autocast. torch_dtype (`str`): the weights' dtype. gradient_checkpointing
            (`bool`): activation checkpointing as Trainer enables it (non-reentrant).
        lora_r (`int`, *optional*), lora_targets (`tuple[str, ...]`, *optional*): LoRA adapters (peft) on a frozen
            base; targets default to peft's for the architecture, and ones matching no module are refused.
        device_memory (`str` or `int`, *optional*): e.g. `"80GiB"`; each row then says whether its device peak fits.
        device (`str`, defaults to `"cuda"`): its optimizer defaults and collectives (`StepSetup`; gloo on `"cpu"`).
        extrapolate (`bool`, defaults to `True`): simulate 2-4 identical decoder layers and extend the exact line;
            counterparts (`bool`, defaults to `True`): also run each optimizer's standard / layer-wise counterpart.
        world_size, dp_replicate, tp (`int`, defaults to `1`), sharding (`str`, defaults to `"none"`), sync_each_batch
            (`bool`): one rank of the mesh (`StepSetup`) on a fake process group (`plan.ranks`), figures per rank.
        offload (`str` or a list of them), host_memory (*optional*): `layerwise_offload` of the layer-wise rows (a
            row each; `layerwise_hf.plan.offload`); e.g. `"256GiB"`: whether each offload row's host peak fits.

    Example:

    ```python
    >>> from layerwise_hf.plan import plan
    >>> result = plan("llama-3.2-1b", ["adamw_torch"], seq_len=2048, bf16=True, device_memory="24GiB")
    >>> [(r.optimizer, r.fits) for r in result.rows]  # doctest: +SKIP
    [('adamw_torch', False), ('adamw_torch_layerwise', True)]
    ```
    """
    started = time.perf_counter()
    expanded = expand_optimizers(optimizers, counterparts)
    names = fsdp2_counterparts(expanded, optimizers, sharding, tp if isinstance(tp, int) else 1)
    modes = check_offload_modes(offload, names)
    options = dict(seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum, max_grad_norm=max_grad_norm,
                   clip_mode=clip_mode, bf16=bf16, fp16=fp16, torch_dtype=torch_dtype, device=device, lora_r=lora_r,
                   gradient_checkpointing=gradient_checkpointing, lora_targets=lora_targets)  # fmt: skip
    setup = make_setup(optimizers=names, world_size=world_size, sharding=sharding, sync_each_batch=sync_each_batch,
                       dp_replicate=dp_replicate, tp=tp, **options)  # fmt: skip
    memory, host = _memory_limits(device_memory, host_memory)
    config, name, source = _config_of(model)
    setup = setup.replace(lora_targets=lora_targets_of(config, lora_targets)) if setup.lora_r else setup
    jobs = [(n, m) for n in names for m in (modes if n.endswith(SUFFIX) else ("none",))]
    run = functools.partial(in_fresh_process, simulate_all) if needs_fresh_process(sharding) else simulate_all
    with single_process():
        steps, extrapolated = run(config, jobs, setup, extrapolate, name)
    rows = [to_row(step, setup, memory, host, steps) for step in steps.values()]
    seconds = time.perf_counter() - started
    return Plan(name, source, setup, memory, rows, extrapolated, seconds, plan_notes(expanded, names, modes, tp),
                modes, host, choose_offload(rows, memory, host))  # fmt: skip


def _layout(setup: StepSetup) -> str:
    if setup.dp_replicate > 1 or setup.tp > 1:
        return layout_words(setup.world_size, setup.dp_replicate, setup.tp)
    return setup.sharding


def _config_of(model: Any) -> tuple[Any, str, str]:
    """The model's config (a copy: the simulation turns off its KV cache), name and source."""
    try:
        config, name, source = resolve_config(model)
    except EstimateError:
        raise
    except Exception as e:
        # transformers validates a config as it builds it (e.g. heads that do not divide the hidden size).
        reason = " ".join(line.strip() for line in str(e).strip().splitlines())
        raise EstimateError(f"{model}: transformers refuses this config: {type(e).__name__}: {reason}") from e
    check_causal_lm(config, name)
    return copy.deepcopy(config), name, source


def plan_notes(expanded: list[str], names: list[str], modes: tuple[str, ...], tp: int = 1) -> list[str]:
    """What the plan left out: counterparts FSDP2 cannot step, offload asked of standard optimizers only."""
    notes = [f"{n} left out: under FSDP2 {fsdp2_refusal(n, tp)}." for n in expanded if n not in names]
    if modes != ("none",) and not any(n.endswith(SUFFIX) for n in names):
        notes.append(f"offload {', '.join(modes)}: a layer-wise optimizer's option; the standard rows run without.")
    return notes


def check_offload_modes(offload: str | list[str] | tuple[str, ...], names: list[str]) -> tuple[str, ...]:
    """The offload modes asked for, each valid, in order; `"optimizer"` refused for a base that cannot step on the
    host (as `layerwise_offload="optimizer"` refuses it before training)."""
    from ..estimate.offload import OFFLOAD_MODES
    from ..placement.offloading import NOT_ON_HOST

    modes = (offload,) if isinstance(offload, str) else tuple(dict.fromkeys(offload))
    for mode in modes:
        if mode not in OFFLOAD_MODES:
            raise EstimateError(f"offload={mode!r}: choose one of {', '.join(OFFLOAD_MODES)}.")
    if not modes:
        raise EstimateError(f"offload=(): give at least one of {', '.join(OFFLOAD_MODES)}.")
    if "optimizer" in modes:
        for n in names:
            if n.endswith(SUFFIX) and n.removesuffix(SUFFIX) in NOT_ON_HOST:
                raise EstimateError(
                    f"offload='optimizer' cannot step {n} on the host: {NOT_ON_HOST[n.removesuffix(SUFFIX)]}. "
                    "Use offload='gradients', or a base that steps on the host (adamw_torch, adafactor, sgd)."
                )
    return modes


def simulate_all(
    config: Any, jobs: list[tuple[str, str]], setup: StepSetup, extrapolate: bool, name: str = "model"
) -> tuple[dict, bool]:
    """Each `(optimizer, offload)` job simulated; results keyed by the job. An error from inside a simulation (the
    model's code, a kernel on fake tensors, peft) becomes an `EstimateError` naming the model and the setting."""
    steps: dict[tuple[str, str], SimulatedStep] = {}
    extrapolated = True
    with tempfile.TemporaryDirectory(prefix="layerwise-hf-plan-") as out:
        for optimizer, mode in jobs:
            one = functools.partial(simulate, optimizer=optimizer, setup=setup, output_dir=out, offload=mode)
            try:
                if extrapolate:
                    step, used = simulate_layers(config, lambda c, one=one: one(c))
                else:
                    step, used = one(config), False
            except EstimateError as e:
                raise EstimateError(f"{name}: {e}") from e
            except Exception as e:
                raise simulation_error(e, name, config, optimizer, mode, setup) from e
            steps[(optimizer, mode)] = step
            extrapolated &= used
    return steps, extrapolated


def describe_setting(optimizer: str, mode: str, setup: StepSetup) -> str:
    """The simulated setting in the command line's words, e.g. `--optim adamw_torch --torch-dtype float32 ...`."""
    words = [f"--optim {optimizer}", f"--torch-dtype {setup.torch_dtype}", f"--seq-len {setup.seq_len}",
             f"--micro-batch {setup.micro_batch}"]  # fmt: skip
    words += ["--bf16"] * setup.bf16 + ["--fp16"] * setup.fp16
    words += [f"--grad-accum {setup.grad_accum}"] * (setup.grad_accum > 1)
    words += ["--gradient-checkpointing"] * setup.gradient_checkpointing
    if setup.lora_r:
        words += [f"--lora-r {setup.lora_r} --lora-target-modules {' '.join(setup.lora_targets)}"]
    words += [f"--offload {mode}"] * (mode != "none")
    if setup.sharding != "none":
        words += [f"--world-size {setup.world_size} --sharding {setup.sharding}"]
    words += [f"--dp-replicate {setup.dp_replicate}"] * (setup.dp_replicate > 1)
    words += [f"--tp {setup.tp}"] * (setup.tp > 1)
    return " ".join(words)


def simulation_error(
    error: Exception, name: str, config: Any, optimizer: str, mode: str, setup: StepSetup
) -> EstimateError:
    """What the user reads when the model's own code or a kernel fails on fake tensors: the model, the setting, the
    error's first line, and what to try."""
    first = (str(error).strip().splitlines() or [""])[0]
    model_type = getattr(config, "model_type", "?")
    setting = describe_setting(optimizer, mode, setup)
    return EstimateError(
        f"{name} (model_type {model_type!r}): the simulated step failed with {setting}: "
        f"{type(error).__name__}: {first.rstrip('.')}. "
        "This is where the simulation on fake tensors stops, not necessarily the run: another --torch-dtype "
        "(e.g. bfloat16), --bf16, or --no-extrapolate may plan it; `layerwise-hf estimate` gives the formula's "
        "figures."
    )


def lora_targets_of(config: Any, asked: tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """LoRA's target modules: those asked for, or peft's default for the architecture (q_proj and v_proj for the
    Llama family, c_attn for GPT-2); refused, naming the model's linear modules, when none of them matches."""
    targets = tuple(asked) if asked else default_lora_targets(config.model_type)
    try:
        linear = linear_module_names(config)
    except Exception:
        return targets  # a model that cannot be built: the simulation reports it, naming the setting
    if not any(_module_matches(full, t) for t in targets for full in linear):
        leaves = sorted({full.rsplit(".", 1)[-1] for full in linear})
        raise EstimateError(
            f"--lora-target-modules {' '.join(targets)} match no module of this {config.model_type} model; "
            f"its linear modules LoRA can target: {', '.join(leaves)} (e.g. --lora-target-modules {leaves[0]})."
        )
    return targets


def default_lora_targets(model_type: str) -> tuple[str, ...]:
    """peft's default `target_modules` for `model_type` (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`), or
    q_proj and v_proj where peft has none."""
    try:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS
    except ImportError:
        DEFAULTS = {}
    return tuple(DEFAULTS.get(model_type) or DEFAULT_LORA_TARGETS)


def linear_module_names(config: Any) -> list[str]:
    """The qualified names of the modules LoRA can wrap (`nn.Linear`, transformers' `Conv1D`), from a model built on
    the meta device (nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    # Two decoder layers name every module kind a deep model has (the extrapolation's rule for a smaller model).
    small = with_layers(config, min(2, getattr(config, "num_hidden_layers", 2) or 2)) or config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(small))
    return [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))]


def _module_matches(full: str, target: str) -> bool:
    # NOTE: peft's rule for a list of targets: the whole name, or its last dotted parts.
    return full == target or full.endswith("." + target)


def to_row(
    step: SimulatedStep, setup: StepSetup, memory: int | None, host: int | None, steps: dict[tuple[str, str], Any]
) -> PlanRow:
    peak = step.peak
    row = PlanRow(step.optimizer, peak.total, dict(peak.by_category), peak.phase, step.from_rule)
    row.between_steps = dict(step.steady_by_category)
    row.offload = step.offload
    row.host_peak_bytes = step.host_peak.total
    row.host_categories = dict(step.host_peak.by_category)
    row.combined_peak_bytes = step.combined_peak
    row.backward_flops = step.backward_flops
    if memory is not None:
        row.fits = peak.total <= memory
        row.headroom_bytes = memory - peak.total
    if host is not None:
        row.host_fits = step.host_peak.total <= host
        row.host_headroom_bytes = host - step.host_peak.total
    standard = steps.get((step.optimizer.removesuffix(SUFFIX), "none")) if step.optimizer.endswith(SUFFIX) else None
    if standard is not None:
        row.saving_bytes = standard.peak.total - peak.total
    row.advice = advise(row, setup)
    return row
