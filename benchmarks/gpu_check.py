"""The GPU check: the layer-wise optimizers on one CUDA device, against the standard ones, in one run of a few minutes.

Run it through `bash benchmarks/gpu_check.sh` (sets the environment, refuses to start without CUDA, bounds the time),
or directly:

    python benchmarks/gpu_check.py                      # CUDA: the three checks below (not yet run on a GPU)
    python benchmarks/gpu_check.py --tiny               # CPU dry run: tiny models, same code paths (~80 s, 2 cores)
    python benchmarks/gpu_check.py --checks parity,fp16 --output /tmp/gpu_check.json

Models are built from `LlamaConfig` with random weights (nothing downloaded). Three checks, each in its own
try/except so that one failing keeps the others' numbers:

1. `parity`: `adamw_torch`, `adamw_8bit` and `sgd` through `Trainer` against their `_layerwise` forms through
   `LayerwiseTrainer`; a small Llama (vocab 1024, hidden 256, 4 layers: bitsandbytes quantizes its matrices), fp32,
   GA 1 and 2, `max_grad_norm=1.0` with `layerwise_clip="exact"`, eager attention, deterministic algorithms. Reports
   the largest absolute parameter difference after training and both logged `grad_norm` lists. On CPU the two are
   bit-identical (the test suite's promise); on CUDA a difference is reported, and passes under `--parity_atol`.
2. `fp16`: `fp16=True` (autocast + the accelerator's CUDA `GradScaler`), same model, GA 1 and 2, clipping on. A
   forward hook on the input embedding multiplies its output by inf on one chosen step: that step must be skipped by
   both (non-finite `grad_norm` logged, no parameter changed across it, the scale halved), the scale histories and
   `grad_norm` lists must agree, and the final parameters must match.
3. `memory`: a ~1.1B Llama (vocab 32000, hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads) with
   bfloat16 weights, activation checkpointing, micro-batch 4 x 512, a few steps of `adamw_8bit` vs
   `adamw_8bit_layerwise`, each in a fresh process: `torch.cuda.max_memory_allocated()` / `max_memory_reserved()`
   over `train()` (peak stats reset just before), next to `layerwise_hf.estimate.estimate()`'s weights / gradients /
   optimizer state for the same config and the optimizer state actually held. Passes when the layer-wise peak is
   below the standard one. On CPU (`--tiny`) the same runs happen but memory is reported as not measured.

Writes one JSON (`--output`, default `benchmarks/results/gpu_check.json`, rewritten after every check so a run cut
short keeps what it measured) and prints a table. Exit status: 0 when every check passed, 1 otherwise, 2 when the
asked device is missing, 124 when stopped by SIGTERM/SIGINT (the time limit of gpu_check.sh).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
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
CHECKS = ("parity", "fp16", "memory")
PARITY_OPTIMS = ("adamw_torch", "adamw_8bit", "sgd")
MEMORY_OPTIMS = ("adamw_8bit", "adamw_8bit_layerwise")
MAX_GRAD_NORM = 1.0  # Trainer's default; with layerwise_clip="exact"

# Sizes of the full (CUDA) run and of --tiny (CPU dry run). The small model keeps every decoder matrix >= 4096
# elements so bitsandbytes really keeps 8-bit state for them (its embeddings stay 32-bit either way).
SIZES = {
    "full": dict(
        small_model=dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2),
        small_seq=64, small_batch=4, parity_steps=6, fp16_steps=6, fp16_overflow_step=2,
        memory_model=dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                          num_attention_heads=32, num_key_value_heads=4),
        memory_seq=512, memory_batch=4, memory_steps=3, memory_timeout=200,
    ),
    "tiny": dict(
        small_model=dict(vocab_size=1024, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2),
        small_seq=16, small_batch=2, parity_steps=4, fp16_steps=4, fp16_overflow_step=2,
        memory_model=dict(vocab_size=1024, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2),
        memory_seq=32, memory_batch=2, memory_steps=2, memory_timeout=240,
    ),
}  # fmt: skip


class Terminated(BaseException):
    """SIGTERM / SIGINT (the time limit): stop, but write what was measured first."""


def _terminate(signum, frame):
    raise Terminated(signal.Signals(signum).name)


# ---- models, data, training ----


def llama_config(sizes: dict, seq: int, attn: str) -> LlamaConfig:
    config = LlamaConfig(**sizes, max_position_embeddings=seq, tie_word_embeddings=False)
    config._attn_implementation = attn
    return config


def build_model(config: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


class TokenDataset(torch.utils.data.Dataset):
    """Next token = previous + 1 with 10% noise: a learnable pattern, so losses and gradients move."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        self.ids = (start + torch.arange(seq)) % vocab
        noise = torch.rand(n, seq, generator=g) < 0.1
        self.ids[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_args(output_dir, optim: str, device: str, **overrides) -> LayerwiseTrainingArguments:
    kwargs = dict(
        output_dir=str(output_dir),
        optim=optim,
        learning_rate=1e-2,
        weight_decay=0.1,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        max_steps=6,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_grad_norm=MAX_GRAD_NORM,
        layerwise_clip="exact",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=device == "cpu",
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return LayerwiseTrainingArguments(**kwargs)


def make_trainer(model, args, dataset, callbacks=(), device="cuda"):
    cls = LayerwiseTrainer if args.is_layerwise else Trainer
    trainer = cls(model=model, args=args, train_dataset=dataset, callbacks=list(callbacks))
    trainer.remove_callback(PrinterCallback)  # every log line is in the JSON; keep the output to the table
    for callback in callbacks:
        callback.trainer = trainer
    if args.fp16 and device == "cpu":
        # Accelerate creates a GradScaler (and fp16 autocast) only on accelerator devices; on CPU give the
        # accelerator torch's CPU GradScaler, as tests/test_fp16.py does: the same object and calls as with CUDA.
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
        trainer.accelerator.native_amp = True
    return trainer


def train_pair(optim, base_model, dataset, device, make_callback=None, **overrides) -> dict:
    """`{"standard": (trainer, callback), "layerwise": (...)}`: `optim` and `optim_layerwise` trained from copies of
    `base_model` with the same arguments (`make_callback(model)` builds a callback per run, or none)."""
    runs = {}
    for kind, name in (("standard", optim), ("layerwise", f"{optim}_layerwise")):
        with tempfile.TemporaryDirectory() as out:
            model = copy.deepcopy(base_model)
            callback = make_callback(model) if make_callback else None
            args = training_args(out, name, device, **overrides)
            trainer = make_trainer(model, args, dataset, [callback] if callback else (), device=device)
            trainer.train()
        runs[kind] = (trainer, callback)
    return runs


def logged(trainer, key: str) -> list[float]:
    return [e[key] for e in trainer.state.log_history if key in e and "train_runtime" not in e]


def param_diff(a, b) -> tuple[float, bool]:
    """Largest absolute difference over all parameters, and whether every parameter is bit-identical."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    if pa.keys() != pb.keys():
        raise ValueError("the two models have different parameters")
    worst, exact = 0.0, True
    for name in pa:
        x, y = pa[name].detach().float(), pb[name].detach().float()
        exact = exact and torch.equal(pa[name], pb[name])
        worst = max(worst, float((x - y).abs().max()))
    return worst, exact


def list_diff(a: list[float], b: list[float]) -> float | None:
    """Largest absolute difference of two logged lists (nan == nan, inf == inf); None when they cannot be paired."""
    if len(a) != len(b):
        return None
    worst = 0.0
    for x, y in zip(a, b):
        if x == y or (math.isnan(x) and math.isnan(y)):
            continue
        if not (math.isfinite(x) and math.isfinite(y)):
            return math.inf
        worst = max(worst, abs(x - y))
    return worst


def jsonable(values: list[float]) -> list:
    """JSON has no nan/inf: write them as strings."""
    return [v if math.isfinite(v) else str(v) for v in values]


def finite(obj):
    """A copy JSON can hold: nan / inf floats become strings ("nan", "inf")."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def optimizer_state_bytes(trainer) -> int:
    """Bytes of the tensors in the optimizer's state, each storage once (bitsandbytes shares its quantization maps)."""
    layerwise = trainer.layerwise_optimizer if isinstance(trainer, LayerwiseTrainer) else None
    opts = list(layerwise.inner) if layerwise is not None else [getattr(trainer.optimizer, "optimizer", None)]
    seen = {}
    for opt in opts:  # Accelerate's AcceleratedOptimizer wraps the standard one
        for state in opt.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    storage = value.untyped_storage()
                    seen[(value.device.type, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def cleanup(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- check 1: parity ----


def check_parity(opts, sizes, device, record) -> dict:
    config = llama_config(sizes["small_model"], sizes["small_seq"], attn="eager")
    base_model = build_model(config)
    steps, batch = sizes["parity_steps"], sizes["small_batch"]
    cases = []
    result = {
        "model": sizes["small_model"],
        "seq": sizes["small_seq"],
        "batch": batch,
        "steps": steps,
        "dtype": "float32",
        "max_grad_norm": MAX_GRAD_NORM,
        "layerwise_clip": "exact",
        "attention": "eager",
        "atol": opts.parity_atol,
        "cases": cases,
    }
    record(result)
    for optim in PARITY_OPTIMS:
        for ga in (1, 2):
            case = {"optim": optim, "ga": ga}
            cases.append(case)
            try:
                t0 = time.perf_counter()
                dataset = TokenDataset(batch * ga * steps, sizes["small_seq"], config.vocab_size)
                runs = train_pair(
                    optim, base_model, dataset, device, max_steps=steps, per_device_train_batch_size=batch,
                    gradient_accumulation_steps=ga,
                )  # fmt: skip
                std, lw = runs["standard"][0], runs["layerwise"][0]
                diff, exact = param_diff(std.model, lw.model)
                norms_std, norms_lw = logged(std, "grad_norm"), logged(lw, "grad_norm")
                norm_diff = list_diff(norms_std, norms_lw)
                case.update(
                    max_abs_param_diff=diff,
                    exact=exact,
                    grad_norm_standard=jsonable(norms_std),
                    grad_norm_layerwise=jsonable(norms_lw),
                    grad_norm_max_abs_diff=norm_diff,
                    clipped_steps=sum(n > MAX_GRAD_NORM for n in norms_std if math.isfinite(n)),
                    loss_standard=jsonable(logged(std, "loss")),
                    seconds=round(time.perf_counter() - t0, 2),
                )
                case["passed"] = bool(
                    len(norms_std) == steps
                    and diff <= opts.parity_atol
                    and norm_diff is not None
                    and norm_diff <= max(opts.parity_atol, 1e-6) * max(1.0, max(norms_std))
                )
                del runs, std, lw
            except Exception:
                case.update(passed=False, error=traceback.format_exc())
            finally:
                cleanup(device)
            record(result)
    result["passed"] = all(c.get("passed") for c in cases)
    return result


# ---- check 2: fp16 + GradScaler with an injected overflow ----


class Overflow(TrainerCallback):
    """
    On optimizer step `at_step` (0-based, every micro-batch of it), the input embedding's output is multiplied by inf
    (a forward hook), so the loss and every gradient are inf/nan. Records the parameters before and after that step,
    and the scaler's scale after every step.
    """

    def __init__(self, model, at_step: int):
        self.at_step, self.active = at_step, False
        self.trainer = None
        self.scales: list[float] = []
        self.changed: list[str] | None = None
        self.model = model
        model.get_input_embeddings().register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        return output * float("inf") if self.active else output

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = state.global_step == self.at_step
        if self.active:
            self.before = {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def on_step_end(self, args, state, control, **kwargs):
        self.scales.append(float(self.trainer.accelerator.scaler.get_scale()))
        if self.active:
            self.active = False
            self.changed = [n for n, p in self.model.named_parameters() if not torch.equal(p.detach(), self.before[n])]
            del self.before


def check_fp16(opts, sizes, device, record) -> dict:
    config = llama_config(sizes["small_model"], sizes["small_seq"], attn="eager")
    base_model = build_model(config)
    steps, batch, at = sizes["fp16_steps"], sizes["small_batch"], sizes["fp16_overflow_step"]
    optim = "adamw_torch"
    cases = []
    result = {
        "model": sizes["small_model"],
        "optim": optim,
        "steps": steps,
        "overflow_step": at,
        "max_grad_norm": MAX_GRAD_NORM,
        "layerwise_clip": "exact",
        "grad_scaler": "accelerator's torch.amp.GradScaler('cuda')"
        if device != "cpu"
        else "torch.amp.GradScaler('cpu') given to the accelerator (tests/test_fp16.py)",
        "cases": cases,
    }
    record(result)
    for ga in (1, 2):
        case = {"ga": ga}
        cases.append(case)
        try:
            t0 = time.perf_counter()
            dataset = TokenDataset(batch * ga * steps, sizes["small_seq"], config.vocab_size)
            runs = train_pair(
                optim, base_model, dataset, device, lambda model: Overflow(model, at), fp16=True, learning_rate=1e-3,
                max_steps=steps, per_device_train_batch_size=batch, gradient_accumulation_steps=ga,
            )  # fmt: skip
            per_kind = {}
            for kind, (trainer, overflow) in runs.items():
                norms = logged(trainer, "grad_norm")
                injected = norms[at] if len(norms) > at else math.nan
                scales = overflow.scales
                per_kind[kind] = {
                    "grad_norm": jsonable(norms),
                    "scales": scales,
                    "injected_grad_norm": str(injected) if not math.isfinite(injected) else injected,
                    "injected_step_nonfinite": not math.isfinite(injected),
                    "params_changed_on_injected_step": overflow.changed,
                    "scale_halved": len(scales) > at and scales[at] == scales[at - 1] / 2,
                    "skipped_steps": sum(not math.isfinite(n) for n in norms),
                }
                if isinstance(trainer, LayerwiseTrainer):
                    # Skipped steps never reach the per-layer optimizers.
                    per_kind[kind]["inner_steps_taken"] = trainer.layerwise_optimizer.steps_taken
            std_trainer, lw_trainer = runs["standard"][0], runs["layerwise"][0]
            diff, exact = param_diff(std_trainer.model, lw_trainer.model)
            norms_std, norms_lw = logged(std_trainer, "grad_norm"), logged(lw_trainer, "grad_norm")
            norm_diff = list_diff(norms_std, norms_lw)
            case.update(per_kind)
            case.update(
                max_abs_param_diff=diff,
                exact=exact,
                grad_norm_max_abs_diff=norm_diff,
                scales_equal=runs["standard"][1].scales == runs["layerwise"][1].scales,
                seconds=round(time.perf_counter() - t0, 2),
            )
            skipped_ok = all(
                k["injected_step_nonfinite"] and k["params_changed_on_injected_step"] == [] and k["scale_halved"]
                for k in per_kind.values()
            )
            case["overflow_step_skipped"] = skipped_ok
            case["passed"] = bool(
                skipped_ok
                and case["scales_equal"]
                and len(norms_std) == steps
                and diff <= opts.parity_atol
                and norm_diff is not None
                and (norm_diff <= max(opts.parity_atol, 1e-6) * max(1.0, *[n for n in norms_std if math.isfinite(n)]))
            )
            del runs, std_trainer, lw_trainer
        except Exception:
            case.update(passed=False, error=traceback.format_exc())
        finally:
            cleanup(device)
        record(result)
    result["passed"] = all(c.get("passed") for c in cases)
    return result


# ---- check 3: memory of a ~1B model, standard vs layer-wise, one fresh process each ----


def memory_case(optim: str, sizes: dict, device: str) -> dict:
    """One training run; what `--memory_case` prints as JSON."""
    seq, batch, steps = sizes["memory_seq"], sizes["memory_batch"], sizes["memory_steps"]
    config = llama_config(sizes["memory_model"], seq, attn="sdpa")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):  # random init on the device: seconds instead of minutes on CPU for 1.1B
        model = LlamaForCausalLM(config)
    model.to(torch.bfloat16)
    build_s = time.perf_counter() - t0
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    dataset = TokenDataset(batch * steps, seq, config.vocab_size)
    cuda = device.startswith("cuda")
    with tempfile.TemporaryDirectory() as out:
        args = training_args(
            out,
            optim,
            device,
            learning_rate=1e-4,
            max_steps=steps,
            per_device_train_batch_size=batch,
            activation_checkpointing=True,
            activation_checkpointing_kwargs={"use_reentrant": False},
        )
        trainer = make_trainer(model, args, dataset, device=device)
        cleanup(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            allocated_before = torch.cuda.memory_allocated()
        t1 = time.perf_counter()
        trainer.train()
        if cuda:
            torch.cuda.synchronize()
        train_s = time.perf_counter() - t1
    result = {
        "optim": optim,
        "param_dtypes": dtypes,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "activation_checkpointing": bool(args.activation_checkpointing),
        "build_seconds": round(build_s, 2),
        "train_seconds": round(train_s, 2),
        "optimizer_state_bytes_measured": optimizer_state_bytes(trainer),
        "grad_norm": jsonable(logged(trainer, "grad_norm")),
        "loss": jsonable(logged(trainer, "loss")),
    }
    if cuda:
        result.update(
            measured=True,
            allocated_before_train_bytes=allocated_before,
            peak_allocated_bytes=torch.cuda.max_memory_allocated(),
            peak_reserved_bytes=torch.cuda.max_memory_reserved(),
        )
    else:
        result.update(measured=False, note="memory not measured on CPU (no CUDA allocator)")
    layerwise = trainer.layerwise_optimizer if isinstance(trainer, LayerwiseTrainer) else None
    if layerwise is not None:
        result["layerwise_peak_grad_bytes"] = int(layerwise.peak_grad_bytes)
    est = estimate(config, optimizer=optim, dtype="bfloat16")
    result["estimate"] = {
        k: getattr(est, k)
        for k in ("weight_bytes", "gradient_bytes", "optimizer_state_bytes", "total_bytes", "all_gradient_bytes")
    }
    return result


def check_memory(opts, sizes, device, record) -> dict:
    cases = []
    result = {
        "model": sizes["memory_model"],
        "dtype": "bfloat16",
        "seq": sizes["memory_seq"],
        "batch": sizes["memory_batch"],
        "steps": sizes["memory_steps"],
        "max_grad_norm": MAX_GRAD_NORM,
        "layerwise_clip": "exact",
        "activation_checkpointing": "use_reentrant=False",
        "isolation": "one subprocess per optimizer",
        "cases": cases,
    }
    record(result)
    for optim in MEMORY_OPTIMS:
        case = {"optim": optim}
        cases.append(case)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--memory_case", optim, "--device", device]
        if opts.tiny:
            cmd.append("--tiny")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=sizes["memory_timeout"], cwd=ROOT)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEMORY_CASE_JSON ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            case.update(json.loads(lines[-1].split(" ", 1)[1]))
        except Exception:
            case.update(error=traceback.format_exc())
        record(result)
    by = {c["optim"]: c for c in cases}
    std, lw = by.get("adamw_8bit", {}), by.get("adamw_8bit_layerwise", {})
    if std.get("grad_norm") and lw.get("grad_norm"):
        # Not a pass criterion (bf16 weights, 8-bit state), but the two runs should log the same norms.
        result["grad_norm_max_abs_diff"] = list_diff(
            [float(x) for x in std["grad_norm"]], [float(x) for x in lw["grad_norm"]]
        )
    if any("error" in c for c in cases):
        result["passed"] = False
    elif std.get("measured") and lw.get("measured"):
        saved = std["peak_allocated_bytes"] - lw["peak_allocated_bytes"]
        predicted = std["estimate"]["total_bytes"] - lw["estimate"]["total_bytes"]
        result.update(
            peak_allocated_saved_bytes=saved,
            peak_reserved_saved_bytes=std["peak_reserved_bytes"] - lw["peak_reserved_bytes"],
            estimate_saved_bytes=predicted,
            passed=saved > 0,
        )
    else:
        # CPU: both runs completed and the estimator answered; nothing measured, nothing to compare.
        result.update(measured=False, passed=True, note="memory not measured on CPU")
    return result


# ---- report ----


def environment(device: str) -> dict:
    import accelerate
    import transformers

    env = {
        "device": device,
        "device_name": torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "python": platform.python_version(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }
    try:
        import bitsandbytes

        env["bitsandbytes"] = bitsandbytes.__version__
    except Exception as e:
        env["bitsandbytes"] = f"not importable: {e}"
    try:
        env["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception:
        env["git_commit"] = None
    if device.startswith("cuda"):
        env["gpu_total_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return env


def mib(b) -> str:
    return "-" if b is None else f"{b / MIB:.1f}"


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def status_of(check: dict) -> str:
    if check.get("status") == "NOT RUN":
        return "NOT RUN"
    if "passed" not in check:
        return "ERROR" if "error" in check else "INCOMPLETE"
    return "PASS" if check["passed"] else "FAIL"


def print_table(report: dict) -> None:
    env = report["environment"]
    print(f"\nGPU check on {env.get('device_name')} (torch {env.get('torch')}, CUDA {env.get('cuda')})")
    checks = report["checks"]
    rows = []
    for c in checks.get("parity", {}).get("cases", []):
        res = "ERROR" if "error" in c else ("PASS" if c.get("passed") else "FAIL")
        rows.append(
            (
                f"parity {c['optim']} GA{c['ga']}",
                res,
                f"max|dparam|={fmt(c.get('max_abs_param_diff'))} exact={c.get('exact')} "
                f"max|dgrad_norm|={fmt(c.get('grad_norm_max_abs_diff'))} clipped={c.get('clipped_steps')}",
            )
        )
    for c in checks.get("fp16", {}).get("cases", []):
        res = "ERROR" if "error" in c else ("PASS" if c.get("passed") else "FAIL")
        lw = c.get("layerwise", {})
        rows.append(
            (
                f"fp16 adamw_torch GA{c['ga']}",
                res,
                f"overflow skipped={c.get('overflow_step_skipped')} scales={lw.get('scales')} "
                f"max|dparam|={fmt(c.get('max_abs_param_diff'))} exact={c.get('exact')}",
            )
        )
    for c in checks.get("memory", {}).get("cases", []):
        est = c.get("estimate", {})
        est_s = (
            f"est weights/grads/state {mib(est.get('weight_bytes'))}/{mib(est.get('gradient_bytes'))}/"
            f"{mib(est.get('optimizer_state_bytes'))} MiB; state held {mib(c.get('optimizer_state_bytes_measured'))}"
        )
        if "error" in c:
            rows.append((f"memory {c['optim']}", "ERROR", ""))
        elif c.get("measured"):
            rows.append(
                (
                    f"memory {c['optim']}",
                    "-",
                    f"peak alloc {mib(c['peak_allocated_bytes'])} MiB, reserved {mib(c['peak_reserved_bytes'])} MiB; "
                    + est_s,
                )
            )
        else:
            rows.append((f"memory {c['optim']}", "-", "not measured on CPU; " + est_s))
    width = max((len(r[0]) for r in rows), default=10)
    for name, res, detail in rows:
        print(f"  {name:<{width}}  {res:<5}  {detail}")
    for name, check in checks.items():
        line = f"  => {name}: {status_of(check)}"
        if name == "memory" and "peak_allocated_saved_bytes" in check:
            line += (
                f" (layer-wise saves {mib(check['peak_allocated_saved_bytes'])} MiB peak allocated, "
                f"{mib(check['peak_reserved_saved_bytes'])} MiB reserved; "
                f"estimator: {mib(check['estimate_saved_bytes'])} MiB)"
            )
        print(line)
    for name, check in checks.items():
        for c in check.get("cases", []):
            if "error" in c:
                print(f"\n{name} {c.get('optim', '')} GA{c.get('ga', '-')} error:\n{c['error'][-1500:]}")
        if "error" in check:
            print(f"\n{name} error:\n{check['error'][-3000:]}")
    print(f"\nall passed: {report.get('passed')}  ({report.get('seconds')} s)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models; the CPU dry run (device defaults to cpu)")
    parser.add_argument("--device", default=None, help="cuda (default) or cpu (default with --tiny)")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "gpu_check.json"))
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    parser.add_argument(
        "--parity_atol",
        type=float,
        default=1e-4,
        help="largest parameter difference that still passes (CUDA kernels may round differently); 'exact' is "
        "reported separately",
    )
    parser.add_argument("--memory_case", default=None, help=argparse.SUPPRESS)  # internal: one memory run
    opts = parser.parse_args(argv)
    opts.device = opts.device or ("cpu" if opts.tiny else "cuda")
    opts.checks = [c.strip() for c in opts.checks.split(",") if c.strip()]
    unknown = set(opts.checks) - set(CHECKS)
    if unknown:
        parser.error(f"unknown checks {sorted(unknown)}; choose from {CHECKS}")
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    sizes = SIZES["tiny" if opts.tiny else "full"]
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"gpu_check: torch.cuda.is_available() is False (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda}); run on a CUDA machine, or use --tiny for the CPU dry run",
            file=sys.stderr,
        )
        return 2
    if opts.memory_case:
        print("MEMORY_CASE_JSON " + json.dumps(memory_case(opts.memory_case, sizes, opts.device)), flush=True)
        return 0

    torch.use_deterministic_algorithms(True, warn_only=True)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    t0 = time.perf_counter()
    output = Path(opts.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "script": "benchmarks/gpu_check.py",
        "tiny": opts.tiny,
        "environment": environment(opts.device),
        "sizes": sizes,
        "checks": {},
        "passed": None,
    }

    def write():
        report["seconds"] = round(time.perf_counter() - t0, 1)
        tmp = output.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(finite(report), indent=1, allow_nan=False, default=str) + "\n")
        tmp.replace(output)

    functions = {"parity": check_parity, "fp16": check_fp16, "memory": check_memory}
    rc = 0
    for name in opts.checks:
        check = report["checks"][name] = {}

        def record(partial, check=check):
            check.update(partial)
            write()

        t1 = time.perf_counter()
        print(f"gpu_check: {name} ...", flush=True)
        try:
            check.update(functions[name](opts, sizes, opts.device, record))
        except Terminated as e:
            check.update(passed=False, error=f"terminated by {e} (time limit?)")
            for case in check.get("cases", []):
                if "passed" not in case:
                    case.update(passed=False, error="interrupted")
            rc = 124
        except Exception:
            check.update(passed=False, error=traceback.format_exc())
        check["seconds"] = round(time.perf_counter() - t1, 1)
        check["status"] = status_of(check)
        write()
        print(f"gpu_check: {name} {check['status']} in {check['seconds']} s", flush=True)
        if rc:
            for rest in opts.checks[opts.checks.index(name) + 1 :]:
                report["checks"][rest] = {"status": "NOT RUN", "passed": False}
            break
    report["passed"] = all(report["checks"].get(n, {}).get("passed") for n in opts.checks) and not rc
    write()
    print_table(report)
    print(f"JSON: {output}")
    return rc or (0 if report["passed"] else 1)


if __name__ == "__main__":
    sys.exit(main())
