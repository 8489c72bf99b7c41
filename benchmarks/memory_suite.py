"""Peak memory, counted gradient / optimizer-state bytes and step time of standard vs layer-wise optimizers on one CPU
process, next to the analytic floor and `layerwise_hf.estimate.estimate()`.
Launch, method and last results: benchmarks/README.md."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as h  # noqa: E402
from benchmarks._common import MIB, mib, pct, proc_status_bytes, reset_peak_rss, settle  # noqa: E402

FLOOR_GOAL = 1.05
TIME_GOAL = 1.05
# RSS and the counted bytes agree when they differ by at most this: heap slack and small buffers no count sees.
AGREEMENT_SLACK = 16 * MIB
AGREEMENT_FRACTION = 0.02  # of the counted bytes above the baseline
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
    # No clipping on either side (clipping's time is clipping_speed.py's subject), except where the norm pass's
    # memory is the subject.
    clip = MAX_GRAD_NORM if cfg.clip else 0.0
    args = h.training_args(cfg.optim, learning_rate=opts.learning_rate, max_grad_norm=clip,
                           gradient_accumulation_steps=cfg.ga, **extra)  # fmt: skip
    if not cfg.layerwise:
        return h.trainer_optimizer(model, args), None
    # Outside Accelerate the last micro-batch of a window is ours to say.
    optimizer = h.layerwise_optimizer(
        model, args, clip=(clip, "exact"), attach=False, sync_gradients=lambda: sync["value"]
    )
    return optimizer, optimizer


def train_step(model, cfg: Config, optimizer, lw, batches: list, sync: dict, meter=None) -> float:
    """One optimizer step: each micro-batch's forward and backward, Trainer's clipping of a standard optimizer's
    gradients, `step()`, `zero_grad()`. A layer-wise configuration with clipping measures every gradient first as
    `LayerwiseTrainer` does: `backward_with_norm_pass`, or where the package's rule asks for it (`forward_again`)
    forward and backward twice with `run_with_norm_pass`. With `meter`, the RSS peaks of backward and of the step."""
    import torch

    from layerwise_hf.optim.norm_pass import backward_with_norm_pass, forward_again, run_with_norm_pass

    out = {"grads_before_backward_bytes": 0}
    for k, batch in enumerate(batches):
        sync["value"] = k == len(batches) - 1
        if meter is not None:
            out["grads_before_backward_bytes"] = max(out["grads_before_backward_bytes"], meter.live())
            meter.start_backward()

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
    if meter is not None:
        out |= {"peak_backward_bytes": proc_status_bytes("VmHWM"), "grads_at_step_bytes": meter.live()}
        settle()
        reset_peak_rss()
    if cfg.clip and lw is None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if meter is not None:
        out["peak_step_bytes"] = proc_status_bytes("VmHWM")
    return out


def micro_batches(opts, step: int, ga: int) -> list:
    return [
        h.random_tokens(opts.vocab_size, opts.batch_size, opts.seq_len, 10_000 + 100 * step + k) for k in range(ga)
    ]


def activation_probe(model, ids) -> dict:
    """
    Activations, measured before any optimizer exists: a forward+backward exactly as in training, whose every weight
    gradient is freed the moment it is produced. The peak RSS without gradients (the high-water mark when the loss and
    logit buffers have peaked, before lm_head's backward, or the RSS less the gradient at a later gradient, whichever
    is higher), the RSS less the gradient when backward produces its first weight gradient (where a layer-wise
    optimizer takes its first step) and that parameter's name, and the RSS less the gradient at the gradient before
    the last one (where the one-process route releases a held lm_head step, before the embedding's).
    """
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    samples, before_gradients = [], []

    # NOTE: weights stay trainable: a linear layer saves its input only when its weight needs a gradient, so
    # freezing them would hide part of the activations (about 30 MiB at the default size).
    def free(param) -> None:
        samples.append((proc_status_bytes("VmRSS") - h.nbytes(param.grad), names[id(param)]))
        param.grad = None

    def on_logits(module, args, output) -> None:
        output.register_hook(lambda grad: before_gradients.append(proc_status_bytes("VmHWM")))

    handles = [p.register_post_accumulate_grad_hook(free) for p in model.parameters() if p.requires_grad]
    handles.append(model.get_output_embeddings().register_forward_hook(on_logits))
    settle()
    reset_peak_rss()
    model(input_ids=ids, labels=ids).loss.backward()
    for handle in handles:
        handle.remove()
    settle()
    return {"probe_peak_bytes": max([*before_gradients, *(rss for rss, _ in samples)]),
            "probe_rss_at_first_gradient_bytes": samples[0][0], "first_gradient": samples[0][1],
            "probe_rss_before_last_gradient_bytes": samples[-2 if len(samples) > 1 else 0][0]}  # fmt: skip


def step_temporaries(model, cfg: Config, opts, lw, names: list[str]) -> dict[str, int]:
    """Peak RSS one optimizer step of each named tensor adds beyond its gradient and its (existing) state: the
    temporaries the optimizer allocates while it steps that tensor, which no count includes."""
    import torch

    # The standard optimizers here step tensor by tensor on CPU, with the same per-tensor code as their one-tensor
    # form, so the layer-wise form of the same base measures one tensor's temporaries alone.
    probe = lw or build_optimizer(model, cfg._replace(optim=f"{cfg.optim}_layerwise"), opts, {"value": True})[0]
    out = {}
    for name in dict.fromkeys(names):
        inner = probe.inner[probe.names.index(name)]
        param = h.inner_param(inner)
        # A fresh optimizer's first step creates its state (and GaLore's projection): measure a later one.
        for _ in range(1 if lw is not None else 2):
            param.grad = torch.randn_like(param).mul_(1e-3)
            settle()
            before = proc_status_bytes("VmRSS")
            reset_peak_rss()
            inner.step()
            out[name] = proc_status_bytes("VmHWM") - before
            param.grad = None
    return out


def measure_memory(cfg: Config, opts) -> dict:
    """In a process of its own: the RSS at rest and the activation probe, then `opts.steps` steps with the RSS peaks
    of backward and step, the gradients alive (hooks) and the optimizer state (by storage and by shape)."""
    from layerwise_hf.optim.norm_pass import last_norm_pass

    opts = sized(cfg, opts)
    model = build_model(cfg, opts)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sizes = {n: h.nbytes(p) for n, p in named}
    # Warm-up (lazy library state, thread pools, autograd), then the RSS at rest: weights + runtime.
    ids = micro_batches(opts, -1, 1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    settle()
    result = {"rss_rest_bytes": proc_status_bytes("VmRSS"), **activation_probe(model, ids)}
    sync = {"value": True}
    optimizer, lw = build_optimizer(model, cfg, opts, sync)
    meter = h.GradMeter([p for _, p in named], names={id(p): n for n, p in named}).attach()
    stepped: list[str] = []  # inner optimizers in the order they stepped in the last backward (torch's step hooks)
    if lw is not None:
        for name, inner in zip(lw.names, lw.inner):
            inner.register_step_pre_hook(lambda *a, name=name: stepped.append(name))
        lw.attach()
    steps = []
    for step in range(opts.steps):
        meter.start_step()
        stepped.clear()
        settle()
        reset_peak_rss()
        s = train_step(model, cfg, optimizer, lw, micro_batches(opts, step, cfg.ga), sync, meter)
        state = h.optimizer_state_tensors(optimizer)
        # GaLore's projection matrix is a slice of its SVD factor, which it keeps whole: count storages.
        s |= {"grads_first_hook_bytes": meter.first_max, "grads_peak_bytes": max(meter.peak_tensor,
              s["grads_at_step_bytes"]), "state_bytes": h.storage_bytes(state),
              "state_view_bytes": h.tensor_bytes(state), "first_gradient": meter.first_name,
              "first_stepped": stepped[0] if stepped else None,
              "norm_pass": None if lw is None or last_norm_pass(lw) is None else last_norm_pass(lw).value}  # fmt: skip
        # The route held the first gradient's step (layerwise_hf.routes.hooks._StepHold) when it was not the first
        # to step in backward.
        s["first_step_held"] = bool(stepped) and stepped[0] != meter.first_name and meter.first_name in stepped
        steps.append(s)
    if lw is not None:
        lw.detach()
    meter.remove()
    # The two largest tensors bound a standard step's temporaries (they are freed tensor by tensor); the first
    # gradient's tensor is the one a layer-wise optimizer steps first, with most activations still alive.
    largest = sorted(sizes, key=sizes.get, reverse=True)
    result |= {
        "num_params": model.num_parameters(), "num_trainable_tensors": len(named),
        "trainable_bytes": sum(sizes.values()),
        "weight_bytes": sum(h.nbytes(t) for t in [*model.parameters(), *model.buffers()]),
        "largest_trainable_bytes": sizes[largest[0]], "steps": steps,
        "step_temporaries_bytes": step_temporaries(model, cfg, opts, lw, [steps[-1]["first_gradient"], *largest[:2]]),
    }  # fmt: skip
    if lw is not None:
        result["package"] = {"peak_grad_bytes": lw.peak_grad_bytes, "state_bytes": lw.state_bytes()}
    return result


# ---- analysis ----


def estimate_for(cfg: Config, opts) -> dict:
    from layerwise_hf.estimate import EstimateError, estimate

    kwargs = {"optimizer": cfg.optim, "dtype": "float32", "gradient_accumulation_steps": cfg.ga}
    if cfg.lora:
        kwargs.update(lora_rank=LORA["r"], lora_target_modules=LORA["target_modules"], adapter_dtype="float32")
    try:
        est = estimate(h.llama_config(sized(cfg, opts), tie=cfg.tie), **kwargs)
    except EstimateError as err:
        return {"error": str(err)}
    return {k: getattr(est, k) for k in ("weight_bytes", "gradient_bytes", "optimizer_state_bytes", "total_bytes")}


def rel(a: float, b: float) -> float | None:
    return None if not b else (a - b) / b


def analyse(cfg: Config, mem: dict, est: dict) -> dict:
    """Peak, floor, the agreement of RSS with the counted bytes, and the estimator's errors for one configuration."""
    steps = mem["steps"]
    steady = steps[1:] or steps  # step 1 creates the optimizer state; later steps are the steady state
    state, rest, weights = steps[-1]["state_bytes"], mem["rss_rest_bytes"], mem["weight_bytes"]
    runtime = rest - weights  # Python, libraries, allocator: what the process holds besides the model
    activations = mem["probe_peak_bytes"] - rest
    peak = max(max(s["peak_backward_bytes"], s["peak_step_bytes"]) for s in steps)
    grads = max(s["grads_peak_bytes"] for s in steps)
    floor = weights + state + mem["largest_trainable_bytes"] + activations
    # Counted prediction per moment: in backward the activations then with the gradients alive then (and, layer-wise,
    # the temporaries of stepping the first gradient's tensor right then, unless the route held that step: then they
    # come at the held step, near the end of backward); at the step the activations are gone, every gradient not yet
    # consumed is alive, and a standard optimizer's temporaries are those of its largest tensor.
    temporaries, last = mem["step_temporaries_bytes"], steady[-1]
    held = cfg.layerwise and last.get("first_step_held", False)
    first_temps = temporaries.get(last["first_gradient"], 0) if cfg.layerwise and not held else 0
    most = lambda key: max(s[key] for s in steady)  # noqa: E731
    candidates = {
        "act": (mem["probe_peak_bytes"], most("grads_before_backward_bytes"), 0),
        "1st": (mem["probe_rss_at_first_gradient_bytes"], most("grads_first_hook_bytes"), first_temps),
        "step": (rest, most("grads_at_step_bytes"), 0 if cfg.layerwise else max(temporaries.values())),
    }
    if held:
        # The held first gradient steps right before the embedding's gradient is computed: the activations then are the
        # probe's sample at the gradient before the last; that held gradient is alive, and under accumulation the
        # embedding's too (lm_head and the embedding are the same size here).
        held_grad = mem["largest_trainable_bytes"] * (2 if cfg.ga > 1 else 1)
        candidates["held"] = (
            mem["probe_rss_before_last_gradient_bytes"],
            held_grad,
            temporaries.get(last["first_gradient"], 0),
        )
    predictions = {k: base + state + g + t for k, (base, g, t) in candidates.items()}
    measured_bwd = max(s["peak_backward_bytes"] for s in steady)
    measured_step = max(s["peak_step_bytes"] for s in steady)
    moment = (
        "step" if measured_step > measured_bwd else max((k for k in predictions if k != "step"), key=predictions.get)
    )
    measured = max(measured_bwd, measured_step)
    baseline, _, temps = candidates[moment]
    predicted = predictions[moment]
    tolerance = AGREEMENT_SLACK + round(AGREEMENT_FRACTION * (predicted - baseline))
    out = {
        "runtime_bytes": runtime, "activation_bytes": activations, "peak_rss_bytes": peak,
        "training_peak_bytes": peak - runtime, "grads_counted_bytes": grads, "state_counted_bytes": state,
        "state_view_bytes": steps[-1]["state_view_bytes"], "floor_bytes": floor,
        "floor_ratio": (peak - runtime) / floor,
        "floor_plus_temporaries_ratio": (peak - runtime) / (floor + first_temps),
        "ga_floor_bytes": weights + state + mem["trainable_bytes"] + activations,
        "norm_passes": sorted({s["norm_pass"] for s in steps if s.get("norm_pass")}),
        "agreement": {
            "peak_moment": moment, "predictions": predictions, "measured_rss_bytes": measured,
            "baseline_rss_bytes": baseline, "measured_minus_baseline_bytes": measured - baseline,
            "counted_bytes": predicted - baseline - temps, "temporaries_bytes": temps,
            "discrepancy_bytes": measured - predicted, "tolerance_bytes": tolerance,
            # The counted moments follow neither a layer-wise norm pass (a retained graph, a second forward, held
            # gradients) nor tied embeddings (the shared gradient's two parts and their sum at the embedding's
            # backward, next to every other gradient): no verdict there.
            "pass": None if cfg.tie or (cfg.clip and cfg.layerwise) else abs(measured - predicted) <= tolerance,
        },
    }  # fmt: skip
    if "package" in mem:
        # The package counts shapes (numel x element size), as does the view count here.
        out["package_matches"] = {"state_bytes": mem["package"]["state_bytes"] == out["state_view_bytes"],
                                  "peak_grad_bytes": mem["package"]["peak_grad_bytes"] == grads}  # fmt: skip
    if "error" not in est:
        out["estimate_errors"] = {
            "weights": rel(est["weight_bytes"], weights), "gradients": rel(est["gradient_bytes"], grads),
            "state": rel(est["optimizer_state_bytes"], state),
            # The estimator leaves activations out; a user adds them: compare that sum with the measured peak.
            "total_plus_activations_vs_peak": rel(est["total_bytes"] + activations, peak - runtime),
        }  # fmt: skip
    return out


def goals_of(configs: list[dict]) -> list[dict]:
    """Per layer-wise configuration: the floor target (GA 1, no clipping), its training peak against the standard one's
    (exact clipping) and the step-time target; per configuration: RSS against the counted bytes."""
    done = {c["name"]: c for c in configs if "analysis" in c}
    out = []
    for c in done.values():
        cfg, a, t = BY_NAME[c["name"]], c["analysis"], c.get("timing") or {}
        g = a["agreement"]
        out.append({"config": cfg.name, "kind": "agreement", "target": "RSS agrees with counted bytes",
                    "value": f"{g['discrepancy_bytes'] / MIB:+.1f}MiB", "pass": g["pass"],
                    "note": f" (|disc| <= {mib(g['tolerance_bytes'])} MiB, peak at {g['peak_moment']})"})  # fmt: skip
        if not cfg.layerwise:
            continue
        if cfg.clip:
            ref = done.get(cfg.standard)
            ref_peak = ref and ref["analysis"]["training_peak_bytes"]
            # The graph retained in every step (`retain`), as before the rule: shown for comparison, not a target.
            over = None if ref is None else a["training_peak_bytes"] - ref_peak
            out.append({"config": cfg.name, "kind": "peak_vs_standard", "target": "peak <= standard's + 4 MiB",
                        "value": "-" if ref is None else f"{over / MIB:+.1f}MiB",
                        "pass": None if ref is None or cfg.norm_pass != "auto" else over <= PEAK_NOISE,
                        "note": f" (norm pass: {'/'.join(a['norm_passes']) or cfg.norm_pass})"})  # fmt: skip
        else:
            # Under accumulation every gradient is held through the window (a documented limitation): no target.
            ga_note = (f" (GA {cfg.ga} holds every gradient: {a['training_peak_bytes'] / a['ga_floor_bytes']:.3f}x "
                       "weights + state + all gradients + act)")  # fmt: skip
            note = f" (vs floor + the first-stepped tensor's temporaries: {a['floor_plus_temporaries_ratio']:.3f}x)"
            out.append({"config": cfg.name, "kind": "floor", "target": f"peak <= {FLOOR_GOAL}x floor",
                        "value": f"{a['floor_ratio']:.3f}x", "note": ga_note if cfg.ga > 1 else note,
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
        out[name] = h.timing_stats(run.times, run.cpu_times, ref.times, ref.cpu_times)
        if ref is run:
            out[name] = {k: v for k, v in out[name].items() if "ratio" not in k}
    return out


# ---- report ----


def print_report(report: dict) -> None:
    print(
        f"\n{report['description']}\n\nMemory (MiB). training = peak RSS - runtime (runtime = RSS at rest - weights);"
        " act = activation probe peak - RSS at rest; grads = most .grad bytes alive at once; state = optimizer "
        "state; floor = weights + state + largest gradient + act. Agreement at the moment holding the peak (at: act "
        "= activation peak, 1st = first weight gradient, held = the held lm_head step, step): peak - base vs G+S "
        "(gradients alive then + state) + temps (the optimizer's temporaries for one tensor, measured alone); disc "
        f"= the difference; tol = {AGREEMENT_SLACK // MIB} MiB + {100 * AGREEMENT_FRACTION:g}% of G+S+temps."
    )
    rows = []
    for c in report["configs"]:
        if "error" in c:
            rows.append(f"{c['name']:<27} ERROR: {c['error'].splitlines()[0][:150]}")
            continue
        a, t = c["analysis"], c.get("timing") or {}
        g, e = a["agreement"], a.get("estimate_errors", {})
        rows.append([c["name"], c["config"]["ga"], *(mib(a[k]) for k in ("peak_rss_bytes", "training_peak_bytes",
                     "activation_bytes", "grads_counted_bytes", "state_counted_bytes", "floor_bytes")),
                     f"{a['floor_ratio']:.3f}x", g["peak_moment"], mib(g["measured_minus_baseline_bytes"]),
                     mib(g["counted_bytes"]), mib(g["temporaries_bytes"]), f"{g['discrepancy_bytes'] / MIB:+.1f}",
                     mib(g["tolerance_bytes"]), h.verdict(g["pass"]), f"{t['ratio']:.3f}x" if "ratio" in t else "-",
                     pct(e.get("total_plus_activations_vs_peak"))])  # fmt: skip
    h.print_table([("config", 27), ("GA", 2), ("peak RSS", 8), ("training", 8), ("act", 6), ("grads", 6), ("state", 6),
                   ("floor", 6), ("xfloor", 6), ("at", 4), ("peak-base", 9), ("G+S", 6), ("temps", 6), ("disc", 6),
                   ("tol", 5), ("agree", 5), ("time", 6), ("est+act", 7)], rows)  # fmt: skip
    print("time: median step time / the standard configuration's (one process, round-robin); est+act: the estimator's "
          "total + act vs the training peak.")  # fmt: skip
    for c in report["configs"]:
        a = c.get("analysis", {})
        if a and a["state_counted_bytes"] - a["state_view_bytes"] > MIB:
            print(f"NOTE {c['name']}: the optimizer state keeps {mib(a['state_counted_bytes'])} MiB allocated but its "
                  f"tensors' shapes say {mib(a['state_view_bytes'])} MiB (GaLore's projections are slices of their "
                  "SVD factors; LayerwiseOptimizer.state_bytes() counts shapes).")  # fmt: skip
        if a.get("package_matches") and not all(a["package_matches"].values()):
            print(f"NOTE {c['name']}: LayerwiseOptimizer's own counts differ from these: {c['memory']['package']}")
    print("\nTargets")
    for g in report["goals"]:
        print(f"  {g['config']:<42} {g['target']:<34} {g['value']:<9} {g['verdict']}{g['note']}")


def plot(report: dict, path: Path) -> None:
    configs = [c for c in report["configs"] if "analysis" in c]
    # The counted prediction at the moment holding the peak, part by part, beside the measured peak.
    parts = {
        "counted: weights": lambda c, a: c["memory"]["weight_bytes"],
        "counted: activations then": lambda c, a: a["agreement"]["baseline_rss_bytes"] - c["memory"]["rss_rest_bytes"],
        "counted: optimizer state": lambda c, a: a["state_counted_bytes"],
        "counted: gradients alive then": lambda c, a: a["agreement"]["counted_bytes"] - a["state_counted_bytes"],
        "counted: optimizer temporaries": lambda c, a: a["agreement"]["temporaries_bytes"],
        "measured: peak RSS - runtime": lambda c, a: a["training_peak_bytes"],
        "floor": lambda c, a: a["floor_bytes"],
    }
    memory = {k: {c["name"]: fn(c, c["analysis"]) / MIB for c in configs} for k, fn in parts.items()}
    timed = {
        "layer-wise / standard": {
            c["name"]: c["timing"]["ratio"] for c in configs if "ratio" in (c.get("timing") or {})
        }
    }
    h.plot_panels(path, report["description"], [
        dict(title="Training memory at the peak: counted parts vs measured", ylabel="MiB", series=memory),
        dict(title="Step time", ylabel="median step time, layer-wise / standard", series=timed,
             lines={f"target {TIME_GOAL}x": TIME_GOAL}),
    ])  # fmt: skip


def main(argv=None) -> int:
    import logging
    import warnings

    import torch
    from transformers import LlamaForCausalLM, Trainer  # noqa: F401

    from layerwise_hf import LayerwiseTrainingArguments, build_layerwise_optimizer  # noqa: F401
    from layerwise_hf.optim import norm_pass  # noqa: F401

    opts, started, load_start = parse_args(argv), time.perf_counter(), os.getloadavg()
    torch.set_num_threads(opts.threads)
    # Deprecation notices of the libraries (GaLore's own AdamW, PEFT's is_gradient_checkpointing): not results.
    warnings.filterwarnings("ignore", message=".*implementation of AdamW is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    # optim_target_modules "attn" / "mlp" also match the attention and MLP containers, which transformers and
    # layerwise_hf warn about once per module (48 lines per GaLore configuration).
    for name in ("transformers.trainer_optimizer", "layerwise_hf.bases.galore"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in ("peft", "bitsandbytes", "galore_torch"):  # imported once, before the forks
        try:
            __import__(module)
        except ImportError:
            pass  # the configuration that needs it reports the error
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
        "targets": {"floor_ratio": FLOOR_GOAL, "step_time_ratio": TIME_GOAL},
        "configs": configs,
        "goals": goals_of(configs),
        "errors": {c["name"]: c["error"] for c in configs if "error" in c},
        "wall_time_s": time.perf_counter() - started,
    }  # fmt: skip
    # Written first: a long run's results survive a failure while printing them.
    h.write_report(opts.output_dir, "memory_suite", report, plot if timed else None)
    print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
