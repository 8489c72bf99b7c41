"""Peak memory, counted gradient / optimizer-state bytes and step time of standard vs layer-wise optimizers on one CPU
process, next to the analytic floor, `layerwise_hf.estimate.estimate()` and the plan (`layerwise-hf plan`).
Launch, method and last results: benchmarks/README.md."""

# ruff: noqa: E402 - the checkout goes on sys.path first
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

# NOTE: the libraries, imported once, before the forks: Trainer's create_optimizer, imported in a child after its RSS
# at rest, put ~90 MiB of modules (accelerate, datasets, bitsandbytes) into the training peak.
from transformers import Trainer  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as h
from benchmarks._common import MIB, mib, pct, proc_status_bytes, reset_peak_rss, settle
from layerwise_hf.estimate import EstimateError, estimate
from layerwise_hf.optim.norm_pass import backward_with_norm_pass, forward_again, run_with_norm_pass
from layerwise_hf.plan import plan

FLOOR_GOAL = 1.05
TIME_GOAL = 1.05
PLAN_GOAL = 0.05  # the plan's peak against the training peak
# A layer-wise configuration with clipping passes when its training peak is at most its standard one's plus this:
# the run-to-run noise of a standard configuration's RSS peak (+0.9 to +3.7 MiB between two runs, benchmarks/README).
PEAK_NOISE = 4 * MIB
# One 256-token sequence per micro-batch keeps activations below the gradients, as with activation checkpointing
# or long-context micro-batches of 1: the regime where the gradient term shows in the peak at all. steps: measured
# steps per configuration; warmup, rounds: of the timing.
FULL = h.LLAMA_58M | dict(seq_len=256, batch_size=1, steps=3, warmup=2, rounds=13)
SMALL = h.LLAMA_TINY | dict(seq_len=32, batch_size=1, steps=2, warmup=1, rounds=2)
MAX_GRAD_NORM = 1.0  # Trainer's default, for the configurations with clipping
LORA = dict(r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"))
# GaLore through transformers groups parameters without Trainer's decay split: both GaLore sides train without decay.
GALORE = dict(optim_target_modules=["attn", "mlp"], optim_args="rank=16,update_proj_gap=50", weight_decay=0.0)


class Config(NamedTuple):
    name: str
    optim: str
    ga: int = 1
    lora: bool = False
    standard: str | None = None  # the standard configuration a layer-wise one is compared with
    galore: bool = False
    tie: bool = False  # tied input and output embeddings
    clip: bool = False  # exact clipping at MAX_GRAD_NORM (standard: clip_grad_norm_; layer-wise: its norm pass)
    norm_pass: str = "auto"  # layer-wise with clip: "auto" (the package's rule) or "retain" (the way before it)
    batch_size: int | None = None  # instead of --batch_size

    @property
    def layerwise(self) -> bool:
        return self.optim.endswith("_layerwise")


def pair(name: str, optim: str, **kw) -> list[Config]:
    return [Config(name, optim, **kw), Config(f"{name}_layerwise".replace("_ga4_layerwise", "_layerwise_ga4"),
                                              f"{optim}_layerwise", standard=name, **kw)]  # fmt: skip


CONFIGS = [
    *pair("adamw_torch", "adamw_torch"), *pair("adamw_8bit", "adamw_8bit"), *pair("adafactor", "adafactor"),
    *pair("galore_adamw", "galore_adamw", galore=True), *pair("lora_adamw_torch", "adamw_torch", lora=True),
    *pair("adamw_torch_ga4", "adamw_torch", ga=4),
    # Tied embeddings with exact clipping at GA 1, where the layer-wise step must measure every gradient first:
    # micro-batch 1 (activations 116 MiB, below the 159 MiB of gradients: the rule re-runs forward) and 2
    # (activations 232 MiB, above them: the rule holds the gradients for step()), each also with the graph retained.
    *(Config(f"tied_clip_{kind}_b{b}", optim, tie=True, clip=True, batch_size=b, norm_pass=way,
             standard=None if optim == "adamw_torch" else f"tied_clip_adamw_torch_b{b}")
      for b in (1, 2) for kind, optim, way in (("adamw_torch", "adamw_torch", "auto"),
                                               ("adamw_torch_layerwise", "adamw_torch_layerwise", "auto"),
                                               ("adamw_torch_layerwise_retain", "adamw_torch_layerwise", "retain"))),
]  # fmt: skip
BY_NAME = {c.name: c for c in CONFIGS}


def parse_args(argv=None) -> argparse.Namespace:
    parser = h.benchmark_parser(__doc__.splitlines()[0], FULL, SMALL)
    parser.add_argument("--configs", nargs="+", default=[c.name for c in CONFIGS], choices=list(BY_NAME))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: less sensitive to shared cores)")
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--weight_decay", type=float, default=0.1, help="(GaLore: 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per memory configuration")
    return h.parse(parser, argv)


# ---- one configuration ----


def sized(cfg: Config, opts):
    """`opts` with the configuration's own micro-batch size, if it has one."""
    return opts if cfg.batch_size is None else argparse.Namespace(**{**vars(opts), "batch_size": cfg.batch_size})


def build_model(cfg: Config, opts):
    # Every configuration starts from the same weights (and the same LoRA init: its RNG follows the model's).
    model = h.build_llama(opts, seed=opts.seed, tie=cfg.tie)
    if cfg.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["lora_alpha"], lora_dropout=0.0, task_type="CAUSAL_LM",
                          target_modules=list(LORA["target_modules"]))  # fmt: skip
        model = get_peft_model(model, lora)
    model.train()
    return model


def build_optimizer(model, cfg: Config, opts, sync: dict):
    """The optimizer and, for a layer-wise one, the `LayerwiseOptimizer` (hooks not attached yet)."""
    extra = dict(GALORE) if cfg.galore else {"weight_decay": opts.weight_decay}
    # No clipping on either side (clipping's time is step_time.py's norm-pass row), except where the norm pass's
    # memory is the subject.
    clip = MAX_GRAD_NORM if cfg.clip else 0.0
    args = h.training_args(cfg.optim, learning_rate=opts.learning_rate, max_grad_norm=clip,
                           gradient_accumulation_steps=cfg.ga, **extra)  # fmt: skip
    # Outside Accelerate the last micro-batch of a window is ours to say.
    return h.build_optimizer(model, args, clip, sync=lambda: sync["value"], attach=False)


def train_step(model, cfg: Config, optimizer, lw, batches: list, sync: dict, meter=None) -> dict:
    """One optimizer step: each micro-batch's forward and backward, Trainer's clipping of a standard optimizer's
    gradients, `step()`, `zero_grad()`. A layer-wise configuration with clipping measures every gradient first as
    `LayerwiseTrainer` does: `backward_with_norm_pass`, or where the package's rule asks for it (`forward_again`)
    forward and backward twice with `run_with_norm_pass`. With `meter`, the RSS peak and the gradients alive at the
    step, before and after backward's RSS peak."""
    for k, batch in enumerate(batches):
        sync["value"] = k == len(batches) - 1

        def run(batch=batch):
            loss = model(input_ids=batch, labels=batch).loss / len(batches)
            loss.backward()
            return loss

        if lw is None or not cfg.clip:
            run()
        elif cfg.norm_pass == "auto" and forward_again(lw):
            run_with_norm_pass(lw, run, model)
        else:
            backward_with_norm_pass(lw, model(input_ids=batch, labels=batch).loss / len(batches),
                                    norm_pass=cfg.norm_pass)  # fmt: skip
    out = {}
    if meter is not None:
        # Garbage of backward must not count in the step's peak.
        out = {"peak_backward_bytes": proc_status_bytes("VmHWM"), "grads_at_step_bytes": meter.live()}
        settle()
        reset_peak_rss()
    if cfg.clip and lw is None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return out | {"peak_step_bytes": proc_status_bytes("VmHWM")}


def micro_batches(opts, step: int, ga: int) -> list:
    return [
        h.random_tokens(opts.vocab_size, opts.batch_size, opts.seq_len, 10_000 + 100 * step + k) for k in range(ga)
    ]


def activation_probe(model, ids) -> int:
    """
    The peak RSS of activations, measured before any optimizer exists: a forward+backward exactly as in training,
    whose every weight gradient is freed the moment it is produced; the high-water mark when the loss and logit
    buffers have peaked (before lm_head's backward), or the RSS less the gradient at a later gradient, if higher.
    """

    # NOTE: weights stay trainable: a linear layer saves its input only when its weight needs a gradient, so
    # freezing them would hide part of the activations (about 30 MiB at the default size).
    def free(param) -> None:
        samples.append(proc_status_bytes("VmRSS") - h.nbytes(param.grad))
        param.grad = None

    def on_logits(module, args, output) -> None:  # None: a forward hook's result would replace the output
        output.register_hook(lambda grad: samples.append(proc_status_bytes("VmHWM")))

    samples = []
    handles = [p.register_post_accumulate_grad_hook(free) for p in model.parameters() if p.requires_grad]
    handles.append(model.get_output_embeddings().register_forward_hook(on_logits))
    settle()
    reset_peak_rss()
    model(input_ids=ids, labels=ids).loss.backward()
    for handle in handles:
        handle.remove()
    settle()
    return max(samples)


def measure_memory(cfg: Config, opts) -> dict:
    """In a process of its own: the RSS at rest and the activation probe, then `opts.steps` steps with the RSS peak,
    the gradients alive (hooks) and the optimizer state (by storage and by shape)."""
    opts = sized(cfg, opts)
    model = build_model(cfg, opts)
    params = [p for p in model.parameters() if p.requires_grad]
    # Warm-up (lazy library state, thread pools, autograd), then the RSS at rest: weights + runtime.
    ids = micro_batches(opts, -1, 1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    settle()
    result = {"rss_rest_bytes": proc_status_bytes("VmRSS"), "probe_peak_bytes": activation_probe(model, ids)}
    sync = {"value": True}
    optimizer, lw = build_optimizer(model, cfg, opts, sync)
    meter = h.GradMeter(params).attach()  # before the layer-wise hooks: it sees each gradient before its step
    if lw is not None:
        lw.attach()
    steps = []
    for step in range(opts.steps):
        meter.start_step()
        settle()
        reset_peak_rss()
        s = train_step(model, cfg, optimizer, lw, micro_batches(opts, step, cfg.ga), sync, meter)
        state = h.optimizer_state_tensors(optimizer)
        # GaLore's projection matrix is a slice of its SVD factor, which it keeps whole: count storages.
        s |= {"grads_peak_bytes": max(meter.peak_tensor, s["grads_at_step_bytes"]),
              "state_bytes": h.storage_bytes(state), "state_view_bytes": h.tensor_bytes(state),
              "norm_pass": None if lw is None else h.norm_pass_name(lw)}  # fmt: skip
        steps.append(s)
    if lw is not None:
        lw.detach()
    meter.remove()
    return result | {
        "num_params": model.num_parameters(), "trainable_bytes": sum(h.nbytes(p) for p in params),
        "weight_bytes": sum(h.nbytes(t) for t in [*model.parameters(), *model.buffers()]),
        "largest_trainable_bytes": max(h.nbytes(p) for p in params), "steps": steps,
    }  # fmt: skip


# ---- analysis ----


def estimate_for(cfg: Config, opts) -> dict:
    """The estimator's terms and the plan's peak (`layerwise-hf plan`, fake tensors, moment by moment: weights,
    activations, gradients, state and the optimizer's temporaries) for the same setup."""
    config, out = h.llama_config(sized(cfg, opts), tie=cfg.tie), {}
    lora = dict(lora_rank=LORA["r"], lora_target_modules=LORA["target_modules"], adapter_dtype="float32")
    try:
        est = estimate(config, optimizer=cfg.optim, dtype="float32", gradient_accumulation_steps=cfg.ga,
                       **(lora if cfg.lora else {}))  # fmt: skip
        out = {k: getattr(est, k) for k in ("weight_bytes", "gradient_bytes", "optimizer_state_bytes", "total_bytes")}
    except EstimateError as err:
        out["error"] = str(err)
    # The plan follows the package's rule for the norm pass; GaLore's projections it does not simulate.
    if not cfg.galore and cfg.norm_pass == "auto":
        lora = dict(lora_r=LORA["r"], lora_targets=LORA["target_modules"]) if cfg.lora else {}
        row = plan(config, [cfg.optim], seq_len=opts.seq_len, micro_batch=sized(cfg, opts).batch_size,
                   grad_accum=cfg.ga, max_grad_norm=MAX_GRAD_NORM if cfg.clip else 0.0, device="cpu",
                   counterparts=False, **lora).rows[0]  # fmt: skip
        out["plan"] = {"peak_bytes": row.peak_bytes, "categories": row.categories, "when": row.when}
    return out


def rel(a: float, b: float) -> float | None:
    return None if not b else (a - b) / b


def analyse(cfg: Config, mem: dict, est: dict) -> dict:
    """Peak, floor, counted bytes, and the estimator's and the plan's errors for one configuration."""
    steps = mem["steps"]
    state, rest, weights = steps[-1]["state_bytes"], mem["rss_rest_bytes"], mem["weight_bytes"]
    runtime = rest - weights  # Python, libraries, allocator: what the process holds besides the model
    activations = mem["probe_peak_bytes"] - rest
    peak = max(max(s["peak_backward_bytes"], s["peak_step_bytes"]) for s in steps)
    grads = max(s["grads_peak_bytes"] for s in steps)
    floor = weights + state + mem["largest_trainable_bytes"] + activations
    out = {
        "runtime_bytes": runtime, "activation_bytes": activations, "peak_rss_bytes": peak,
        "training_peak_bytes": peak - runtime, "grads_counted_bytes": grads, "state_counted_bytes": state,
        "state_view_bytes": steps[-1]["state_view_bytes"], "floor_bytes": floor,
        "floor_ratio": (peak - runtime) / floor,
        "ga_floor_bytes": weights + state + mem["trainable_bytes"] + activations,
        "norm_passes": sorted({s["norm_pass"] for s in steps if s.get("norm_pass")}),
        "plan_error": rel(est["plan"]["peak_bytes"], peak - runtime) if "plan" in est else None,
    }  # fmt: skip
    if "error" not in est:
        out["estimate_errors"] = {
            "weights": rel(est["weight_bytes"], weights), "gradients": rel(est["gradient_bytes"], grads),
            "state": rel(est["optimizer_state_bytes"], state),
            # The estimator leaves activations out; a user adds them: compare that sum with the measured peak.
            "total_plus_activations_vs_peak": rel(est["total_bytes"] + activations, peak - runtime),
        }  # fmt: skip
    return out


def goals_of(configs: list[dict]) -> list[dict]:
    """Per configuration: the plan against the training peak; per layer-wise configuration: the floor target (GA 1,
    no clipping), its training peak against the standard one's (exact clipping) and the step-time target."""
    done = {c["name"]: c for c in configs if "analysis" in c}
    out = []
    for c in done.values():
        cfg, a, t = BY_NAME[c["name"]], c["analysis"], c.get("timing") or {}
        if a["plan_error"] is not None:
            out.append({"config": cfg.name, "kind": "plan", "target": f"plan within {PLAN_GOAL:.0%} of the peak",
                        "value": pct(a["plan_error"]), "pass": abs(a["plan_error"]) <= PLAN_GOAL,
                        "note": f" (peak at {c['estimate']['plan']['when']})"})  # fmt: skip
        if not cfg.layerwise:
            continue
        if cfg.clip:
            ref = done.get(cfg.standard)
            # The graph retained in every step (`retain`), as before the rule: shown for comparison, not a target.
            over = None if ref is None else a["training_peak_bytes"] - ref["analysis"]["training_peak_bytes"]
            out.append({"config": cfg.name, "kind": "peak_vs_standard", "target": "peak <= standard's + 4 MiB",
                        "value": "-" if ref is None else f"{over / MIB:+.1f}MiB",
                        "pass": None if ref is None or cfg.norm_pass != "auto" else over <= PEAK_NOISE,
                        "note": f" (norm pass: {'/'.join(a['norm_passes']) or cfg.norm_pass})"})  # fmt: skip
        else:
            # Under accumulation every gradient is held through the window (a documented limitation): no target.
            note = (f" (GA {cfg.ga} holds every gradient: {a['training_peak_bytes'] / a['ga_floor_bytes']:.3f}x "
                    "weights + state + all gradients + act)") if cfg.ga > 1 else ""  # fmt: skip
            out.append({"config": cfg.name, "kind": "floor", "target": f"peak <= {FLOOR_GOAL}x floor",
                        "value": f"{a['floor_ratio']:.3f}x", "note": note,
                        "pass": a["floor_ratio"] <= FLOOR_GOAL if cfg.ga == 1 else None})  # fmt: skip
        if "ratio" in t:
            # A norm pass runs a second backward (and, re-running, a second forward): no time target there.
            q = t["paired_ratio_quartiles"]
            out.append({"config": cfg.name, "kind": "time", "target": f"step time <= {TIME_GOAL}x {cfg.standard}",
                        "value": f"{t['ratio']:.3f}x", "pass": None if cfg.clip else t["ratio"] <= TIME_GOAL,
                        "note": f" (paired {t['paired_ratio_median']:.3f}, quartiles {q[0]:.3f}-{q[2]:.3f}; cpu "
                        f"{t['cpu_ratio']:.3f}x)"})  # fmt: skip
    return [g | {"verdict": h.verdict(g["pass"])} for g in out]


# ---- timing ----


class TimedRun(h.TimedRun):
    """One configuration of the timing: its own model and optimizer, stepped as `measure_memory` steps."""

    def __init__(self, cfg: Config, opts):
        super().__init__()
        self.cfg, self.opts, self.sync = cfg, sized(cfg, opts), {"value": True}
        self.model = build_model(cfg, self.opts)
        self.optimizer, self.lw = build_optimizer(self.model, cfg, self.opts, self.sync)
        if self.lw is not None:
            self.lw.attach()

    def step(self, rnd: int) -> tuple[float, float]:
        batches = micro_batches(self.opts, rnd, self.cfg.ga)
        return self.clock(train_step, self.model, self.cfg, self.optimizer, self.lw, batches, self.sync)


def time_configs(names: list[str], opts) -> dict:
    """All configurations in this process (no malloc setting), round-robin in shuffled order; each layer-wise one
    against its standard configuration."""
    runs = {name: TimedRun(BY_NAME[name], opts) for name in names}
    h.interleaved_rounds(list(runs.values()), opts, lambda run, rnd: run.step(rnd), label="timing round")
    out = {}
    for name, run in runs.items():
        ref = runs.get(BY_NAME[name].standard, run)
        out[name] = h.timing_stats(run, ref)
        if ref is run:
            out[name] = {k: v for k, v in out[name].items() if "ratio" not in k}
    return out


# ---- report ----


def print_report(report: dict) -> None:
    print(
        f"\n{report['description']}\n\nMemory (MiB). training = peak RSS - runtime (runtime = RSS at rest - weights);"
        " act = activation probe peak - RSS at rest; grads = most .grad bytes alive at once; state = optimizer "
        "state; floor = weights + state + largest gradient + act; plan: `layerwise-hf plan`'s peak (weights, act, "
        "gradients, state and the optimizer's temporaries, moment by moment) vs training; time: median step time / "
        "the standard configuration's; est+act: the estimator's total + act vs training."
    )
    rows = []
    for c in report["configs"]:
        if "error" in c:
            rows.append(f"{c['name']:<42} ERROR: {c['error'].splitlines()[0][:150]}")
            continue
        a, t, e = c["analysis"], c.get("timing") or {}, c["analysis"].get("estimate_errors", {})
        rows.append([c["name"], c["config"]["ga"], *(mib(a[k]) for k in ("peak_rss_bytes", "training_peak_bytes",
                     "activation_bytes", "grads_counted_bytes", "state_counted_bytes", "floor_bytes")),
                     f"{a['floor_ratio']:.3f}x", pct(a["plan_error"]), f"{t['ratio']:.3f}x" if "ratio" in t else "-",
                     pct(e.get("total_plus_activations_vs_peak"))])  # fmt: skip
    h.print_table([("config", 42), ("GA", 2), ("peak RSS", 8), ("training", 8), ("act", 6), ("grads", 6), ("state", 6),
                   ("floor", 6), ("xfloor", 6), ("plan", 6), ("time", 6), ("est+act", 7)], rows)  # fmt: skip
    for c in report["configs"]:
        a = c.get("analysis", {})
        if a and a["state_counted_bytes"] - a["state_view_bytes"] > MIB:
            print(f"NOTE {c['name']}: the optimizer state keeps {mib(a['state_counted_bytes'])} MiB allocated but its "
                  f"tensors' shapes say {mib(a['state_view_bytes'])} MiB (GaLore's projections are slices of their "
                  "SVD factors; LayerwiseOptimizer.pipeline.memory.state_bytes() counts shapes).")  # fmt: skip
    print("\nTargets")
    for g in report["goals"]:
        print(f"  {g['config']:<42} {g['target']:<34} {g['value']:<9} {g['verdict']}{g['note']}")


def main(argv=None) -> int:
    opts, started, load_start = parse_args(argv), time.perf_counter(), os.getloadavg()
    torch.set_num_threads(opts.threads)
    # Deprecation notices of the libraries (GaLore's own AdamW, PEFT's is_gradient_checkpointing): not results.
    warnings.filterwarnings("ignore", message=".*implementation of AdamW is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    # optim_target_modules "attn" / "mlp" also match the attention and MLP containers, which transformers and
    # layerwise_hf warn about once per module (48 lines per GaLore configuration).
    for name in ("transformers.trainer_optimizer", "layerwise_hf.bases.galore"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in ("peft", "bitsandbytes", "galore_torch"):  # a configuration that needs one reports its error
        with contextlib.suppress(ImportError):
            __import__(module)
    print(f"memory: {len(opts.configs)} configurations, one forked process each", flush=True)
    memory = h.fork_each(opts.configs, lambda name: measure_memory(BY_NAME[name], opts), opts.timeout, "memory")
    timed = [n for n in opts.configs if "error" not in memory[n]]
    timing = time_configs(timed, opts) if timed and opts.rounds > 0 else {}
    configs = []
    for name in opts.configs:
        cfg, entry = BY_NAME[name], {"name": name, "config": BY_NAME[name]._asdict()}
        if "error" in memory[name]:
            entry |= memory[name]
        else:
            est = estimate_for(cfg, opts)
            entry |= {"memory": memory[name], "estimate": est, "analysis": analyse(cfg, memory[name], est),
                      "timing": timing.get(name)}  # fmt: skip
        configs.append(entry)
    num_params = next((c["memory"]["num_params"] for c in configs if "memory" in c and not c["config"]["lora"]), 0)
    report = {
        "description": f"Llama {num_params / 1e6:.1f}M params (vocab {opts.vocab_size}, hidden {opts.hidden_size}, "
        f"{opts.num_hidden_layers} layers), fp32, micro-batch {opts.batch_size}x{opts.seq_len}, {opts.steps} memory "
        f"steps, {opts.rounds} timed rounds after {opts.warmup}, {opts.threads} thread(s), CPU",
        "model": {k: getattr(opts, k) for k in (*h.LLAMA_58M, "seq_len", "batch_size")} | {"num_params": num_params},
        "settings": {k: getattr(opts, k) for k in ("steps", "warmup", "rounds", "threads", "learning_rate",
                                                   "weight_decay", "seed", "configs")} | {"lora": LORA},
        "environment": {"memory_mmap_threshold": 65536, "timing_malloc": "default", "cpus": os.cpu_count(),
                        "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "python": h.python_version()},
        "targets": {"floor_ratio": FLOOR_GOAL, "step_time_ratio": TIME_GOAL, "plan_error": PLAN_GOAL},
        "configs": configs,
        "goals": goals_of(configs),
        "errors": {c["name"]: c["error"] for c in configs if "error" in c},
        "wall_time_s": time.perf_counter() - started,
    }  # fmt: skip
    # Written first: a long run's results survive a failure while printing them.
    h.write_report(opts.output_dir, "memory_suite", report)
    print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
