"""Step time of fp16 loss scaling (`torch.amp.GradScaler`) with the layer-wise optimizer relative to a standard
AdamW under the same scaler, on the example task. What is measured and the last results: benchmarks/README.md."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `examples.train` is the example task: its model, corpus and defaults

from benchmarks import _common as h  # noqa: E402
from benchmarks._common import MIB  # noqa: E402

OPTIM = "adamw_torch_layerwise"
MAX_GRAD_NORM = 1.0  # Trainer's default
WEIGHT_DECAY = 0.1
KINDS = ("standard", "layerwise")


def parse_args(argv=None) -> argparse.Namespace:
    parser = h.example_task_parser(__doc__.splitlines()[0], rounds=20)
    parser.add_argument("--init_scale", type=float, default=2.0**16, help="GradScaler init_scale (its default)")
    return h.parse_example_task_args(parser, argv)


class Run(h.TimedRun):
    """One configuration: its own model copy, optimizer and GradScaler; counts forwards and backwards."""

    def __init__(self, base_model, kind: str, ga: int, opts):
        super().__init__()
        self.kind, self.ga = kind, ga
        self.model = h.copy_model(base_model)
        self.forwards = self.backwards = 0
        self.model.register_forward_pre_hook(self._count_forward)
        # The input embedding's gradient is the last one each backward computes (also the measuring one).
        self.model.get_input_embeddings().weight.register_hook(self._count_backward)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=opts.init_scale)
        self.sync = True
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if kind == "standard":
            self.optimizer = torch.optim.AdamW(self.params, lr=opts.learning_rate, weight_decay=WEIGHT_DECAY)
        else:
            args = h.training_args(OPTIM, learning_rate=opts.learning_rate, weight_decay=WEIGHT_DECAY)
            # Outside Accelerate the window's last micro-batch is ours to say.
            clip = (MAX_GRAD_NORM, "exact")
            self.optimizer = h.layerwise_optimizer(self.model, args, clip=clip, sync_gradients=lambda: self.sync)
            self.optimizer.use_grad_scaler(self.scaler)
        self.grad_bytes_at_step = 0  # standard: the .grad bytes alive when it steps
        self.grad_norms: list[float] = []
        self.scales: list[float] = []

    def _count_forward(self, module, inputs):
        self.forwards += 1

    def _count_backward(self, grad):
        self.backwards += 1

    def _standard_step(self, micro_batches: list[dict]) -> float:
        for batch in micro_batches:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = self.model(**batch).loss / len(micro_batches)
            self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, MAX_GRAD_NORM)
        self.grad_bytes_at_step = max(
            self.grad_bytes_at_step,
            sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None),
        )
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def _layerwise_step(self, micro_batches: list[dict]) -> float:
        for k, batch in enumerate(micro_batches):
            self.sync = k == len(micro_batches) - 1
            with torch.autocast("cpu", dtype=torch.float16):
                loss = self.model(**batch).loss / len(micro_batches)
            # 'retain', the way whose cost this measures ('auto' holds instead where activations outweigh gradients).
            self.optimizer.backward_with_norm_pass(self.scaler.scale(loss), norm_pass="retain")
        grad_norm = self.optimizer.grad_norm()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()
        return float(grad_norm) if grad_norm is not None else float("nan")

    def step(self, micro_batches: list[dict]) -> tuple[float, float]:
        """One optimizer step; returns its wall and process CPU seconds."""
        step = self._standard_step if self.kind == "standard" else self._layerwise_step
        elapsed, cpu = self.clock(lambda: self.grad_norms.append(step(micro_batches)))
        self.scales.append(self.scaler.get_scale())
        return elapsed, cpu

    def close(self) -> None:
        if self.kind == "layerwise":
            self.optimizer.detach()


def time_configs(base_model, dataset, opts) -> dict:
    runs = [Run(base_model, kind, ga, opts) for ga in opts.grad_accum for kind in KINDS]
    per_step = {}

    def step(run, rnd):
        forwards, backwards = run.forwards, run.backwards
        times = run.step(h.micro_batches(dataset, rnd, run.ga, opts.batch_size))
        per_step.setdefault(run, []).append((run.forwards - forwards, run.backwards - backwards))
        return times

    h.interleaved_rounds(runs, opts, step)
    results = {}
    for ga in opts.grad_accum:
        ref = next(r for r in runs if r.ga == ga and r.kind == "standard")
        for run in (r for r in runs if r.ga == ga):
            skipped = [not math.isfinite(n) for n in run.grad_norms]
            # A skipped step (inf/nan found) runs no second backward; the per-step counts below are those of the
            # last step that was not skipped (or the last one if all were).
            counted = [c for c, s in zip(per_step[run], skipped) if not s] or per_step[run]
            entry = {
                "optimizer": run.kind,
                "grad_accum": ga,
                **h.timing_stats(run.times, run.cpu_times, ref.times, ref.cpu_times),
                "forwards_per_step": counted[-1][0],
                "backwards_per_step": counted[-1][1],
                "forwards_backwards_each_step": per_step[run],
                "steps": len(run.grad_norms),
                "skipped_steps": sum(skipped),
                "skipped_steps_timed": sum(skipped[opts.warmup :]),
                "grad_norms": run.grad_norms,
                "scales": run.scales,
                "final_scale": run.scales[-1],
            }
            if run.kind == "layerwise":
                entry["peak_grad_bytes"] = run.optimizer.peak_grad_bytes
                entry["full_grad_bytes"] = run.optimizer.full_grad_bytes()
            else:
                entry["peak_grad_bytes"] = run.grad_bytes_at_step
                entry["full_grad_bytes"] = sum(p.numel() * p.element_size() for p in run.params)
            results[f"{run.kind} ga{ga}"] = entry
    for run in runs:
        run.close()
    return results


def print_report(timing: dict, desc: str) -> None:
    print(f"\n{desc}")
    h.print_timing(timing, "optimizer", "standard", [
        ("fwd/bwd", 7, lambda e: f"{e['forwards_per_step']}/{e['backwards_per_step']}"),
        ("skipped", 8, lambda e: f"{e['skipped_steps']}/{e['steps']}"),
        ("peak grad MiB", 13, lambda e: f"{e['peak_grad_bytes'] / MIB:.2f}"),
        ("full grad MiB", 13, lambda e: f"{e['full_grad_bytes'] / MIB:.2f}"),
    ])  # fmt: skip
    print("fwd/bwd: model forwards / backwards per optimizer step. skipped: steps with a non-finite gradient norm "
          "(GradScaler skipped them), warm-up included. peak grad: layer-wise `peak_grad_bytes`; standard: the .grad "
          "bytes alive at its step.")  # fmt: skip


def plot(timing: dict, path: Path, desc: str) -> None:
    def series(key, scale=1):
        return {k: {f"GA {e['grad_accum']}": e[key] / scale for e in timing.values() if e["optimizer"] == k}
                for k in KINDS}  # fmt: skip

    h.plot_panels(path, desc, [
        dict(title="fp16 + GradScaler step time", ylabel="median step time (s)", series=series("median_s")),
        dict(title="gradient bytes alive at once (peak)", ylabel="MiB", series=series("peak_grad_bytes", MIB)),
    ])  # fmt: skip


def main(argv=None) -> None:
    opts = parse_args(argv)
    base_model, dataset, num_params, started = h.setup_example_task(opts)
    desc = (
        f"fp16 autocast + GradScaler(init_scale {opts.init_scale:g}), AdamW vs {OPTIM} (exact clip "
        f"{MAX_GRAD_NORM}), {h.example_task_description(opts, num_params)}"
    )
    print(f"timing {len(KINDS) * len(opts.grad_accum)} configurations, interleaved: {desc}", flush=True)
    timing = time_configs(base_model, dataset, opts)
    print_report(timing, desc)
    report = {
        "config": {k: v for k, v in vars(opts).items() if k != "output_dir"} | {"num_params": num_params},
        "torch": torch.__version__,
        "timing": timing,
        "wall_time_s": time.perf_counter() - started,
    }
    h.write_report(opts.output_dir, "fp16_speed", report, lambda r, path: plot(timing, path, desc))


if __name__ == "__main__":
    main()
