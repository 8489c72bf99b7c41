"""Per-rank memory and step time on 2 CPU ranks (gloo): Trainer under the DDP config (standard DDP vs the layer-wise
data-parallel route), and a plain Accelerate loop under FSDP2.
Launch, method and last results: benchmarks/README.md."""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as h  # noqa: E402
from benchmarks._common import mib, proc_status_bytes, reset_peak_rss  # noqa: E402

ENGINES = {"ddp": "configs/accelerate/cpu_ddp.yaml", "fsdp2": "configs/accelerate/cpu_fsdp2.yaml"}
# FSDP2 plain loop; bitsandbytes' 8-bit steps each rank's local shard (no standard FSDP2 run of it: bitsandbytes does
# not take DTensors).
OPTIMS = ("adamw_torch", "adamw_torch_layerwise", "adamw_8bit_layerwise")
KINDS = {"standard": "(a) DDP, Trainer's default", "bucket_view": "(b) DDP, gradient_as_bucket_view",
         "layerwise": "(c) layer-wise route"}  # fmt: skip
TARGET_FRACTION = 0.6  # of all gradient bytes: how far (c) must be below (b)
TIME_GOAL = 1.10
FULL = h.LLAMA_58M | dict(seq_len=128, batch_size=1)
SMALL = h.LLAMA_TINY | dict(seq_len=32, batch_size=1)
# Where a DDP step's time goes: (label, how to recognise the function in cProfile's stats: file part, function name).
PROFILE_ROWS = [
    ("forward (LlamaForCausalLM.forward)", "modeling_llama.py", "forward"),
    ("backward (autograd engine; DDP reducer / layer-wise hooks inside)", "~",
     "<method 'run_backward' of 'torch._C._EngineBase' objects>"),
    ("  layer-wise hook: _local_ready (cumulative)", "data_parallel.py", "_local_ready"),
    ("    copies into buckets (torch.mul out=)", "~", "<built-in method torch.mul>"),
    ("    bucket steps: _step_bucket (cumulative)", "data_parallel.py", "_step_bucket"),
    ("      all-reduce waits (Work.wait)", "~", "<built-in method torch._C._distributed_c10d.wait>"),
    ("      grad_ready -> gate -> inner step (cumulative)", "layerwise_hf/optim/optimizer.py", "grad_ready"),
    ("  end of backward: _finish_backward (cumulative)", "data_parallel.py", "_finish_backward"),
    ("Adam math (_single_tensor_adam, all calls)", "adam.py", "_single_tensor_adam"),
    ("Trainer optimizer.step (AcceleratedOptimizer.step)", "accelerate/optimizer.py", "step"),
]  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    parser = h.benchmark_parser(__doc__.splitlines()[0], FULL, SMALL)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per memory run (GA 1)")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--optims", nargs="+", default=list(OPTIMS[:2]), choices=OPTIMS, help="FSDP2 runs")
    parser.add_argument("--ddp_optims", nargs="+", default=["adamw_torch", "adamw_8bit"], help="DDP: base optimizers")
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=list(KINDS), help="DDP memory runs")
    parser.add_argument("--time", action="store_true", help="DDP step time, (c) vs (a), interleaved rounds")
    parser.add_argument("--time_optims", nargs="+", default=["adamw_torch"], help="base optimizers timed")
    parser.add_argument("--rounds", type=int, default=4, help="--time: rounds (one train() per configuration each)")
    parser.add_argument("--time_steps", type=int, default=8, help="--time: steps per train()")
    parser.add_argument("--warmup_steps", type=int, default=2, help="--time: steps dropped at each train()'s start")
    parser.add_argument("--profile", action="store_true", help="--time: cProfile rank 0 for a few steps of each")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launched configuration")
    parser.add_argument("--one_launch", action="store_true", help="smoke run: an engine's memory runs in one launch")
    # Internal: set by the driver for the launched ranks.
    parser.add_argument("--worker", default=None, choices=("loop", "trainer", "time"), help=argparse.SUPPRESS)
    for name in ("engine", "optim", "kind", "result"):  # --optim, --kind: each run of the launch
        parser.add_argument(f"--{name}", nargs=None if name in ("engine", "result") else "+", help=argparse.SUPPRESS)
    return h.parse(parser, argv)


# ---- DDP through Trainer (inside the launched ranks) ----


def build_trainer(opts, kind: str, optim: str, model, out: str, max_steps: int, callbacks=()):
    """(a) / (b): `Trainer` with `optim`; (c): `LayerwiseTrainer` with `<optim>_layerwise`."""
    # NOTE: TrainingArguments before any Accelerator: constructing them resets Accelerate's shared state.
    args = h.training_args(f"{optim}_layerwise" if kind == "layerwise" else optim, out, seed=0, max_steps=max_steps,
                           per_device_train_batch_size=opts.batch_size, learning_rate=1e-4, weight_decay=0.1,
                           max_grad_norm=0.0, lr_scheduler_type="constant", logging_steps=10**6, save_strategy="no",
                           disable_tqdm=True, dataloader_num_workers=0)  # fmt: skip
    dataset = h.TokenRows(opts.vocab_size, opts.seq_len, rows=max_steps * opts.batch_size * 2)
    trainer = h.trainer(model, args, dataset, callbacks)
    if kind == "bucket_view":
        # Trainer has no argument for it: set on the DDP kwargs Accelerate will wrap the model with.
        trainer.accelerator.ddp_handler.gradient_as_bucket_view = True
    h.check_distributed(trainer.accelerator, "ddp")
    return trainer


def ddp_bucket_bytes(ddp_model) -> int | None:
    """Standard DDP: the reducer's bucket buffers (as large as all gradients, for the whole run)."""
    try:
        return sum(int(s) for s in str(ddp_model._get_ddp_logging_data()["bucket_sizes"]).split(",") if s.strip())
    except (AttributeError, KeyError, ValueError):
        return None


def train_meter(trainer, kind: str, sample_grads: bool = True):
    """A Trainer callback and gradient meter for one run. RSS: the peak (VmHWM) of each segment of `train()` (setup:
    from `train()` to `on_train_begin`, the optimizer and the DDP wrap; then each step), each reset with `echo 5 >
    /proc/self/clear_refs`. Gradients: the distinct storages behind every live `.grad`, plus the layer-wise route's
    bucket buffers or standard DDP's reducer buckets, sampled at every post-accumulate-grad hook (registered before
    train(), so ahead of the route's hooks) and before every optimizer step. Time: each step's wall and CPU seconds."""
    from transformers import TrainerCallback

    from layerwise_hf import unwrap_layerwise_optimizer

    class Meter(h.GradMeter, TrainerCallback):
        def __init__(self):
            super().__init__([p for p in trainer.model.parameters() if p.requires_grad])
            self.segments, self.wall, self.cpu, self.bucket_bytes = [], [], [], None
            if sample_grads:
                self.attach()

        def total(self, held: dict) -> int:
            lw = getattr(trainer, "layerwise_optimizer", None)
            route = lw.pipeline.route if lw is not None else None
            if route is not None:
                held = held | h.storages([b.buffer for b in getattr(route, "buckets", []) if b.buffer is not None])
            elif self.bucket_bytes is not None:
                # With gradient_as_bucket_view the .grad storages are the buckets; otherwise a second copy.
                return self.bucket_bytes + (0 if kind == "bucket_view" else sum(held.values()))
            return sum(held.values())

        def mark(self, label: str) -> None:
            self.segments.append({"label": label, "peak": proc_status_bytes("VmHWM"),
                                  "rss": proc_status_bytes("VmRSS")})  # fmt: skip
            reset_peak_rss()

        def on_train_begin(self, args, state, control, **kwargs):
            self.mark("setup")
            if sample_grads:
                lw = unwrap_layerwise_optimizer(trainer.optimizer)
                self.watch_steps(lw.inner if lw else [getattr(trainer.optimizer, "optimizer", trainer.optimizer)])
                self.bucket_bytes = None if lw is not None else ddp_bucket_bytes(trainer.model_wrapped)

        def on_step_begin(self, args, state, control, **kwargs):
            self._t = (time.perf_counter(), time.process_time())

        def on_step_end(self, args, state, control, **kwargs):
            self.wall.append(time.perf_counter() - self._t[0])
            self.cpu.append(time.process_time() - self._t[1])
            self.mark(f"step {state.global_step}")

    meter = Meter()
    trainer.add_callback(meter)
    return meter


def trainer_worker(opts, optim: str, kind: str) -> dict:
    """One DDP memory run: (a), (b) or (c) for one optimizer, `opts.steps` Trainer steps."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        model = h.build_llama(opts, seed=0)
        trainer = build_trainer(opts, kind, optim, model, out, opts.steps)
        meter = train_meter(trainer, kind)
        rss_before = h.rss_at_rest()
        trainer.train()
        meter.mark("end")
        lw = trainer.layerwise_optimizer if kind == "layerwise" else None
        params = meter.params
        peak = max(s["peak"] for s in meter.segments)
        result = {
            "engine": "ddp", "kind": kind, "optim": trainer.args.optim, "base_optim": optim,
            "rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "wrapped": type(trainer.model_wrapped).__name__,
            "route": lw.route if lw is not None else None, "num_params": model.num_parameters(),
            "grad_bytes_all": sum(h.nbytes(p) for p in params), "rss_before_train_bytes": rss_before,
            "training_peak_bytes": peak - rss_before, "segments": meter.segments,
            "grad_live_peak_bytes": meter.peak_total,
            "grad_tensor_peak_bytes": meter.peak_tensor, "ddp_bucket_bytes": meter.bucket_bytes,
            "optimizer_state_bytes": h.tensor_bytes(h.optimizer_state_tensors(trainer.optimizer)),
            "package_peak_grad_bytes": lw.pipeline.memory.peak_grad_bytes if lw is not None else None,
            "step_times_s": meter.wall,
        }  # fmt: skip
        meter.remove()
        # The DDP objects must die while the process group is alive (see write_gathered_and_finish).
        trainer.accelerator.free_memory()
        del trainer, model, meter
    return result


def time_worker(opts) -> dict:
    """(a) and (c) for each of `--time_optims`, one `train()` of `--time_steps` steps per configuration and round, in
    an order shuffled alike on both ranks; then, with `--profile`, cProfile of a few steps of each on rank 0."""
    import cProfile

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    base = h.build_llama(opts, seed=0)
    configs = [f"{kind}:{optim}" for optim in opts.time_optims for kind in ("standard", "layerwise")]
    times = {c: {"wall": [], "cpu": [], "rounds": []} for c in configs}

    def run(config, steps, profile=None):
        kind, optim = config.split(":")
        with tempfile.TemporaryDirectory() as out:
            trainer = build_trainer(opts, kind, optim, h.copy_model(base), out, steps)
            meter = train_meter(trainer, kind, sample_grads=False)
            with profile or contextlib.nullcontext():
                trainer.train()
            # Only the times leave: a DDP reducer still alive at destroy_process_group can crash or hang the rank.
            wall, cpu = meter.wall[opts.warmup_steps :], meter.cpu[opts.warmup_steps :]
            trainer.accelerator.free_memory()
            del trainer, meter
            gc.collect()
            return wall, cpu

    def timed(r, rnd):
        wall, cpu = run(r.name, opts.time_steps)
        times[r.name]["wall"] += wall
        times[r.name]["cpu"] += cpu
        return statistics.median(wall), statistics.median(cpu)

    # The same order on both ranks (the same seed): they must run the same Trainer at once.
    runs = [h.TimedRun(config) for config in configs]
    h.interleaved_rounds(runs, argparse.Namespace(warmup=0, rounds=opts.rounds, seed=42), timed, "time round")
    for r in runs:
        times[r.name]["rounds"] = r.times
    profiles = {}
    for config in configs if opts.profile else []:
        prof = cProfile.Profile() if dist.get_rank() == 0 else None
        run(config, opts.warmup_steps + 3, profile=prof)
        if prof is not None:
            profiles[config] = h.cprofile_summary(prof, opts.warmup_steps + 3, PROFILE_ROWS)
    return {"rank": dist.get_rank(), "times": times, "profiles": profiles}


# ---- FSDP2, plain Accelerate loop (inside the launched ranks) ----


def loop_worker(opts, optim: str, kind=None) -> dict:
    """One FSDP2 run: `accelerator.prepare(model, optimizer)`, then for layer-wise `connect(model)`; per step the RSS
    peak, the live `.grad` tensors and storages (sampled in every gradient hook, at every inner step and at the end of
    backward)."""
    import torch
    from accelerate import Accelerator

    from layerwise_hf import unwrap_layerwise_optimizer

    torch.set_num_threads(1)
    # NOTE: built before the Accelerator: constructing TrainingArguments resets Accelerate's shared state.
    args = h.training_args(optim, learning_rate=1e-4, weight_decay=0.1, max_grad_norm=0.0)
    accelerator = Accelerator()
    h.check_distributed(accelerator, "fsdp2")
    model = h.build_llama(opts, seed=0)
    # Hooks come with connect() after prepare: FSDP2 replaces the parameters. A bitsandbytes optimizer steps each
    # rank's local shard as a plain tensor.
    optimizer, _ = h.build_optimizer(model, args, attach=False, local_shards=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    meter = h.GradMeter([p for p in model.parameters() if p.requires_grad]).attach()  # before the layer-wise hooks
    lw = unwrap_layerwise_optimizer(optimizer)
    route = lw.connect(model) if lw is not None else None
    meter.watch_steps(lw.inner if lw is not None else [])
    rank = accelerator.process_index
    h.settle()
    accelerator.wait_for_everyone()
    rss_start = h.rss_at_rest()
    step_peaks, grad_peaks, step_times = [], [], []
    for step in range(opts.steps):
        meter.start_step()
        start = time.perf_counter()
        ids = h.random_tokens(opts.vocab_size, opts.batch_size, opts.seq_len, 1000 * step + rank)
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        meter.sample()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)
        # Per-step peaks: the first step also allocates the optimizer state (lazily), later steps show steady state.
        step_peaks.append(proc_status_bytes("VmHWM"))
        grad_peaks.append([meter.peak_tensor, meter.peak_storage])
        reset_peak_rss()
    result = {
        "engine": "fsdp2", "optim": optim, "rank": rank, "world_size": accelerator.num_processes, "route": route,
        "num_params": sum(p.numel() for p in model.parameters()), "rss_start_bytes": rss_start,
        "step_peak_rss_bytes": step_peaks, "peak_rss_bytes": max(step_peaks),
        "steady_peak_rss_bytes": max(step_peaks[1:] or step_peaks),
        "step_grad_peaks_bytes": grad_peaks, "grad_tensor_peak_bytes": max(p[0] for p in grad_peaks),
        "grad_storage_peak_bytes": max(p[1] for p in grad_peaks), "grad_samples": meter.samples,
        "optimizer_state_bytes": h.tensor_bytes(h.optimizer_state_tensors(optimizer)),
        "package_peak_grad_bytes": lw.pipeline.memory.peak_grad_bytes if lw is not None else None,
        "step_times_s": step_times,
    }  # fmt: skip
    if lw is not None:
        lw.detach()
    meter.remove()
    accelerator.free_memory()
    return result


# ---- the driver and its report ----


def launch(opts, engine: str, worker_args: list[str], result: Path, mmap: bool = True) -> list:
    """Run this script's `--worker ...` on 2 ranks under `engine`'s config; the ranks' results (rank 0 writes them).
    `mmap`: freed tensors go back to the OS (`MALLOC_MMAP_THRESHOLD_`); not for timing."""
    env = h.worker_env(threads=1, mmap_threshold=mmap, sharding=engine)
    args = [*worker_args, "--engine", engine, "--result", str(result), "--steps", str(opts.steps)]
    return h.launch_ranks(Path(__file__).resolve(), ["--config_file", h.ROOT / ENGINES[engine]],
                          [*args, *h.size_args(opts, FULL)], result, opts.timeout, env)  # fmt: skip


def most(runs: list[dict], key: str) -> int | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return max(values) if values else None


def ddp_targets(ddp_runs: list[dict]) -> list[dict]:
    """Per base optimizer: the training peak of (a), (b), (c) (max over ranks and per rank), and the target: (c) below
    (b) by at least TARGET_FRACTION of all gradient bytes, on the max over ranks and on each rank."""
    out = []
    for base in dict.fromkeys(r["base_optim"] for r in ddp_runs):
        runs = {k: [r for r in ddp_runs if (r["base_optim"], r["kind"]) == (base, k)] for k in KINDS}
        peak = {k: most(rs, "training_peak_bytes") for k, rs in runs.items()}
        per_rank = {k: {str(r["rank"]): r["training_peak_bytes"] for r in rs} for k, rs in runs.items()}
        need = TARGET_FRACTION * most(ddp_runs, "grad_bytes_all")
        below = {k: None if None in (peak["layerwise"], peak[k]) else peak[k] - peak["layerwise"] for k in peak}
        view, lw = per_rank["bucket_view"], per_rank["layerwise"]
        rank_savings = [view[k] - v for k, v in lw.items() if k in view]
        out.append({"base_optim": base, "grad_bytes_all": most(ddp_runs, "grad_bytes_all"), "peak_bytes": peak,
                    "peak_bytes_per_rank": per_rank, "target_saving_bytes": need, "saving_vs_standard_bytes":
                    below["standard"], "saving_vs_bucket_view_bytes": below["bucket_view"],
                    "saving_vs_bucket_view_per_rank_bytes": rank_savings, "pass": None if below["bucket_view"] is None
                    else below["bucket_view"] >= need and all(s >= need for s in rank_savings)})  # fmt: skip
    return out


def estimator_check(opts, ddp_runs: list[dict]) -> list[dict]:
    """`estimate()` for the same LlamaConfig, DDP on 2 ranks, vs what the ranks counted and the RSS peak (max over
    ranks)."""
    from layerwise_hf.estimate import estimate

    out, groups = [], {}
    for r in ddp_runs:
        groups.setdefault((r["base_optim"], r["kind"]), []).append(r)
    for (base, kind), rs in groups.items():
        optim = f"{base}_layerwise" if kind == "layerwise" else base
        est = estimate(h.llama_config(opts), optimizer=optim, dtype="float32", world_size=2, sharding="ddp",
                       gradient_as_bucket_view=kind == "bucket_view")  # fmt: skip
        predicted = est.gradient_bytes + est.optimizer_state_bytes
        counted = max(r["grad_live_peak_bytes"] + r["optimizer_state_bytes"] for r in rs)
        peak = most(rs, "training_peak_bytes")
        out.append({"base_optim": base, "kind": kind, "estimated_gradient_bytes": est.gradient_bytes,
                    "estimated_state_bytes": est.optimizer_state_bytes, "estimated_bytes": predicted,
                    "counted_grad_live_plus_state_bytes": counted, "measured_training_peak_bytes": peak,
                    "vs_counted": predicted / counted - 1, "vs_training_peak": predicted / peak - 1})  # fmt: skip
    return out


def time_summary(results: list[dict]) -> dict:
    """Per configuration the median step time of the slower rank, and layer-wise / standard: of those medians and the
    median of same-round ratios per rank."""
    out = {"configs": {}, "ratios": {}, "profiles": results[0]["profiles"]}
    for c in results[0]["times"]:
        per_rank = [r["times"][c] for r in results]
        out["configs"][c] = {"median_s_per_rank": [statistics.median(t["wall"]) for t in per_rank],
                             "cpu_median_s_per_rank": [statistics.median(t["cpu"]) for t in per_rank],
                             "steps_per_rank": len(per_rank[0]["wall"])}  # fmt: skip
        out["configs"][c] |= {"median_s": max(out["configs"][c]["median_s_per_rank"]),
                              "cpu_median_s": max(out["configs"][c]["cpu_median_s_per_rank"])}  # fmt: skip
    for c, a in out["configs"].items():
        kind, optim = c.split(":")
        if kind == "layerwise" and f"standard:{optim}" in out["configs"]:
            b, ref = out["configs"][f"standard:{optim}"], f"standard:{optim}"
            paired = [statistics.median(x / y for x, y in zip(r["times"][c]["rounds"], r["times"][ref]["rounds"]))
                      for r in results]  # fmt: skip
            out["ratios"][optim] = {"wall_ratio": a["median_s"] / b["median_s"], "cpu_ratio": a["cpu_median_s"] /
                                    b["cpu_median_s"], "paired_round_ratio_per_rank": paired, "goal": TIME_GOAL,
                                    "pass": a["median_s"] / b["median_s"] <= TIME_GOAL}  # fmt: skip
    return out


def cells(*spec) -> list[tuple]:
    """Columns for `print_rows`: (header, width, key) with `key` a field shown in MiB, or a function of the row."""
    return [(c[0], c[1], c[2] if callable(c[2]) else lambda r, k=c[2]: mib(r[k]), *c[3:]) for c in spec]


DDP_COLUMNS = cells(
    ("optim", 22, lambda r: r["optim"]), ("run", 33, lambda r: KINDS[r["kind"]], "<"),
    ("rank", 4, lambda r: r["rank"]), ("model", 23, lambda r: r["wrapped"], "<"),
    ("train peak", 10, "training_peak_bytes"),
    ("peak in", 7, lambda r: max(r["segments"], key=lambda s: s["peak"])["label"]),
    ("grads live", 10, "grad_live_peak_bytes"), ("opt state", 9, "optimizer_state_bytes"),
    ("DDP buckets", 11, "ddp_bucket_bytes"),
)  # fmt: skip
TARGET_COLUMNS = cells(
    ("optimizer", 12, lambda t: t["base_optim"]),
    *((name, 8, lambda t, k=k: mib(t["peak_bytes"][k])) for name, k in zip(("(a) std", "(b) view", "(c) lw"), KINDS)),
    ("c vs b", 8, "saving_vs_bucket_view_bytes"), ("c vs a", 8, "saving_vs_standard_bytes"),
    ("c vs b per rank", 16, lambda t: " / ".join(map(mib, t["saving_vs_bucket_view_per_rank_bytes"]))),
    ("needed", 18, lambda t: f">= {mib(t['target_saving_bytes'])} of {mib(t['grad_bytes_all'])}"),
    ("target", 6, lambda t: h.verdict(t["pass"])),
)  # fmt: skip
ESTIMATE_COLUMNS = cells(
    ("optimizer", 12, lambda r: r["base_optim"]), ("run", 33, lambda r: KINDS[r["kind"]], "<"),
    ("est grads", 9, "estimated_gradient_bytes"), ("est state", 9, "estimated_state_bytes"),
    ("est sum", 8, "estimated_bytes"), ("counted", 8, "counted_grad_live_plus_state_bytes"),
    ("vs counted", 10, lambda r: h.pct(r["vs_counted"])), ("train peak", 10, "measured_training_peak_bytes"),
    ("vs peak", 8, lambda r: h.pct(r["vs_training_peak"])),
)  # fmt: skip
FSDP2_COLUMNS = cells(
    ("optim", 22, lambda r: r["optim"]), ("rank", 4, lambda r: r["rank"]), ("RSS start", 9, "rss_start_bytes"),
    ("+ step 1", 9, lambda r: mib(r["step_peak_rss_bytes"][0] - r["rss_start_bytes"])),
    ("+ steady", 9, lambda r: mib(r["steady_peak_rss_bytes"] - r["rss_start_bytes"])),
    (".grad tensors", 13, "grad_tensor_peak_bytes"), (".grad storages", 14, "grad_storage_peak_bytes"),
    ("opt state", 9, "optimizer_state_bytes"), ("pkg peak_grad", 13, "package_peak_grad_bytes"),
    ("s/step", 7, lambda r: f"{statistics.mean(r['step_times_s'][1:] or r['step_times_s']):.2f}"),
)  # fmt: skip


def print_report(report: dict) -> None:
    print(f"\n{report['description']}")
    if report["ddp_runs"]:
        h.print_rows(report["ddp_runs"], DDP_COLUMNS, "\nDDP, Trainer, 2 ranks: training peak per rank = VmHWM "
                     "during train() - RSS before it (MiB); grads live: the most gradient storage alive at once "
                     "(.grad storages + the route's buckets, or + DDP's reducer buckets); peak in: its "
                     "segment")  # fmt: skip
        h.print_rows(report["ddp_targets"], TARGET_COLUMNS, "\nTarget: layer-wise training peak below (b) by >= 60% "
                     "of all gradients (max over ranks)")  # fmt: skip
        h.print_rows(report["estimator_check"], ESTIMATE_COLUMNS, "\nEstimator (gradient + state terms, --sharding "
                     "ddp) vs the ranks' count and RSS (MiB)")  # fmt: skip
    for c, t in (report["step_time"] or {}).get("configs", {}).items():
        print(f"{c:<28} median s/step {' / '.join(f'{x:.3f}' for x in t['median_s_per_rank'])}, CPU "
              f"{' / '.join(f'{x:.3f}' for x in t['cpu_median_s_per_rank'])} (rank 0 / 1)")  # fmt: skip
    for optim, r in (report["step_time"] or {}).get("ratios", {}).items():
        print(f"{optim}: layer-wise / standard DDP = {r['wall_ratio']:.3f}x wall (slower rank), {r['cpu_ratio']:.3f}x "
              f"CPU, paired rounds {' / '.join(f'{x:.3f}' for x in r['paired_round_ratio_per_rank'])} -> goal <= "
              f"{TIME_GOAL:.2f}: {h.verdict(r['pass'])}")  # fmt: skip
    for c, p in (report["step_time"] or {}).get("profiles", {}).items():
        print(f"\ncProfile, rank 0, {c}: ms per step (profiler overhead in)")
        for row in p["rows"]:
            print(f"  {row['label']:<66} {row['cumulative_ms_per_step']:9.1f} {row['calls_per_step']:7.0f} calls")
    if report["runs"]:
        h.print_rows(report["runs"], FSDP2_COLUMNS, "\nFSDP2, plain loop, per rank (MiB; peak RSS - RSS before step "
                     "1, for step 1 (which creates the state) and the later steps; .grad storages: what the live "
                     ".grad tensors keep allocated)")  # fmt: skip


def main(argv=None) -> None:
    opts = parse_args(argv)
    if opts.worker:  # write_gathered_and_finish ends the process
        from transformers import Trainer  # noqa: F401 - imported here, then frozen with the rest

        gc.freeze()  # the imported libraries are never garbage: every collection (each train()'s end) skips them
        worker = {"loop": loop_worker, "trainer": trainer_worker}.get(opts.worker)  # each run of the launch in turn
        runs = [worker(opts, o, k) for o in opts.optim for k in opts.kind or [None]] if worker else time_worker(opts)
        h.write_gathered_and_finish(opts.result, runs)
    started = time.perf_counter()
    runs, ddp_runs, timed = [], [], None
    each = lambda names: [names] if opts.one_launch else [[n] for n in names]  # noqa: E731 - the runs of each launch
    with tempfile.TemporaryDirectory() as tmp:
        for engine in opts.engines:
            jobs = [(f"{engine} {' '.join(o)}", ["--worker", "loop", "--optim", *o], True) for o in each(opts.optims)]
            if engine == "ddp":
                jobs = [(f"ddp {' '.join(o + k)}", ["--worker", "trainer", "--optim", *o, "--kind", *k], True)
                        for o in each(opts.ddp_optims) for k in each(opts.kinds)]  # fmt: skip
                time_args = [*h.size_args(opts, ("rounds", "time_steps", "warmup_steps")), "--time_optims",
                             *opts.time_optims, *(["--profile"] if opts.profile else [])]  # fmt: skip
                jobs += [("ddp step time", ["--worker", "time", *time_args], False)] if opts.time else []
            for k, (label, args, mmap) in enumerate(jobs):
                t0 = time.perf_counter()
                out = launch(opts, engine, args, Path(tmp) / f"{engine}{k}.json", mmap=mmap)
                if args[1] == "time":
                    timed = out
                else:
                    (ddp_runs if engine == "ddp" else runs).extend(r for run in zip(*out) for r in run)
                print(f"{label:<40} done in {time.perf_counter() - t0:.0f}s", flush=True)
    num_params = (runs or ddp_runs or [{"num_params": h.build_llama(opts).num_parameters()}])[0]["num_params"]
    report = {
        "description": f"Llama {num_params / 1e6:.1f}M params (vocab {opts.vocab_size}, hidden {opts.hidden_size}, "
        f"{opts.num_hidden_layers} layers), batch {opts.batch_size}x{opts.seq_len} per rank, {opts.steps} steps, "
        f"fp32, 2 gloo ranks{', one launch per engine (a smoke run)' * opts.one_launch}",
        "model": {k: getattr(opts, k) for k in FULL} | {"num_params": num_params, "steps": opts.steps},
        "environment": {"malloc_mmap_threshold": "65536", "omp_num_threads": 1, "backend": "gloo", "world_size": 2},
        "ddp_runs": ddp_runs, "ddp_targets": ddp_targets(ddp_runs), "estimator_check": estimator_check(opts, ddp_runs),
        "step_time": time_summary(timed) if timed else None, "runs": runs,
    }  # fmt: skip
    report["ddp_goal_pass"] = all(t["pass"] for t in report["ddp_targets"]) if ddp_runs else None
    report["wall_time_s"] = time.perf_counter() - started
    print_report(report)
    # The FSDP2 runs alone go to a report of their own (results/distributed_memory_fsdp2.json).
    h.write_report(opts.output_dir, "distributed_memory" + ("" if "ddp" in opts.engines else "_fsdp2"), report)


if __name__ == "__main__":
    main()
