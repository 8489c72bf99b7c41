"""How close `layerwise-hf plan` comes to real runs: the peak of live tensor bytes and the RSS training peak of small
real CPU trainings, against the plan of the same setup (`plan(..., device="cpu")`, fake tensors).
Launch, method and last results: benchmarks/README.md."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import inspect
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common as h  # noqa: E402

GOAL = 0.05  # planned peak against the tensor peak
RSS_GOAL = 0.10  # planned peak against the RSS training peak
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc malloc.h)
MARK = "plan_accuracy: measured step"  # the profiler range of the measured step
MODELS = {
    # An untied Llama, a Qwen2 with tied embeddings, and OPT (learned positions, biases, LayerNorm, ReLU).
    "llama": dict(
        model_type="llama",
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "opt": dict(
        model_type="opt",
        vocab_size=4096,
        hidden_size=256,
        ffn_dim=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        word_embed_proj_dim=256,
        max_position_embeddings=1024,
    ),
    # --quick's model: a smoke run in seconds.
    "tiny": dict(
        model_type="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}
ACCELERATE_CONFIGS = {"ddp": "configs/accelerate/cpu_ddp.yaml", "fsdp2": "configs/accelerate/cpu_fsdp2.yaml"}


class Config(NamedTuple):
    model: str
    optim: str
    seq_len: int = 128
    micro_batch: int = 1
    grad_accum: int = 1
    checkpointing: bool = False
    bf16: bool = False
    lora_r: int | None = None
    fp16: bool = False
    sharding: str = "none"  # "ddp" or "fsdp2": 2 gloo ranks
    offload: str = "none"  # layerwise_offload (LAYERWISE_HF_OFFLOAD_SIMULATE=1: separate host buffers on a CPU)

    @property
    def world_size(self) -> int:
        return 1 if self.sharding == "none" else 2

    @property
    def name(self) -> str:
        extra = "".join([" ckpt" if self.checkpointing else "", " bf16" if self.bf16 else ""])
        extra += " fp16" if self.fp16 else ""
        extra += f" lora{self.lora_r}" if self.lora_r else ""
        extra += f" {self.sharding}x{self.world_size}" if self.world_size > 1 else ""
        extra += f" offload-{self.offload}" if self.offload != "none" else ""
        return f"{self.model} {self.optim} s{self.seq_len} b{self.micro_batch} ga{self.grad_accum}{extra}"


def configurations() -> list[Config]:
    out = []
    for model in ("llama", "qwen2", "opt"):
        for optim in ("adamw_torch", "adamw_8bit", "adafactor"):
            out += [Config(model, optim), Config(model, optim + "_layerwise")]
    for optim in ("adamw_torch", "adamw_torch_layerwise"):
        out += [
            Config("llama", optim, seq_len=512),
            Config("llama", optim, micro_batch=4),
            Config("llama", optim, grad_accum=4),
            Config("llama", optim, seq_len=512, checkpointing=True),
            Config("qwen2", optim, seq_len=512, micro_batch=4, checkpointing=True),
            Config("opt", optim, seq_len=512, grad_accum=4),
            Config("llama", optim, seq_len=512, bf16=True),
            Config("llama", optim, seq_len=512, checkpointing=True, lora_r=8),
            Config("llama", optim, fp16=True),
        ]
    out += [
        Config("qwen2", "adamw_8bit_layerwise", micro_batch=4, grad_accum=4),
        Config("opt", "adafactor_layerwise", seq_len=512, checkpointing=True),
    ]
    for sharding in ACCELERATE_CONFIGS:
        out += [Config("llama", optim, sharding=sharding) for optim in ("adamw_torch", "adamw_torch_layerwise")]
    return out + offload_configurations()


def offload_configurations() -> list[Config]:
    """Host offload on one process: both modes at GA 1 (exact clipping in one backward) and GA 4, other bases and
    models. On a CPU the device and the host are one memory: the plan's device + host peak is compared."""
    out = []
    for mode in ("gradients", "optimizer"):
        out += [
            Config("llama", "adamw_torch_layerwise", offload=mode),
            Config("llama", "adamw_torch_layerwise", grad_accum=4, offload=mode),
            Config("qwen2", "adamw_torch_layerwise", seq_len=512, checkpointing=True, offload=mode),
            Config("opt", "adafactor_layerwise", grad_accum=4, offload=mode),
        ]
    return out


# `--small` (tests/test_plan.py): four configurations of the benchmark's models, each expected within the goal.
SMALL = [
    Config("llama", "adamw_torch"),
    Config("llama", "adamw_torch_layerwise"),
    Config("qwen2", "adamw_8bit_layerwise"),
    Config("opt", "adafactor", checkpointing=True),
]
# `--quick`: the smoke run of tests/test_benchmarks.py.
QUICK = [Config("tiny", "adamw_torch"), Config("tiny", "adamw_torch_layerwise", grad_accum=2)]


# ---- the real run ----


def build_model(cfg: Config):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from layerwise_hf.platform.compat import enable_activation_checkpointing

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**MODELS[cfg.model]))
    model.config.use_cache = False
    if cfg.lora_r:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora_r, lora_alpha=2 * cfg.lora_r, lora_dropout=0.0,
                          target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")  # fmt: skip
        model = get_peft_model(model, lora)
    if cfg.checkpointing:
        enable_activation_checkpointing(model)
        if cfg.lora_r:
            model.enable_input_require_grads()
    model.train()
    return model


class Run(NamedTuple):
    """What one real step needs: the model, the optimizer, the layer-wise one (or None), the accumulation window,
    fp16's scaler and, on 2 ranks, the Accelerator."""

    model: object
    optimizer: object
    layerwise: object
    window: dict
    scaler: object = None
    accelerator: object = None


def build_run(cfg: Config, max_grad_norm: float) -> Run:
    """The model and the optimizer, as Trainer would build them for `cfg` on one process."""
    import torch

    model = build_model(cfg)
    args = h.training_args(cfg.optim, max_grad_norm=max_grad_norm, gradient_accumulation_steps=cfg.grad_accum)
    window = {"last": True}
    scaler = torch.amp.GradScaler("cpu") if cfg.fp16 else None
    if cfg.optim.endswith("_layerwise"):
        offload = {"offload": cfg.offload} if cfg.offload != "none" else {}
        optimizer = h.layerwise_optimizer(
            model, args, clip=(max_grad_norm, "exact"), sync_gradients=lambda: window["last"], **offload
        )
        if scaler is not None:
            optimizer.use_grad_scaler(scaler)
        return Run(model, optimizer, optimizer, window, scaler)
    return Run(model, h.trainer_optimizer(model, args), None, window, scaler)


def real_step(run: Run, cfg: Config, max_grad_norm: float) -> None:
    """One optimizer step as Trainer takes it: `grad_accum` micro-batches, then clipping, `step()`, `zero_grad()`."""
    import torch

    from layerwise_hf.optim.norm_pass import forward_again

    model, optimizer, layerwise, scaler = run.model, run.optimizer, run.layerwise, run.scaler
    vocab = model.get_input_embeddings().num_embeddings
    dtype = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else None
    amp = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
    for k in range(cfg.grad_accum):
        run.window["last"] = k == cfg.grad_accum - 1

        def forward_backward():
            ids = torch.randint(0, vocab, (cfg.micro_batch, cfg.seq_len))
            with amp:
                loss = model(input_ids=ids, labels=ids).loss / cfg.grad_accum
            del ids
            if scaler is not None:
                loss = scaler.scale(loss)
            if layerwise is not None:
                layerwise.backward_with_norm_pass(loss, backward=backward_of(run))
            else:
                backward_of(run)(loss)

        # The plain-loop protocol of `forward_again`: a step whose last one chose `rerun` runs forward twice.
        if layerwise is not None and forward_again(layerwise):
            layerwise.run_with_norm_pass(forward_backward, model)
        else:
            forward_backward()
    if layerwise is None and max_grad_norm > 0:
        if scaler is not None:
            scaler.unscale_(optimizer)
        params = [p for p in model.parameters() if p.requires_grad]
        if run.accelerator is not None:
            run.accelerator.clip_grad_norm_(params, max_grad_norm)
        else:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def backward_of(run: Run):
    if run.accelerator is None:
        return lambda loss, **kwargs: loss.backward(**kwargs)
    return lambda loss, **kwargs: run.accelerator.backward(loss, **kwargs)


def allocator_peak(prof, marker: str) -> dict:
    """From the profile's allocator events: the bytes allocated at the end, and the highest running sum inside the
    `marker` range (a `record_function`)."""
    events = prof.profiler.kineto_results.events()
    ranges = [(e.start_ns(), e.end_ns()) for e in events if e.name() == marker]
    if len(ranges) != 1:
        raise RuntimeError(f"expected one {marker!r} range in the profile, found {len(ranges)}")
    start, end = ranges[0]
    running = highest = 0
    at_start = None
    for when, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        if at_start is None and when >= start:
            at_start = highest = running
        running += nbytes
        if start <= when <= end:
            highest = max(highest, running)
    return {"peak_bytes": highest, "start_bytes": at_start, "end_bytes": running}


def live_tensor_bytes() -> int:
    """The storages of every real tensor Python can reach (distinct, in full)."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    # Fake and meta tensors (a plan made earlier in this process) hold no memory and have no data pointer.
    return h.storage_bytes(
        [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type != "meta" and not is_fake(o)]
    )


def measure_real(cfg: Config, max_grad_norm: float, split: bool = False) -> dict:
    """The RSS training peak of step 3 of a first run (with `split`, its step 4 split into the plan's categories),
    then the tensor peak of step 2 of a second run, profiled from before its model existed. See the module
    docstring."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    # NOTE: RSS first: the profiler keeps memory of its own that later steps would count (+10-20 MiB seen).
    run = build_run(cfg, max_grad_norm)
    real_step(run, cfg, max_grad_norm)
    real_step(run, cfg, max_grad_norm)
    rss = rss_step(run, cfg, max_grad_norm)
    if cfg.offload != "none":
        return offload_measure(run, cfg, max_grad_norm, rss)
    split_out = split_step(run, cfg, max_grad_norm) if split else None
    if run.layerwise is not None:
        run.layerwise.detach()
    del run
    h.settle()  # nothing of the first run may be freed while the profiler counts
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run = build_run(cfg, max_grad_norm)
        real_step(run, cfg, max_grad_norm)
        with record_function(MARK):
            real_step(run, cfg, max_grad_norm)
    out = allocator_peak(prof, MARK)
    del prof
    out["optimizer_state_bytes"] = h.storage_bytes(h.optimizer_state_tensors(run.optimizer))
    if cfg.offload != "none":
        out.update(host_side(run.layerwise))
    out.update(rss_fields(rss["rss_rest_bytes"], rss["rss_peak_bytes"], out["end_bytes"], rss["live"]))
    if split_out is not None:
        out["split"] = split_out
    if run.layerwise is not None:
        out["norm_pass"] = norm_pass_name(run.layerwise)
        run.layerwise.detach()
    return out


def offload_measure(run: Run, cfg: Config, max_grad_norm: float, rss: dict) -> dict:
    """An offload run's tensor peak: one more step under the plan's `LiveBytes` on the real tensors, on every thread.

    The profiler records the allocations and frees of the thread that started it only (torch 2.13: its
    `profile_all_threads` option records no memory events at all), and offload's copy thread frees each device gradient
    once it is copied out while its host worker allocates the host steps' states and temporaries. `LiveBytes` sees
    every storage allocated on the main thread and on the host worker (its dispatch mode is pushed there) and every
    free on any thread (a storage's finalizer): device and host sides apart, the host side being the host buffers,
    host copies and states at the start and what the worker and `host_empty_like` allocate."""
    from unittest import mock

    from torch.utils._python_dispatch import _pop_mode, _push_mode

    from layerwise_hf.placement import offload as offload_module
    from layerwise_hf.placement import transfer as transfer_module
    from layerwise_hf.plan.tracker import GRADIENTS, OPTIMIZER_STATE, WEIGHTS, LiveBytes

    out = host_side(run.layerwise)
    h.settle()
    tracker = LiveBytes()
    lw = run.layerwise
    lw.detach()  # the tracker's gradient hooks must run before the ones that free `.grad`
    handles = tracker.watch_model(run.model)
    hosted = host_tensors(lw)
    with tracker.on_host():
        for category, tensors in ((WEIGHTS, hosted["copies"]), (GRADIENTS, hosted["gradients"]),
                                  (OPTIMIZER_STATE, hosted["states"])):  # fmt: skip
            tracker.track_tensors(tensors, category)
    device_states = [t for inner in lw.inner if not hasattr(inner, "base")
                     for t in h.optimizer_state_tensors(inner).values()]  # fmt: skip
    tracker.track_tensors(device_states, OPTIMIZER_STATE)
    submit, host_empty_like = offload_module.HostWorker.submit, transfer_module.Transfer.host_empty_like

    def on_host(fn, *args):
        _push_mode(tracker)
        try:
            with tracker.on_host():
                return fn(*args)
        finally:
            _pop_mode()

    def empty_on_host(self, tensor):
        with tracker.on_host():
            return host_empty_like(self, tensor)

    lw.attach()
    tracker.reset_peak()
    with mock.patch.object(offload_module.HostWorker, "submit", lambda self, fn, *a: submit(self, on_host, fn, *a)), \
            mock.patch.object(transfer_module.Transfer, "host_empty_like", empty_on_host), tracker:  # fmt: skip
        real_step(run, cfg, max_grad_norm)
        out.update(host_side(lw))  # every host step done and copied back
    for handle in handles:
        handle.remove()
    out.update(peak_bytes=tracker.combined_peak, device_peak_bytes=tracker.peak.total, device_when=tracker.peak.phase,
               host_peak_bytes=tracker.host_peak.total, end_bytes=tracker.current + tracker.host_current,
               optimizer_state_bytes=h.storage_bytes(device_states + hosted["states"]),
               device_categories=tracker.peak.by_category, host_categories=tracker.host_peak.by_category)  # fmt: skip
    out.update(rss_fields(rss["rss_rest_bytes"], rss["rss_peak_bytes"], out["end_bytes"], rss["live"]))
    lw.detach()
    return out


def host_tensors(layerwise) -> dict:
    """The host-side tensors of an offload run: parameter copies, gradient buffers, host states."""
    import torch

    from layerwise_hf.optim.host_offload import offload_of
    from layerwise_hf.placement.host_step import HostStepOptimizer

    hosted = [inner for inner in layerwise.inner if isinstance(inner, HostStepOptimizer)]
    return {
        "copies": [i.host for i in hosted],
        "gradients": [*offload_of(layerwise).host.values(), *(i.host_grad for i in hosted if i.host_grad is not None)],
        "states": [
            t for i in hosted for s in i.base.state.values() for t in s.values() if isinstance(t, torch.Tensor)
        ],
    }


def host_side(layerwise) -> dict:
    """An offload run's host-side storages now: the host states, the host copies of the parameters, the gradient
    buffers (`GradientOffload.host` and each host step's `host_grad`)."""
    from layerwise_hf.placement.offloading import wait_for_host_steps

    wait_for_host_steps(layerwise)
    hosted = host_tensors(layerwise)
    return {
        "host_state_bytes": h.storage_bytes(hosted["states"]),
        "host_copy_bytes": h.storage_bytes(hosted["copies"]),
        "host_gradient_bytes": h.storage_bytes(hosted["gradients"]),
    }


def rss_step(run: Run, cfg: Config, max_grad_norm: float) -> dict:
    h.settle()
    live = live_tensor_bytes()
    rss_rest = h.proc_status_bytes("VmRSS")
    h.reset_peak_rss()
    real_step(run, cfg, max_grad_norm)
    return {"rss_rest_bytes": rss_rest, "rss_peak_bytes": h.proc_status_bytes("VmHWM"), "live": live}


def rss_fields(rss_rest: int, rss_peak: int, held_bytes: int, live: int) -> dict:
    # The runtime (libraries, interpreter, heap slack): the RSS at rest less the tensors held then. The allocator's
    # sum counts the C++-only ones too (DDP buckets); the Python scan is the check that nothing was missed.
    runtime = rss_rest - max(held_bytes, live)
    return {
        "rss_rest_bytes": rss_rest,
        "rss_peak_bytes": rss_peak,
        "rss_runtime_bytes": runtime,
        "rss_training_peak_bytes": rss_peak - runtime,
        "live_tensor_bytes_at_rest": live,
        "held_bytes_at_rest": held_bytes,
    }


def split_step(run: Run, cfg: Config, max_grad_norm: float) -> dict:
    """One more step under the plan's `LiveBytes` on real tensors: the real peak by category and when it falls."""
    from layerwise_hf.plan.tracker import OPTIMIZER_STATE, LiveBytes

    tracker = LiveBytes()
    lw = run.layerwise
    if lw is not None:
        lw.detach()  # the tracker's gradient hooks must run before the ones that free `.grad`
    handles = tracker.watch_model(run.model)
    tracker.track_tensors(h.optimizer_state_tensors(run.optimizer).values(), OPTIMIZER_STATE)
    inner = list(zip(lw.names, lw.inner)) if lw is not None else [("optimizer.step()", run.optimizer)]
    for name, opt in inner:
        handles += tracker.watch_optimizer(getattr(opt, "optimizer", opt), name)
    if lw is not None:
        lw.attach() if run.accelerator is None else lw.connect(run.model, run.accelerator)
    tracker.reset_peak()
    with tracker:
        real_step(run, cfg, max_grad_norm)
    for handle in handles:
        handle.remove()
    return {"peak_bytes": tracker.peak.total, "categories": tracker.peak.by_category, "when": tracker.peak.phase}


def norm_pass_name(layerwise) -> str | None:
    from layerwise_hf.optim.norm_pass import last_norm_pass

    chosen = last_norm_pass(layerwise)
    return None if chosen is None else chosen.value


# ---- the plan ----


def plan_supports_sharding() -> bool:
    from layerwise_hf.plan import plan

    return {"world_size", "sharding"} <= set(inspect.signature(plan).parameters)


def planned(cfg: Config, max_grad_norm: float) -> dict:
    from layerwise_hf.plan import plan

    sharding = {} if cfg.world_size == 1 else dict(world_size=cfg.world_size, sharding=cfg.sharding)
    if cfg.offload != "none":
        sharding["offload"] = cfg.offload
    result = plan(
        MODELS[cfg.model],
        [cfg.optim],
        seq_len=cfg.seq_len,
        micro_batch=cfg.micro_batch,
        grad_accum=cfg.grad_accum,
        max_grad_norm=max_grad_norm,
        bf16=cfg.bf16,
        fp16=cfg.fp16,
        gradient_checkpointing=cfg.checkpointing,
        lora_r=cfg.lora_r,
        device="cpu",
        counterparts=False,
        **sharding,
    )
    row = result.rows[0]
    return {
        "peak_bytes": row.peak_bytes,
        "categories": row.categories,
        "when": row.when,
        "optimizer_state_from_rule": row.optimizer_state_from_rule,
        "seconds": result.seconds,
        **(offload_fields(row) if cfg.offload != "none" else {}),
    }


def offload_fields(row) -> dict:
    """An offload row's device peak, host peak and their joint peak (what one memory holds: a CPU run's)."""
    return {
        "device_peak_bytes": row.peak_bytes,
        "host_peak_bytes": row.host_peak_bytes,
        "host_categories": row.host_categories,
        "combined_peak_bytes": row.combined_peak_bytes,
    }


def compared_bytes(plan_: dict) -> int:
    """The planned figure a CPU run is compared with: the peak, or with offload the device + host peak (on a CPU
    both sides are one memory)."""
    return plan_.get("combined_peak_bytes", plan_["peak_bytes"])


# ---- 2 ranks: Trainer under `accelerate launch` (runs inside the launched ranks) ----


def rank_worker(opts: argparse.Namespace) -> None:
    """One rank of a 2-rank configuration, Trainer (or LayerwiseTrainer) for `RANK_STEPS` steps, the last measured:
    `--measure tensor` counts the CPU allocator from before the model exists (each step's peak is kept); `--measure
    rss` (a launch of its own, as on one process) measures by RSS."""
    import torch
    from accelerate.utils import DistributedType

    import layerwise_hf  # noqa: F401  (applies LAYERWISE_HF_FORCE_FSDP_CPU before the first Accelerator)
    from benchmarks import _ranks as ranks

    limit_mmap_threshold()
    torch.set_num_threads(1)
    cfg = Config(**json.loads(opts.config))
    probe = StepProbe(counted=opts.measure == "tensor", steps=opts.rank_steps)
    trainer = build_trainer(cfg, opts.max_grad_norm, Path(opts.result).parent / "trainer_output", probe)
    expected = DistributedType.FSDP if cfg.sharding == "fsdp2" else DistributedType.MULTI_CPU
    accelerator = trainer.accelerator
    if accelerator.distributed_type != expected or accelerator.num_processes != cfg.world_size:
        raise RuntimeError(
            f"{cfg.name}: got {accelerator.distributed_type} with {accelerator.num_processes} processes; a silent "
            "fallback would measure the wrong thing (ACCELERATE_USE_CPU / LAYERWISE_HF_FORCE_FSDP_CPU missing?)"
        )
    trainer.train()
    lw = getattr(trainer, "layerwise_optimizer", None)
    result = {
        "rank": accelerator.process_index,
        **probe.rss,
        "optimizer_state_bytes": h.storage_bytes(h.optimizer_state_tensors(trainer.optimizer)),
        "route": None if lw is None else lw.route,
        "norm_pass": None if lw is None else norm_pass_name(lw),
    }
    if probe.counter is not None:
        result.update(probe.measured[-1], step_peak_bytes=[s["peak_bytes"] for s in probe.measured])
    trainer.accelerator.free_memory()
    del trainer
    ranks.write_gathered_and_finish(opts.result, result)


def build_trainer(cfg: Config, max_grad_norm: float, out: Path, probe):
    """The model and its Trainer (or LayerwiseTrainer), `probe` among its callbacks."""
    from transformers import Trainer

    from layerwise_hf import LayerwiseTrainer

    args = h.training_args(
        cfg.optim,
        str(out),
        per_device_train_batch_size=cfg.micro_batch,
        gradient_accumulation_steps=cfg.grad_accum,
        max_steps=probe.steps,
        max_grad_norm=max_grad_norm,
        bf16=cfg.bf16,
        fp16=cfg.fp16,
        gradient_checkpointing=cfg.checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=1000,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = build_model(cfg)
    rows = cfg.world_size * cfg.micro_batch * cfg.grad_accum * probe.steps
    data = h.TokenRows(MODELS[cfg.model]["vocab_size"], cfg.seq_len, rows)
    trainer_cls = LayerwiseTrainer if cfg.optim.endswith("_layerwise") else Trainer
    return trainer_cls(model=model, args=args, train_dataset=data, callbacks=[probe])


RANK_STEPS = 4  # DDP rebuilds its buckets in the second step: the last of these is the steady state measured (default)


def StepProbe(counted: bool, steps: int = RANK_STEPS):  # noqa: N802 - a class made where transformers is imported
    """A callback: (`counted`) each step's tensor peak and the bytes held before and after it, from the CPU allocator
    counted on every thread (installed here, before the model exists); or (not `counted`) the last step's RSS."""
    from transformers import TrainerCallback

    from benchmarks._thread_memory import CountingAllocator

    class Probe(TrainerCallback):
        def __init__(self):
            self.counter = CountingAllocator() if counted else None
            self.measured: list[dict] = []
            self.rss: dict = {}
            self.steps = steps

        def on_step_begin(self, args, state, control, **kwargs):
            # NOTE: Trainer counts finished steps: global_step is k - 1 when step k begins.
            if self.counter is not None:
                self.measured.append({"start_bytes": self.counter.current()})
                self.counter.reset_peak()
            elif state.global_step == steps - 1:
                h.settle()
                self.rss = {"live": live_tensor_bytes(),
                            "rss_rest_bytes": h.proc_status_bytes("VmRSS")}  # fmt: skip
                h.reset_peak_rss()

        def on_step_end(self, args, state, control, **kwargs):
            if self.counter is not None:
                self.measured[-1].update(peak_bytes=self.counter.peak(), end_bytes=self.counter.current())
            elif state.global_step == steps:
                self.rss["rss_peak_bytes"] = h.proc_status_bytes("VmHWM")

    return Probe()


# ---- one configuration, the table, the figure ----


def limit_mmap_threshold() -> None:
    # NOTE: glibc serves allocations above the threshold by mmap and returns them to the OS on free, so RSS follows
    # live tensors instead of heap slack; set by mallopt it also stops the threshold from growing (MALLOC_MMAP_
    # THRESHOLD_ in the environment does the same, but only for processes started with it).
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 65536)


def measure_config(cfg: Config, opts: argparse.Namespace) -> dict:
    """The real run (this process, or 2 launched ranks) and the plan of `cfg`."""
    started = time.perf_counter()
    if cfg.offload != "none":
        import os

        from layerwise_hf.placement.transfer import SIMULATE_ENV

        os.environ[SIMULATE_ENV] = "1"  # a CPU run of offload as a GPU runs it (copy thread, worker, host buffers)
    if cfg.world_size == 1:
        limit_mmap_threshold()
        real = measure_real(cfg, opts.max_grad_norm, split=opts.split)
    else:
        real = launch_ranks(cfg, opts)
    real["seconds"] = time.perf_counter() - started
    out = {"config": cfg._asdict(), "name": cfg.name, "real": real}
    if cfg.world_size > 1 and not plan_supports_sharding():
        out["plan"] = None
        out["plan_missing"] = "layerwise_hf.plan.plan() takes no world_size / sharding in this version"
        return out
    out["plan"] = planned(cfg, opts.max_grad_norm)
    out["error"] = compared_bytes(out["plan"]) / real["peak_bytes"] - 1
    out["rss_error"] = compared_bytes(out["plan"]) / real["rss_training_peak_bytes"] - 1
    return out


def launch_ranks(cfg: Config, opts: argparse.Namespace) -> dict:
    """`cfg` on 2 gloo ranks under its Accelerate config, twice (tensor peak, then RSS: see `rank_worker`); the rank
    with the higher tensor peak, and both ranks."""
    from benchmarks import _ranks as ranks
    from benchmarks import _thread_memory

    _thread_memory.build()  # once, here, rather than in both ranks at the same time
    env = h.worker_env(threads=1)
    if cfg.sharding == "fsdp2":
        env["LAYERWISE_HF_FORCE_FSDP_CPU"] = "1"
    runs = {}
    for measure in ("tensor", "rss"):
        with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
            result = Path(tmp) / "ranks.json"
            args = ["--worker", "--measure", measure, "--config", json.dumps(cfg._asdict()), "--result", str(result)]
            args += ["--max_grad_norm", str(opts.max_grad_norm), "--rank_steps", str(opts.rank_steps)]
            config_file = ROOT / ACCELERATE_CONFIGS[cfg.sharding]
            runs[measure] = ranks.launch_ranks(Path(__file__).resolve(), config_file, args, result, opts.timeout, env)
    per_rank = []
    for tensor, rss in zip(runs["tensor"], runs["rss"]):
        fields = rss_fields(rss["rss_rest_bytes"], rss["rss_peak_bytes"], tensor["end_bytes"], rss["live"])
        per_rank.append({**tensor, **fields})
    return {**max(per_rank, key=lambda r: r["peak_bytes"]), "ranks": per_rank}


def selected(opts: argparse.Namespace) -> list[Config]:
    configs = SMALL if opts.small else QUICK if opts.quick else configurations()
    if opts.only:
        patterns = [re.compile(p) for p in opts.only]
        configs = [c for c in configs if any(p.search(c.name) for p in patterns)]
    if not configs:
        raise SystemExit(f"--only {opts.only}: no configuration matches (see --list)")
    return configs


COLUMNS = [("configuration", 50), ("plan MiB", 9), ("tensor MiB", 10), ("error", 7), ("RSS MiB", 8),
           ("RSS error", 9), ("state real", 10), ("state plan", 10), ("plan: peak falls at", 44, "<")]  # fmt: skip


def table_row(r: dict) -> tuple:
    real, plan_ = r["real"], r.get("plan")
    if "error" in real or plan_ is None:
        why = real.get("error") or r.get("plan_missing", "")
        return (r["name"], "-", h.mib(real.get("peak_bytes")), "-", h.mib(real.get("rss_training_peak_bytes")), "-",
                "-", "-", why[:44])  # fmt: skip
    state = plan_["categories"]["optimizer_state"]
    return (r["name"], h.mib(compared_bytes(plan_)), h.mib(real["peak_bytes"]), h.pct(r["error"]),
            h.mib(real["rss_training_peak_bytes"]), h.pct(r["rss_error"]), h.mib(real["optimizer_state_bytes"]),
            h.mib(state) + ("*" if plan_["optimizer_state_from_rule"] else ""), plan_["when"][:44])  # fmt: skip


def summary(rows: list[dict]) -> dict:
    scored = [r for r in rows if r.get("error") is not None]
    return {
        "configurations": len(rows),
        "compared": len(scored),
        "within_goal": sum(abs(r["error"]) <= GOAL for r in scored),
        "within_rss_goal": sum(abs(r["rss_error"]) <= RSS_GOAL for r in scored),
        "within_both": sum(abs(r["error"]) <= GOAL and abs(r["rss_error"]) <= RSS_GOAL for r in scored),
        "largest_error": max((abs(r["error"]) for r in scored), default=None),
        "largest_rss_error": max((abs(r["rss_error"]) for r in scored), default=None),
    }


def print_report(rows: list[dict], stats: dict) -> None:
    title = (f"\nplanned peak vs the real run (CPU, steady-state step): tensor peak (allocator events), goal within "
             f"{GOAL:.0%}; RSS training peak, goal within {RSS_GOAL:.0%}")  # fmt: skip
    h.print_table(COLUMNS, [table_row(r) for r in rows], title=title)
    print("* optimizer state from the estimator's rules (bitsandbytes); its CPU step temporaries from a measured rule")
    print(
        f"{stats['within_goal']}/{stats['compared']} within {GOAL:.0%} of the tensor peak, {stats['within_rss_goal']}/"
        f"{stats['compared']} within {RSS_GOAL:.0%} of the RSS training peak, {stats['within_both']} both"
    )
    for r in rows:
        plan_, real = r.get("plan") or {}, r["real"]
        if "host_peak_bytes" in plan_ and "host_state_bytes" in real:
            host = plan_["host_categories"]
            print(f"{r['name']}: device peak planned {h.mib(plan_['device_peak_bytes'])} / real "
                  f"{h.mib(real.get('device_peak_bytes'))} MiB, host peak {h.mib(plan_['host_peak_bytes'])} / "
                  f"{h.mib(real.get('host_peak_bytes'))} MiB; "
                  f"host states planned {h.mib(host['optimizer_state'])} / real {h.mib(real['host_state_bytes'])}, "
                  f"host parameter copies {h.mib(host['weights'])} / {h.mib(real['host_copy_bytes'])}, host "
                  f"gradient buffers {h.mib(host['gradients'])} (at the host peak) / "
                  f"{h.mib(real['host_gradient_bytes'])} MiB")  # fmt: skip
        if r.get("plan_missing"):
            print(f"not planned: {r['name']}: {r['plan_missing']}")
        for rank in r["real"].get("ranks", []):
            steps = " ".join(h.mib(b) for b in rank["step_peak_bytes"])
            held, reached = h.mib(rank["end_bytes"]), h.mib(rank["live_tensor_bytes_at_rest"])
            print(f"{r['name']} rank {rank['rank']}: tensor peak per step {steps} MiB; held between steps {held} MiB, "
                  f"of which Python reaches {reached}")  # fmt: skip


def plot(report: dict, path: Path) -> None:
    plt = h.pyplot()
    rows = [r for r in report["rows"] if r.get("error") is not None]
    # Points outside a band are numbered; the numbers are named under the plots.
    misses = [r["name"] for r in rows if abs(r["error"]) > GOAL or abs(r["rss_error"]) > RSS_GOAL]
    fig = plt.figure(figsize=(15, 7.5 + 0.17 * len(misses)))
    grid = fig.add_gridspec(2, 2, height_ratios=[7, 0.3 + 0.17 * len(misses)])
    axes = [fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])]
    notes_ax = fig.add_subplot(grid[1, :])
    notes_ax.axis("off")
    for ax, key, goal, label in (
        (axes[0], "peak_bytes", GOAL, "measured peak of live tensor bytes (MiB)"),
        (axes[1], "rss_training_peak_bytes", RSS_GOAL, "measured RSS training peak (MiB)"),
    ):
        xs = [r["real"][key] / h.MIB for r in rows]
        ys = [compared_bytes(r["plan"]) / h.MIB for r in rows]
        top = max(xs + ys) * 1.08
        line = [0, top]
        ax.plot(line, line, color="black", lw=0.8)
        ax.fill_between(line, [0, top * (1 - goal)], [0, top * (1 + goal)], color="tab:green", alpha=0.15,
                        label=f"within {goal:.0%}")  # fmt: skip
        for kind, color, marker in KINDS:
            picked = [(x, y) for x, y, r in zip(xs, ys, rows) if kind_of(r) == kind]
            if picked:
                ax.scatter(*zip(*picked), color=color, marker=marker, s=28, label=kind, zorder=3)
        for x, y, r in zip(xs, ys, rows):
            if abs(y / x - 1) > goal:
                ax.annotate(str(misses.index(r["name"]) + 1), (x, y), fontsize=7, xytext=(4, -3),
                            textcoords="offset points")  # fmt: skip
        ax.set(xlim=(0, top), ylim=(0, top), xlabel=label, ylabel="planned peak (MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    s = report["summary"]
    title = (f"layerwise-hf plan vs real CPU runs, one point per configuration: {s['within_goal']}/{s['compared']} "
             f"within {GOAL:.0%} of the tensor peak, {s['within_rss_goal']}/{s['compared']} within {RSS_GOAL:.0%} of "
             f"the RSS training peak")  # fmt: skip
    if misses:
        errors = {r["name"]: r for r in rows}
        notes = [f"{k}: {n} ({h.pct(errors[n]['error'])} / {h.pct(errors[n]['rss_error'])})" for k, n in
                 enumerate(misses, 1)]  # fmt: skip
        notes_ax.text(0, 1, "outside a band (tensor / RSS error):\n" + "\n".join(notes), fontsize=8, va="top")
    h.save_figure(fig, path, title)


KINDS = [
    ("host offload (device + host)", "tab:green", "v"),
    ("standard", "tab:blue", "o"),
    ("layer-wise", "tab:orange", "s"),
    ("bitsandbytes (state: rule)", "tab:red", "^"),
    ("2 ranks", "tab:purple", "D"),
]


def kind_of(r: dict) -> str:
    if r["config"]["sharding"] != "none":
        return "2 ranks"
    if r["config"].get("offload", "none") != "none":
        return "host offload (device + host)"
    if r["plan"]["optimizer_state_from_rule"]:
        return "bitsandbytes (state: rule)"
    return "layer-wise" if r["config"]["optim"].endswith("_layerwise") else "standard"


def plan_source() -> dict:
    """The commit the planner was read from, and whether its files had changes not committed yet."""
    import subprocess

    def git(*args: str) -> str:
        result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return result.stdout.strip() if result.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD"), "uncommitted": git("status", "--porcelain", "--", "layerwise_hf/plan")}


def merge(paths: list[str], output_dir: str) -> dict:
    """The report in `output_dir` (if any) with the rows of the reports at `paths`: a later report's row replaces
    the row of the same name; rows in `configurations()` order; summary as a run computes it (`summary`)."""
    base = Path(output_dir) / "plan_accuracy.json"
    rows: dict[str, dict] = {}
    origin: dict[str, int] = {}
    runs: list[dict] = []
    models: dict = {}
    for path in ([base] if base.is_file() else []) + [Path(p) for p in paths]:
        report = json.loads(path.read_text())
        models.update(report.get("models", {}))
        names = [r["name"] for r in report["rows"]]
        # A merged report says which run each row comes from; a run's report is one run.
        parts = report.get("measured_in") or [{"rows": names, **{k: report.get(k) for k in RUN_FIELDS}}]
        for part in parts:
            runs.append({k: part.get(k) for k in RUN_FIELDS})
            for name in part["rows"]:
                origin[name] = len(runs) - 1
        rows.update((r["name"], r) for r in report["rows"])
    order = {c.name: k for k, c in enumerate(configurations())}
    merged = sorted(rows.values(), key=lambda r: order.get(r["name"], len(order)))
    measured_in = [{"rows": [r["name"] for r in merged if origin[r["name"]] == k], **run} for k, run in
                   enumerate(runs)]  # fmt: skip
    stats = summary(merged)
    return {
        "goal": GOAL,
        "rss_goal": RSS_GOAL,
        **stats,
        "summary": stats,
        "models": {k: v for k, v in models.items() if any(r["config"]["model"] == k for r in merged)},
        "rows": merged,
        "measured_in": [m for m in measured_in if m["rows"]],
    }


RUN_FIELDS = ("plan_source", "torch", "python", "wall_time_s")  # what a report says of the run that made it


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default=str(h.RESULTS))
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="two tiny configurations (smoke run)")
    group.add_argument("--small", action="store_true", help="four configurations of the benchmark's models")
    parser.add_argument("--only", action="append", metavar="REGEX", help="configurations whose name matches (repeat)")
    parser.add_argument("--list", action="store_true", help="print the selected configurations' names and stop")
    parser.add_argument("--split", action="store_true", help="also split the real peak into the plan's categories")
    parser.add_argument("--max_grad_norm", type=float, default=1.0, help="Trainer's default clipping")
    parser.add_argument("--rank_steps", type=int, default=RANK_STEPS, help="2-rank runs: steps, the last measured")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per configuration")
    parser.add_argument("--merge", nargs="+", metavar="REPORT",
                        help="put these reports' rows into the report in --output_dir (rows of the same name "
                        "replaced); summary and figure made again, nothing run")  # fmt: skip
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--measure", choices=["tensor", "rss"], help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.worker:
        rank_worker(opts)
        return 0
    if opts.merge:
        report = merge(opts.merge, opts.output_dir)
        print_report(report["rows"], report["summary"])
        h.write_report(opts.output_dir, "plan_accuracy", report, plot if report["compared"] else None)
        return 0
    configs = selected(opts)
    if opts.list:
        print("\n".join(c.name for c in configs))
        return 0
    import torch

    import layerwise_hf.plan.core  # noqa: F401  (imported once, before the forks)

    torch.set_num_threads(1)
    started = time.perf_counter()
    by_name = {c.name: c for c in configs}
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
        h.fork_each(list(by_name), Path(tmp), lambda name: measure_config(by_name[name], opts), opts.timeout, "ran")
        rows = [json.loads((Path(tmp) / f"{name}.json").read_text()) for name in by_name]
    rows = [r if "name" in r else {"name": n, "config": c._asdict(), "real": r} for r, (n, c) in
            zip(rows, by_name.items())]  # fmt: skip
    stats = summary(rows)
    print_report(rows, stats)
    report = {
        "goal": GOAL,
        "rss_goal": RSS_GOAL,
        **stats,
        "summary": stats,
        "models": {k: v for k, v in MODELS.items() if any(c.model == k for c in configs)},
        "rows": rows,
        "plan_source": plan_source(),
        "torch": torch.__version__,
        "python": h.python_version(),
        "wall_time_s": time.perf_counter() - started,
    }
    h.write_report(opts.output_dir, "plan_accuracy", report, plot if stats["compared"] else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
