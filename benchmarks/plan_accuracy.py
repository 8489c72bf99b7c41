"""How close `layerwise-hf plan` comes to real runs: the peak of live tensor bytes and the RSS training peak of small
real CPU trainings, against the plan of the same setup (`plan(..., device="cpu")`, fake tensors).
Launch, method and last results: benchmarks/README.md."""

# ruff: noqa: E402 - the checkout goes on sys.path first
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple
from unittest import mock

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import _pop_mode, _push_mode
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as h
from benchmarks import _thread_memory
from layerwise_hf.optim.norm_pass import backward_with_norm_pass, forward_again, run_with_norm_pass
from layerwise_hf.optim.optimizer import offload_of
from layerwise_hf.placement import offload as offload_module
from layerwise_hf.placement import transfer as transfer_module
from layerwise_hf.placement.host_step import HostStepOptimizer
from layerwise_hf.placement.offloading import wait_for_host_steps
from layerwise_hf.plan import plan
from layerwise_hf.plan.tracker import GRADIENTS, OPTIMIZER_STATE, WEIGHTS, LiveBytes
from layerwise_hf.platform.compat import enable_activation_checkpointing

GOAL = 0.05  # planned peak against the tensor peak
RSS_GOAL = 0.10  # planned peak against the RSS training peak
MARK = "plan_accuracy: measured step"  # the profiler range of the measured step
RANK_STEPS = 4  # DDP rebuilds its buckets in the second step: the last of these is the steady state measured
_LLAMA = dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
MODELS = {
    # An untied Llama, a Qwen2 with tied embeddings, and OPT (learned positions, biases, LayerNorm, ReLU).
    "llama": _LLAMA,
    "qwen2": _LLAMA | dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True),
    "opt": dict(model_type="opt", vocab_size=4096, hidden_size=256, ffn_dim=1024, num_hidden_layers=4,
                num_attention_heads=4, word_embed_proj_dim=256, max_position_embeddings=1024),
    # --quick's model: a smoke run in seconds.
    "tiny": _LLAMA | dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2),
}  # fmt: skip
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
        flags = [" ckpt" * self.checkpointing, " bf16" * self.bf16, " fp16" * self.fp16,
                 f" lora{self.lora_r}" if self.lora_r else "", f" {self.sharding}x2" if self.world_size > 1 else "",
                 f" offload-{self.offload}" if self.offload != "none" else ""]  # fmt: skip
        return f"{self.model} {self.optim} s{self.seq_len} b{self.micro_batch} ga{self.grad_accum}{''.join(flags)}"


def configurations() -> list[Config]:
    out = [Config(m, o + lw) for m in ("llama", "qwen2", "opt") for o in ("adamw_torch", "adamw_8bit", "adafactor")
           for lw in ("", "_layerwise")]  # fmt: skip
    for optim in ("adamw_torch", "adamw_torch_layerwise"):
        out += [Config("llama", optim, seq_len=512), Config("llama", optim, micro_batch=4),
                Config("llama", optim, grad_accum=4), Config("llama", optim, seq_len=512, checkpointing=True),
                Config("qwen2", optim, seq_len=512, micro_batch=4, checkpointing=True),
                Config("opt", optim, seq_len=512, grad_accum=4), Config("llama", optim, seq_len=512, bf16=True),
                Config("llama", optim, seq_len=512, checkpointing=True, lora_r=8),
                Config("llama", optim, fp16=True)]  # fmt: skip
    out += [Config("qwen2", "adamw_8bit_layerwise", micro_batch=4, grad_accum=4),
            Config("opt", "adafactor_layerwise", seq_len=512, checkpointing=True)]  # fmt: skip
    out += [
        Config("llama", o, sharding=s) for s in ACCELERATE_CONFIGS for o in ("adamw_torch", "adamw_torch_layerwise")
    ]
    # Host offload on one process: both modes at GA 1 (exact clipping in one backward) and GA 4, other bases and
    # models. On a CPU the device and the host are one memory: the plan's device + host peak is compared.
    for mode in ("gradients", "optimizer"):
        out += [Config("llama", "adamw_torch_layerwise", offload=mode),
                Config("llama", "adamw_torch_layerwise", grad_accum=4, offload=mode),
                Config("qwen2", "adamw_torch_layerwise", seq_len=512, checkpointing=True, offload=mode),
                Config("opt", "adafactor_layerwise", grad_accum=4, offload=mode)]  # fmt: skip
    return out


# `--small` (tests/test_plan.py): four configurations of the benchmark's models, each expected within the goal.
SMALL = [Config("llama", "adamw_torch"), Config("llama", "adamw_torch_layerwise"),
         Config("qwen2", "adamw_8bit_layerwise"), Config("opt", "adafactor", checkpointing=True)]  # fmt: skip
# `--quick`: the smoke run of tests/test_benchmarks.py.
QUICK = [Config("tiny", "adamw_torch"), Config("tiny", "adamw_torch_layerwise", grad_accum=2)]


# ---- the real run on one process ----


def build_model(cfg: Config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**MODELS[cfg.model]))
    model.config.use_cache = False
    if cfg.lora_r:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora_r, lora_alpha=2 * cfg.lora_r, lora_dropout=0.0, task_type="CAUSAL_LM",
                          target_modules=["q_proj", "v_proj"])  # fmt: skip
        model = get_peft_model(model, lora)
    if cfg.checkpointing:
        enable_activation_checkpointing(model)
        if cfg.lora_r:
            model.enable_input_require_grads()
    model.train()
    return model


def build_run(cfg: Config, max_grad_norm: float) -> SimpleNamespace:
    """What one real step needs, as Trainer would build it for `cfg` on one process: the model, the optimizer, the
    layer-wise one (or None), the accumulation window and fp16's scaler."""
    model = build_model(cfg)
    args = h.training_args(cfg.optim, max_grad_norm=max_grad_norm, gradient_accumulation_steps=cfg.grad_accum)
    window, offload = {"last": True}, {"offload": cfg.offload} if cfg.offload != "none" else {}
    optimizer, layerwise = h.build_optimizer(model, args, max_grad_norm, sync=lambda: window["last"], **offload)
    scaler = torch.amp.GradScaler("cpu") if cfg.fp16 else None
    if layerwise is not None and scaler is not None:
        layerwise.use_grad_scaler(scaler)
    return SimpleNamespace(model=model, optimizer=optimizer, layerwise=layerwise, window=window, scaler=scaler)


def real_step(run: SimpleNamespace, cfg: Config, max_grad_norm: float) -> None:
    """One optimizer step as Trainer takes it: `grad_accum` micro-batches, then clipping, `step()`, `zero_grad()`."""
    model, optimizer, layerwise, scaler = run.model, run.optimizer, run.layerwise, run.scaler
    vocab = model.get_input_embeddings().num_embeddings
    dtype = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else None
    for k in range(cfg.grad_accum):
        run.window["last"] = k == cfg.grad_accum - 1

        def forward_backward():
            ids = torch.randint(0, vocab, (cfg.micro_batch, cfg.seq_len))
            with torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
                loss = model(input_ids=ids, labels=ids).loss / cfg.grad_accum
            del ids
            loss = scaler.scale(loss) if scaler is not None else loss
            backward_with_norm_pass(layerwise, loss) if layerwise is not None else loss.backward()

        # The plain-loop protocol of `forward_again`: a step whose last one chose `rerun` runs forward twice.
        if layerwise is not None and forward_again(layerwise):
            run_with_norm_pass(layerwise, forward_backward, model)
        else:
            forward_backward()
    if layerwise is None and max_grad_norm > 0:
        if scaler is not None:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def allocator_peak(prof, marker: str) -> dict:
    """From the profile's allocator events: the bytes allocated at the end, and the highest running sum inside the
    `marker` range (a `record_function`)."""
    events = prof.profiler.kineto_results.events()
    ranges = [(e.start_ns(), e.end_ns()) for e in events if e.name() == marker]
    if len(ranges) != 1:
        raise RuntimeError(f"expected one {marker!r} range in the profile, found {len(ranges)}")
    (start, end), running, highest, at_start = ranges[0], 0, 0, None
    for when, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        if at_start is None and when >= start:
            at_start = highest = running
        running += nbytes
        if start <= when <= end:
            highest = max(highest, running)
    return {"peak_bytes": highest, "start_bytes": at_start, "end_bytes": running}


def live_tensor_bytes() -> int:
    """The storages of every real tensor Python can reach (distinct, in full)."""
    # Fake and meta tensors (a plan made earlier in this process) hold no memory and have no data pointer.
    return h.storage_bytes(
        [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type != "meta" and not is_fake(o)]
    )


def rss_at_rest() -> dict:
    """Before a measured step: the tensors Python reaches and the RSS; the peak is reset."""
    h.settle()
    live = live_tensor_bytes()
    return {"live": live, "rss_rest_bytes": h.rss_at_rest()}


def rss_fields(rss: dict, held_bytes: int) -> dict:
    # The runtime (libraries, interpreter, heap slack): the RSS at rest less the tensors held then. The allocator's
    # sum counts the C++-only ones too (DDP buckets); the Python scan is the check that nothing was missed.
    runtime = rss["rss_rest_bytes"] - max(held_bytes, rss["live"])
    return {"rss_rest_bytes": rss["rss_rest_bytes"], "rss_peak_bytes": rss["rss_peak_bytes"],
            "rss_runtime_bytes": runtime, "rss_training_peak_bytes": rss["rss_peak_bytes"] - runtime,
            "live_tensor_bytes_at_rest": rss["live"], "held_bytes_at_rest": held_bytes}  # fmt: skip


def measure_real(cfg: Config, max_grad_norm: float, split: bool = False) -> dict:
    """The RSS training peak of step 3 of a first run (with `split`, its step 4 split into the plan's categories),
    then the tensor peak of step 2 of a second run, profiled from before its model existed (benchmarks/README.md)."""
    # NOTE: RSS first: the profiler keeps memory of its own that later steps would count (+10-20 MiB seen).
    run = build_run(cfg, max_grad_norm)
    real_step(run, cfg, max_grad_norm)
    real_step(run, cfg, max_grad_norm)
    rss = rss_at_rest()
    real_step(run, cfg, max_grad_norm)
    rss["rss_peak_bytes"] = h.proc_status_bytes("VmHWM")
    if cfg.offload != "none":
        return offload_measure(run, cfg, max_grad_norm, rss)
    split_out = tracked_step(run, cfg, max_grad_norm) if split else None
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
    out |= rss_fields(rss, out["end_bytes"])
    if split_out is not None:
        out["split"] = split_out
    if run.layerwise is not None:
        out["norm_pass"] = h.norm_pass_name(run.layerwise)
        run.layerwise.detach()
    return out


def tracked_step(run: SimpleNamespace, cfg: Config, max_grad_norm: float) -> dict:
    """One more step under the plan's `LiveBytes` on real tensors: the real peak by category and when it falls."""
    tracker, lw = LiveBytes(), run.layerwise
    if lw is not None:
        lw.detach()  # the tracker's gradient hooks must run before the ones that free `.grad`
    handles = tracker.watch_model(run.model)
    tracker.track_tensors(h.optimizer_state_tensors(run.optimizer).values(), OPTIMIZER_STATE)
    for name, opt in zip(lw.names, lw.inner) if lw is not None else [("optimizer.step()", run.optimizer)]:
        handles += tracker.watch_optimizer(getattr(opt, "optimizer", opt), name)
    if lw is not None:
        lw.attach()
    tracker.reset_peak()
    with tracker:
        real_step(run, cfg, max_grad_norm)
    for handle in handles:
        handle.remove()
    return {"peak_bytes": tracker.peak.total, "categories": tracker.peak.by_category, "when": tracker.peak.phase}


def offload_measure(run: SimpleNamespace, cfg: Config, max_grad_norm: float, rss: dict) -> dict:
    """An offload run's tensor peak: one more step under the plan's `LiveBytes` on the real tensors, on every thread.

    The profiler records the allocations and frees of the thread that started it only (torch 2.13: its
    `profile_all_threads` option records no memory events at all), and offload's copy thread frees each device gradient
    once it is copied out while its host worker allocates the host steps' states and temporaries. `LiveBytes` sees
    every storage allocated on the main thread and on the host worker (its dispatch mode is pushed there) and every
    free on any thread (a storage's finalizer): device and host sides apart, the host side being the host buffers,
    host copies and states at the start and what the worker and `host_empty_like` allocate."""
    out = host_side(run.layerwise)
    h.settle()
    tracker, lw = LiveBytes(), run.layerwise
    lw.detach()  # the tracker's gradient hooks must run before the ones that free `.grad`
    handles = tracker.watch_model(run.model)
    hosted = host_tensors(lw)
    with tracker.on_host():
        for category, tensors in ((WEIGHTS, "copies"), (GRADIENTS, "gradients"), (OPTIMIZER_STATE, "states")):
            tracker.track_tensors(hosted[tensors], category)
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
    out.update(rss_fields(rss, out["end_bytes"]))
    lw.detach()
    return out


def host_tensors(layerwise) -> dict:
    """The host-side tensors of an offload run: parameter copies, gradient buffers, host states."""
    hosted = [inner for inner in layerwise.inner if isinstance(inner, HostStepOptimizer)]
    offload = offload_of(layerwise)
    grads = [*offload.host.values(), *offload.staging.blocks]  # each parameter's buffer, the staging blocks
    shared = {id(g) for g in grads}  # a host step's gradient buffer is the offload's, when it has one
    grads += [i.host_grad for i in hosted if i.host_grad is not None and id(i.host_grad) not in shared]
    states = [t for i in hosted for s in i.base.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"copies": [i.host for i in hosted], "gradients": grads, "states": states}


def host_side(layerwise) -> dict:
    """An offload run's host-side storages now: the host states, the host copies of the parameters, the gradient
    buffers (`GradientOffload.host` and each host step's `host_grad`)."""
    wait_for_host_steps(layerwise)
    return {f"host_{k}_bytes": h.storage_bytes(v) for k, v in
            zip(("copy", "gradient", "state"), host_tensors(layerwise).values())}  # fmt: skip


# ---- the plan ----


def planned(cfg: Config, max_grad_norm: float) -> dict:
    extra = {} if cfg.world_size == 1 else dict(world_size=cfg.world_size, sharding=cfg.sharding)
    extra |= {"offload": cfg.offload} if cfg.offload != "none" else {}
    result = plan(MODELS[cfg.model], [cfg.optim], seq_len=cfg.seq_len, micro_batch=cfg.micro_batch,
                  grad_accum=cfg.grad_accum, max_grad_norm=max_grad_norm, bf16=cfg.bf16, fp16=cfg.fp16,
                  gradient_checkpointing=cfg.checkpointing, lora_r=cfg.lora_r, device="cpu", counterparts=False,
                  **extra)  # fmt: skip
    row = result.rows[0]
    out = {"peak_bytes": row.peak_bytes, "categories": row.categories, "when": row.when, "seconds": result.seconds,
           "optimizer_state_from_rule": row.optimizer_state_from_rule}  # fmt: skip
    if cfg.offload != "none":
        # On a CPU the device and the host are one memory: a run is compared with the joint peak.
        out |= {"device_peak_bytes": row.peak_bytes, "host_peak_bytes": row.host_peak_bytes,
                "host_categories": row.host_categories, "combined_peak_bytes": row.combined_peak_bytes}  # fmt: skip
    return out


def compared_bytes(plan_: dict) -> int:
    """The planned figure a CPU run is compared with: the peak, or with offload the device + host peak."""
    return plan_.get("combined_peak_bytes", plan_["peak_bytes"])


# ---- 2 ranks: Trainer under `accelerate launch` (runs inside the launched ranks) ----


def rank_worker(opts: argparse.Namespace) -> None:
    """One rank of a 2-rank configuration, Trainer (or LayerwiseTrainer) for `--rank_steps` steps, the last measured:
    `--measure tensor` counts the CPU allocator on every thread from before the model exists (each step's peak is
    kept); `--measure rss` (a launch of its own, as on one process) measures by RSS."""
    h.limit_mmap_threshold()
    torch.set_num_threads(1)
    cfg, steps = Config(**json.loads(opts.config)), opts.rank_steps
    counter = _thread_memory.CountingAllocator() if opts.measure == "tensor" else None
    measured, rss = [], {}

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            # NOTE: Trainer counts finished steps: global_step is k - 1 when step k begins.
            if counter is not None:
                measured.append({"start_bytes": counter.current()})
                counter.reset_peak()
            elif state.global_step == steps - 1:
                rss.update(rss_at_rest())

        def on_step_end(self, args, state, control, **kwargs):
            if counter is not None:
                measured[-1].update(peak_bytes=counter.peak(), end_bytes=counter.current())
            elif state.global_step == steps:
                rss["rss_peak_bytes"] = h.proc_status_bytes("VmHWM")

    args = h.training_args(cfg.optim, str(Path(opts.result).parent / "trainer_output"), max_steps=steps,
                           per_device_train_batch_size=cfg.micro_batch, gradient_accumulation_steps=cfg.grad_accum,
                           max_grad_norm=opts.max_grad_norm, bf16=cfg.bf16, fp16=cfg.fp16, logging_steps=1000,
                           gradient_checkpointing=cfg.checkpointing, save_strategy="no",
                           gradient_checkpointing_kwargs={"use_reentrant": False}, disable_tqdm=True,
                           dataloader_num_workers=0)  # fmt: skip
    data = h.TokenRows(MODELS[cfg.model]["vocab_size"], cfg.seq_len, 2 * cfg.micro_batch * cfg.grad_accum * steps)
    trainer = h.trainer(build_model(cfg), args, data, [Probe()])
    h.check_distributed(trainer.accelerator, cfg.sharding)
    trainer.train()
    lw = getattr(trainer, "layerwise_optimizer", None)
    result = {"rank": trainer.accelerator.process_index, **rss, "route": None if lw is None else lw.route,
              "optimizer_state_bytes": h.storage_bytes(h.optimizer_state_tensors(trainer.optimizer)),
              "norm_pass": None if lw is None else h.norm_pass_name(lw)}  # fmt: skip
    if counter is not None:
        result.update(measured[-1], step_peak_bytes=[s["peak_bytes"] for s in measured])
    trainer.accelerator.free_memory()
    del trainer
    h.write_gathered_and_finish(opts.result, result)


def launch_ranks(cfg: Config, opts: argparse.Namespace) -> dict:
    """`cfg` on 2 gloo ranks under its Accelerate config, twice (tensor peak, then RSS: see `rank_worker`); the rank
    with the higher tensor peak, and both ranks."""
    _thread_memory.build()  # once, here, rather than in both ranks at the same time
    env = h.worker_env(threads=1, sharding=cfg.sharding)
    runs = {}
    for measure in ("tensor", "rss"):
        with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
            result = Path(tmp) / "ranks.json"
            args = ["--worker", "--measure", measure, "--config", json.dumps(cfg._asdict()), "--result", str(result),
                    "--max_grad_norm", str(opts.max_grad_norm), "--rank_steps", str(opts.rank_steps)]  # fmt: skip
            launcher = ["--config_file", h.ROOT / ACCELERATE_CONFIGS[cfg.sharding]]
            runs[measure] = h.launch_ranks(Path(__file__).resolve(), launcher, args, result, opts.timeout, env)
    per_rank = [{**t, **rss_fields(r, t["end_bytes"])} for t, r in zip(runs["tensor"], runs["rss"])]
    return {**max(per_rank, key=lambda r: r["peak_bytes"]), "ranks": per_rank}


def measure_config(cfg: Config, opts: argparse.Namespace) -> dict:
    """The real run (this process, or 2 launched ranks) and the plan of `cfg`."""
    started = time.perf_counter()
    if cfg.offload != "none":  # a CPU run of offload as a GPU runs it (copy thread, worker, host buffers)
        os.environ[transfer_module.SIMULATE_ENV] = "1"
    real = measure_real(cfg, opts.max_grad_norm, split=opts.split) if cfg.world_size == 1 else launch_ranks(cfg, opts)
    real["seconds"] = time.perf_counter() - started
    plan_ = planned(cfg, opts.max_grad_norm)
    return {"config": cfg._asdict(), "name": cfg.name, "real": real, "plan": plan_,
            "error": compared_bytes(plan_) / real["peak_bytes"] - 1,
            "rss_error": compared_bytes(plan_) / real["rss_training_peak_bytes"] - 1}  # fmt: skip


# ---- the report ----


def summary(rows: list[dict]) -> dict:
    scored = [r for r in rows if r.get("error") is not None]
    errors, rss_errors = [abs(r["error"]) for r in scored], [abs(r["rss_error"]) for r in scored]
    return {"configurations": len(rows), "compared": len(scored), "within_goal": sum(e <= GOAL for e in errors),
            "within_rss_goal": sum(e <= RSS_GOAL for e in rss_errors),
            "within_both": sum(e <= GOAL and r <= RSS_GOAL for e, r in zip(errors, rss_errors)),
            "largest_error": max(errors, default=None),
            "largest_rss_error": max(rss_errors, default=None)}  # fmt: skip


def report_of(rows: list[dict], **run) -> dict:
    stats = summary(rows)
    models = {c["config"]["model"] for c in rows}
    return {"goal": GOAL, "rss_goal": RSS_GOAL, **stats, "summary": stats, "rows": rows,
            "models": {k: v for k, v in MODELS.items() if k in models}, **run}  # fmt: skip


COLUMNS = [
    ("configuration", 50, lambda r: r["name"]), ("plan MiB", 9, lambda r: h.mib(compared_bytes(r["plan"]))),
    ("tensor MiB", 10, lambda r: h.mib(r["real"]["peak_bytes"])), ("error", 7, lambda r: h.pct(r["error"])),
    ("RSS MiB", 8, lambda r: h.mib(r["real"]["rss_training_peak_bytes"])),
    ("RSS error", 9, lambda r: h.pct(r["rss_error"])),
    ("state real", 10, lambda r: h.mib(r["real"]["optimizer_state_bytes"])),
    ("state plan", 10, lambda r: h.mib(r["plan"]["categories"]["optimizer_state"])
     + "*" * r["plan"]["optimizer_state_from_rule"]),
    ("plan: peak falls at", 44, lambda r: r["plan"]["when"][:44], "<"),
]  # fmt: skip


def print_report(report: dict) -> None:
    rows = [r for r in report["rows"] if r.get("error") is not None]
    h.print_rows(rows, COLUMNS, f"\nplanned peak vs the real run (CPU, steady-state step): tensor peak (allocator "
                 f"events), goal within {GOAL:.0%}; RSS training peak, goal within {RSS_GOAL:.0%}")  # fmt: skip
    for r in report["rows"]:
        if r.get("error") is None:
            print(f"{r['name']}: {str(r['real'].get('error')).splitlines()[0][:200]}")
    print("* optimizer state from the estimator's rules (bitsandbytes); its CPU step temporaries from a measured rule")
    print(f"{report['within_goal']}/{report['compared']} within {GOAL:.0%} of the tensor peak, "
          f"{report['within_rss_goal']}/{report['compared']} within {RSS_GOAL:.0%} of the RSS training peak, "
          f"{report['within_both']} both")  # fmt: skip
    for r in rows:
        plan_, real = r["plan"], r["real"]
        if "host_peak_bytes" in plan_:
            print(f"{r['name']}: device peak planned / real {h.mib(plan_['device_peak_bytes'])} / "
                  f"{h.mib(real['device_peak_bytes'])} MiB, host peak {h.mib(plan_['host_peak_bytes'])} / "
                  f"{h.mib(real['host_peak_bytes'])}, host states {h.mib(plan_['host_categories']['optimizer_state'])}"
                  f" / {h.mib(real['host_state_bytes'])}, host copies {h.mib(plan_['host_categories']['weights'])} / "
                  f"{h.mib(real['host_copy_bytes'])}")  # fmt: skip


def kind_of(r: dict) -> str:
    c = r["config"]
    if c["sharding"] != "none" or c.get("offload", "none") != "none":
        return "2 ranks" if c["sharding"] != "none" else "host offload (device + host)"
    if r["plan"]["optimizer_state_from_rule"]:
        return "bitsandbytes (state: rule)"
    return "layer-wise" if c["optim"].endswith("_layerwise") else "standard"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if r.get("error") is not None]
    kinds = sorted({kind_of(r) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(15, 7.5))
    panels = (("peak_bytes", GOAL, "measured peak of live tensor bytes (MiB)"),
              ("rss_training_peak_bytes", RSS_GOAL, "measured RSS training peak (MiB)"))  # fmt: skip
    for ax, (key, goal, label) in zip(axes, panels):
        points = [(r["real"][key] / h.MIB, compared_bytes(r["plan"]) / h.MIB, kind_of(r)) for r in rows]
        top = max(max(x, y) for x, y, _ in points) * 1.08
        ax.plot([0, top], [0, top], color="black", lw=0.8)
        ax.fill_between([0, top], [0, top * (1 - goal)], [0, top * (1 + goal)], color="tab:green", alpha=0.15,
                        label=f"within {goal:.0%}")  # fmt: skip
        for k, kind in enumerate(kinds):
            ax.scatter(*zip(*[(x, y) for x, y, w in points if w == kind]), color=f"C{k}", marker="osD^v"[k % 5], s=28,
                       label=kind, zorder=3)  # fmt: skip
        ax.set(xlim=(0, top), ylim=(0, top), xlabel=label, ylabel="planned peak (MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"layerwise-hf plan vs real CPU runs, one point per configuration: {report['within_goal']}/"
                 f"{report['compared']} within {GOAL:.0%} of the tensor peak, {report['within_rss_goal']}/"
                 f"{report['compared']} within {RSS_GOAL:.0%} of the RSS training peak", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


RUN_FIELDS = ("plan_source", "torch", "python", "wall_time_s")  # what a report says of the run that made it


def merge(paths: list[str], output_dir: str) -> dict:
    """The report in `output_dir` (if any) with the rows of the reports at `paths`: a later report's row replaces
    the row of the same name; rows in `configurations()` order; `measured_in` says which run each row comes from."""
    base = Path(output_dir) / "plan_accuracy.json"
    rows, origin, runs = {}, {}, []
    for path in ([base] if base.is_file() else []) + [Path(p) for p in paths]:
        report = json.loads(path.read_text())
        names = [r["name"] for r in report["rows"]]
        # A merged report says which run each row comes from; a run's report is one run.
        for part in report.get("measured_in") or [{"rows": names, **{k: report.get(k) for k in RUN_FIELDS}}]:
            runs.append({k: part.get(k) for k in RUN_FIELDS})
            origin |= {name: len(runs) - 1 for name in part["rows"]}
        rows |= {r["name"]: r for r in report["rows"]}
    order = {c.name: k for k, c in enumerate(configurations())}
    merged = sorted(rows.values(), key=lambda r: order.get(r["name"], len(order)))
    measured_in = [{"rows": [r["name"] for r in merged if origin[r["name"]] == k], **run}
                   for k, run in enumerate(runs)]  # fmt: skip
    return report_of(merged, measured_in=[m for m in measured_in if m["rows"]])


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
    parser.add_argument("--merge", nargs="+", metavar="REPORT", help="put these reports' rows into the report in "
                        "--output_dir (rows of the same name replaced); summary and figure made again")  # fmt: skip
    for name in ("config", "result", "measure"):  # the launched ranks'
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.worker:
        rank_worker(opts)
        return 0
    if opts.merge:
        report = merge(opts.merge, opts.output_dir)
    else:
        configs = {c.name: c for c in (SMALL if opts.small else QUICK if opts.quick else configurations())
                   if not opts.only or any(re.search(p, c.name) for p in opts.only)}  # fmt: skip
        if not configs:
            raise SystemExit(f"--only {opts.only}: no configuration matches (see --list)")
        if opts.list:
            print("\n".join(configs))
            return 0
        torch.set_num_threads(1)
        started = time.perf_counter()
        results = h.fork_each(list(configs), lambda n: measure_config(configs[n], opts), opts.timeout, "ran")
        rows = [r if "name" in r else {"name": n, "config": configs[n]._asdict(), "real": r}
                for n, r in results.items()]  # fmt: skip
        git = lambda *a: subprocess.run(["git", *a], cwd=h.ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
        # The commit the planner was read from, and whether its files had changes not committed yet.
        source = {"commit": git("rev-parse", "HEAD"),
                  "uncommitted": git("status", "--porcelain", "--", "layerwise_hf/plan")}  # fmt: skip
        report = report_of(rows, plan_source=source, torch=torch.__version__, python=h.python_version(),
                           wall_time_s=time.perf_counter() - started)  # fmt: skip
    print_report(report)
    h.write_report(opts.output_dir, "plan_accuracy", report, plot if report["compared"] else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
