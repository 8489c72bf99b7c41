"""The GPU check: the layer-wise optimizers on one CUDA device, against the standard ones, in one run of a few minutes.
Run it through `bash benchmarks/gpu_check.sh`, or `--tiny` for the CPU dry run. The seven checks, their criteria, the
JSON and the exit status: benchmarks/README.md."""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import functools
import gc
import inspect
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

# Before torch initialises CUDA: cuBLAS is deterministic only with a fixed workspace.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PrinterCallback, Trainer, TrainerCallback  # noqa: E402

from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments  # noqa: E402
from layerwise_hf.estimate import estimate  # noqa: E402

MIB = 2**20
CHECKS = ("parity", "fp16", "fp16_norm_pass", "fsdp2_8bit", "memory", "step_time", "offload")
PARITY_OPTIMS = ("adamw_torch", "adamw_8bit", "sgd")
MEMORY_OPTIMS = ("adamw_8bit", "adamw_8bit_layerwise")
MAX_GRAD_NORM = 1.0  # Trainer's default; with layerwise_clip="exact"
KEEP_DEVICE_SYNC_ENV = "LAYERWISE_HF_BNB_DEVICE_SYNC"  # layerwise_hf.platform.streams: "1" keeps bitsandbytes' syncs
# (label, optim, LAYERWISE_HF_BNB_DEVICE_SYNC or None for unset)
STEP_TIME_RUNS = (
    ("adamw_8bit", "adamw_8bit", None),
    ("adamw_8bit_layerwise", "adamw_8bit_layerwise", None),
    ("adamw_8bit_layerwise bnb sync", "adamw_8bit_layerwise", "1"),
)
OFFLOAD_MODES = ("gradients", "optimizer")
# The offload check's ~1B runs, one process, one after the other: (label, optim, layerwise_offload or None).
OFFLOAD_RUNS = (
    ("adamw_torch", "adamw_torch", None),
    ("adamw_torch_layerwise", "adamw_torch_layerwise", "none"),
    ("adamw_torch_layerwise offload=gradients", "adamw_torch_layerwise", "gradients"),
    ("adamw_torch_layerwise offload=optimizer", "adamw_torch_layerwise", "optimizer"),
)

# Sizes of the full (CUDA) run and of --tiny (CPU dry run). The small model keeps every decoder matrix >= 4096
# elements so bitsandbytes really keeps 8-bit state for them (its embeddings stay 32-bit either way). Timeouts are
# per subprocess, and never past --time_limit.
SIZES = {
    "full": dict(
        small_model=dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2),
        small_seq=64, small_batch=4, parity_steps=6, fp16_steps=6, fp16_overflow_step=2,
        fsdp_steps=4, fsdp_timeout=180,
        memory_model=dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                          num_attention_heads=32, num_key_value_heads=4),
        memory_seq=512, memory_batch=4, memory_steps=3, memory_timeout=200,
        step_time_steps=10, step_time_warmup=3, step_time_timeout=150,
        offload_steps=6, offload_warmup=2, offload_timeout=120,
    ),
    "tiny": dict(
        small_model=dict(vocab_size=1024, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2),
        small_seq=16, small_batch=2, parity_steps=4, fp16_steps=4, fp16_overflow_step=2,
        fsdp_steps=3, fsdp_timeout=240,
        memory_model=dict(vocab_size=1024, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2),
        memory_seq=32, memory_batch=2, memory_steps=2, memory_timeout=240,
        step_time_steps=4, step_time_warmup=1, step_time_timeout=240,
        offload_steps=3, offload_warmup=1, offload_timeout=300,
    ),
}  # fmt: skip


# Seconds each check is planned to take on one H200 (estimates from the work each does; none was run on a GPU yet),
# 435 in all, inside gpu_check.sh's --time_limit and its 8 minutes with the preflight. A process of the ~1B model is
# ~12 s of imports and CUDA start-up, ~3 s to build, steps of ~0.2 s; subprocesses are cut at --time_limit whatever
# the budget.
CHECK_BUDGET_S = {
    "parity": 55,  # 12 Trainer runs of 6 steps on the 13M Llama, CUDA and cuBLAS start-up included
    "fp16": 25,  # 4 runs
    "fp16_norm_pass": 15,  # 1 run
    "fsdp2_8bit": 70,  # 1 accelerate launch (imports, NCCL, 2 runs); a second on 2 GPUs
    "memory": 85,  # 2 processes: imports, a 1.1B model built on the GPU, 3 steps; the plan (~15 s) runs beside them
    "step_time": 110,  # 3 processes, 10 steps each
    "offload": 75,  # 6 small runs (~25 s), then ONE process for the 4 runs of the ~1B model (host AdamW ~1-2 s a step)
}


class Terminated(BaseException):
    """SIGTERM / SIGINT (the time limit): stop, but write what was measured first."""


def _terminate(signum, frame):
    raise Terminated(signal.Signals(signum).name)


# ---- models, data, training, comparison ----


def llama_config(sizes: dict, seq: int, attn: str) -> LlamaConfig:
    config = LlamaConfig(**sizes, max_position_embeddings=seq, tie_word_embeddings=False)
    config._attn_implementation = attn
    return config


def build_model(config: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


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


def make_trainer(model, args, dataset, callbacks=(), device="cuda", scaler: dict | None = None):
    """Trainer or LayerwiseTrainer, each callback's `trainer` set; with fp16, `scaler`: the GradScaler's settings."""
    cls = LayerwiseTrainer if args.is_layerwise else Trainer
    trainer = cls(model=model, args=args, train_dataset=dataset, callbacks=list(callbacks))
    trainer.remove_callback(PrinterCallback)  # every log line is in the JSON; keep the output to the table
    for callback in callbacks:
        callback.trainer = trainer
    if args.fp16 and (device == "cpu" or scaler is not None):
        # Accelerate creates a GradScaler (and fp16 autocast) only on accelerator devices; on CPU give the
        # accelerator torch's CPU GradScaler, as tests/test_fp16.py does: the same object and calls as with CUDA.
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu" if device == "cpu" else "cuda", **(scaler or {}))
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
    return config, build_model(config), token_dataset(n, sizes["small_seq"], config.vocab_size)


def logged(trainer, key: str) -> list[float]:
    return [e[key] for e in trainer.state.log_history if key in e and "train_runtime" not in e]


def param_diff(a, b) -> tuple[float, bool]:
    """Largest absolute difference over all parameters, and whether every parameter is bit-identical."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    if pa.keys() != pb.keys():
        raise ValueError("the two models have different parameters")
    worst, exact = 0.0, True
    for name in pa:
        exact = exact and torch.equal(pa[name], pb[name])
        worst = max(worst, float((pa[name].detach().float() - pb[name].detach().float()).abs().max()))
    return worst, exact


def update_diff(before, standard, layerwise) -> dict:
    """Per parameter |(w_lw - w0) - (w_std - w0)| / |w_std - w0| (L2 norms, float64): the largest, and the model's.
    A wrongly scaled clip moves SGD's updates by the scale's error and AdamW's by far less, but never by nothing."""
    p0, ps, pl = (dict(m.named_parameters()) for m in (before, standard, layerwise))
    worst, worst_name, num_sq, den_sq = 0.0, None, 0.0, 0.0
    for name, w0 in p0.items():
        w0 = w0.detach().double().cpu()
        d_std, d_lw = (p[name].detach().double().cpu() - w0 for p in (ps, pl))
        num, den = float((d_lw - d_std).norm()), float(d_std.norm())
        rel = num / den if den > 0 else (0.0 if num == 0 else math.inf)
        num_sq, den_sq = num_sq + num**2, den_sq + den**2
        if rel > worst or worst_name is None:
            worst, worst_name = rel, name
    total = math.sqrt(num_sq) / math.sqrt(den_sq) if den_sq > 0 else (0.0 if num_sq == 0 else math.inf)
    return {"update_max_rel_diff": worst, "update_worst_param": worst_name, "update_model_rel_diff": total}


def list_diff(a: list, b: list) -> float | None:
    """Largest difference of two logged lists (nan == nan, "nan" read as nan); None if of unlike lengths."""
    if len(a) != len(b):
        return None
    worst = 0.0
    for x, y in zip(map(float, a), map(float, b)):
        if x == y or (math.isnan(x) and math.isnan(y)):
            continue
        if not (math.isfinite(x) and math.isfinite(y)):
            return math.inf
        worst = max(worst, abs(x - y))
    return worst


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
    grad_norm within `--update_rtol`); `passed_former_atol`: the former check (weights within `--parity_atol`)."""
    diff, exact = param_diff(std.model, lw.model)
    norms_std, norms_lw = logged(std, "grad_norm"), logged(lw, "grad_norm")
    norm_diff = list_diff(norms_std, norms_lw)
    scale = max([1.0, *[abs(n) for n in norms_std if math.isfinite(n)]])
    out = dict(criterion=criterion, max_abs_param_diff=diff, exact=exact, **update_diff(base_model, std.model,
               lw.model), grad_norm_max_abs_diff=norm_diff, steps_logged=len(norms_std))  # fmt: skip
    complete = len(norms_std) == steps and norm_diff is not None
    close = out["update_max_rel_diff"] <= opts.update_rtol and complete and norm_diff <= opts.update_rtol * scale
    out["passed"] = bool(complete and exact and norm_diff == 0.0) if criterion == "bit-exact" else bool(close)
    out["passed_former_atol"] = bool(complete and diff <= opts.parity_atol
                                     and norm_diff <= max(opts.parity_atol, 1e-6) * scale)  # fmt: skip
    out["clipped_steps"] = sum(n > MAX_GRAD_NORM for n in norms_std if math.isfinite(n))
    return out


def state_bytes_by_device(trainer) -> dict[str, int]:
    """The optimizer state's bytes per device type, each storage once (bitsandbytes shares its quantization maps)."""
    layerwise = trainer.layerwise_optimizer if isinstance(trainer, LayerwiseTrainer) else None
    opts = list(layerwise.inner) if layerwise is not None else [getattr(trainer.optimizer, "optimizer", None)]
    seen = {}
    for opt in opts:  # Accelerate's AcceleratedOptimizer wraps the standard one
        for state in opt.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    storage = value.untyped_storage()
                    seen[(value.device.type, storage.data_ptr())] = storage.nbytes()
    out: dict[str, int] = {}
    for (kind, _), nbytes in seen.items():
        out[kind] = out.get(kind, 0) + nbytes
    return out


def cleanup(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def attempt(cases: list, case: dict, save, device: str | None = None, fail: bool = True):
    """`case` appended to `cases`; an exception in the block becomes its `error` (`passed=False` with `fail`): a
    failing case keeps the others' numbers. Then the device is emptied and `save()` writes the JSON."""
    cases.append(case)
    try:
        yield case
    except Exception:
        case.update(error=traceback.format_exc(), **({"passed": False} if fail else {}))
    finally:
        if device is not None:
            cleanup(device)
        save()


def time_left(opts) -> float:
    """Seconds left before `--time_limit` (inf without one)."""
    return math.inf if opts.deadline is None else opts.deadline - time.monotonic()


def run_subprocess(cmd, opts, timeout: float, env=None) -> subprocess.CompletedProcess:
    """`cmd` with its output captured, stopped at `timeout` or 10 s before `--time_limit`, whichever is first."""
    budget = min(timeout, time_left(opts) - 10)
    if budget < 20:
        raise TimeoutError(f"not started: {max(0, round(time_left(opts)))} s left of --time_limit")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=budget, cwd=ROOT, env=env)


# ---- checks 1-3: parity, fp16 + GradScaler with an injected overflow, an overflow in the stepping backward only ----


class WrongClip(TrainerCallback):
    """Scales every layer-wise step's gradient by `factor` (torch's step pre-hooks on each inner optimizer, after the
    clip was applied): a clip coefficient off by `1 - factor`. Fault injection for `--inject_clip_error`."""

    def __init__(self, factor: float):
        self.factor, self.trainer = factor, None

    def on_train_begin(self, args, state, control, **kwargs):
        for inner in self.trainer.layerwise_optimizer.inner:
            inner.register_step_pre_hook(self._pre)

    def _pre(self, inner, args, kwargs):
        for group in inner.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(self.factor)


def check_parity(opts, sizes, device, record) -> dict:
    steps, batch = sizes["parity_steps"], sizes["small_batch"]
    result = {"model": sizes["small_model"], "seq": sizes["small_seq"], "batch": batch, "steps": steps,
              "dtype": "float32", "max_grad_norm": MAX_GRAD_NORM, "layerwise_clip": "exact", "attention": "eager",
              "criterion": "bit-exact weights and grad_norm (fp32, deterministic algorithms, eager attention, same "
              "kernels)", "former_atol": opts.parity_atol, "inject_clip_error": opts.inject_clip_error,
              "cases": []}  # fmt: skip
    record(result)
    for optim in opts.parity_optims:
        for ga in (1, 2):
            with attempt(result["cases"], {"optim": optim, "ga": ga}, lambda: record(result), device) as case:
                t0 = time.perf_counter()
                _, base_model, dataset = small_setup(sizes, "parity_steps", ga)
                common = dict(max_steps=steps, per_device_train_batch_size=batch, gradient_accumulation_steps=ga)
                std = train_one(optim, base_model, dataset, device, **common)
                wrong = [WrongClip(1.0 - opts.inject_clip_error)] if opts.inject_clip_error else []
                lw = train_one(f"{optim}_layerwise", base_model, dataset, device, wrong, **common)
                case.update(compare_runs(base_model, std, lw, steps, "bit-exact", opts),
                            grad_norm_standard=finite(logged(std, "grad_norm")),
                            grad_norm_layerwise=finite(logged(lw, "grad_norm")),
                            loss_standard=finite(logged(std, "loss")),
                            seconds=round(time.perf_counter() - t0, 2))  # fmt: skip
    result["passed"] = all(c.get("passed") for c in result["cases"])
    return result


class StepWatch(TrainerCallback):
    """`active` on step `at_step` (0-based); after it, what it changed and left non-finite; every step's scale."""

    def __init__(self, at_step: int):
        self.at_step, self.active, self.trainer, self.scales = at_step, False, None, []
        self.changed = self.nonfinite_after_step = None

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
            self.nonfinite_after_step = [n for n, p in params.items() if not torch.isfinite(p).all()]
            self.step_ended()

    def step_ended(self):
        pass

    def scale_halved(self) -> bool:
        at, scales = self.at_step, self.scales
        return len(scales) > at and scales[at] == scales[at - 1] / 2


class Overflow(StepWatch):
    """On step `at_step` the input embedding's output times inf (a forward hook): loss and gradients inf/nan."""

    def on_train_begin(self, args, state, control, **kwargs):
        hook = lambda module, inputs, output: output * float("inf") if self.active else output  # noqa: E731
        self.trainer.model.get_input_embeddings().register_forward_hook(hook)

    def summary(self) -> dict:
        norms = logged(self.trainer, "grad_norm")
        injected = norms[self.at_step] if len(norms) > self.at_step else math.nan
        out = {"grad_norm": finite(norms), "scales": self.scales, "injected_grad_norm": finite(injected),
               "injected_step_nonfinite": not math.isfinite(injected), "params_changed_on_injected_step": self.changed,
               "scale_halved": self.scale_halved(),
               "skipped_steps": sum(not math.isfinite(n) for n in norms)}  # fmt: skip
        if isinstance(self.trainer, LayerwiseTrainer):  # skipped steps never reach the per-layer optimizers
            out["inner_steps_taken"] = self.trainer.layerwise_optimizer.steps_taken
        return out


def check_fp16(opts, sizes, device, record) -> dict:
    steps, batch, at, optim = sizes["fp16_steps"], sizes["small_batch"], sizes["fp16_overflow_step"], "adamw_torch"
    scaler = "accelerator's torch.amp.GradScaler('cuda')" if device != "cpu" else (
        "torch.amp.GradScaler('cpu') given to the accelerator (tests/test_fp16.py)")  # fmt: skip
    result = {"model": sizes["small_model"], "optim": optim, "steps": steps, "overflow_step": at,
              "max_grad_norm": MAX_GRAD_NORM, "layerwise_clip": "exact", "grad_scaler": scaler,
              "criterion": f"updates within {opts.update_rtol:g} of their norm per parameter (fp16 autocast)",
              "update_rtol": opts.update_rtol, "cases": []}  # fmt: skip
    record(result)
    for ga in (1, 2):
        with attempt(result["cases"], {"ga": ga}, lambda: record(result), device) as case:
            t0 = time.perf_counter()
            _, base_model, dataset = small_setup(sizes, "fp16_steps", ga)
            watch = {"standard": Overflow(at), "layerwise": Overflow(at)}
            for kind, name in (("standard", optim), ("layerwise", f"{optim}_layerwise")):
                train_one(name, base_model, dataset, device, [watch[kind]], fp16=True, learning_rate=1e-3,
                          max_steps=steps, per_device_train_batch_size=batch,
                          gradient_accumulation_steps=ga)  # fmt: skip
            case.update({kind: w.summary() for kind, w in watch.items()})
            std, lw = watch["standard"].trainer, watch["layerwise"].trainer
            case.update(compare_runs(base_model, std, lw, steps, "update_rtol", opts))
            case["scales_equal"] = watch["standard"].scales == watch["layerwise"].scales
            case["seconds"] = round(time.perf_counter() - t0, 2)
            case["overflow_step_skipped"] = all(
                k["injected_step_nonfinite"] and k["params_changed_on_injected_step"] == [] and k["scale_halved"]
                for k in (case["standard"], case["layerwise"])
            )
            case["passed"] = bool(case["overflow_step_skipped"] and case["scales_equal"] and case["passed"])
    result["passed"] = all(c.get("passed") for c in result["cases"])
    return result


class SecondPassOverflow(StepWatch):
    """On step `at_step`, `target`'s gradient times inf the second time it is computed (the stepping backward after
    fp16's measuring one); records the order of the gradients and the layers that stepped (step post-hooks)."""

    def __init__(self, at_step: int, target: str):
        super().__init__(at_step)
        self.target, self.calls, self.order, self.stepped = target, 0, [], []
        self.calls_in_step = self.computed_before = None
        self.stepped_in_step: list[str] = []

    def on_train_begin(self, args, state, control, **kwargs):
        optimizer = self.trainer.layerwise_optimizer
        for name, inner in zip(optimizer.names, optimizer.inner):
            inner.register_step_post_hook(lambda *_, name=name: self.stepped.append(name) if self.active else None)
        for name, param in self.trainer.model.named_parameters():
            param.register_hook(lambda grad, name=name: self.order.append(name) if self.active else None)
            if name == self.target:
                param.register_hook(self._second_call_overflows)

    def _second_call_overflows(self, grad):
        if not self.active:
            return grad
        self.calls += 1
        return grad * float("inf") if self.calls == 2 else grad

    def on_step_begin(self, args, state, control, **kwargs):
        super().on_step_begin(args, state, control, **kwargs)
        self.calls, self.order, self.stepped = 0, [], []

    def step_ended(self):
        self.calls_in_step, self.stepped_in_step = self.calls, list(self.stepped)
        # Each gradient is computed once per backward: the second half of the order is the stepping backward.
        stepping = self.order[len(self.order) // 2 :]
        if self.target in stepping:
            self.computed_before = stepping[: stepping.index(self.target)]


def check_fp16_norm_pass(opts, sizes, device, record) -> dict:
    config, model, dataset = small_setup(sizes, "fp16_steps")
    steps, at = sizes["fp16_steps"], sizes["fp16_overflow_step"]
    target = f"model.layers.{config.num_hidden_layers // 2}.self_attn.o_proj.weight"  # in the middle of backward
    # A scale that does not overflow by itself here, so that the only inf/nan is the injected one.
    scaler = dict(init_scale=2.0**8, growth_interval=1000)
    result = {"model": sizes["small_model"], "optim": "adamw_torch_layerwise", "steps": steps, "ga": 1,
              "max_grad_norm": MAX_GRAD_NORM, "layerwise_clip": "exact", "overflow_step": at,
              "overflow_param": target, "grad_scaler": scaler}  # fmt: skip
    record(result)
    overflow = SecondPassOverflow(at, target)
    with tempfile.TemporaryDirectory() as out:
        args = training_args(out, "adamw_torch_layerwise", device, fp16=True, learning_rate=1e-3, max_steps=steps,
                             per_device_train_batch_size=sizes["small_batch"])  # fmt: skip
        trainer = make_trainer(model, args, dataset, [overflow], device=device, scaler=scaler)
        trainer.train()
    names = [n for n, _ in model.named_parameters()]
    before, changed, stepped = overflow.computed_before or [], overflow.changed or [], overflow.stepped_in_step
    lrs = logged(trainer, "learning_rate")
    result.update(
        hook_calls_on_overflow_step=overflow.calls_in_step, params=len(names), computed_before_overflow=before,
        stepped_on_overflow_step=stepped,
        # A step the route held for later (a large lm_head first in backward) comes after the overflow: not taken.
        computed_before_not_stepped=[n for n in before if n not in stepped], params_changed_on_overflow_step=changed,
        overflow_param_unchanged=target not in changed and target not in stepped,
        steps_taken_kept=set(changed) == set(stepped), none_stepped_after_overflow=set(stepped) <= set(before),
        scales=overflow.scales, scale_halved=overflow.scale_halved(),
        lr_held_on_skipped_step=len(lrs) > at + 1 and lrs[at + 1] == lrs[at],
        nonfinite_params_after_overflow_step=overflow.nonfinite_after_step,
        nonfinite_params_at_end=[n for n, p in model.named_parameters() if not torch.isfinite(p.detach()).all()],
        grad_norm=finite(logged(trainer, "grad_norm")), loss=finite(logged(trainer, "loss")),
        inner_steps_taken=trainer.layerwise_optimizer.steps_taken,
    )  # fmt: skip
    # The measuring and the stepping backward; some layers stepped before the overflow, some gradients came after.
    flags = ("overflow_param_unchanged", "steps_taken_kept", "none_stepped_after_overflow", "scale_halved")
    result["passed"] = bool(overflow.calls_in_step == 2 and stepped and len(before) < len(names) - 1
                            and all(result[k] for k in flags) and overflow.nonfinite_after_step == []
                            and result["nonfinite_params_at_end"] == [] and len(result["loss"]) == steps)  # fmt: skip
    cleanup(device)
    return result


# ---- check 4: FSDP2 + bitsandbytes on local shards, against the same optimizer stepped by hand ----


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def rebuild_by_hand(base, param):
    """`base`'s optimizer anew over `param` (bitsandbytes keeps settings in `args`), as tests/distributed does."""
    from layerwise_hf.bases.params import isolate_bnb_overrides

    accepted = inspect.signature(type(base).__init__).parameters
    kwargs = {k: v for k, v in base.defaults.items() if k in accepted}
    settings = getattr(base, "args", None)
    kwargs.update({k: getattr(settings, k) for k in accepted if settings is not None and hasattr(settings, k)})
    return isolate_bnb_overrides(type(base)([param], **kwargs))


class HandRun(TrainerCallback):
    """Each wrapped optimizer built anew over a copy of its first local shard; every step's local gradient and settings
    recorded (on the stream the hook runs on) and replayed by hand after training."""

    def __init__(self):
        self.trainer, self.records, self.cuda_steps, self.off_default_stream = None, {}, 0, 0

    def on_train_begin(self, args, state, control, **kwargs):
        optimizer = self.trainer.layerwise_optimizer
        for name, inner in zip(optimizer.names, optimizer.inner):
            inner.register_step_pre_hook(lambda inner, *_, name=name: self._pre(name, inner))

    def _pre(self, name, inner):
        param = inner.param_groups[0]["params"][0]
        if param.grad is None:
            return
        if name not in self.records:
            start = torch.nn.Parameter(_local(param).detach().clone())
            self.records[name] = {"by_hand": rebuild_by_hand(inner.base, start), "inner": inner, "steps": []}
        group = {k: v for k, v in inner.param_groups[0].items() if k not in ("params", "name")}
        self.records[name]["steps"].append((_local(param.grad).detach().clone(), group))
        if param.device.type == "cuda":
            self.cuda_steps += 1
            self.off_default_stream += torch.cuda.current_stream() != torch.cuda.default_stream()

    def replay(self) -> tuple[float, bool]:
        worst, exact = 0.0, True
        for record in self.records.values():
            by_hand = record["by_hand"]
            local = by_hand.param_groups[0]["params"][0]
            for grad, group in record["steps"]:
                by_hand.param_groups[0].update(group)
                local.grad = grad
                by_hand.step()
            final = _local(record["inner"].param_groups[0]["params"][0]).detach()
            if final.numel():
                worst = max(worst, float((final.float() - local.detach().float()).abs().max()))
                exact = exact and torch.equal(final, local.detach())
        return worst, exact


FSDP_CASES = (("ga1 exact clip", {}), ("ga2 no clip", {"gradient_accumulation_steps": 2, "max_grad_norm": 0.0}))


def fsdp_case(sizes: dict, device: str, report_path: str) -> None:
    """One rank: the FSDP_CASES, its shards against the replay by hand, reduced over the ranks; rank 0 writes them."""
    import torch.distributed as dist

    from layerwise_hf.placement.local_shard import LocalShardOptimizer

    config = llama_config(sizes["small_model"], sizes["small_seq"], attn="eager")
    steps, batch = sizes["fsdp_steps"], sizes["small_batch"]
    results = []
    for name, overrides in FSDP_CASES:
        ga = overrides.get("gradient_accumulation_steps", 1)
        with tempfile.TemporaryDirectory() as out:
            # TrainingArguments set up the process group (accelerate's PartialState, CPU or not).
            args = training_args(out, "adamw_8bit_layerwise", device, max_steps=steps,
                                 per_device_train_batch_size=batch, **overrides)  # fmt: skip
            world = args.world_size
            dataset = token_dataset(batch * ga * steps * world, sizes["small_seq"], config.vocab_size)
            hand = HandRun()
            trainer = make_trainer(build_model(config), args, dataset, [hand], device=device)
            trainer.train()
        optimizer = trainer.layerwise_optimizer
        wrapped = all(isinstance(inner, LocalShardOptimizer) for inner in optimizer.inner)
        states = [inner.base.state.get(inner.local, {}) for inner in optimizer.inner] if wrapped else []
        if device.startswith("cuda"):
            torch.cuda.synchronize()  # the recorded gradients were copied on the hook's stream
        worst, exact = hand.replay() if wrapped else (math.inf, False)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        # Over the ranks: the largest difference, whether all are exact and wrapped, the hook's streams.
        flags = [worst, float(exact), float(wrapped), hand.cuda_steps, hand.off_default_stream, len(hand.records)]
        # nccl reduces CUDA tensors only, each rank's on its own GPU
        high, low, total = (torch.tensor(flags, dtype=torch.float64, device=trainer.accelerator.device) for _ in "abc")
        for tensor, op in ((high, dist.ReduceOp.MAX), (low, dist.ReduceOp.MIN), (total, dist.ReduceOp.SUM)):
            dist.all_reduce(tensor, op=op)
        eight_bit = sum(s.get("state1", torch.empty(0)).dtype == torch.uint8 for s in states)
        results.append(dict(
            case=name, ga=ga, max_grad_norm=args.max_grad_norm,
            distributed_type=str(trainer.accelerator.distributed_type), route=optimizer.route,
            fsdp_version=getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", None),
            wrapped_local_shard=bool(low[2]), hand_max_diff=float(high[0]), hand_bit_exact=bool(low[1]),
            stepped_params=int(total[5]), cuda_steps=int(total[3]), cuda_steps_off_default_stream=int(total[4]),
            eight_bit_states_rank0=eight_bit, states_rank0=len(states), loss=finite(logged(trainer, "loss")),
            grad_norm=finite(logged(trainer, "grad_norm")),
        ))  # fmt: skip
        del trainer, optimizer, hand, states
        cleanup(device)
    if dist.get_rank() == 0:
        env = {k: os.environ.get(k) for k in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", KEEP_DEVICE_SYNC_ENV)}
        Path(report_path).write_text(json.dumps(finite({"world_size": world, "env": env, "cases": results})))
    # Every rank leaves together, without C++ static destructors (gloo was seen to abort at teardown otherwise).
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def visible_devices(device: str) -> tuple[int, str | None]:
    """The FSDP2 launches' rank count and CUDA_VISIBLE_DEVICES (None: inherited, "all": unset), from GPU_CHECK_*: what
    gpu_check.sh saw before narrowing this process to one GPU."""
    if not device.startswith("cuda"):
        return 2, None  # gloo ranks on CPU
    visible = os.environ.get("GPU_CHECK_CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    count = os.environ.get("GPU_CHECK_DEVICE_COUNT")
    return (int(count) if count else torch.cuda.device_count()), visible


def fsdp_launch(world: int, opts, sizes, device: str, visible: str | None) -> dict:
    cpu = not device.startswith("cuda")
    config = ROOT / "configs" / "accelerate" / ("cpu_fsdp2.yaml" if cpu else "gpu_fsdp2.yaml")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if cpu:
        # As tests/test_fsdp2_8bit.py: accelerate keeps FSDP for accelerator devices only, gloo ranks need forcing.
        env.update(ACCELERATE_USE_CPU="true", LAYERWISE_HF_FORCE_FSDP_CPU="1", OMP_NUM_THREADS="1")
    elif visible == "all":
        env.pop("CUDA_VISIBLE_DEVICES", None)
    elif visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "fsdp.json"
        # fp32 (the config's bf16 autocast is not what is checked), and every rank builds the model from its config.
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
               str(world), "--main_process_port", str(port), "--mixed_precision", "no",
               "--fsdp_cpu_ram_efficient_loading", "false", str(Path(__file__).resolve()), "--fsdp_case", str(report),
               "--device", device] + (["--tiny"] if opts.tiny else [])  # fmt: skip
        t0 = time.perf_counter()
        proc = run_subprocess(cmd, opts, sizes["fsdp_timeout"], env=env)
        if proc.returncode != 0 or not report.exists():
            raise RuntimeError(f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        out = json.loads(report.read_text())
    out["seconds"] = round(time.perf_counter() - t0, 1)
    for case in out["cases"]:
        case["passed"] = bool(case["wrapped_local_shard"] and case["hand_bit_exact"] and case["hand_max_diff"] == 0.0
                              and case["route"] == "fsdp2" and case["fsdp_version"] == 2
                              and case["eight_bit_states_rank0"] > 0 and len(case["loss"]) == sizes["fsdp_steps"]
                              and all(isinstance(x, float) for x in case["loss"]))  # fmt: skip
    out["passed"] = out["world_size"] == world and all(c["passed"] for c in out["cases"])
    return out


def check_fsdp2(opts, sizes, device, record) -> dict:
    count, visible = visible_devices(device)
    result = {"optim": "adamw_8bit_layerwise", "model": sizes["small_model"], "steps": sizes["fsdp_steps"],
              "config": f"configs/accelerate/{'gpu' if device.startswith('cuda') else 'cpu'}_fsdp2.yaml",
              "launch_overrides": "--mixed_precision no --fsdp_cpu_ram_efficient_loading false",
              "criterion": "every rank's local shards bit-identical to the same bitsandbytes optimizer stepped by "
              "hand on them with the same gradients", "devices_visible": count, "runs": []}  # fmt: skip
    record(result)
    for world in (1, 2):
        with attempt(result["runs"], {"world_size": world}, lambda: record(result)) as run:
            if world > count:
                run.update(skipped=True, reason=f"{world} ranks need {world} GPUs; {count} visible")
            else:
                run.update(fsdp_launch(world, opts, sizes, device, visible))
    ran = [r for r in result["runs"] if not r.get("skipped")]
    result["passed"] = bool(ran) and all(r.get("passed") for r in ran)
    return result


# ---- checks 5-7: a ~1B model in fresh processes: memory, step time, host offload ----


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step, the device drained at both ends."""

    def __init__(self, cuda: bool):
        self.cuda, self.seconds, self.t0 = cuda, [], None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self.t0)


class SyncCounter:
    """Counts bitsandbytes' per-parameter device syncs (`bitsandbytes.optim.optimizer.sync_gpu`), on any device."""

    def __init__(self):
        import bitsandbytes.optim.optimizer as bnb_optimizer

        self.original, self.calls = bnb_optimizer.sync_gpu, 0
        bnb_optimizer.sync_gpu = self

    def __call__(self, tensor):
        self.calls += 1
        return self.original(tensor)


def run_case(spec: dict, sizes: dict, device: str) -> dict:
    """One run of the ~1B model (tiny under --tiny); `spec`: optim, steps, max_grad_norm, offload, memory."""
    optim, steps, seq, batch = spec["optim"], spec["steps"], sizes["memory_seq"], sizes["memory_batch"]
    config = llama_config(sizes["memory_model"], seq, attn="sdpa")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):  # random init on the device: seconds instead of minutes on CPU for 1.1B
        model = LlamaForCausalLM(config)
    model.to(torch.bfloat16)
    build_s = time.perf_counter() - t0
    cuda, syncs, timer = device.startswith("cuda"), SyncCounter(), StepTimer(device.startswith("cuda"))
    with tempfile.TemporaryDirectory() as out:
        # The estimator's layer-wise gradient term is the streamed one (measured, then stepped one by one): pin the
        # norm pass that streams. 'auto' would hold every gradient where activations outweigh them (the tiny CPU dry
        # run), which the estimator does not model; `layerwise-hf plan` does.
        extra = {"layerwise_norm_pass": "retain"} if optim.endswith("_layerwise") else {}
        extra |= {"layerwise_offload": spec["offload"]} if spec.get("offload") else {}
        args = training_args(out, optim, device, learning_rate=1e-4, max_steps=steps,
                             max_grad_norm=spec["max_grad_norm"], per_device_train_batch_size=batch,
                             activation_checkpointing=True,
                             activation_checkpointing_kwargs={"use_reentrant": False}, **extra)  # fmt: skip
        trainer = make_trainer(model, args, token_dataset(batch * steps, seq, config.vocab_size), [timer], device)
        cleanup(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            allocated_before = torch.cuda.memory_allocated()
        t1 = time.perf_counter()
        trainer.train()
        if cuda:
            torch.cuda.synchronize()
        train_s = time.perf_counter() - t1
    result = {"optim": optim, KEEP_DEVICE_SYNC_ENV: os.environ.get(KEEP_DEVICE_SYNC_ENV),
              "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
              "num_parameters": sum(p.numel() for p in model.parameters()),
              "num_tensors": sum(1 for _ in model.parameters()),
              "activation_checkpointing": bool(args.activation_checkpointing), "max_grad_norm": args.max_grad_norm,
              "build_seconds": round(build_s, 2), "train_seconds": round(train_s, 2),
              "step_seconds": [round(s, 5) for s in timer.seconds], "bnb_device_syncs": syncs.calls,
              "optimizer_state_bytes_measured": sum(state_bytes_by_device(trainer).values()),
              "grad_norm": finite(logged(trainer, "grad_norm")), "loss": finite(logged(trainer, "loss"))}  # fmt: skip
    if cuda:
        result.update(measured=True, allocated_before_train_bytes=allocated_before,
                      peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                      peak_reserved_bytes=torch.cuda.max_memory_reserved())  # fmt: skip
    else:
        result.update(measured=False, note="memory not measured on CPU (no CUDA allocator)")
    if isinstance(trainer, LayerwiseTrainer):
        result["layerwise_peak_grad_bytes"] = int(trainer.layerwise_optimizer.peak_grad_bytes)
    if spec.get("offload"):
        result.update(offload_summary(trainer, spec["offload"]))
    if spec.get("memory"):
        est = estimate(config, optimizer=optim, dtype="bfloat16")
        keys = ("weight_bytes", "gradient_bytes", "optimizer_state_bytes", "total_bytes", "all_gradient_bytes")
        result["estimate"] = {k: getattr(est, k) for k in keys}
    return result


def run_cases(specs: list[dict], sizes: dict, device: str) -> None:
    """`run_case` of each spec in turn, each printed as a `CASE_JSON` line (an error too); emptied between."""
    if any(spec.get("offload") for spec in specs):
        simulate_offload_on_cpu(device)
    for spec in specs:
        try:
            out = run_case(spec, sizes, device)
        except Exception:
            out = {"optim": spec["optim"], "error": traceback.format_exc()[-4000:]}
        cleanup(device)
        print("CASE_JSON " + json.dumps({"label": spec.get("label"), **out}), flush=True)


def launch_cases(specs: list[dict], opts, timeout: float, device_sync: str | None = None) -> list[dict]:
    """`run_cases(specs)` in a fresh process (its own CUDA context), KEEP_DEVICE_SYNC_ENV=`device_sync`; a run it did
    not reach reads as an error."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--cases", json.dumps(specs), "--device", opts.device]
    env = {k: v for k, v in os.environ.items() if k != KEEP_DEVICE_SYNC_ENV}
    env |= {KEEP_DEVICE_SYNC_ENV: device_sync} if device_sync is not None else {}
    try:
        proc = run_subprocess(cmd + (["--tiny"] if opts.tiny else []), opts, timeout, env=env)
        stdout, stderr, why = proc.stdout, proc.stderr, f"exit {proc.returncode}"
    except subprocess.TimeoutExpired as e:
        decode = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        stdout, stderr, why = decode(e.stdout), decode(e.stderr), f"timed out after {e.timeout:.0f} s"
    done = [json.loads(ln.split(" ", 1)[1]) for ln in stdout.splitlines() if ln.startswith("CASE_JSON ")]
    missing = [{"label": spec.get("label"), "optim": spec["optim"], "error": f"not reached ({why})\n{stderr[-3000:]}"}
               for spec in specs[len(done):]]  # fmt: skip
    return done + missing


def launch_case(spec: dict, opts, timeout: float, device_sync: str | None = None) -> dict:
    """`run_case(spec)` in a fresh process; raises with its error."""
    out = launch_cases([spec], opts, timeout, device_sync)[0]
    if "error" in out:
        raise RuntimeError(out["error"])
    out.pop("label")
    return out


def offload_summary(trainer, mode: str) -> dict:
    """Where a layer-wise run with `layerwise_offload=mode` kept its gradients and states."""
    from layerwise_hf.optim.host_offload import offload_of
    from layerwise_hf.placement.host_step import HostStepOptimizer

    out = {"layerwise_offload": mode, "state_bytes_by_device": state_bytes_by_device(trainer)}
    layerwise = trainer.layerwise_optimizer if isinstance(trainer, LayerwiseTrainer) else None
    offload = offload_of(layerwise) if layerwise is not None else None
    if offload is not None:
        out["host_gradient_buffer_bytes"] = offload.host_bytes()
        out["device_gradient_copies_peak_bytes"] = offload.peak_device_bytes
        out["transfer"] = type(offload.transfer).__name__ if offload.transfer is not None else None
    if layerwise is not None and mode == "optimizer":
        hosted = [inner for inner in layerwise.inner if isinstance(inner, HostStepOptimizer)]
        out["host_stepped_tensors"] = len(hosted)
        out["host_parameter_copy_bytes"] = sum(inner.host.numel() * inner.host.element_size() for inner in hosted)
    return out


def plan_memory(sizes: dict, device: str) -> dict:
    """`layerwise-hf plan` of the memory check's two runs, on their device (CUDA's optimizer defaults on CUDA)."""
    from layerwise_hf.plan import plan  # here only: the --cases and FSDP2 processes do not need it

    t0 = time.perf_counter()
    planned = plan(llama_config(sizes["memory_model"], sizes["memory_seq"], attn="sdpa"), [MEMORY_OPTIMS[0]],
                   seq_len=sizes["memory_seq"], micro_batch=sizes["memory_batch"], grad_accum=1,
                   max_grad_norm=MAX_GRAD_NORM, clip_mode="exact", torch_dtype="bfloat16", gradient_checkpointing=True,
                   device="cuda" if device.startswith("cuda") else "cpu")  # fmt: skip  # and its layer-wise form
    rows = {r.optimizer: dict(peak_bytes=r.peak_bytes, categories=r.categories, when=r.when,
                              optimizer_state_from_rule=r.optimizer_state_from_rule)
            for r in planned.rows}  # fmt: skip
    assert set(rows) == set(MEMORY_OPTIMS), sorted(rows)
    return {"seconds": round(time.perf_counter() - t0, 1), "device": planned.setup.device,
            "extrapolated_layers": planned.extrapolated, "rows": rows,
            # What the plan cannot follow in these runs, so that a ratio away from 1 can be read.
            "note": "plan: one steady-state step, layer-wise norm pass chosen as 'auto' (the run pins 'retain'); "
            "bitsandbytes state from the estimator's rules, its step temporaries not counted; measured: "
            "max_memory_allocated over all steps of train(), the first included; the CUDA context is in neither",
            }  # fmt: skip


def in_background(out: dict, function, *args) -> None:
    """`out["result"] = function(*args)` or `out["error"]`: a daemon thread's target, that cannot hold the exit."""
    try:
        out["result"] = function(*args)
    except Exception:
        out["error"] = traceback.format_exc()


def big_model(sizes: dict) -> dict:
    """What the JSON says of the ~1B model's runs."""
    return {"model": sizes["memory_model"], "dtype": "bfloat16", "seq": sizes["memory_seq"],
            "batch": sizes["memory_batch"], "activation_checkpointing": "use_reentrant=False"}  # fmt: skip


def check_memory(opts, sizes, device, record) -> dict:
    result = {**big_model(sizes), "steps": sizes["memory_steps"], "max_grad_norm": MAX_GRAD_NORM,
              "layerwise_clip": "exact", "isolation": "one subprocess per optimizer", "cases": []}  # fmt: skip
    cases = result["cases"]
    record(result)
    # The plan needs only the CPU: it runs in a thread while the GPU runs, and adds no time unless it is the slower.
    planned: dict = {}
    planning = threading.Thread(target=in_background, args=(planned, plan_memory, sizes, device), daemon=True)
    planning.start()
    for optim in MEMORY_OPTIMS:
        with attempt(cases, {"optim": optim}, lambda: record(result), fail=False) as case:
            spec = {"optim": optim, "steps": sizes["memory_steps"], "max_grad_norm": MAX_GRAD_NORM, "memory": True}
            case.update(launch_case(spec, opts, sizes["memory_timeout"]))
    planning.join(timeout=max(1.0, min(sizes["memory_timeout"], time_left(opts))))
    result["plan"] = planned.get("result") or {"error": planned.get("error", "the plan did not finish in time")}
    for case in cases:  # each case's planned peak, and on CUDA the measured peak over it
        row = result["plan"].get("rows", {}).get(case["optim"])
        if row is not None:
            case["planned_peak_bytes"] = row["peak_bytes"]
            if case.get("measured"):
                case["measured_over_planned"] = round(case["peak_allocated_bytes"] / row["peak_bytes"], 4)
    record(result)
    std, lw = ({c["optim"]: c for c in cases}.get(optim, {}) for optim in MEMORY_OPTIMS)
    if std.get("grad_norm") and lw.get("grad_norm"):
        # Not a pass criterion (bf16 weights, 8-bit state), but the two runs should log the same norms.
        result["grad_norm_max_abs_diff"] = list_diff(std["grad_norm"], lw["grad_norm"])
    if any("error" in c for c in cases):
        result["passed"] = False
    elif std.get("measured") and lw.get("measured"):
        saved = std["peak_allocated_bytes"] - lw["peak_allocated_bytes"]
        result.update(peak_allocated_saved_bytes=saved,
                      peak_reserved_saved_bytes=std["peak_reserved_bytes"] - lw["peak_reserved_bytes"],
                      estimate_saved_bytes=std["estimate"]["total_bytes"] - lw["estimate"]["total_bytes"],
                      passed=saved > 0)  # fmt: skip
    else:  # CPU: both runs completed and the estimator answered; nothing measured, nothing to compare
        result.update(measured=False, passed=True, note="memory not measured on CPU")
    return result


def check_step_time(opts, sizes, device, record) -> dict:
    steps, warmup = sizes["step_time_steps"], sizes["step_time_warmup"]
    result = {**big_model(sizes), "steps": steps, "warmup_steps_dropped": warmup, "max_grad_norm": 0.0,
              "note": "clipping off: one backward per step on both sides, so the times compare the steps themselves",
              "isolation": "one subprocess per run", "cases": []}  # fmt: skip
    cases, ms = result["cases"], lambda s: round(1000 * s, 2)
    record(result)
    for label, optim, device_sync in STEP_TIME_RUNS:
        case = {"run": label, "optim": optim, KEEP_DEVICE_SYNC_ENV: device_sync}
        with attempt(cases, case, lambda: record(result), fail=False):
            spec = {"optim": optim, "steps": steps, "max_grad_norm": 0.0}
            out = launch_case(spec, opts, sizes["step_time_timeout"], device_sync)
            timed = out["step_seconds"][warmup:]
            case.update(median_step_ms=ms(statistics.median(timed)), min_step_ms=ms(min(timed)),
                        max_step_ms=ms(max(timed)), step_ms=[ms(s) for s in out["step_seconds"]],
                        steps_run=len(out["step_seconds"]), **{k: out[k] for k in ("bnb_device_syncs", "num_tensors",
                        "loss", "measured") + ("peak_allocated_bytes",) * out["measured"]})  # fmt: skip
    std, lw, kept = cases
    if not any("error" in c for c in cases):
        expected = steps * std["num_tensors"]  # bitsandbytes syncs after every parameter of every step
        result.update(sync_removed_saves_ms=round(kept["median_step_ms"] - lw["median_step_ms"], 2),
                      sync_removed_saves_percent=round(100 * (1 - lw["median_step_ms"] / kept["median_step_ms"]), 1),
                      layerwise_vs_standard_ms=round(lw["median_step_ms"] - std["median_step_ms"], 2),
                      syncs_where_expected=std["bnb_device_syncs"] == expected == kept["bnb_device_syncs"]
                      and lw["bnb_device_syncs"] == 0)  # fmt: skip
    result["measured"] = all(c.get("measured") for c in cases)
    if not result["measured"]:
        result["note_cpu"] = "on CPU bitsandbytes' sync does nothing: the times are not what a GPU shows"
    result["passed"] = bool(result.get("syncs_where_expected")) and all(c.get("steps_run") == steps for c in cases)
    return result


def simulate_offload_on_cpu(device: str) -> None:
    """On CPU, the offload code's stand-in (a copy thread, a delay on every copy) runs the path a GPU takes."""
    if device == "cpu":
        from layerwise_hf.placement.transfer import DELAY_ENV, SIMULATE_ENV

        os.environ.setdefault(SIMULATE_ENV, "1")
        os.environ.setdefault(DELAY_ENV, "0.001")


def offload_parity(opts, sizes, device, cases: list, record) -> None:
    """adamw_torch through Trainer against adamw_torch_layerwise with each offload mode, GA 1 and 2, exact clipping."""
    steps, batch = sizes["parity_steps"], sizes["small_batch"]
    # The host's AdamW is not CUDA's kernel, nor the host's norm of a GA sum CUDA's: on a GPU, 'optimizer' and
    # 'gradients' at GA 2 are compared by their updates, not bit for bit.
    host_opts = argparse.Namespace(**{**vars(opts), "update_rtol": opts.offload_rtol})
    for ga in (1, 2):
        _, base_model, dataset = small_setup(sizes, "parity_steps", ga)
        common = dict(max_steps=steps, per_device_train_batch_size=batch, gradient_accumulation_steps=ga)
        std = None
        for mode in OFFLOAD_MODES:
            with attempt(cases, {"mode": mode, "ga": ga}, lambda: record({}), device) as case:
                t0 = time.perf_counter()
                std = std if std is not None else train_one("adamw_torch", base_model, dataset, device, **common)
                lw = train_one("adamw_torch_layerwise", base_model, dataset, device, layerwise_offload=mode, **common)
                # At GA > 1 the norm of a window's host sum is the CPU's kernel, not CUDA's _foreach_norm: the clip
                # coefficient, and so the weights, differ in the last bits there (docs/offload.md).
                exact = (mode == "gradients" and ga == 1) or not device.startswith("cuda")
                case.update(compare_runs(base_model, std, lw, steps, "bit-exact" if exact else "update_rtol",
                                         opts if exact else host_opts))  # fmt: skip
                case.update(offload_summary(lw, mode), seconds=round(time.perf_counter() - t0, 2))
                # The gradients waited on the host (exact clipping needs every one before a step), and with
                # 'optimizer' no state is left on the device.
                on_host = case["host_gradient_buffer_bytes"] > 0
                hosted = case.get("host_stepped_tensors") == len(lw.layerwise_optimizer.inner)
                on_cpu = not device.startswith("cuda") or set(case["state_bytes_by_device"]) <= {"cpu"}
                case["passed"] = bool(case["passed"] and on_host and (mode == "gradients" or (hosted and on_cpu)))


def check_offload(opts, sizes, device, record) -> dict:
    simulate_offload_on_cpu(device)
    cuda = device.startswith("cuda")
    steps, warmup = sizes["offload_steps"], sizes["offload_warmup"]
    criterion = "bit-exact (host and device are both the CPU)"
    if cuda:
        criterion = (f"updates within {opts.offload_rtol:g} of their norm per parameter, grad_norm within it (the "
                     "host's AdamW kernel against CUDA's)")  # fmt: skip
    result = {"parity_model": sizes["small_model"], "parity_steps": sizes["parity_steps"],
              "max_grad_norm": MAX_GRAD_NORM, "layerwise_clip": "exact",
              "criterion": {"gradients": "bit-exact weights and grad_norm against adamw_torch"
                            + (" at GA 1; at GA 2 as 'optimizer' (the host's norm of a GA sum)" if cuda else ""),
                            "optimizer": criterion},
              "cases": [], **big_model(sizes), "steps": steps, "warmup_steps_dropped": warmup,
              "isolation": "one process for the four runs, emptied and peak statistics reset before each",
              "runs": []}  # fmt: skip
    record(result)
    offload_parity(opts, sizes, device, result["cases"], lambda _: record(result))
    specs = [{"label": label, "optim": optim, "offload": offload, "steps": steps, "max_grad_norm": MAX_GRAD_NORM}
             for label, optim, offload in OFFLOAD_RUNS]  # fmt: skip
    runs = result["runs"]
    for out in launch_cases(specs, opts, sizes["offload_timeout"]):
        run = {"run": out.pop("label"), **out}
        if "error" not in run:
            timed = run["step_seconds"][warmup:]
            run.update(median_step_ms=round(1000 * statistics.median(timed), 2), steps_run=len(run["step_seconds"]))
        runs.append(run)
    record(result)
    std, none, grads, host = runs
    finished = all("error" not in r and r["steps_run"] == steps for r in runs)
    if finished:
        for r in runs:
            r["vs_standard"] = round(r["median_step_ms"] / std["median_step_ms"], 3)
            r["grad_norm_max_abs_diff_vs_standard"] = list_diff(std["grad_norm"], r["grad_norm"])
    result["measured"] = finished and all(r.get("measured") for r in runs)
    if result["measured"]:
        for r in (grads, host):
            r["peak_allocated_saved_vs_no_offload_bytes"] = none["peak_allocated_bytes"] - r["peak_allocated_bytes"]
    memory_ok = not result["measured"] or host["peak_allocated_bytes"] < none["peak_allocated_bytes"]
    # Every tensor stepped on the host; on CUDA every state on the CPU (on CPU the device is the CPU too).
    states_ok = finished and host.get("host_stepped_tensors") == host["num_tensors"]
    states_ok = states_ok and (not cuda or set(host["state_bytes_by_device"]) <= {"cpu"})
    result["passed"] = bool(all(c.get("passed") for c in result["cases"]) and finished and memory_ok and states_ok)
    if not result["measured"]:
        result["note"] = "memory not measured on CPU; the times are the CPU stand-in's, not what a GPU shows"
    return result


# ---- report ----


def environment(device: str) -> dict:
    import accelerate
    import transformers

    cuda = device.startswith("cuda")
    env = {"device": device, "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "torch_build": "CUDA" if torch.version.cuda else "CPU",
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
           "transformers": transformers.__version__, "accelerate": accelerate.__version__,
           "python": platform.python_version(), "python_executable": sys.executable,
           "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
           "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
           # What gpu_check.sh saw before narrowing this process to one GPU (the FSDP2 launches get it back).
           "gpu_check_sh": {k: os.environ.get(k) for k in ("GPU_CHECK_DEVICE_COUNT",
                                                            "GPU_CHECK_CUDA_VISIBLE_DEVICES")},
           "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}  # fmt: skip
    try:
        import bitsandbytes

        env["bitsandbytes"] = bitsandbytes.__version__
    except Exception as e:
        env["bitsandbytes"] = f"not importable: {e}"
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    env["git_commit"] = git.stdout.strip() or None
    if cuda:
        env["gpu_total_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
        env["devices_visible_to_fsdp2"] = visible_devices(device)[0]
    return env


def show(key: str, value) -> str:
    """A value in the table: bytes in MiB, lists of names as their count, floats to 4 digits."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show(key, v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list) and value and isinstance(value[0], str):
        return str(len(value))
    if "_bytes" in key and isinstance(value, (int, float)):
        return f"{value / MIB:.1f}MiB"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def status_of(check: dict) -> str:
    if check.get("status") == "NOT RUN":
        return "NOT RUN"
    if "passed" not in check:
        return "ERROR" if "error" in check else "INCOMPLETE"
    return "PASS" if check["passed"] else "FAIL"


COMPARED = ("criterion", "exact", "max_abs_param_diff", "update_max_rel_diff", "grad_norm_max_abs_diff",
            "passed_former_atol")  # fmt: skip
# The table: (check, where its rows are (None: the check is the row), a row's name, the keys its detail shows
# (a.b: b of a), whether a row is judged on its own (PASS / FAIL) or only the check is ("-")). FSDP2's runs hold cases.
TABLE = (
    ("parity", "cases", "parity {optim} GA{ga}", (*COMPARED, "clipped_steps"), True),
    ("fp16", "cases", "fp16 adamw_torch GA{ga}", ("overflow_step_skipped", "scales_equal", *COMPARED), True),
    ("fp16_norm_pass", None, "fp16 overflow in 2nd backward", ("overflow_param", "overflow_param_unchanged",
     "params_changed_on_overflow_step", "stepped_on_overflow_step", "computed_before_overflow", "scale_halved",
     "nonfinite_params_at_end"), True),
    ("fsdp2_8bit", "runs", "fsdp2 adamw_8bit x{world_size} {case}", ("reason", "hand_max_diff", "hand_bit_exact",
     "route", "eight_bit_states_rank0", "states_rank0", "cuda_steps_off_default_stream", "cuda_steps"), True),
    ("memory", "cases", "memory {optim}", ("peak_allocated_bytes", "peak_reserved_bytes", "planned_peak_bytes",
     "measured_over_planned", "estimate.weight_bytes", "estimate.gradient_bytes", "estimate.optimizer_state_bytes",
     "optimizer_state_bytes_measured"), False),
    ("step_time", "cases", "step time {run}", ("median_step_ms", "min_step_ms", "max_step_ms", "bnb_device_syncs",
     "steps_run"), False),
    ("offload", "cases", "offload parity {mode} GA{ga}", (*COMPARED, "state_bytes_by_device",
     "host_gradient_buffer_bytes"), True),
    ("offload", "runs", "offload {run}", ("median_step_ms", "vs_standard", "peak_allocated_bytes",
     "peak_allocated_saved_vs_no_offload_bytes", "state_bytes_by_device"), False),
)  # fmt: skip
# What the summary line of a check adds to its status.
SUMMARY = {"memory": ("peak_allocated_saved_bytes", "peak_reserved_saved_bytes", "estimate_saved_bytes"),
           "step_time": ("sync_removed_saves_ms", "sync_removed_saves_percent", "layerwise_vs_standard_ms"),
           }  # fmt: skip


def details(c: dict, keys) -> str:
    values = {k: functools.reduce(lambda d, part: d.get(part, {}), k.split("."), c) for k in keys}
    return " ".join(f"{k.split('.')[-1]}={show(k, v)}" for k, v in values.items() if v not in (None, {}, ""))


def table_rows(checks: dict) -> list[tuple[str, str, str]]:
    rows = []
    for name, where, row, keys, judged in TABLE:
        check = checks.get(name, {})
        for item in check.get(where, []) if where else [check] if "params" in check else []:
            for c in [{**item, **case} for case in item.get("cases", [])] or [item]:
                status = "SKIP" if c.get("skipped") else "PASS" if c.get("passed") else "FAIL" if judged else "-"
                rows.append((row.format_map(collections.defaultdict(str, c)).strip(),
                             "ERROR" if "error" in c else status,
                             "" if "error" in c else details(c, keys)))  # fmt: skip
    return rows


def summary_line(name: str, check: dict) -> str:
    skipped = "; ".join(r["reason"] for r in check.get("runs", []) if r.get("skipped"))
    extra = details({**check, "skipped": skipped, "plan_error": check.get("plan", {}).get("error") and "see the JSON"},
                    (*SUMMARY.get(name, ()), "note_cpu", "skipped", "plan_error"))  # fmt: skip
    return f"  => {name}: {status_of(check)}" + (f" ({extra})" if extra else "")


def print_table(report: dict) -> None:
    env, checks = report["environment"], report["checks"]
    print(f"\nGPU check on {env.get('device_name')} (torch {env.get('torch')}, {env.get('torch_build')} build, "
          f"CUDA {env.get('cuda')})")  # fmt: skip
    rows = table_rows(checks)
    width = max((len(r[0]) for r in rows), default=10)
    for name, res, detail in rows:
        print(f"  {name:<{width}}  {res:<5}  {detail}")
    for name, check in checks.items():
        print(summary_line(name, check))
    for name, check in checks.items():
        for c in check.get("cases", []) + check.get("runs", []):
            if "error" in c:
                which = c.get("optim", c.get("world_size", ""))
                print(f"\n{name} {which} GA{c.get('ga', '-')} error:\n{c['error'][-1500:]}")
        if "error" in check:
            print(f"\n{name} error:\n{check['error'][-3000:]}")
    print(f"\nall passed: {report.get('passed')}  ({report.get('seconds')} s)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models; the CPU dry run (device defaults to cpu)")
    parser.add_argument("--device", default=None, help="cuda (default) or cpu (default with --tiny)")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "gpu_check.json"))
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    parser.add_argument("--parity_optims", default=",".join(PARITY_OPTIMS),
                        help=f"comma-separated subset of {','.join(PARITY_OPTIMS)}")  # fmt: skip
    floats = {
        "update_rtol": (1e-6, "where weights are not expected bit-identical (fp16): largest |update_lw - update_std| "
                        "/ |update_std| per parameter, updates being w_after - w_before"),
        "parity_atol": (1e-4, "the former criterion (largest parameter difference), reported as passed_former_atol, "
                        "not judged"),
        "inject_clip_error": (0.0, "fault injection for the parity check: scale every layer-wise step's gradient "
                              "by 1 - this (a clip coefficient off by this fraction); the check must then fail"),
        "time_limit": (None, "seconds: no subprocess runs past it (gpu_check.sh sets it)"),
        "offload_rtol": (1e-4, "the offload check on CUDA: layerwise_offload='optimizer' steps AdamW on the host, "
                         "whose kernel is not CUDA's; its updates must be within this of the standard ones (per "
                         "parameter, relative to their norm)"),
    }  # fmt: skip
    for name, (default, what) in floats.items():
        parser.add_argument(f"--{name}", type=float, default=default, help=what)
    parser.add_argument("--cases", default=None, help=argparse.SUPPRESS)  # internal: ~1B runs in one process
    parser.add_argument("--fsdp_case", default=None, help=argparse.SUPPRESS)  # internal: one FSDP2 rank
    opts = parser.parse_args(argv)
    opts.device = opts.device or ("cpu" if opts.tiny else "cuda")
    for name, valid in (("checks", CHECKS), ("parity_optims", PARITY_OPTIMS)):
        setattr(opts, name, [c.strip() for c in getattr(opts, name).split(",") if c.strip()])
        if set(getattr(opts, name)) - set(valid):
            parser.error(f"--{name}: unknown {sorted(set(getattr(opts, name)) - set(valid))}; choose from "
                         f"{', '.join(valid)}")  # fmt: skip
    if not 0.0 <= opts.inject_clip_error < 1.0:
        parser.error(f"--inject_clip_error: {opts.inject_clip_error} is not in [0, 1)")
    opts.deadline = None if opts.time_limit is None else time.monotonic() + opts.time_limit
    return opts


def run_checks(opts, sizes, report, write) -> int:
    functions = {"parity": check_parity, "fp16": check_fp16, "fp16_norm_pass": check_fp16_norm_pass,
                 "fsdp2_8bit": check_fsdp2, "memory": check_memory, "step_time": check_step_time,
                 "offload": check_offload}  # fmt: skip
    rc = 0
    for name in opts.checks:
        check = report["checks"][name] = {}

        def record(partial, check=check):
            check.update(partial)
            write()

        t1 = time.perf_counter()
        budget = None if opts.tiny else CHECK_BUDGET_S[name]
        print(f"gpu_check: {name} (budget {budget} s, {time_left(opts):.0f} s left) ...", flush=True)
        try:
            check.update(functions[name](opts, sizes, opts.device, record))
        except Terminated as e:
            check.update(passed=False, error=f"terminated by {e} (time limit?)")
            for case in check.get("cases", []) + check.get("runs", []):
                if "passed" not in case:
                    case.update(passed=False, error="interrupted")
            rc = 124
        except Exception:
            check.update(passed=False, error=traceback.format_exc())
        check.update(seconds=round(time.perf_counter() - t1, 1), budget_s=budget, status=status_of(check))
        write()
        print(f"gpu_check: {name} {check['status']} in {check['seconds']} s (budget {budget} s)", flush=True)
        if rc:
            for rest in opts.checks[opts.checks.index(name) + 1 :]:
                report["checks"][rest] = {"status": "NOT RUN", "passed": False}
            break
    return rc


def main(argv=None) -> int:
    opts = parse_args(argv)
    sizes = SIZES["tiny" if opts.tiny else "full"]
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU build"
        print(f"gpu_check: torch.cuda.is_available() is False (torch {torch.__version__}, {build}, at "
              f"{sys.executable}); run on a CUDA machine, or use --tiny for the CPU dry run",
              file=sys.stderr)  # fmt: skip
        return 2
    if opts.cases:
        run_cases(json.loads(opts.cases), sizes, opts.device)
        return 0
    if opts.fsdp_case:
        fsdp_case(sizes, opts.device, opts.fsdp_case)

    torch.use_deterministic_algorithms(True, warn_only=True)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    t0 = time.perf_counter()
    output = Path(opts.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    report = {"script": "benchmarks/gpu_check.py", "tiny": opts.tiny,
              "argv": sys.argv[1:] if argv is None else list(argv), "environment": environment(opts.device),
              "sizes": sizes, "checks": {}, "passed": None}  # fmt: skip

    def write():
        report["seconds"] = round(time.perf_counter() - t0, 1)
        tmp = output.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(finite(report), indent=1, allow_nan=False, default=str) + "\n")
        tmp.replace(output)

    rc = run_checks(opts, sizes, report, write)
    report["passed"] = all(report["checks"].get(n, {}).get("passed") for n in opts.checks) and not rc
    write()
    print_table(report)
    print(f"JSON: {output}")
    return rc or (0 if report["passed"] else 1)


if __name__ == "__main__":
    sys.exit(main())
