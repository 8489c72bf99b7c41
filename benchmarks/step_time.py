"""Step time of `adamw_torch_layerwise` vs `torch.optim.AdamW` in a plain loop (no Trainer, one process); with
`--offload` the host offload rows, with `--fp16` the clipping rows under fp16 autocast and `GradScaler`.
Launch, method and last results: benchmarks/README.md."""

# ruff: noqa: E402 - the checkout goes on sys.path first
from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as h
from layerwise_hf.estimate.offload_choice import choose_clipping_offload
from layerwise_hf.optim.norm_pass import backward_with_norm_pass
from layerwise_hf.optim.optimizer import offload_of
from layerwise_hf.placement import transfer
from layerwise_hf.placement.host_step import unwrap_host_step
from layerwise_hf.placement.offloading import wait_for_host_steps

OPTIM = "adamw_torch_layerwise"
# Each row and the row it is timed against, in the same rounds. Offload rows: `offload_optimizer_after` holds the host
# worker until backward has returned (as torchao's CPUOffloadOptimizer and ZeRO-Offload step); the clipping rows clip
# exactly at GA 1: the norm pass (a measuring backward, then the stepping one) or gradients offload (one backward).
REFERENCE = {"standard": "standard", "layerwise": "standard", "offload_optimizer": "standard",
             "offload_optimizer_after": "standard", "standard_clip": "standard_clip",
             "layerwise_norm_pass": "standard_clip", "offload_gradients": "standard_clip"}  # fmt: skip
OFFLOAD = {"offload_optimizer": "optimizer", "offload_optimizer_after": "optimizer", "offload_gradients": "gradients"}
# Ratios printed and stored beside the ones against the references: (row, against).
OFFLOAD_PAIRS = (("offload_optimizer", "offload_optimizer_after"), ("offload_gradients", "layerwise_norm_pass"))
MAX_GRAD_NORM = 1.0  # the clipping rows: Trainer's default, exact
LEARNING_RATE, WEIGHT_DECAY = 1e-4, 0.1
GOAL = 1.03  # layer-wise / standard median step time, after the core refactor
FULL = h.LLAMA_20M | dict(seq_len=128, batch_size=2)
SMALL = h.LLAMA_TINY | dict(seq_len=32, batch_size=2)
# --fp16: the example task of examples/train.py (its model and grammar corpus), one step a round, its peak lr.
FP16 = dict(rounds=20, seed=42, steps_per_round=1, learning_rate=3e-3, grad_accum=[1, 4], name="step_time_fp16")


def parse_args(argv=None):
    fp16 = "--fp16" in (sys.argv[1:] if argv is None else argv)  # the sizes and defaults follow the mode
    sizes = (h.EXAMPLE_FULL, h.EXAMPLE_SMALL) if fp16 else (FULL, SMALL)
    parser = h.benchmark_parser(__doc__.splitlines()[0], *sizes, rounds=8, seed=0)
    parser.add_argument("--steps_per_round", type=int, default=3, help="steps of each optimizer per round")
    parser.add_argument("--offload", action="store_true", help="add the host offload rows")
    parser.add_argument("--offload_only", action="store_true", help="the offload rows and their references only")
    parser.add_argument("--name", default="step_time", help="the report's file name: <output_dir>/<name>.json")
    parser.add_argument("--rows", default=None, help="comma-separated rows to time (their references are added)")
    parser.add_argument("--fp16", action="store_true", help="standard_clip and layerwise_norm_pass under fp16 "
                        "autocast and GradScaler, on the example task, at each --grad_accum")  # fmt: skip
    parser.add_argument("--grad_accum", type=int, nargs="+", default=[1], help="GA values timed (each row at each)")
    parser.add_argument("--learning_rate", type=float, default=LEARNING_RATE)
    parser.set_defaults(**(FP16 if fp16 else {}))
    opts = h.parse(parser, argv)
    if opts.fp16:
        if opts.rows or opts.offload or opts.offload_only:
            parser.error("--fp16 times the clipping rows only")
        opts.kinds = ["standard_clip", "layerwise_norm_pass"]
    elif opts.rows:
        rows = [r.strip() for r in opts.rows.split(",") if r.strip()]
        if set(rows) - set(REFERENCE) or set(rows) <= {"standard", "standard_clip"}:
            parser.error(f"--rows: name at least one layer-wise row of {', '.join(REFERENCE)}")
        wanted = set(rows) | {REFERENCE[r] for r in rows}
        opts.kinds = [k for k in REFERENCE if k in wanted]
    else:
        opts.kinds = ["standard"] + ([] if opts.offload_only else ["layerwise"])
        if opts.offload or opts.offload_only:
            opts.kinds += [k for k in REFERENCE if k not in ("standard", "layerwise")]
    return opts


class HostStepClock:
    """When the host worker's optimizer steps ran (`layerwise_offload="optimizer"`): torch's step hooks on each wrapped
    optimizer; `overlap(spans, start, end)` says how much of them fell in a window."""

    def __init__(self, optimizer):
        self.spans, self._started = [], {}
        for inner in optimizer.inner:
            unwrap_host_step(inner).register_step_pre_hook(self._pre)
            unwrap_host_step(inner).register_step_post_hook(self._post)

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


class Run(h.TimedRun):
    """One row of the table: its optimizer on its own copy of the model, `ga` micro-batches a step; with `fp16`
    under autocast, the loss scaled by a `GradScaler` of its own."""

    def __init__(self, base_model, kind: str, opts, ga: int = 1):
        suffix = "" if opts.grad_accum == [1] else f" ga{ga}"
        super().__init__(kind + suffix)
        self.reference = REFERENCE[kind] + suffix
        self.kind, self.ga, self.model = kind, ga, h.copy_model(base_model)
        self.offload = OFFLOAD.get(kind, "none")
        self.clip = MAX_GRAD_NORM if REFERENCE[kind] == "standard_clip" else 0.0
        self.layerwise, self.last = not kind.startswith("standard"), True
        self.passes = h.count_passes(self.model)
        self.parts: list[dict] = []  # per step: forward, backward, step, wait (and the host steps with offload)
        self.grad_bytes_at_step = 0  # standard: the .grad bytes alive when it steps
        # The standard row: torch.optim.AdamW over Trainer's decay split, as Trainer builds it.
        args = h.training_args(OPTIM if self.layerwise else "adamw_torch", learning_rate=opts.learning_rate,
                               weight_decay=WEIGHT_DECAY)  # fmt: skip
        offload = {} if self.offload == "none" else {"offload": self.offload}
        # Outside Accelerate the window's last micro-batch is ours to say.
        self.optimizer, _ = h.build_optimizer(self.model, args, self.clip, sync=lambda: self.last, **offload)
        self.host_clock = HostStepClock(self.optimizer) if self.offload == "optimizer" else None
        self.scaler = torch.amp.GradScaler("cpu") if opts.fp16 else None
        self.scales = [] if self.scaler is None else [self.scaler.get_scale()]  # it halves at a skipped step
        if self.scaler is not None and self.layerwise:
            self.optimizer.use_grad_scaler(self.scaler)

    def one_step(self, batches: list[dict]) -> None:
        passes, parts, backwards = dict(self.passes), dict.fromkeys(("forward", "backward"), 0.0), []
        for k, batch in enumerate(batches):
            self.last, t0 = k == len(batches) - 1, time.perf_counter()
            with torch.autocast("cpu", dtype=torch.float16, enabled=self.scaler is not None):
                loss = self.model(**batch).loss / len(batches)
            loss = loss if self.scaler is None else self.scaler.scale(loss)
            t1 = time.perf_counter()
            held = None
            if self.kind == "offload_optimizer_after":
                # The host worker runs its tasks in order: one that waits for this event keeps every host step queued
                # behind it until backward has returned (the copies out still run during backward, on the copy thread).
                held = threading.Event()
                self.optimizer.inner[0].runner.worker.submit(held.wait)
            if self.layerwise and self.clip:
                # With offload the gradients wait on the host for the global norm instead: one backward. 'retain',
                # the way whose cost this measures ('auto' holds instead where activations outweigh gradients).
                backward_with_norm_pass(self.optimizer, loss, norm_pass="retain")
            else:
                loss.backward()
            t2 = time.perf_counter()
            if held is not None:
                held.set()
            parts["forward"] += t1 - t0
            parts["backward"] += t2 - t1
            backwards.append((t1, t2))
        if self.kind == "standard_clip":
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        if not self.layerwise:
            live = sum(h.nbytes(p.grad) for p in self.model.parameters() if p.grad is not None)
            self.grad_bytes_at_step = max(self.grad_bytes_at_step, live)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if self.offload != "none":
            wait_for_host_steps(self.optimizer)  # what the next forward waits for: counted in this step
        part = parts | {"step": t3 - t2, "wait": time.perf_counter() - t3}
        part |= {f"{k}s": self.passes[k] - passes[k] for k in ("forward", "backward")}
        if self.scaler is not None:
            self.scales.append(self.scaler.get_scale())
        if self.host_clock is not None:
            spans = self.host_clock.take()
            part["host_step"] = sum(b - a for a, b in spans)
            part["host_in_backward"] = sum(HostStepClock.overlap(spans, *window) for window in backwards)
        self.parts.append(part)

    def close(self) -> None:
        if self.layerwise:
            self.optimizer.detach()
        if self.offload != "none":
            offload_of(self.optimizer).close()  # the copy thread and the host worker
            if self.offload == "optimizer":
                self.optimizer.inner[0].runner.close()  # and the global forward pre-hook that waits for the host


def batches(opts, dataset, run: Run, rnd: int) -> list[list[dict]]:
    """The steps of round `rnd`, each `run.ga` micro-batches, the same for every row: random tokens, or with `--fp16`
    the example task's corpus."""
    out = []
    for k in range(opts.steps_per_round):
        if dataset is not None:
            out.append(h.micro_batches(dataset, rnd * opts.steps_per_round + k, run.ga, opts.batch_size))
        else:
            ids = h.random_tokens(opts.vocab_size, opts.batch_size, opts.seq_len, 1000 * rnd + k)
            out.append([{"input_ids": ids, "labels": ids}] * run.ga)
    return out


def breakdown(run: Run, timed: int) -> dict:
    """Where a row's time goes: the median per step of each part over the timed steps; the passes a step runs, the
    most gradient bytes alive at once and, under a GradScaler, the steps it skipped (warm-up included)."""
    parts = run.parts[-timed:]
    med = {key: statistics.median(p[key] for p in parts) for key in parts[0]}
    out = {f"{key}_s": value for key, value in med.items() if key not in ("forwards", "backwards")}
    out |= {f"{key}_per_step": med[key] for key in ("forwards", "backwards")}
    out["peak_grad_bytes"] = run.optimizer.pipeline.memory.peak_grad_bytes if run.layerwise else run.grad_bytes_at_step
    if run.scales:
        out["skipped_steps"] = sum(b < a for a, b in zip(run.scales, run.scales[1:]))
    if "host_step" in med:
        total = sum(p["host_step"] for p in parts)
        out["host_step_in_backward_fraction"] = sum(p["host_in_backward"] for p in parts) / total if total else None
    return out


def copy_seconds(model) -> tuple[float, float]:
    """One copy of every trainable tensor into a buffer of its own, on this thread (one direction of the offload's
    copies on this machine), and of the largest alone (the copy the cost model leaves unhidden): median seconds."""
    params = [p.detach() for p in model.parameters() if p.requires_grad]
    buffers = [torch.empty_like(p) for p in params]
    largest = max(range(len(params)), key=lambda k: params[k].numel())

    def timed(pairs):
        for b, p in pairs:  # first touch of the pages
            b.copy_(p)
        return statistics.median(h.TimedRun.clock(lambda: [b.copy_(p) for b, p in pairs])[0] for _ in range(5))

    return timed(list(zip(buffers, params))), timed([(buffers[largest], params[largest])])


def cost_model_check(runs: dict, report: dict) -> dict | None:
    """`layerwise_hf.estimate.offload_choice`'s cost model against this run: what it predicts `offload_gradients` and
    the norm pass add to `standard_clip`'s step, from this run's backward and step times, the copy times measured here
    and the delay per copy (`LAYERWISE_HF_OFFLOAD_DELAY`: a slower link, emulated), next to what the same rounds
    measured (median of the same-round differences)."""
    if not {"standard_clip", "layerwise_norm_pass", "offload_gradients"} <= set(runs):
        return None
    delay = float(os.environ.get(transfer.DELAY_ENV, "0") or 0)
    parts, grad_bytes = report["breakdown"]["standard_clip"], report["trainable_bytes"]
    one_way = report["copy_one_direction_s"] + report["num_trainable_tensors"] * delay
    link = grad_bytes / one_way  # bytes per second that make grad_bytes take `one_way`
    choice = choose_clipping_offload(grad_bytes, parts["backward_s"], step_s=parts["step_s"], link_bytes_per_s=link,
                                     largest_grad_bytes=round((report["largest_copy_s"] + delay) * link))  # fmt: skip
    measured = {k: statistics.median(a - b for a, b in zip(runs[k].times, runs["standard_clip"].times))
                for k in ("offload_gradients", "layerwise_norm_pass")}  # fmt: skip
    return {
        "copy_delay_s": delay, "transfer_one_direction_s": one_way, "predicted_gradients_extra_s": choice.gradients_s,
        "predicted_norm_pass_extra_s": choice.norm_pass_s, "predicted_mode": choice.mode,
        "measured_gradients_extra_s": measured["offload_gradients"],
        "measured_norm_pass_extra_s": measured["layerwise_norm_pass"],
        "measured_mode": "gradients" if measured["offload_gradients"] < measured["layerwise_norm_pass"] else "none",
    }  # fmt: skip


def print_report(report: dict) -> None:
    print(f"\n{report['description']}")
    ms = lambda x: "-" if x is None else f"{1000 * x:.1f}"  # noqa: E731
    rows = [[kind, e["reference"], f"{e['median_s']:.4f}", f"{e['ratio']:.3f}x", f"{e['paired_ratio_median']:.3f}",
             f"{e['paired_ratio_quartiles'][0]:.3f}-{e['paired_ratio_quartiles'][2]:.3f}", f"{e['cpu_ratio']:.3f}x",
             *(ms(b.get(k)) for k in ("forward_s", "backward_s", "step_s", "wait_s", "host_step_s")),
             f"{b['forwards_per_step']:g}/{b['backwards_per_step']:g}", h.mib(b["peak_grad_bytes"]),
             "-" if b.get("host_step_in_backward_fraction") is None
             else f"{100 * b['host_step_in_backward_fraction']:.0f}%", b.get("skipped_steps", "-")]
            for (kind, e), b in zip(report["timing"].items(), report["breakdown"].values())]  # fmt: skip
    h.print_table([("row", 26), ("against", 16), ("median s", 8), ("ratio", 7), ("paired", 7), ("quartiles", 11),
                   ("cpu", 7), ("fwd ms", 7), ("bwd ms", 7), ("step ms", 7), ("wait ms", 7), ("host ms", 7),
                   ("fwd/bwd", 7), ("grad MiB", 8), ("in bwd", 6), ("skipped", 7)], rows)  # fmt: skip
    print("ratio: median step time / its reference's; paired: median (and quartiles) of same-round ratios; cpu: "
          "process CPU time ratio; where the time goes, ms per step (median); host: the host worker's steps, in bwd: "
          "the share of them that ran during backward; fwd/bwd: passes per step; grad: the most gradient bytes alive "
          "at once; skipped: steps GradScaler skipped (warm-up included).")  # fmt: skip
    if "ratio" in report:
        print(f"layer-wise / standard: {report['ratio']:.3f}x; goal <= {GOAL}x: {h.verdict(report['ratio'] <= GOAL)}")
    for name, e in report.get("offload_pairs", {}).items():
        print(f"  {name}: {e['ratio']:.3f}x (same-round median {e['paired_ratio_median']:.3f})")
    if report.get("cost_model"):
        c = {k: f"{v:.3f}" if isinstance(v, float) else v for k, v in report["cost_model"].items()}
        print(f"  cost model, seconds a step adds to standard_clip (copy delay {c['copy_delay_s']} s, one direction "
              f"{c['transfer_one_direction_s']} s): gradients offload {c['predicted_gradients_extra_s']} predicted / "
              f"{c['measured_gradients_extra_s']} measured, norm pass {c['predicted_norm_pass_extra_s']} / "
              f"{c['measured_norm_pass_extra_s']}; choice {c['predicted_mode']} / {c['measured_mode']}")  # fmt: skip


def main(argv=None) -> int:
    opts, started, load_start = parse_args(argv), time.perf_counter(), os.getloadavg()
    torch.set_num_threads(opts.threads)
    if any(k in OFFLOAD for k in opts.kinds):
        # The GPU path on CPU: separate host buffers, the host worker and the copy thread, no injected delay.
        os.environ.setdefault(transfer.SIMULATE_ENV, "1")
    if opts.fp16:
        base_model, dataset = h.example_task(opts)
    else:
        base_model, dataset = h.build_llama(opts, seed=opts.seed), None
    runs = {r.name: r for ga in opts.grad_accum for r in [Run(base_model, kind, opts, ga) for kind in opts.kinds]}
    desc = (f"{' / '.join(runs)}, plain loop, {'the example task: ' * opts.fp16}Llama "
            f"{base_model.num_parameters() / 1e6:.1f}M params (vocab {base_model.config.vocab_size}, hidden "
            f"{opts.hidden_size}, {opts.num_hidden_layers} layers, untied), "
            f"{'fp16 autocast + GradScaler' if opts.fp16 else 'fp32'}, batch {opts.batch_size}x{opts.seq_len}, "
            f"{opts.threads} thread(s), {opts.rounds} rounds x {opts.steps_per_round} steps after {opts.warmup} "
            "warm-up, CPU")  # fmt: skip
    print(f"timing: {desc}", flush=True)

    def step(run, rnd):
        wall, cpu = run.clock(lambda: [run.one_step(micro) for micro in batches(opts, dataset, run, rnd)])
        return wall / opts.steps_per_round, cpu / opts.steps_per_round

    h.interleaved_rounds(list(runs.values()), opts, step)
    timing = {k: {"reference": r.reference, **h.timing_stats(r, runs[r.reference])} for k, r in runs.items()}
    report = {
        "description": desc,
        "model": {k: getattr(opts, k) for k in FULL if hasattr(opts, k)}
        | {"vocab_size": base_model.config.vocab_size, "num_params": base_model.num_parameters()},
        "settings": {k: getattr(opts, k) for k in ("warmup", "rounds", "steps_per_round", "threads", "seed",
                                                   "grad_accum", "fp16", "learning_rate")}
        | {"weight_decay": WEIGHT_DECAY, "clip_rows_max_grad_norm": MAX_GRAD_NORM},
        "num_trainable_tensors": sum(p.requires_grad for p in base_model.parameters()),
        "trainable_bytes": sum(h.nbytes(p) for p in base_model.parameters() if p.requires_grad),
        "timing": timing,
        "breakdown": {k: breakdown(r, opts.rounds * opts.steps_per_round) for k, r in runs.items()},
        "offload_pairs": {f"{a}/{b}": h.timing_stats(runs[a], runs[b])
                          for a, b in OFFLOAD_PAIRS if {a, b} <= set(runs)},
        "environment": {"torch": torch.__version__, "python": h.python_version(), "cpus": os.cpu_count(),
                        "loadavg_start": load_start},
    }  # fmt: skip
    if "layerwise" in timing:
        report["ratio"] = timing["layerwise"]["ratio"]
    if any(k in OFFLOAD for k in runs):
        report["copy_one_direction_s"], report["largest_copy_s"] = copy_seconds(base_model)
        report["cost_model"] = cost_model_check(runs, report)
    for run in runs.values():
        run.close()
    report["environment"]["loadavg_end"] = os.getloadavg()
    report["wall_time_s"] = time.perf_counter() - started
    print_report(report)
    h.write_report(opts.output_dir, opts.name, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
