"""Step time of `adamw_torch_layerwise` vs `torch.optim.AdamW` in a plain loop (no Trainer, one process), and with
`--profile` where the layer-wise optimizer's extra time goes.
Launch, method and last results: benchmarks/README.md."""

from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common as h  # noqa: E402

OPTIM = "adamw_torch_layerwise"
KINDS = ("standard", "layerwise")
# --offload: (kind, what it is timed against); each reference row is timed in the same rounds.
OFFLOAD_KINDS = {
    "offload_optimizer": "standard",
    "offload_optimizer_after": "standard",
    "standard_clip": "standard_clip",
    "layerwise_norm_pass": "standard_clip",
    "offload_gradients": "standard_clip",
}
# Ratios printed and stored beside the ones against the references: (kind, against).
OFFLOAD_PAIRS = (("offload_optimizer", "offload_optimizer_after"), ("offload_gradients", "layerwise_norm_pass"))
MAX_GRAD_NORM = 1.0  # the clipping rows: Trainer's default, exact
LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.1
GOAL = 1.03  # layer-wise / standard median step time, after the core refactor
FULL = h.LLAMA_20M | dict(seq_len=128, batch_size=2)
SMALL = h.LLAMA_TINY | dict(seq_len=32, batch_size=2)
TOP = 15  # rows kept of each profile table


def parse_args(argv=None):
    parser = h.benchmark_parser(__doc__.splitlines()[0], FULL, SMALL)
    h.add_timing_args(parser, rounds=8, seed=0)
    parser.add_argument("--steps_per_round", type=int, default=3, help="steps of each optimizer per round")
    parser.add_argument(
        "--profile", action="store_true", help="then profile a few steps: hooks, torch.profiler, cProfile"
    )
    parser.add_argument("--profile_steps", type=int, default=3, help="steps of each optimizer per profiler")
    parser.add_argument("--offload", action="store_true", help="add the host offload rows (see the docstring)")
    parser.add_argument(
        "--offload_only", action="store_true", help="the offload rows and their references only (no `layerwise`)"
    )
    parser.add_argument("--name", default="step_time", help="the report's file name: <output_dir>/<name>.json, .png")
    parser.add_argument(
        "--rows", default=None, help="comma-separated rows to time (their references are added), e.g. "
        "standard_clip,layerwise_norm_pass,offload_gradients",
    )  # fmt: skip
    opts = parser.parse_args(argv)
    h.fill_sizes(opts, FULL, SMALL)
    if opts.rows:
        rows = [r.strip() for r in opts.rows.split(",") if r.strip()]
        unknown = set(rows) - set(KINDS) - set(OFFLOAD_KINDS)
        if unknown or not any(r not in ("standard", "standard_clip") for r in rows):
            parser.error(f"--rows: name at least one layer-wise row of {', '.join([*KINDS, *OFFLOAD_KINDS])}")
        opts.rows = rows
        opts.offload = opts.offload or any(r in OFFLOAD_KINDS for r in rows)
        if opts.profile and "layerwise" not in rows:
            parser.error("--profile profiles `layerwise` against `standard`: add layerwise to --rows")
    opts.offload = opts.offload or opts.offload_only
    if opts.offload_only and opts.profile:
        parser.error("--profile profiles `layerwise` against `standard`: not with --offload_only")
    return opts


def kinds_of(opts) -> list[str]:
    """The rows timed: `standard` and `layerwise`, and with `--offload` the offload rows."""
    if opts.rows:
        wanted = set(opts.rows) | {reference_of(r) for r in opts.rows}
        return [k for k in (*KINDS, *OFFLOAD_KINDS) if k in wanted]
    kinds = ["standard"] if opts.offload_only else list(KINDS)
    return kinds + (list(OFFLOAD_KINDS) if opts.offload else [])


def reference_of(kind: str) -> str:
    return OFFLOAD_KINDS.get(kind, "standard")


# ---- offload instrumentation ----


def thread_cpu_seconds(native_ids) -> float:
    """User + system CPU seconds of this process's threads `native_ids` so far (Linux; 0 for a thread gone)."""
    total = 0
    for tid in native_ids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
    return total / os.sysconf("SC_CLK_TCK")


class HostStepClock:
    """
    The host worker's optimizer steps (`layerwise_offload="optimizer"`): torch's step hooks on each wrapped optimizer
    (`unwrap_host_step`) record when each host step ran; `overlap(start, end)` says how much of it fell in a window.
    """

    def __init__(self, optimizer):
        from layerwise_hf.placement.host_step import unwrap_host_step

        self.spans: list[tuple[float, float]] = []
        self._started: dict[int, float] = {}
        self.handles = []
        for inner in optimizer.inner:
            base = unwrap_host_step(inner)
            self.handles.append(base.register_step_pre_hook(self._pre))
            self.handles.append(base.register_step_post_hook(self._post))

    def _pre(self, opt, args, kwargs) -> None:
        self._started[id(opt)] = time.perf_counter()

    def _post(self, opt, args, kwargs) -> None:
        self.spans.append((self._started.pop(id(opt)), time.perf_counter()))

    def take(self) -> list[tuple[float, float]]:
        spans, self.spans = self.spans, []
        return spans

    @staticmethod
    def overlap(spans, start: float, end: float) -> float:
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class Run(h.TimedRun):
    """One optimizer (a row of the table) on its own copy of the model."""

    def __init__(self, base_model, kind: str):
        super().__init__()
        self.kind = kind
        self.model = h.copy_model(base_model)
        self.offload = {"offload_optimizer": "optimizer", "offload_optimizer_after": "optimizer",
                        "offload_gradients": "gradients"}.get(kind, "none")  # fmt: skip
        self.clip = MAX_GRAD_NORM if kind in ("standard_clip", "layerwise_norm_pass", "offload_gradients") else 0.0
        self.layerwise = not kind.startswith("standard")
        args = h.training_args(OPTIM if self.layerwise else "adamw_torch", learning_rate=LEARNING_RATE,
                               weight_decay=WEIGHT_DECAY, max_grad_norm=self.clip)  # fmt: skip
        self.track_grad_norm_passed = None
        if self.layerwise:
            from layerwise_hf import build_layerwise_optimizer

            wanted = {"track_grad_norm": False, "sync_gradients": lambda: True}
            if self.offload != "none":
                wanted["offload"] = self.offload
            self.track_grad_norm_passed = "track_grad_norm" in h.supported_keywords(build_layerwise_optimizer, wanted)
            self.optimizer = h.layerwise_optimizer(self.model, args, clip=(self.clip, "exact"), **wanted)
        else:
            from transformers import Trainer

            decay = set(Trainer.get_decay_parameter_names(None, self.model))
            named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for n, p in named if n in decay], "weight_decay": WEIGHT_DECAY},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
            ]
            self.optimizer = torch.optim.AdamW(groups, lr=LEARNING_RATE)
        self.optimizer_seconds = 0.0  # time in the explicit step() + zero_grad() of the last step
        self.timer: h.InnerStepTimer | None = None  # set while profiling: paused in the explicit step()
        # Where the time goes, per step: forward, backward, step, wait (and host steps with offload).
        self.parts: list[dict] = []
        self.backwards = 0
        self.model.get_input_embeddings().weight.register_hook(self._count_backward)
        self.host_clock = HostStepClock(self.optimizer) if self.offload == "optimizer" else None
        self.threads: dict[str, int] = {}  # the offload's copy thread and host worker by name (`find_threads`)
        self.thread_cpu_s: dict[str, list[float]] = {}  # their CPU seconds in each timed call of `steps`

    def _count_backward(self, grad):
        self.backwards += 1

    def find_threads(self, ids, before: set[int]) -> None:
        """One step, then the threads started since `before` (taken before this run was built): this run's copy
        thread and host worker (started on first use)."""
        self.one_step(ids)
        # "copy": the copy thread (ThreadTransfer); "host": the host worker (HostWorker's pool thread).
        named = {"layerwise-offload-copy": "copy", "layerwise-host": "host"}
        self.threads = {
            role: t.native_id
            for t in threading.enumerate()
            if t.native_id not in before
            for prefix, role in named.items()
            if t.name.startswith(prefix)
        }
        self.parts.clear()

    def _hold_host_worker(self) -> threading.Event:
        # The host worker runs its tasks in order: a task that waits for this event keeps every host step queued
        # behind it until backward has returned (the copies out still run during backward, on the copy thread).
        released = threading.Event()
        self.optimizer.inner[0].runner.worker.submit(released.wait)
        return released

    def one_step(self, ids) -> None:
        t0 = time.perf_counter()
        backwards = self.backwards
        loss = self.model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        held = self._hold_host_worker() if self.kind == "offload_optimizer_after" else None
        if self.layerwise and self.clip:
            # The norm pass: a measuring backward over the retained graph, then the stepping one. With offload the
            # gradients wait on the host for the global norm instead, and this is one backward.
            self.optimizer.backward_with_norm_pass(loss, norm_pass="retain")
        else:
            loss.backward()
        t2 = time.perf_counter()
        if held is not None:
            held.set()
        if self.timer is not None:
            self.timer.paused = True
        if self.kind == "standard_clip":
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.timer is not None:
            self.timer.paused = False
        t3 = time.perf_counter()
        self.optimizer_seconds = t3 - t2
        if self.offload != "none":
            from layerwise_hf.placement.offloading import wait_for_host_steps

            wait_for_host_steps(self.optimizer)  # what the next forward waits for: counted in this step
        t4 = time.perf_counter()
        part = {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "wait": t4 - t3,
                "backwards": self.backwards - backwards}  # fmt: skip
        if self.host_clock is not None:
            spans = self.host_clock.take()
            part["host_step"] = sum(b - a for a, b in spans)
            part["host_step_in_backward"] = HostStepClock.overlap(spans, t1, t2)
        self.parts.append(part)

    def steps(self, batches: list) -> tuple[float, float]:
        """The mean wall and CPU seconds of one step over `batches`; the offload threads' CPU time is summed."""
        before = {name: thread_cpu_seconds([tid]) for name, tid in self.threads.items()}
        wall, cpu = self.clock(lambda: [self.one_step(ids) for ids in batches])
        for name, tid in self.threads.items():
            self.thread_cpu_s.setdefault(name, []).append(thread_cpu_seconds([tid]) - before[name])
        return wall / len(batches), cpu / len(batches)

    def close(self) -> None:
        if self.host_clock is not None:
            self.host_clock.remove()
        if self.layerwise:
            self.optimizer.detach()
        if self.offload != "none":
            from layerwise_hf.optim.host_offload import offload_of

            offload_of(self.optimizer).close()  # the copy thread and the host worker
            if self.offload == "optimizer":
                self.optimizer.inner[0].runner.close()  # and the global forward pre-hook that waits for the host


def round_batches(opts, rnd: int) -> list:
    return [
        h.random_tokens(opts.vocab_size, opts.batch_size, opts.seq_len, seed=1000 * rnd + k)
        for k in range(opts.steps_per_round)
    ]


def time_runs(runs: dict, opts) -> dict:
    h.interleaved_rounds(list(runs.values()), opts, lambda run, rnd: run.steps(round_batches(opts, rnd)))
    timing = {}
    for kind, run in runs.items():
        ref = runs[reference_of(kind)]
        stats = h.timing_stats(run.times, run.cpu_times, ref.times, ref.cpu_times)
        stats["reference"] = reference_of(kind)
        stats["paired_ratios"] = h.paired_ratios(run.times, ref.times)
        stats["paired_ratio_quartiles"] = h.quartiles(stats["paired_ratios"])
        timing[kind] = stats
    return timing


def breakdown(runs: dict, opts) -> dict:
    """Where each row's time goes: the median per step of each part over the timed rounds (warm-up dropped)."""
    out = {}
    timed = opts.rounds * opts.steps_per_round
    for kind, run in runs.items():
        parts = run.parts[-timed:]
        med = {key: statistics.median(p[key] for p in parts) for key in parts[0]}
        entry = {f"{key}_s": value for key, value in med.items() if key != "backwards"}
        entry["backwards_per_step"] = med["backwards"]
        if "host_step" in med:
            total = sum(p["host_step"] for p in parts)
            inside = sum(p["host_step_in_backward"] for p in parts)
            entry["host_step_in_backward_fraction"] = inside / total if total else None
        if run.threads:
            for name in ("copy", "host"):
                thread_cpu = run.thread_cpu_s.get(name, [])[-opts.rounds :]
                entry[f"{name}_thread_cpu_s_per_step"] = sum(thread_cpu) / timed if thread_cpu else None
        out[kind] = entry
    return out


def pair_ratios(timing: dict) -> dict:
    """The offload pairs timed in the same rounds: ratio of medians and the median same-round ratio."""
    out = {}
    for kind, against in OFFLOAD_PAIRS:
        if kind in timing and against in timing:
            a, b = timing[kind]["times_s"], timing[against]["times_s"]
            out[f"{kind}/{against}"] = {
                "ratio": statistics.median(a) / statistics.median(b),
                "paired_ratio_median": statistics.median(h.paired_ratios(a, b)),
                "paired_ratio_quartiles": h.quartiles(h.paired_ratios(a, b)),
            }
    return out


def cost_model_check(runs: dict, report: dict) -> dict | None:
    """
    `layerwise_hf.estimate.offload_choice`'s cost model against this run: what it predicts `offload_gradients` and
    the norm pass add to `standard_clip`'s step, from this run's own backward and step times, the copy time measured
    here and the injected delay per copy (`LAYERWISE_HF_OFFLOAD_DELAY`: a slower link, emulated), next to what the
    same rounds measured (median of the same-round differences).
    """
    if not {"standard_clip", "layerwise_norm_pass", "offload_gradients"} <= set(runs):
        return None
    from layerwise_hf.estimate.offload_choice import choose_clipping_offload
    from layerwise_hf.placement.transfer import DELAY_ENV

    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    parts = report["breakdown"]["standard_clip"]
    tensors = report["num_trainable_tensors"]
    transfer = report["copy_one_direction_s"] + tensors * delay
    largest = report["largest_copy_s"] + delay
    link = report["trainable_bytes"] / transfer  # bytes per second that make grad_bytes take `transfer`
    choice = choose_clipping_offload(
        report["trainable_bytes"], parts["backward_s"], largest_grad_bytes=round(largest * link),
        step_s=parts["step_s"], link_bytes_per_s=link,
    )  # fmt: skip
    ref = runs["standard_clip"].times

    def measured(kind):
        return statistics.median(a - b for a, b in zip(runs[kind].times, ref))

    return {
        "copy_delay_s": delay,
        "transfer_one_direction_s": transfer,
        "predicted_gradients_extra_s": choice.gradients_s,
        "predicted_norm_pass_extra_s": choice.norm_pass_s,
        "predicted_mode": choice.mode,
        "measured_gradients_extra_s": measured("offload_gradients"),
        "measured_norm_pass_extra_s": measured("layerwise_norm_pass"),
        "measured_mode": "gradients" if measured("offload_gradients") < measured("layerwise_norm_pass") else "none",
    }


def largest_copy_seconds(model) -> float:
    """One copy of the largest trainable tensor (the one whose copy the cost model leaves unhidden)."""
    biggest = max((p.detach() for p in model.parameters() if p.requires_grad), key=lambda p: p.numel())
    buffer = torch.empty_like(biggest)
    buffer.copy_(biggest)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        buffer.copy_(biggest)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_seconds(model) -> float:
    """One copy of every trainable tensor into a buffer of its own, on this thread: what one direction of the
    offload's copies costs on this machine (the copy thread runs them one by one, beside the compute)."""
    params = [p.detach() for p in model.parameters() if p.requires_grad]
    buffers = [torch.empty_like(p) for p in params]
    for b, p in zip(buffers, params):  # first touch of the pages
        b.copy_(p)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for b, p in zip(buffers, params):
            b.copy_(p)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- profile ----


def hook_profile(runs: dict, opts) -> dict:
    """Per step: the layer-wise inner steps and hook work from torch's step hooks; the standard optimizer's step()."""
    lw_run, std_run = runs["layerwise"], runs["standard"]
    lw = lw_run.optimizer
    lw.detach()
    timer = h.InnerStepTimer(lw, arrivals=True, keep=True)  # its arrival hooks must come before the layer-wise ones
    lw.attach()
    lw_run.timer = timer
    per_step = {"layerwise": [], "standard": []}
    try:
        for k in range(opts.profile_steps):
            ids = h.random_tokens(opts.vocab_size, opts.batch_size, opts.seq_len, seed=10_000 + k)
            for kind, run in (("layerwise", lw_run), ("standard", std_run)):
                timer.reset()
                wall, _ = run.clock(run.one_step, ids)
                entry = {"step_s": wall, "explicit_step_s": run.optimizer_seconds}
                if kind == "layerwise":
                    entry |= {
                        "inner_steps": timer.calls,
                        "inner_step_s": timer.seconds,
                        "hook_before_step_s": timer.hook_seconds,
                        "inner_step_us_each": [1e6 * s for s in timer.per_call],
                        "hook_before_step_us_each": [1e6 * s for s in timer.hook_per_call],
                    }
                per_step[kind].append(entry)
    finally:
        lw_run.timer = None
        timer.remove()
    lw_steps, std_steps = per_step["layerwise"], per_step["standard"]
    med = statistics.median
    inner_each = [u for s in lw_steps for u in s["inner_step_us_each"]]
    hook_each = [u for s in lw_steps for u in s["hook_before_step_us_each"]]
    summary = {
        "steps": opts.profile_steps,
        "layerwise_step_s": med(s["step_s"] for s in lw_steps),
        "standard_step_s": med(s["step_s"] for s in std_steps),
        "standard_optimizer_step_s": med(s["explicit_step_s"] for s in std_steps),
        "layerwise_inner_step_total_s": med(s["inner_step_s"] for s in lw_steps),
        "layerwise_hook_before_step_total_s": med(s["hook_before_step_s"] for s in lw_steps),
        "layerwise_explicit_step_s": med(s["explicit_step_s"] for s in lw_steps),
        "inner_steps_per_step": lw_steps[-1]["inner_steps"],
        "inner_step_us_median": med(inner_each) if inner_each else None,
        "hook_before_step_us_median": med(hook_each) if hook_each else None,
    }
    # The layer-wise optimizer's work, all of it, against the standard step(): what one optimizer per tensor adds.
    lw_total = summary["layerwise_inner_step_total_s"] + summary["layerwise_hook_before_step_total_s"]
    summary["optimizer_extra_s"] = (
        lw_total + summary["layerwise_explicit_step_s"] - summary["standard_optimizer_step_s"]
    )
    summary["step_extra_s"] = summary["layerwise_step_s"] - summary["standard_step_s"]
    return {"summary": summary, "per_step": per_step}


def torch_profile(run: Run, opts) -> dict:
    """Operator totals of `opts.profile_steps` steps of `run` under torch.profiler (CPU)."""
    from torch.profiler import ProfilerActivity, profile

    batches = [h.random_tokens(opts.vocab_size, opts.batch_size, opts.seq_len, seed=20_000 + k) for k in range(2)]
    run.one_step(batches[0])  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(opts.profile_steps):
            run.one_step(batches[k % 2])
    ops = {}
    for e in prof.key_averages():
        ops[e.key] = {"count": e.count, "self_cpu_us": e.self_cpu_time_total, "cpu_us": e.cpu_time_total}
    return ops


def op_table(lw_ops: dict, std_ops: dict, steps: int) -> dict:
    """Per step: the layer-wise run's top operators by own time, and the operators whose own time grew most."""

    def row(name):
        lw, std = lw_ops.get(name, {}), std_ops.get(name, {})
        return {
            "op": name,
            "layerwise_calls": lw.get("count", 0) / steps,
            "standard_calls": std.get("count", 0) / steps,
            "layerwise_self_ms": lw.get("self_cpu_us", 0) / steps / 1000,
            "standard_self_ms": std.get("self_cpu_us", 0) / steps / 1000,
            "extra_self_ms": (lw.get("self_cpu_us", 0) - std.get("self_cpu_us", 0)) / steps / 1000,
            "layerwise_total_ms": lw.get("cpu_us", 0) / steps / 1000,
            "standard_total_ms": std.get("cpu_us", 0) / steps / 1000,
        }

    names = set(lw_ops) | set(std_ops)
    rows = [row(n) for n in names]
    norms = [r for r in rows if "norm" in r["op"] and ("vector_norm" in r["op"] or "foreach_norm" in r["op"])]
    steps_rows = [r for r in rows if r["op"].startswith("Optimizer.step#")]
    return {
        "top_self_layerwise": sorted(rows, key=lambda r: -r["layerwise_self_ms"])[:TOP],
        "top_extra": sorted(rows, key=lambda r: -r["extra_self_ms"])[:TOP],
        "norm_ops": norms,
        "optimizer_step_ops": steps_rows,
        "layerwise_self_ms_total": sum(r["layerwise_self_ms"] for r in rows),
        "standard_self_ms_total": sum(r["standard_self_ms"] for r in rows),
    }


def c_profile(run: Run, opts) -> list[dict]:
    """The layer-wise steps' top Python functions by own time (cProfile)."""
    batches = [h.random_tokens(opts.vocab_size, opts.batch_size, opts.seq_len, seed=30_000 + k) for k in range(2)]
    profiler = cProfile.Profile()
    profiler.enable()
    for k in range(opts.profile_steps):
        run.one_step(batches[k % 2])
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        # The package directory and file name: enough to tell layerwise_hf's functions from torch's.
        where = f"{'/'.join(Path(file).parts[-2:])}:{line}({func})" if line else func
        rows.append(
            {
                "function": where,
                "calls_per_step": ncalls / opts.profile_steps,
                "own_ms_per_step": 1000 * tottime / opts.profile_steps,
                "cumulative_ms_per_step": 1000 * cumtime / opts.profile_steps,
            }
        )
    top = sorted(rows, key=lambda r: -r["own_ms_per_step"])[:TOP]
    ours = sorted((r for r in rows if "layerwise_hf" in r["function"]), key=lambda r: -r["cumulative_ms_per_step"])
    return {"top_own_time": top, "layerwise_hf_functions": ours[:TOP]}


def profile_runs(runs: dict, opts) -> dict:
    print(f"profile: {opts.profile_steps} steps each, step hooks / torch.profiler / cProfile", flush=True)
    hooks = hook_profile(runs, opts)
    ops = {kind: torch_profile(run, opts) for kind, run in runs.items()}
    return {
        "hooks": hooks,
        "torch_profiler": op_table(ops["layerwise"], ops["standard"], opts.profile_steps),
        "cprofile_layerwise": c_profile(runs["layerwise"], opts),
    }


# ---- report ----


def print_report(report: dict) -> None:
    print(f"\n{report['description']}")
    t = report["timing"]
    rows = [
        [kind, f"{e['median_s']:.4f}", e["reference"], f"{e['ratio']:.3f}x", f"{e['paired_ratio_median']:.3f}",
         f"{e['paired_ratio_quartiles'][0]:.3f}-{e['paired_ratio_quartiles'][2]:.3f}", f"{e['cpu_median_s']:.4f}",
         f"{e['cpu_ratio']:.3f}x", " ".join(f"{x:.3f}" for x in e["times_s"])]
        for kind, e in t.items()
    ]  # fmt: skip
    h.print_table(
        [("optimizer", 23), ("median s", 8), ("against", 13), ("ratio", 7), ("paired", 7), ("quartiles", 11),
         ("cpu med s", 9), ("cpu", 7), ("", 0)],
        rows,
    )  # fmt: skip
    if "layerwise" in t:
        lw = t["layerwise"]
        verdict = "PASS" if lw["ratio"] <= GOAL else "FAIL"
        print(
            f"layer-wise / standard: {lw['ratio']:.3f}x (paired {lw['paired_ratio_median']:.3f}, "
            f"cpu {lw['cpu_ratio']:.3f}x); goal <= {GOAL}x after the core refactor: {verdict}. "
            f"track_grad_norm=False passed: {report['track_grad_norm_passed']}"
        )
    print_breakdown(report)
    prof = report.get("profile")
    if not prof:
        return
    s = prof["hooks"]["summary"]
    print(f"\nProfile, step hooks ({s['steps']} steps, median per step)")
    print(
        f"  step: layer-wise {1000 * s['layerwise_step_s']:.1f} ms, standard {1000 * s['standard_step_s']:.1f} ms "
        f"(+{1000 * s['step_extra_s']:.1f} ms)\n"
        f"  standard optimizer.step()+zero_grad(): {1000 * s['standard_optimizer_step_s']:.1f} ms\n"
        f"  layer-wise: {s['inner_steps_per_step']} inner step() calls "
        f"{1000 * s['layerwise_inner_step_total_s']:.1f} ms"
        f" (median {s['inner_step_us_median']:.0f} us each) + hook work before each step "
        f"{1000 * s['layerwise_hook_before_step_total_s']:.1f} ms (median {s['hook_before_step_us_median']:.0f} us: "
        f"norm + bookkeeping) + explicit step()+zero_grad() {1000 * s['layerwise_explicit_step_s']:.1f} ms\n"
        f"  optimizer work, layer-wise minus standard: {1000 * s['optimizer_extra_s']:+.1f} ms of the "
        f"{1000 * s['step_extra_s']:+.1f} ms step difference"
    )
    tp = prof["torch_profiler"]
    print(
        f"\ntorch.profiler, ms per step (own CPU time of all ops: layer-wise {tp['layerwise_self_ms_total']:.1f}, "
        f"standard {tp['standard_self_ms_total']:.1f})"
    )
    cols = [("operator", 44), ("lw calls", 8), ("std calls", 9), ("lw self", 8), ("std self", 8), ("extra", 7)]

    def op_rows(rows):
        return [
            [r["op"][:44], f"{r['layerwise_calls']:.0f}", f"{r['standard_calls']:.0f}",
             f"{r['layerwise_self_ms']:.2f}", f"{r['standard_self_ms']:.2f}", f"{r['extra_self_ms']:+.2f}"]
            for r in rows
        ]  # fmt: skip

    h.print_table(cols, op_rows(tp["top_extra"][:10]), title="largest extra own time, layer-wise minus standard:")
    h.print_table(cols, op_rows(tp["norm_ops"] + tp["optimizer_step_ops"][:4]), title="norms and optimizer steps:")
    cp = prof["cprofile_layerwise"]
    cols = [("function", 70), ("calls", 7), ("own ms", 7), ("cum ms", 7)]

    def fn_rows(rows):
        return [
            [r["function"][-70:], f"{r['calls_per_step']:.0f}", f"{r['own_ms_per_step']:.2f}",
             f"{r['cumulative_ms_per_step']:.2f}"]
            for r in rows
        ]  # fmt: skip

    h.print_table(cols, fn_rows(cp["top_own_time"][:10]), title="\ncProfile, layer-wise steps, top own time per step:")
    h.print_table(cols, fn_rows(cp["layerwise_hf_functions"][:8]), title="layerwise_hf functions, cumulative:")


def print_breakdown(report: dict) -> None:
    b = report["breakdown"]
    cols = [("optimizer", 23), ("forward", 8), ("backward", 8), ("bwds", 4), ("step", 8), ("wait", 8),
            ("host step", 9), ("in bwd", 6), ("copy cpu", 8), ("host cpu", 8)]  # fmt: skip

    def ms(x):
        return "-" if x is None else f"{1000 * x:.1f}"

    def pct(x):
        return "-" if x is None else f"{100 * x:.0f}%"

    rows = [
        [kind, ms(e["forward_s"]), ms(e["backward_s"]), f"{e['backwards_per_step']:g}", ms(e["step_s"]),
         ms(e["wait_s"]), ms(e.get("host_step_s")),
         pct(e.get("host_step_in_backward_fraction")),
         ms(e.get("copy_thread_cpu_s_per_step")), ms(e.get("host_thread_cpu_s_per_step"))]
        for kind, e in b.items()
    ]  # fmt: skip
    h.print_table(cols, rows, title="\nwhere the time goes, ms per step (median; copy / host cpu: CPU time of the "
                                    "copy thread / the host worker, mean)")  # fmt: skip
    for name, e in report.get("offload_pairs", {}).items():
        q = e["paired_ratio_quartiles"]
        print(f"  {name}: {e['ratio']:.3f}x (same-round median {e['paired_ratio_median']:.3f}, {q[0]:.3f}-{q[2]:.3f})")
    cost = report.get("cost_model")
    if cost:
        c = {k: f"{v:.3f}" if isinstance(v, float) else v for k, v in cost.items()}
        print(
            f"  cost model (offload_choice), seconds a step adds to standard_clip, copy delay {cost['copy_delay_s']:g}"
            f" s (one direction {c['transfer_one_direction_s']} s): gradients offload predicted "
            f"{c['predicted_gradients_extra_s']} / measured {c['measured_gradients_extra_s']}, norm pass predicted "
            f"{c['predicted_norm_pass_extra_s']} / measured {c['measured_norm_pass_extra_s']}; choice predicted "
            f"{cost['predicted_mode']!r}, measured {cost['measured_mode']!r}"
        )
    if "copy_one_direction_s" in report:
        print(
            f"  one copy of every trainable tensor ({report['trainable_bytes'] / h.MIB:.1f} MiB) on one thread: "
            f"{1000 * report['copy_one_direction_s']:.1f} ms"
        )


def plot(report: dict, path: Path) -> None:
    t = report["timing"]
    ratios = {f"{k} / {v['reference']} (median {v['ratio']:.3f})": dict(enumerate(v["paired_ratios"], 1))
              for k, v in t.items() if v["reference"] != k}  # fmt: skip
    h.plot_panels(path, report["description"], [
        dict(title="step time per round", ylabel="mean step time in the round (s)", line=True,
             series={k: dict(enumerate(v["times_s"], 1)) for k, v in t.items()}),
        dict(title="ratio per round", ylabel="row / its reference, same round", line=True, series=ratios,
             lines={f"layer-wise goal {GOAL}x": GOAL} if "layerwise" in t else {}),
    ])  # fmt: skip


def main(argv=None) -> int:
    opts = parse_args(argv)
    torch.set_num_threads(opts.threads)
    started, load_start = time.perf_counter(), os.getloadavg()
    if opts.offload:
        from layerwise_hf.placement import transfer

        # The GPU path on CPU: separate host buffers, the host worker and the copy thread, no injected delay.
        os.environ.setdefault(transfer.SIMULATE_ENV, "1")
    base_model = h.build_llama(opts, seed=opts.seed)
    num_params = sum(p.numel() for p in base_model.parameters())
    kinds = kinds_of(opts)
    runs = {}
    for kind in kinds:
        before = {t.native_id for t in threading.enumerate()}
        runs[kind] = run = Run(base_model, kind)
        if run.offload != "none":
            run.find_threads(h.random_tokens(opts.vocab_size, opts.batch_size, opts.seq_len, seed=999), before)
    rows = " / ".join(kinds)
    desc = (
        f"{rows}, plain loop, Llama {num_params / 1e6:.1f}M params (vocab {opts.vocab_size}, "
        f"hidden {opts.hidden_size}, {opts.num_hidden_layers} layers, untied), fp32, batch {opts.batch_size}x"
        f"{opts.seq_len}, {opts.threads} thread(s), {opts.rounds} rounds x {opts.steps_per_round} steps "
        f"after {opts.warmup} warm-up, CPU"
    )
    print(f"timing: {desc}", flush=True)
    timing = time_runs(runs, opts)
    lw = runs.get("layerwise", next(r for r in runs.values() if r.layerwise))
    report = {
        "description": desc,
        "model": {k: getattr(opts, k) for k in FULL} | {"num_params": num_params, "tie_word_embeddings": False},
        "settings": {k: getattr(opts, k) for k in ("warmup", "rounds", "steps_per_round", "threads", "seed")}
        | {"learning_rate": LEARNING_RATE, "weight_decay": WEIGHT_DECAY, "max_grad_norm": 0.0, "optim": OPTIM}
        | {"offload": opts.offload, "clip_rows_max_grad_norm": MAX_GRAD_NORM},
        "track_grad_norm_passed": lw.track_grad_norm_passed,
        "num_trainable_tensors": len(lw.optimizer.inner),
        "goal_ratio": GOAL,
        "timing": timing,
        "breakdown": breakdown(runs, opts),
        "environment": {"torch": torch.__version__, "python": h.python_version(), "cpus": os.cpu_count()}
        | {"loadavg_start": load_start},
    }
    if "layerwise" in timing:
        report["ratio"] = timing["layerwise"]["ratio"]
        report["paired_ratio_median"] = timing["layerwise"]["paired_ratio_median"]
    if opts.offload:
        report["offload_pairs"] = pair_ratios(timing)
        report["copy_one_direction_s"] = copy_seconds(base_model)
        report["largest_copy_s"] = largest_copy_seconds(base_model)
        report["trainable_bytes"] = sum(p.numel() * p.element_size() for p in base_model.parameters())
        report["cost_model"] = cost_model_check(runs, report)
    if opts.profile:
        report["profile"] = profile_runs(runs, opts)
    for run in runs.values():
        run.close()
    report["environment"]["loadavg_end"] = os.getloadavg()
    report["wall_time_s"] = time.perf_counter() - started
    print_report(report)
    h.write_report(opts.output_dir, opts.name, report, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
