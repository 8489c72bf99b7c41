"""The GPU check: the layer-wise optimizers on one CUDA device, against the standard ones, in one run of under six
minutes. Run it through `bash benchmarks/gpu_check.sh`, or `--tiny` for the CPU dry run. The checks, their criteria,
the JSON and the exit status: benchmarks/README.md."""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import inspect
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

# Before torch initialises CUDA: cuBLAS is deterministic only with a fixed workspace.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:  # what the check needs besides torch (bitsandbytes is optional: its checks are skipped without it)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PrinterCallback, TrainerCallback

    from benchmarks import _common as h
    from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments
    from layerwise_hf.platform.compat import checkpointing_kwargs
except ImportError as e:
    print(f"gpu_check: FAILED TO START: cannot import what the check needs: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(2)

# In the order they run: what issue 28 asks of a first GPU run comes first, in case the time limit cuts the rest.
CHECKS = ("parity", "offload", "fsdp2_8bit", "sanitizer", "memory")
NEEDS_BNB = ("fsdp2_8bit",)  # every run is 8-bit; the others skip only their 8-bit runs
PARITY_OPTIMS = ("adamw_torch", "adamw_8bit", "sgd", "fp16")  # fp16: adamw_torch with fp16=True
MAX_GRAD_NORM = 1.0  # Trainer's default; with layerwise_clip="exact"
KEEP_DEVICE_SYNC_ENV = "LAYERWISE_HF_BNB_DEVICE_SYNC"  # layerwise_hf.platform.streams: "1" keeps bitsandbytes' syncs
CSAN_ENV = "GPU_CHECK_CSAN"  # "1": the process enables torch's CUDA sanitizer before its first CUDA op
DELAY_CYCLES = 20_000_000  # a reduce-scatter that ends late (FSDP2): ~10 ms of torch.cuda._sleep, far over a step
COPY_DELAY_CYCLES = 2_000_000  # ~1 ms before every offload copy, each direction (the offload check)
# The memory check's ~1B runs, one process: (label, optim, layerwise_offload, max_grad_norm, BNB_DEVICE_SYNC=1).
# The 8-bit runs without clipping (one backward per step on both sides, so the times compare the steps); the host
# offload runs with exact clipping (the gradients wait on the host).
MEMORY_RUNS = (("adamw_8bit", "adamw_8bit", None, 0.0, False),
               ("adamw_8bit_layerwise", "adamw_8bit_layerwise", None, 0.0, False),
               ("adamw_8bit_layerwise bnb sync", "adamw_8bit_layerwise", None, 0.0, True),
               ("adamw_torch", "adamw_torch", None, MAX_GRAD_NORM, False),
               ("adamw_torch_layerwise", "adamw_torch_layerwise", "none", MAX_GRAD_NORM, False),
               ("adamw_torch_layerwise offload=gradients", "adamw_torch_layerwise", "gradients", MAX_GRAD_NORM,
                False),
               ("adamw_torch_layerwise offload=optimizer", "adamw_torch_layerwise", "optimizer", MAX_GRAD_NORM,
                False))  # fmt: skip
# Offload parity on the small model: (mode, GA, max_grad_norm). Clipping off is the case where the host steps run in
# backward and the copies back go on beside it, on both of CudaTransfer's streams.
OFFLOAD_CASES = (("gradients", 1, MAX_GRAD_NORM), ("optimizer", 1, MAX_GRAD_NORM), ("gradients", 2, MAX_GRAD_NORM),
                 ("optimizer", 2, MAX_GRAD_NORM), ("optimizer", 1, 0.0))  # fmt: skip
SANITIZER_CASES = (("optimizer", 1, 0.0), ("gradients", 2, MAX_GRAD_NORM))  # short runs under CSAN, as above

# Sizes of the full (CUDA) run and of --tiny (CPU dry run). The small model keeps every decoder matrix >= 4096
# elements so bitsandbytes really keeps 8-bit state for them (its embeddings stay 32-bit either way). Timeouts are
# per subprocess, and never past --time_limit.
TINY_MODEL = h.LLAMA_TINY | dict(num_key_value_heads=2)
SIZES = {
    "full": dict(
        small_model=dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2),
        small_seq=64, small_batch=4, parity_steps=6, fp16_overflow_step=2,
        fsdp_steps=4, fsdp_timeout=150, sanitizer_steps=2, sanitizer_timeout=120,
        memory_model=dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                          num_attention_heads=32, num_key_value_heads=4),
        memory_seq=512, memory_batch=4, memory_steps=6, memory_warmup=2, memory_timeout=180),
    "tiny": dict(
        small_model=TINY_MODEL, small_seq=16, small_batch=2, parity_steps=4, fp16_overflow_step=2,
        fsdp_steps=3, fsdp_timeout=240, sanitizer_steps=2, sanitizer_timeout=240,
        memory_model=TINY_MODEL, memory_seq=32, memory_batch=2, memory_steps=3, memory_warmup=1, memory_timeout=400),
}  # fmt: skip
# Seconds each check is planned to take on one H200, 300 in all (estimates: none was run on a GPU yet; a process of the
# ~1B model is ~12 s of imports and CUDA start-up, ~3 s to build, steps of ~0.2 s). Subprocesses stop at --time_limit.
CHECK_BUDGET_S = {
    "parity": 60,  # 16 Trainer runs of 6 steps on the 13M Llama, CUDA and cuBLAS start-up included
    "offload": 30,  # 8 Trainer runs of 6 steps on the 13M Llama (host AdamW for 'optimizer')
    "fsdp2_8bit": 45,  # 1 accelerate launch (imports, NCCL, 2 runs of 4 steps with ~10 ms of sleep a step)
    "sanitizer": 45,  # 1 process of 2 short runs and 1 accelerate launch, every CUDA op checked in Python
    "memory": 105,  # 1 process, 7 runs of 6 steps of the ~1B model (host AdamW ~1 s a step); the plan runs beside it
}


class Terminated(BaseException):
    """SIGTERM / SIGINT (the time limit): stop, but write what was measured first."""


def _terminate(signum, frame):
    raise Terminated(signal.Signals(signum).name)


def llama_config(sizes: dict, seq: int, attn: str) -> LlamaConfig:
    config = LlamaConfig(**sizes, max_position_embeddings=seq, tie_word_embeddings=False)
    config._attn_implementation = attn
    return config


def token_dataset(n: int, seq: int, vocab: int, seed: int = 1) -> list[dict]:
    """Next token = previous + 1 with 10% noise: a learnable pattern, so losses and gradients move."""
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randint(0, vocab, (n, 1), generator=g) + torch.arange(seq)) % vocab
    noise = torch.rand(n, seq, generator=g) < 0.1
    ids[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def training_args(output_dir, optim: str, device: str, **overrides) -> LayerwiseTrainingArguments:
    kwargs = dict(output_dir=str(output_dir), optim=optim, learning_rate=1e-2, weight_decay=0.1,
                  lr_scheduler_type="cosine", warmup_steps=0, max_steps=6, per_device_train_batch_size=4,
                  gradient_accumulation_steps=1, max_grad_norm=MAX_GRAD_NORM, layerwise_clip="exact", logging_steps=1,
                  save_strategy="no", report_to="none", use_cpu=device == "cpu", seed=0, data_seed=0,
                  disable_tqdm=True, dataloader_num_workers=0)  # fmt: skip
    return LayerwiseTrainingArguments(**{**kwargs, **overrides})


def make_trainer(model, args, dataset, callbacks=(), device="cuda"):
    """Trainer or LayerwiseTrainer, each callback's `trainer` set."""
    trainer = h.trainer(model, args, dataset, callbacks)
    trainer.remove_callback(PrinterCallback)  # every log line is in the JSON; keep the output to the table
    for callback in callbacks:
        callback.trainer = trainer
    if args.fp16 and device == "cpu":
        # Accelerate creates a GradScaler (and fp16 autocast) only on accelerator devices; on CPU give the
        # accelerator torch's CPU GradScaler, as tests/test_fp16.py does: the same object and calls as with CUDA.
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
        trainer.accelerator.native_amp = True
    return trainer


def train_one(optim, base_model, dataset, device, callbacks=(), **overrides):
    """`optim` trained from a copy of `base_model` (LayerwiseTrainer for a layer-wise name)."""
    with tempfile.TemporaryDirectory() as out:
        args = training_args(out, optim, device, **overrides)
        trainer = make_trainer(copy.deepcopy(base_model), args, dataset, callbacks, device=device)
        trainer.train()
    return trainer


def small_setup(sizes: dict, steps_key: str, ga: int = 1):
    """The small model's config, its random model, and a dataset of `sizes[steps_key]` steps at `ga`."""
    config = llama_config(sizes["small_model"], sizes["small_seq"], attn="eager")
    n = sizes["small_batch"] * ga * sizes[steps_key]
    torch.manual_seed(0)
    return config, LlamaForCausalLM(config), token_dataset(n, sizes["small_seq"], config.vocab_size)


def logged(trainer, key: str) -> list[float]:
    return [e[key] for e in trainer.state.log_history if key in e and "train_runtime" not in e]


def param_diff(a, b) -> tuple[float, bool]:
    """Largest absolute difference over all parameters, and whether every parameter is bit-identical."""
    pa, pb, worst, exact = dict(a.named_parameters()), dict(b.named_parameters()), 0.0, True
    for name in pa:
        exact = exact and torch.equal(pa[name], pb[name])
        worst = max(worst, float((pa[name].detach().float() - pb[name].detach().float()).abs().max()))
    return worst, exact


def update_diff(before, standard, layerwise) -> dict:
    """Per parameter |(w_lw - w0) - (w_std - w0)| / |w_std - w0| (L2 norms, float64): the largest, and where. A wrongly
    scaled clip moves SGD's updates by the scale's error and AdamW's by far less, but never by nothing."""
    rel = {}
    for (name, w0), ws, wl in zip(before.named_parameters(), standard.parameters(), layerwise.parameters()):
        d_std, d_lw = (w.detach().double().cpu() - w0.detach().double().cpu() for w in (ws, wl))
        num, den = float((d_lw - d_std).norm()), float(d_std.norm())
        rel[name] = num / den if den > 0 else (0.0 if num == 0 else math.inf)
    worst = max(rel, key=rel.get)
    return {"update_max_rel_diff": rel[worst], "update_worst_param": worst}


def list_diff(a: list, b: list) -> float | None:
    """Largest difference of two logged lists (nan == nan, "nan" read as nan); None if of unlike lengths."""
    pairs = [(float(x), float(y)) for x, y in zip(a, b)] if len(a) == len(b) else None
    diffs = [0.0 if x == y or math.isnan(x) and math.isnan(y) else abs(x - y) for x, y in pairs or []]
    return None if pairs is None else max([math.inf if math.isnan(d) else d for d in diffs], default=0.0)


def finite(obj):
    """A copy JSON can hold: nan / inf floats become strings ("nan", "inf")."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def compare_runs(base_model, std, lw, steps: int, criterion: str, opts) -> dict:
    """Layer-wise vs standard trained from `base_model`: `criterion` "bit-exact" or "update_rtol" (updates and
    grad_norm within `--update_rtol`). Without clipping Trainer logs no grad_norm: every step's loss must be logged."""
    diff, exact = param_diff(std.model, lw.model)
    norms_std, norms_lw = logged(std, "grad_norm"), logged(lw, "grad_norm")
    norm_diff = list_diff(norms_std, norms_lw)
    scale = max([1.0, *[abs(n) for n in norms_std if math.isfinite(n)]])
    out = dict(criterion=criterion, max_abs_param_diff=diff, exact=exact, **update_diff(base_model, std.model,
               lw.model), grad_norm_max_abs_diff=norm_diff, steps_logged=len(logged(std, "loss")))  # fmt: skip
    complete = out["steps_logged"] == steps == len(logged(lw, "loss")) and norm_diff is not None
    close = out["update_max_rel_diff"] <= opts.update_rtol and complete and norm_diff <= opts.update_rtol * scale
    out["passed"] = bool(complete and exact and norm_diff == 0.0) if criterion == "bit-exact" else bool(close)
    out["clipped_steps"] = sum(n > MAX_GRAD_NORM for n in norms_std if math.isfinite(n))
    return out


def state_bytes_by_device(trainer) -> dict[str, int]:
    """The optimizer state's bytes per device type, each storage once (bitsandbytes shares its quantization maps)."""
    tensors = h.optimizer_state_tensors(trainer.optimizer).values()
    return {d: h.storage_bytes(t for t in tensors if t.device.type == d) for d in {t.device.type for t in tensors}}


def cleanup(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def attempt(cases: list, case: dict, save, device: str | None = None):
    """`case` appended to `cases`; an exception in the block becomes its `error` (and `passed=False`): a failing case
    keeps the others' numbers. Then the device is emptied and `save()` writes the JSON."""
    cases.append(case)
    try:
        yield case
    except Exception:
        case.update(error=traceback.format_exc(), passed=False)
    finally:
        if device is not None:
            cleanup(device)
        save()


def time_left(opts) -> float:
    """Seconds left before `--time_limit` (inf without one)."""
    return math.inf if opts.deadline is None else opts.deadline - time.monotonic()


def budget(opts, timeout: float) -> float:
    """`timeout`, or 10 s before `--time_limit` if that comes first; a subprocess with under 20 s is not started."""
    seconds = min(timeout, time_left(opts) - 10)
    if seconds < 20:
        raise TimeoutError(f"not started: {max(0, round(time_left(opts)))} s left of --time_limit")
    return seconds


def enable_sanitizer(device: str) -> bool:
    """With `GPU_CHECK_CSAN=1` on CUDA: torch's CUDA sanitizer checks every kernel of this process from here on (it
    raises `CUDASanitizerErrors` at the first unsynchronized access). Whether it is on."""
    if os.environ.get(CSAN_ENV) == "1" and device.startswith("cuda"):
        import torch.cuda._sanitizer as csan

        csan.enable_cuda_sanitizer()
        sanitize_host_worker(csan)
        return True
    return False


def sanitize_host_worker(csan) -> None:
    """CSAN's dispatch mode is entered on the thread that enabled it: the host worker's copies back and host steps
    would go unchecked. Each of the worker's tasks runs under a mode that hands every op to the same CSAN mode, so one
    happens-before model sees both threads; one lock for both, as CSAN's handler is not thread-safe."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from layerwise_hf.placement.offload import HostWorker

    dispatch, lock, submit = csan.cuda_sanitizer.dispatch, threading.Lock(), HostWorker.submit
    original = type(dispatch).__torch_dispatch__

    def locked(self, func, types, args=(), kwargs=None):
        with lock:
            return original(self, func, types, args, kwargs)

    type(dispatch).__torch_dispatch__ = locked

    class InWorker(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return locked(dispatch, func, types, args, kwargs)

    def checked(fn, *args):
        with InWorker():
            return fn(*args)

    HostWorker.submit = lambda self, fn, *args: submit(self, checked, fn, *args)


class Overflow(TrainerCallback):
    """Step `at_step` (0-based) overflows (the input embedding's output times inf); what it changed, every scale."""

    def __init__(self, at_step: int):
        self.at_step, self.active, self.trainer, self.scales, self.changed = at_step, False, None, [], None

    def on_train_begin(self, args, state, control, **kwargs):
        hook = lambda module, inputs, output: output * float("inf") if self.active else output  # noqa: E731
        self.trainer.model.get_input_embeddings().register_forward_hook(hook)

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = state.global_step == self.at_step
        if self.active:
            self.before = {n: p.detach().clone() for n, p in self.trainer.model.named_parameters()}

    def on_step_end(self, args, state, control, **kwargs):
        self.scales.append(float(self.trainer.accelerator.scaler.get_scale()))
        if self.active:
            self.active = False
            params = {n: p.detach() for n, p in self.trainer.model.named_parameters()}
            self.changed = [n for n, p in params.items() if not torch.equal(p, self.before.pop(n))]

    def summary(self) -> dict:
        """The injected step skipped: a non-finite norm logged, no weight changed, the scale halved."""
        norms, at, scales = logged(self.trainer, "grad_norm"), self.at_step, self.scales
        injected = norms[at] if len(norms) > at else math.nan
        return {"scales": scales, "injected_grad_norm": finite(injected), "changed_on_injected_step": self.changed,
                "injected_step_skipped": not math.isfinite(injected) and self.changed == [] and len(scales) > at
                and scales[at] == scales[at - 1] / 2}  # fmt: skip


def check_parity(opts, sizes, device, record) -> dict:
    """Bit-exact weights and grad_norm (fp32, deterministic algorithms, eager attention, the same kernels); fp16
    (autocast, the accelerator's GradScaler): updates within --update_rtol, an injected overflow skipped by both."""
    steps, batch = sizes["parity_steps"], sizes["small_batch"]
    result = {"model": sizes["small_model"], "seq": sizes["small_seq"], "batch": batch, "steps": steps,
              "max_grad_norm": MAX_GRAD_NORM, "layerwise_clip": "exact", "cases": []}  # fmt: skip
    record(result)
    for optim in opts.parity_optims:
        for ga in (1, 2):
            case = {"name": f"parity {optim} GA{ga}", "optim": optim, "ga": ga}
            with attempt(result["cases"], case, lambda: record(result), device):
                if "8bit" in optim and opts.no_bnb:
                    case.update(skipped=True, reason=opts.no_bnb)
                    continue
                fp16, base = optim == "fp16", "adamw_torch" if optim == "fp16" else optim
                _, base_model, dataset = small_setup(sizes, "parity_steps", ga)
                watch = [Overflow(sizes["fp16_overflow_step"]) for _ in "ab"] if fp16 else []
                common = dict(max_steps=steps, per_device_train_batch_size=batch, gradient_accumulation_steps=ga,
                              **(dict(fp16=True, learning_rate=1e-3) if fp16 else {}))  # fmt: skip
                std = train_one(base, base_model, dataset, device, watch[:1], **common)
                lw = train_one(f"{base}_layerwise", base_model, dataset, device, watch[1:], **common)
                case.update(compare_runs(base_model, std, lw, steps, "update_rtol" if fp16 else "bit-exact", opts),
                            grad_norm_standard=finite(logged(std, "grad_norm")),
                            grad_norm_layerwise=finite(logged(lw, "grad_norm")))  # fmt: skip
                if fp16:
                    watched = {"standard": watch[0].summary(), "layerwise": watch[1].summary()}
                    case.update(watched, scales_equal=watch[0].scales == watch[1].scales)
                    case["overflow_step_skipped"] = all(case[k]["injected_step_skipped"] for k in watched)
                    case["passed"] = case["passed"] and case["overflow_step_skipped"] and case["scales_equal"]
    result["passed"] = all(c.get("passed") for c in result["cases"] if not c.get("skipped"))
    return result


class HandRun(TrainerCallback):
    """Each local shard's start and every step's local gradient and settings, replayed by hand after training.

    Before each step the gradient is made late on purpose, as a reduce-scatter still running would be: zeroed, then
    written back after `torch.cuda._sleep` on the stream the hook runs on (FSDP2's reduce-scatter stream). A step not
    ordered after that stream reads the zeros, and its shard no longer equals the replay."""

    def __init__(self):
        self.trainer, self.records, self.cuda_steps, self.off_default_stream, self.delayed = None, {}, 0, 0, 0

    def on_train_begin(self, args, state, control, **kwargs):
        optimizer = self.trainer.layerwise_optimizer
        for name, inner in zip(optimizer.names, optimizer.inner):
            inner.register_step_pre_hook(lambda inner, *_, name=name: self._pre(name, inner))

    def _pre(self, name, inner):
        param = inner.param_groups[0]["params"][0]
        if param.grad is None:
            return
        grad = h.local(param.grad)
        saved = grad.clone()
        grad.zero_()
        if grad.is_cuda:
            torch.cuda._sleep(DELAY_CYCLES)
            self.cuda_steps += 1
            self.off_default_stream += torch.cuda.current_stream() != torch.cuda.default_stream()
        grad.copy_(saved)
        self.delayed += 1
        record = self.records.setdefault(name, {"start": h.local(param).detach().clone(), "inner": inner, "steps": []})
        group = {k: v for k, v in inner.param_groups[0].items() if k not in ("params", "name")}
        record["steps"].append((saved, group))

    def replay(self) -> tuple[float, bool]:
        from layerwise_hf.bases.params import isolate_bnb_overrides

        worst, exact = 0.0, True
        for record in self.records.values():
            base, local = record["inner"].base, torch.nn.Parameter(record["start"])
            # As tests/distributed does: bitsandbytes keeps its settings in `args`, not in `defaults`.
            accepted, settings = inspect.signature(type(base).__init__).parameters, getattr(base, "args", None)
            kwargs = {k: v for k, v in base.defaults.items() if k in accepted}
            kwargs.update({k: getattr(settings, k) for k in accepted if hasattr(settings, k)})
            by_hand = isolate_bnb_overrides(type(base)([local], **kwargs))
            for grad, group in record["steps"]:
                by_hand.param_groups[0].update(group)
                local.grad = grad
                by_hand.step()
            final = h.local(record["inner"].param_groups[0]["params"][0]).detach()
            if final.numel():
                worst = max(worst, float((final.float() - local.detach().float()).abs().max()))
                exact = exact and torch.equal(final, local.detach())
        return worst, exact


FSDP_CASES = (("ga1 exact clip", {}), ("ga2 no clip", {"gradient_accumulation_steps": 2, "max_grad_norm": 0.0}))


def fsdp_case(sizes: dict, device: str, report_path: str) -> None:
    """One rank: the FSDP_CASES against the replay by hand (GPU_CHECK_CSAN=1: under CSAN), gathered over the ranks."""
    from layerwise_hf.placement.local_shard import LocalShardOptimizer

    csan = enable_sanitizer(device)
    config = llama_config(sizes["small_model"], sizes["small_seq"], attn="eager")
    steps, batch = sizes["sanitizer_steps" if os.environ.get(CSAN_ENV) == "1" else "fsdp_steps"], sizes["small_batch"]
    results = []
    for name, overrides in FSDP_CASES:
        ga = overrides.get("gradient_accumulation_steps", 1)
        with tempfile.TemporaryDirectory() as out:
            # TrainingArguments set up the process group (accelerate's PartialState, CPU or not).
            args = training_args(out, "adamw_8bit_layerwise", device, max_steps=steps,
                                 per_device_train_batch_size=batch, **overrides)  # fmt: skip
            dataset = token_dataset(batch * ga * steps * args.world_size, sizes["small_seq"], config.vocab_size)
            torch.manual_seed(0)
            trainer = make_trainer(LlamaForCausalLM(config), args, dataset, [hand := HandRun()], device=device)
            trainer.train()
        optimizer = trainer.layerwise_optimizer
        wrapped = all(isinstance(inner, LocalShardOptimizer) for inner in optimizer.inner)
        states = [inner.base.state.get(inner.local, {}) for inner in optimizer.inner] if wrapped else []
        cleanup(device)  # the recorded gradients were copied on the hook's stream
        worst, exact = hand.replay() if wrapped else (math.inf, False)
        results.append(dict(
            case=name, ga=ga, max_grad_norm=args.max_grad_norm, steps=steps, csan=csan, route=optimizer.route,
            fsdp_version=getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", None),
            wrapped_local_shard=wrapped, hand_max_diff=worst, hand_bit_exact=exact, stepped_params=len(hand.records),
            cuda_steps=hand.cuda_steps, cuda_steps_off_default_stream=int(hand.off_default_stream),
            delayed_steps=hand.delayed, states_rank0=len(states),
            eight_bit_states_rank0=sum(s.get("state1", torch.empty(0)).dtype == torch.uint8 for s in states),
            loss=finite(logged(trainer, "loss")), grad_norm=finite(logged(trainer, "grad_norm")),
        ))  # fmt: skip
        del trainer, optimizer, hand, states
        cleanup(device)
    env = {k: os.environ.get(k) for k in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", CSAN_ENV)}
    h.write_gathered_and_finish(report_path, finite({"world_size": args.world_size, "env": env, "cases": results}))


def fsdp_launch(world: int, opts, sizes, device: str, csan: bool = False) -> dict:
    """`fsdp_case` on `world` ranks (`accelerate launch`, fp32 and every rank building the model from its config),
    judged: every rank's shards equal the replay by hand of the same optimizer on the same (late) gradients."""
    cpu = not device.startswith("cuda")
    config = ROOT / "configs" / "accelerate" / ("cpu_fsdp2.yaml" if cpu else "gpu_fsdp2.yaml")
    # One OpenMP thread a rank, as torchrun sets by default; gloo ranks forced into FSDP2, as tests/test_fsdp2_8bit.py.
    env = h.worker_env(threads=1, sharding="fsdp2", cpu=cpu) | ({CSAN_ENV: "1"} if csan else {})
    launcher = ["--config_file", config, "--num_processes", world, "--mixed_precision", "no",
                "--fsdp_cpu_ram_efficient_loading", "false"]  # fmt: skip
    t0, timeout = time.perf_counter(), budget(opts, sizes["sanitizer_timeout" if csan else "fsdp_timeout"])
    with tempfile.TemporaryDirectory() as d:
        args = ["--fsdp_case", str(Path(d) / "fsdp.json"), "--device", device] + ["--tiny"] * opts.tiny
        ranks = h.launch_ranks(Path(__file__).resolve(), launcher, args, Path(d) / "fsdp.json", timeout, env)
    # Each case over the ranks: the largest difference, whether all were wrapped and bit-exact, the counts summed.
    out = {**ranks[0], "seconds": round(time.perf_counter() - t0, 1), "cases": [
        {**cases[0], "hand_max_diff": max(float(c["hand_max_diff"]) for c in cases),
         **{k: all(c[k] for c in cases) for k in ("wrapped_local_shard", "hand_bit_exact")},
         **{k: sum(c[k] for c in cases) for k in ("stepped_params", "cuda_steps", "cuda_steps_off_default_stream",
                                                  "delayed_steps")}}
        for cases in zip(*(r["cases"] for r in ranks))]}  # fmt: skip
    for case in out["cases"]:
        case["name"] = f"fsdp2 adamw_8bit x{world} {case['case']}" + (" sanitizer run" * csan)
        # Whether a missing wait could show: the hook ran off the default stream, where bitsandbytes launches.
        case["wait_tested"] = case["cuda_steps_off_default_stream"] > 0 and case["delayed_steps"] > 0
        case["passed"] = bool(case["wrapped_local_shard"] and case["hand_bit_exact"] and case["hand_max_diff"] == 0.0
                              and case["route"] == "fsdp2" and case["fsdp_version"] == 2 and case["delayed_steps"]
                              and case["eight_bit_states_rank0"] > 0 and len(case["loss"]) == case["steps"]
                              and all(isinstance(x, float) for x in case["loss"]))  # fmt: skip
    out["passed"] = out["world_size"] == world and all(c["passed"] for c in out["cases"])
    return out


def check_fsdp2(opts, sizes, device, record) -> dict:
    """One rank on CUDA (gpu_check.sh shows this process one GPU); two gloo ranks in the CPU dry run."""
    record(result := {"model": sizes["small_model"], "steps": sizes["fsdp_steps"], "runs": []})
    for world in (1,) if device.startswith("cuda") else (1, 2):
        with attempt(result["runs"], {"name": f"fsdp2 x{world}", "world_size": world}, lambda: record(result)) as run:
            run.update(fsdp_launch(world, opts, sizes, device))
    result["passed"] = all(r.get("passed") for r in result["runs"])
    return result


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step, the device drained at both ends."""

    def __init__(self, cuda: bool):
        self.drain, self.seconds = torch.cuda.synchronize if cuda else (lambda: None), []

    def on_step_begin(self, args, state, control, **kwargs):
        self.drain()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.drain()
        self.seconds.append(time.perf_counter() - self.t0)


@contextlib.contextmanager
def counted_syncs(cuda: bool):
    """Counts bitsandbytes' per-parameter device syncs (its `sync_gpu`, on any device) and, on CUDA, every implicit
    sync inside a backward: `torch.cuda.set_sync_debug_mode("warn")` around `torch.autograd.backward`, which
    `Tensor.backward` calls (an explicit `torch.cuda.synchronize()` is not one), with the lines that caused them."""
    counts, sites = {"bnb_device_syncs": None, "implicit_syncs_in_backward": 0 if cuda else None}, Counter()
    try:
        import bitsandbytes.optim.optimizer as bnb
    except Exception:
        bnb = None
    sync_gpu, backward = getattr(bnb, "sync_gpu", None), torch.autograd.backward

    def counting_sync(tensor):
        counts["bnb_device_syncs"] += 1
        return sync_gpu(tensor)

    def watched_backward(*args, **kwargs):
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                backward(*args, **kwargs)  # returns None
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        for w in caught:
            if "synchronizing CUDA operation" in str(w.message):
                counts["implicit_syncs_in_backward"] += 1
                sites[f"{w.filename}:{w.lineno}"] += 1
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    if bnb is not None:
        counts["bnb_device_syncs"], bnb.sync_gpu = 0, counting_sync
    if cuda:
        torch.autograd.backward = watched_backward
    try:
        yield counts
    finally:
        torch.autograd.backward = backward
        if bnb is not None:
            bnb.sync_gpu = sync_gpu
        counts["implicit_sync_sites"] = dict(sites.most_common(5))


def run_case(spec: dict, sizes: dict, device: str) -> dict:
    """One run of the ~1B model (tiny under --tiny; the small one with `small`); `spec`: optim, steps, max_grad_norm,
    and optionally ga, offload, device_sync (LAYERWISE_HF_BNB_DEVICE_SYNC=1)."""
    optim, steps, ga, cuda, size = spec["optim"], spec["steps"], spec.get("ga", 1), device.startswith("cuda"), (
        "small" if spec.get("small") else "memory")  # fmt: skip
    config, seq, batch = llama_config(sizes[f"{size}_model"], sizes[f"{size}_seq"], "sdpa"), *(
        sizes[f"{size}_{k}"] for k in ("seq", "batch"))  # fmt: skip
    os.environ.pop(KEEP_DEVICE_SYNC_ENV, None)  # read at each step: set for this run only
    os.environ.update({KEEP_DEVICE_SYNC_ENV: "1"} if spec.get("device_sync") else {})
    torch.manual_seed(0)
    with torch.device(device):  # random init on the device: seconds instead of minutes on CPU for 1.1B
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    timer = StepTimer(cuda)
    with tempfile.TemporaryDirectory() as out:
        # The norm pass that streams: 'auto' holds every gradient where activations outweigh them (the tiny dry run).
        extra = {"layerwise_norm_pass": "retain"} if optim.endswith("_layerwise") else {}
        extra |= {"layerwise_offload": spec["offload"]} if spec.get("offload") else {}
        args = training_args(out, optim, device, learning_rate=1e-4, max_steps=steps,
                             max_grad_norm=spec["max_grad_norm"], per_device_train_batch_size=batch,
                             gradient_accumulation_steps=ga,
                             **checkpointing_kwargs(True, {"use_reentrant": False}), **extra)  # fmt: skip
        trainer = make_trainer(model, args, token_dataset(batch * ga * steps, seq, config.vocab_size), [timer], device)
        cleanup(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            allocated_before = torch.cuda.memory_allocated()
        t1 = time.perf_counter()
        with counted_syncs(cuda) as syncs:
            trainer.train()
        cleanup(device)
    result = {"optim": optim, KEEP_DEVICE_SYNC_ENV: os.environ.get(KEEP_DEVICE_SYNC_ENV),
              "num_parameters": sum(p.numel() for p in model.parameters()),
              "num_tensors": len(list(model.parameters())), "train_seconds": round(time.perf_counter() - t1, 2),
              "step_seconds": [round(s, 5) for s in timer.seconds],
              **syncs, "optimizer_state_bytes_measured": sum(state_bytes_by_device(trainer).values()),
              "grad_norm": finite(logged(trainer, "grad_norm")), "loss": finite(logged(trainer, "loss")),
              "measured": cuda}  # fmt: skip
    if cuda:
        result.update(allocated_before_bytes=allocated_before, peak_allocated_bytes=torch.cuda.max_memory_allocated())
    if spec.get("offload"):
        result.update(offload_summary(trainer, spec["offload"]))
    return result


def run_cases(specs: list[dict], sizes: dict, device: str) -> None:
    """`run_case` of each spec in turn, each printed as a `CASE_JSON` line (an error too); emptied between."""
    csan = enable_sanitizer(device)
    if device == "cpu" and any(spec.get("offload") for spec in specs):
        simulate_offload_on_cpu()
    for spec in specs:
        try:
            out = {**run_case(spec, sizes, device), "csan": csan}
        except Exception:
            out = {"optim": spec["optim"], "error": traceback.format_exc()[-6000:]}
        cleanup(device)
        print("CASE_JSON " + json.dumps({"label": spec.get("label"), **out}), flush=True)


def launch_cases(specs: list[dict], opts, timeout: float, env: dict | None = None, warmup: int = 0) -> list[dict]:
    """`run_cases(specs)` in a fresh process (its own CUDA context), with `env` added, each run named by its label and
    timed (the median step after `warmup` steps); a run it did not reach reads as an error."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--cases", json.dumps(specs), "--device", opts.device]
    try:
        proc = subprocess.run(cmd + ["--tiny"] * opts.tiny, capture_output=True, text=True, cwd=ROOT,
                              timeout=budget(opts, timeout), env={**os.environ, **(env or {})})  # fmt: skip
        stdout, stderr, why = proc.stdout, proc.stderr, f"exit {proc.returncode}"
    except subprocess.TimeoutExpired as e:
        decode = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        stdout, stderr, why = decode(e.stdout), decode(e.stderr), f"timed out after {e.timeout:.0f} s"
    done = [json.loads(ln.split(" ", 1)[1]) for ln in stdout.splitlines() if ln.startswith("CASE_JSON ")]
    missing = [{"label": spec.get("label"), "optim": spec["optim"], "error": f"not reached ({why})\n{stderr[-3000:]}"}
               for spec in specs[len(done):]]  # fmt: skip
    runs = [{"name": run.pop("label"), **run} for run in done + missing]
    for run in (run for run in runs if "error" not in run):
        ms = sorted(round(1000 * s, 2) for s in run["step_seconds"][warmup:] or run["step_seconds"])
        run.update(median_step_ms=statistics.median(ms), min_step_ms=ms[0], steps_run=len(run["step_seconds"]))
    return runs


def host_allocator_bytes(which: str) -> int:
    """`which` ("current" or "peak") bytes of torch's caching host allocator: what `pin_memory=True` allocated, rounded
    up to a power of two and kept (memory pinned with cudaHostRegister, as the offload arenas are, is not in it)."""
    return torch.cuda.host_memory_stats().get(f"allocated_bytes.{which}", 0)


def offload_summary(trainer, mode: str) -> dict:
    """Where a layer-wise run with `layerwise_offload=mode` kept its gradients and states, which transfer copied them,
    and the pinned bytes of its arenas against the plan's (`estimate.offload.pinned_bytes`)."""
    from layerwise_hf.estimate.offload import pinned_bytes
    from layerwise_hf.optim.optimizer import offload_of
    from layerwise_hf.placement.host_step import HostStepOptimizer

    out = {"layerwise_offload": mode, "state_bytes_by_device": state_bytes_by_device(trainer)}
    layerwise = trainer.layerwise_optimizer if isinstance(trainer, LayerwiseTrainer) else None
    offload = offload_of(layerwise) if layerwise is not None else None
    if offload is None:
        return out
    hosted = [inner for inner in layerwise.inner if isinstance(inner, HostStepOptimizer)]
    runner = hosted[0].runner if hosted else None
    arenas = [offload.arena, *(runner.arenas.values() if runner else ())]
    transfers = {type(t).__name__ for t in (offload.transfer, runner and runner.transfer) if t is not None}
    sizes = [h.nbytes(p) for p in layerwise.params]
    out.update(host_gradient_buffer_bytes=offload.host_bytes(), transfer=",".join(sorted(transfers)) or None,
               pinned_planned_bytes=pinned_bytes(mode, sizes),
               pinned_arena_bytes=sum(a.nbytes for a in arenas if a))  # fmt: skip
    out["pinned_as_planned"] = out["pinned_arena_bytes"] == out["pinned_planned_bytes"]
    if mode == "optimizer":
        out["host_stepped_tensors"] = len(hosted)
        out["host_parameter_copy_bytes"] = sum(inner.host.numel() * inner.host.element_size() for inner in hosted)
    return out


def plan_memory(sizes: dict, device: str, out: dict) -> None:
    """`layerwise-hf plan` of the memory check's first two runs into `out["result"]` (or `out["error"]`): a daemon
    thread's target, that cannot hold the exit."""
    try:
        from layerwise_hf.plan import plan  # here only: the --cases and FSDP2 processes do not need it

        planned = plan(llama_config(sizes["memory_model"], sizes["memory_seq"], attn="sdpa"), ["adamw_8bit"],
                       seq_len=sizes["memory_seq"], micro_batch=sizes["memory_batch"], max_grad_norm=0.0,
                       torch_dtype="bfloat16", gradient_checkpointing=True,
                       device="cuda" if device.startswith("cuda") else "cpu")  # fmt: skip  # and its layer-wise form
        out["result"] = {"device": planned.setup.device, "extrapolated_layers": planned.extrapolated,
                         "rows": {r.optimizer: dict(peak_bytes=r.peak_bytes, categories=r.categories, when=r.when)
                                  for r in planned.rows},
                         # What the plan cannot follow in these runs, so that a ratio away from 1 can be read.
                         "note": "plan: one steady-state step, bitsandbytes' step temporaries not counted; measured: "
                         "every step, the first included; the CUDA context in neither"}  # fmt: skip
    except Exception:
        out["error"] = traceback.format_exc()


def check_memory(opts, sizes, device, record) -> dict:
    steps, warmup, cuda = sizes["memory_steps"], sizes["memory_warmup"], device.startswith("cuda")
    record(result := {"model": sizes["memory_model"], "seq": sizes["memory_seq"], "batch": sizes["memory_batch"],
                      "steps": steps, "warmup_steps_dropped": warmup})  # fmt: skip
    if not cuda:
        simulate_offload_on_cpu()
    # The plan needs only the CPU: it runs in a thread while the GPU runs, and adds no time unless it is the slower.
    planned: dict = {}
    planning = threading.Thread(target=plan_memory, args=(sizes, device, planned), daemon=True)
    planning.start()
    chosen = [run for run in MEMORY_RUNS if not (opts.no_bnb and "8bit" in run[1])]
    specs = [{"label": f"memory {label}", "optim": optim, "offload": offload, "max_grad_norm": clip, "steps": steps,
              "device_sync": sync} for label, optim, offload, clip, sync in chosen]  # fmt: skip
    runs = dict(zip([run[0] for run in chosen], launch_cases(specs, opts, sizes["memory_timeout"], warmup=warmup)))
    result["runs"] = list(runs.values())
    planning.join(timeout=max(1.0, min(sizes["memory_timeout"], time_left(opts))))
    result["plan"] = planned.get("result") or {"error": planned.get("error", "the plan did not finish in time")}
    if any("error" in r or r["steps_run"] != steps for r in runs.values()):
        result["passed"] = False
        return result
    for run in runs.values():  # the planned peak of the 8-bit pair, and on CUDA the measured peak over it
        row = result["plan"].get("rows", {}).get(run["optim"]) if not run.get("offload") else None
        if row is not None and not run[KEEP_DEVICE_SYNC_ENV]:
            run["planned_peak_bytes"] = row["peak_bytes"]
            if cuda:
                run["measured_over_planned"] = round(run["peak_allocated_bytes"] / row["peak_bytes"], 4)
    lower = lambda a, b: not cuda or runs[a]["peak_allocated_bytes"] < runs[b]["peak_allocated_bytes"]  # noqa: E731
    # No more implicit syncs in a layer-wise backward than in stock's (not counted on CPU).
    implicit = lambda name: runs[name]["implicit_syncs_in_backward"] or 0  # noqa: E731
    syncs = lambda a, b: implicit(a) <= implicit(b)  # noqa: E731
    checks = {"torch_layerwise_lower": lower("adamw_torch_layerwise", "adamw_torch"),
              "offload_optimizer_lower": lower("adamw_torch_layerwise offload=optimizer", "adamw_torch_layerwise"),
              "no_added_implicit_syncs": syncs("adamw_torch_layerwise", "adamw_torch")}  # fmt: skip
    host = runs["adamw_torch_layerwise offload=optimizer"]
    # Every tensor stepped on the host; on CUDA every state on the CPU (on CPU the device is the CPU too).
    checks["offload_states_on_host"] = host["host_stepped_tensors"] == host["num_tensors"] and (
        not cuda or set(host["state_bytes_by_device"]) <= {"cpu"})  # fmt: skip
    for label, baseline in (("adamw_torch_layerwise", "adamw_torch"), ("adamw_8bit_layerwise", "adamw_8bit")):
        for run in (r for name, r in runs.items() if name.startswith(label)):
            run["vs_standard"] = round(run["median_step_ms"] / runs[baseline]["median_step_ms"], 3)
            run["loss_max_abs_diff_vs_standard"] = list_diff(runs[baseline]["loss"], run["loss"])
    if "adamw_8bit" in runs:
        std, lw, kept = (runs[k] for k in ("adamw_8bit", "adamw_8bit_layerwise", "adamw_8bit_layerwise bnb sync"))
        expected = steps * std["num_tensors"]  # bitsandbytes syncs after every parameter of every step
        result["sync_removed_saves_ms"] = round(kept["median_step_ms"] - lw["median_step_ms"], 2)
        checks.update(eight_bit_layerwise_lower=lower("adamw_8bit_layerwise", "adamw_8bit"),
                      bnb_syncs_where_expected=std["bnb_device_syncs"] == expected == kept["bnb_device_syncs"]
                      and lw["bnb_device_syncs"] == 0,
                      no_added_implicit_syncs_8bit=syncs("adamw_8bit_layerwise", "adamw_8bit"))  # fmt: skip
    if not cuda:
        result["note_cpu"] = "on CPU: no memory measured, bitsandbytes' sync does nothing, implicit syncs not counted"
    result.update(checks, passed=all(checks.values()))
    return result


def simulate_offload_on_cpu() -> None:
    """On CPU, the offload code's stand-in (a copy thread, a delay on every copy) runs the path a GPU takes."""
    from layerwise_hf.placement.transfer import DELAY_ENV, SIMULATE_ENV

    os.environ.setdefault(SIMULATE_ENV, "1")
    os.environ.setdefault(DELAY_ENV, "0.001")


@contextlib.contextmanager
def slow_copies(cycles: int = COPY_DELAY_CYCLES):
    """Every offload copy starts after `torch.cuda._sleep(cycles)` on its side stream (each direction): a copy that
    ends late, so a wait the code lacks reads a buffer before its copy ran and changes the weights."""
    from layerwise_hf.placement.transfer import CudaTransfer

    copy = CudaTransfer.copy

    def slow(self, dst, src, after=None):
        with torch.cuda.stream(self.to_device if dst.is_cuda else self.to_host):
            torch.cuda._sleep(cycles)
        return copy(self, dst, src, after)

    CudaTransfer.copy = slow
    try:
        yield
    finally:
        CudaTransfer.copy = copy


def check_offload(opts, sizes, device, record) -> dict:
    """adamw_torch through Trainer against adamw_torch_layerwise with offload on the small model, each of OFFLOAD_CASES
    (the ~1B runs are the memory check's), every copy delayed (`slow_copies`; on CPU, ThreadTransfer's delay)."""
    steps, cuda = sizes["parity_steps"], device.startswith("cuda")
    record(result := {"model": sizes["small_model"], "steps": steps, "cases": [], "copy_delay_cycles": 0})
    if not cuda:
        simulate_offload_on_cpu()
    with slow_copies() if cuda else contextlib.nullcontext():
        result["copy_delay_cycles"] = COPY_DELAY_CYCLES if cuda else 0
        return offload_cases(opts, sizes, device, record, result)


def offload_cases(opts, sizes, device, record, result) -> dict:
    steps, batch, cuda, cases = sizes["parity_steps"], sizes["small_batch"], device.startswith("cuda"), result["cases"]
    # The host's AdamW is not CUDA's kernel, nor the host's norm of a GA sum CUDA's: on a GPU, 'optimizer' and
    # 'gradients' at GA 2 are compared by their updates, not bit for bit.
    host_opts = argparse.Namespace(**{**vars(opts), "update_rtol": opts.offload_rtol})
    standard = {}
    for mode, ga, clip in OFFLOAD_CASES:
        name = f"offload parity {mode} GA{ga}" + (" clip off" if not clip else "")
        case = {"name": name, "mode": mode, "ga": ga, "max_grad_norm": clip}
        with attempt(cases, case, lambda: record(result), device):
            t0 = time.perf_counter()
            common = dict(max_steps=steps, per_device_train_batch_size=batch, gradient_accumulation_steps=ga,
                          max_grad_norm=clip)  # fmt: skip
            if (ga, clip) not in standard:
                _, base_model, dataset = small_setup(sizes, "parity_steps", ga)
                std = train_one("adamw_torch", base_model, dataset, device, **common)
                standard[ga, clip] = base_model, dataset, std
            base_model, dataset, std = standard[ga, clip]
            if cuda:
                torch.cuda.reset_peak_host_memory_stats()
                host_before = host_allocator_bytes("current")
            lw = train_one("adamw_torch_layerwise", base_model, dataset, device, layerwise_offload=mode, **common)
            exact = (mode == "gradients" and ga == 1) or not cuda
            case.update(compare_runs(base_model, std, lw, steps, "bit-exact" if exact else "update_rtol",
                                     opts if exact else host_opts))  # fmt: skip
            case.update(offload_summary(lw, mode), seconds=round(time.perf_counter() - t0, 2))
            if cuda:  # what pin_memory=True allocated beside the arenas (GA > 1: the staging buffers); not judged
                case["pinned_by_host_allocator_bytes"] = host_allocator_bytes("peak") - host_before
                case["host_memory_stats"] = {k: v for k, v in torch.cuda.host_memory_stats().items() if "bytes" in k}
                case["pinned_over_planned"] = round((case["pinned_arena_bytes"] + case[
                    "pinned_by_host_allocator_bytes"]) / max(1, case["pinned_planned_bytes"]), 4)  # fmt: skip
            # With clipping the gradients waited on the host (exact clipping needs every one before a step); with
            # 'optimizer' every tensor stepped on the host and no state is left on the device.
            waited = not clip or case["host_gradient_buffer_bytes"] > 0
            hosted = case.get("host_stepped_tensors") == len(lw.layerwise_optimizer.inner)
            on_cpu = not cuda or set(case["state_bytes_by_device"]) <= {"cpu"}
            case["transfer_expected"] = "CudaTransfer" if cuda else "ThreadTransfer"
            case["passed"] = bool(case["passed"] and waited and (mode == "gradients" or (hosted and on_cpu))
                                  and case["transfer"] == case["transfer_expected"] and case["pinned_as_planned"]
                                  )  # fmt: skip
    result["passed"] = all(c.get("passed") for c in cases)
    return result


def check_sanitizer(opts, sizes, device, record) -> dict:
    """Short offload runs (in-backward host steps, both streams; copies back at the step) and a 1-rank FSDP2 8-bit run
    under torch's CUDA sanitizer (on CPU, without it), in processes of their own: each must finish, as CSAN raises
    CUDASanitizerErrors at the first unsynchronized access."""
    cuda, steps = device.startswith("cuda"), sizes["sanitizer_steps"]
    record(result := {"model": sizes["small_model"], "steps": steps, "enabled": cuda, "runs": []})
    specs = [{"label": f"sanitizer offload={mode} GA{ga}" + (" clip off" if not clip else ""), "small": True,
              "optim": "adamw_torch_layerwise", "offload": mode, "ga": ga, "max_grad_norm": clip, "steps": steps}
             for mode, ga, clip in SANITIZER_CASES]  # fmt: skip
    result["runs"] = launch_cases(specs, opts, sizes["sanitizer_timeout"], env={CSAN_ENV: "1"})
    for run in result["runs"]:
        run["passed"] = "error" not in run and run["csan"] == cuda and run["steps_run"] == steps
    with attempt(result["runs"], {"name": "sanitizer fsdp2 adamw_8bit x1"}, lambda: record(result)) as run:
        if opts.no_bnb:
            run.update(skipped=True, reason=opts.no_bnb)
        else:
            run.update(fsdp_launch(1, opts, sizes, device, csan=True))
            run["passed"] = run["passed"] and all(c["csan"] == cuda for c in run["cases"])
    result["passed"] = all(r.get("passed") for r in result["runs"] if not r.get("skipped"))
    return result


def environment(device: str, no_bnb: str | None) -> dict:
    import accelerate
    import transformers

    cuda = device.startswith("cuda")
    try:  # a bare GPU machine may have no git, or a copy of the tree without .git: the checks still run
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"device": device, "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "torch_build": "CUDA" if torch.version.cuda
            else "CPU", "transformers": transformers.__version__, "accelerate": accelerate.__version__,
            "bitsandbytes": no_bnb or __import__("bitsandbytes").__version__, "python_executable": sys.executable,
            "layerwise_hf_from": str(Path(sys.modules["layerwise_hf"].__file__).parent),
            "git_commit": commit or os.environ.get("GPU_CHECK_COMMIT"),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "gpu_check_sh_interpreter": os.environ.get("GPU_CHECK_PYTHON"),
            "gpu_total_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
            "gpu_count": torch.cuda.device_count() if cuda else 0,
            "cuda_host_register": probe_host_register() if cuda else None,
            }  # fmt: skip


def probe_host_register() -> str:
    """Whether this machine pins plain host memory (`cudaHostRegister`, what offload's arenas use): "ok", or the error
    (some containers and virtual machines refuse it; offload then cannot pin its buffers)."""
    block = torch.empty(4096, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    try:
        torch.cuda.check_error(cudart.cudaHostRegister(block.data_ptr(), block.numel(), 0))
    except Exception as e:  # noqa: BLE001 - reported as it is
        return f"refused: {type(e).__name__}: {e}"
    torch.cuda.check_error(cudart.cudaHostUnregister(block.data_ptr()))
    return "ok"


def not_exercised(report: dict) -> list[str]:
    """What a PASS of this run says nothing about: what it could not run here."""
    env, missing = report["environment"], []
    if not str(env.get("bitsandbytes", "")).replace(".", "").isdigit():
        missing.append(
            "platform/streams.py's ordering of 8-bit steps on the default stream (no bitsandbytes: fsdp2_8bit, the "
            "8-bit parity and memory runs and the FSDP2 sanitizer run were skipped)"
        )
    if env.get("device", "").startswith("cuda") and (env.get("gpu_count") or 0) < 2:
        missing.append(
            "a model over two GPUs with offload (refused at setup) and each rank's host worker on its own GPU: one "
            "GPU visible"
        )
    if str(env.get("cuda_host_register") or "ok") != "ok":
        missing.append(f"offload's pinned arenas: cudaHostRegister {env['cuda_host_register']}")
    return missing


def show(key: str, value) -> str:
    """A value in the table: bytes in MiB (dicts of them too), floats to 4 digits."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show(key, v)}" for k, v in sorted(value.items())) + "}"
    return f"{value / h.MIB:.1f}MiB" if "_bytes" in key and isinstance(value, (int, float)) else f"{value:.4g}" if (
        isinstance(value, float)) else str(value)  # fmt: skip


def status_of(check: dict) -> str:
    if check.get("skipped") or check.get("status") in ("NOT RUN", "SKIP"):
        return check.get("status", "SKIP")
    return "ERROR" if "error" in check else ("PASS" if check["passed"] else "FAIL") if "passed" in check else "-"


# What the table shows of a case or run, and of a check, where it has the key.
SHOWN = ("criterion", "exact", "max_abs_param_diff", "update_max_rel_diff", "grad_norm_max_abs_diff", "clipped_steps",
         "overflow_step_skipped", "transfer", "pinned_arena_bytes", "pinned_planned_bytes",
         "pinned_by_host_allocator_bytes", "hand_max_diff", "delayed_steps", "wait_tested", "csan", "median_step_ms",
         "vs_standard", "bnb_device_syncs", "implicit_syncs_in_backward", "peak_allocated_bytes", "planned_peak_bytes",
         "measured_over_planned", "state_bytes_by_device", "reason")  # fmt: skip
SUMMARY = ("sync_removed_saves_ms", "note_cpu", "reason")


def details(c: dict, keys) -> str:
    return " ".join(f"{k}={show(k, c[k])}" for k in keys if c.get(k) not in (None, {}, ""))


def table_rows(checks: dict) -> list[tuple[str, str, str]]:
    """(name, status, details) of every case and run; FSDP2's runs hold their cases."""
    items = [{**item, **case} for check in checks.values() for item in check.get("cases", []) + check.get("runs", [])
             for case in item.get("cases", [{}])]  # fmt: skip
    return [(c["name"], status_of(c), "" if "error" in c else details(c, SHOWN)) for c in items]


def print_table(report: dict) -> None:
    env, checks, rows = report["environment"], report["checks"], table_rows(report["checks"])
    print(f"\nGPU check on {env['device_name']} (torch {env['torch']}, {env['torch_build']} build, CUDA "
          f"{env['cuda']}, bitsandbytes {env['bitsandbytes']})")  # fmt: skip
    width = max((len(r[0]) for r in rows), default=10)
    for name, res, detail in rows + [(f"=> {n}", status_of(c), details(c, SUMMARY)) for n, c in checks.items()]:
        print(f"  {name:<{width}}  {res:<5}  {detail}")
    for c in [c for ch in checks.values() for c in [ch, *ch.get("cases", []), *ch.get("runs", [])] if "error" in c]:
        print(f"\n{c.get('name', 'check')} error:\n{c['error'][-2000:]}")
    skipped = "; ".join(f"{k} ({v})" for k, v in report["checks_skipped"].items())
    print(f"\nran: {', '.join(report['checks_run']) or 'none'}; skipped: {skipped or 'none'}")
    print(f"all passed: {report['passed']}  ({report['seconds']} s)")
    for what in report.get("not_exercised", []):
        print(f"not exercised: {what}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models; the CPU dry run (device defaults to cpu)")
    parser.add_argument("--device", default=None, help="cuda (default) or cpu (default with --tiny)")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "gpu_check.json"))
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    parser.add_argument("--parity_optims", default=",".join(PARITY_OPTIMS),
                        help=f"comma-separated subset of {','.join(PARITY_OPTIMS)}")  # fmt: skip
    parser.add_argument("--update_rtol", type=float, default=1e-6, help="fp16: largest |update_lw - update_std| / "
                        "|update_std| per parameter, updates being w_after - w_0")  # fmt: skip
    parser.add_argument("--offload_rtol", type=float, default=1e-4, help="offload on CUDA (the host's AdamW kernel "
                        "is not CUDA's): as --update_rtol")  # fmt: skip
    parser.add_argument("--time_limit", type=float, default=None, help="seconds: no subprocess runs past it")
    parser.add_argument("--cases", default=None, help=argparse.SUPPRESS)  # internal: runs in a fresh process
    parser.add_argument("--fsdp_case", default=None, help=argparse.SUPPRESS)  # internal: one FSDP2 rank
    opts = parser.parse_args(argv)
    opts.device = opts.device or ("cpu" if opts.tiny else "cuda")
    for name, valid in (("checks", CHECKS), ("parity_optims", PARITY_OPTIMS)):
        chosen = [c.strip() for c in getattr(opts, name).split(",") if c.strip()]
        if set(chosen) - set(valid):
            parser.error(f"--{name}: unknown {sorted(set(chosen) - set(valid))}; choose from {', '.join(valid)}")
        setattr(opts, name, [c for c in valid if c in chosen])  # in the order of CHECKS
    opts.deadline = None if opts.time_limit is None else time.monotonic() + opts.time_limit
    return opts


def run_check(name: str, opts, sizes, check: dict, write) -> int:
    """Check `name` into `check` (SKIP without bitsandbytes where it needs it); 124 when the time limit stopped it."""
    if name in NEEDS_BNB and opts.no_bnb:
        check.update(status="SKIP", reason=opts.no_bnb)
        print(f"gpu_check: {name} SKIPPED: {opts.no_bnb}", flush=True)
        return 0
    functions = {"parity": check_parity, "offload": check_offload, "fsdp2_8bit": check_fsdp2,
                 "sanitizer": check_sanitizer, "memory": check_memory}  # fmt: skip
    t1, budget, rc = time.perf_counter(), None if opts.tiny else CHECK_BUDGET_S[name], 0
    print(f"gpu_check: {name} (budget {budget} s, {time_left(opts):.0f} s left) ...", flush=True)
    try:
        check.update(functions[name](opts, sizes, opts.device, lambda partial: (check.update(partial), write())))
    except Terminated as e:
        check.update(passed=False, error=f"terminated by {e} (time limit?)")
        for case in check.get("cases", []) + check.get("runs", []):
            case.setdefault("passed", False)
        rc = 124
    except Exception:
        check.update(passed=False, error=traceback.format_exc())
    check.update(seconds=round(time.perf_counter() - t1, 1), budget_s=budget, status=status_of(check))
    print(f"gpu_check: {name} {check['status']} in {check['seconds']} s (budget {budget} s)", flush=True)
    return rc


def main(argv=None) -> int:
    opts = parse_args(argv)
    gc.freeze()  # the imported libraries are never garbage: every collection (cleanup, train()'s end) skips them
    sizes = SIZES["tiny" if opts.tiny else "full"]
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        why = f"torch.cuda.is_available() is False (torch {torch.__version__} at {sys.executable})"
        print(f"gpu_check: {why}; gpu_check.sh chooses a CUDA interpreter; --tiny is the CPU dry run", file=sys.stderr)
        return 2
    if opts.cases:
        run_cases(json.loads(opts.cases), sizes, opts.device)
        return 0
    if opts.fsdp_case:
        fsdp_case(sizes, opts.device, opts.fsdp_case)

    torch.use_deterministic_algorithms(True, warn_only=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _terminate)
    t0, output, opts.no_bnb = time.perf_counter(), Path(opts.output), None
    try:  # without it the checks that need it are skipped, with this reason
        import bitsandbytes  # noqa: F401
    except Exception as e:
        opts.no_bnb = f"bitsandbytes not importable ({type(e).__name__}: {e}); benchmarks/README.md: how to carry it"
        print(f"gpu_check: {opts.no_bnb}: the checks that need it are SKIPPED", flush=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    report = {"script": "benchmarks/gpu_check.py", "tiny": opts.tiny, "argv": sys.argv[1:] if argv is None else argv,
              "environment": environment(opts.device, opts.no_bnb), "sizes": sizes, "checks_selected": opts.checks,
              "checks_run": [], "checks_skipped": {}, "checks": {}, "passed": None}  # fmt: skip

    def write():
        checks = report["checks"]
        report["checks_run"] = [n for n, c in checks.items() if c.get("status") not in ("SKIP", "NOT RUN")]
        report["checks_skipped"] = {n: c.get("reason", c["status"]) for n, c in checks.items() if n not in
                                    report["checks_run"]}  # fmt: skip
        report["passed"] = all(checks[n].get("passed") for n in report["checks_run"])
        report["not_exercised"] = not_exercised(report)
        report["seconds"] = round(time.perf_counter() - t0, 1)
        output.with_suffix(".tmp").write_text(json.dumps(finite(report), indent=1, allow_nan=False, default=str))
        output.with_suffix(".tmp").replace(output)

    rc = 0
    for name in opts.checks:
        report["checks"][name] = {"status": "NOT RUN", "reason": "the time limit stopped an earlier check"}
        if not rc:
            report["checks"][name] = {}
            rc = run_check(name, opts, sizes, report["checks"][name], write)
        write()
    print_table(report)
    print(f"JSON: {output}")
    return rc or (0 if report["passed"] else 1)


if __name__ == "__main__":
    sys.exit(main())
