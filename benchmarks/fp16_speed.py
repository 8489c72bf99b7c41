"""Step time of fp16 loss scaling (`torch.amp.GradScaler`) with the layer-wise optimizer relative to a standard
AdamW under the same scaler, on the example task. What is measured and the last results: benchmarks/README.md."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `examples.train` is the example task

from benchmarks import _common as h  # noqa: E402

OPTIM = "adamw_torch_layerwise"
MAX_GRAD_NORM = 1.0  # Trainer's default
KINDS = ("standard", "layerwise")


def parse_args(argv=None):
    parser = h.benchmark_parser(__doc__.splitlines()[0], h.EXAMPLE_FULL, h.EXAMPLE_SMALL, rounds=20)
    parser.add_argument("--grad_accum", type=int, nargs="+", default=[1, 4], help="GA values timed")
    parser.add_argument("--learning_rate", type=float, default=3e-3, help="the example task's peak lr")
    parser.add_argument("--init_scale", type=float, default=2.0**16, help="GradScaler init_scale (its default)")
    return h.parse(parser, argv)


class Run(h.TimedRun):
    """One configuration: its own model copy, optimizer and GradScaler; counts forwards and backwards."""

    def __init__(self, base_model, kind: str, ga: int, opts):
        super().__init__()
        self.kind, self.ga, self.sync = kind, ga, True
        self.model = h.copy_model(base_model)
        self.passes = h.count_passes(self.model)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=opts.init_scale)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.grad_bytes_at_step = 0  # standard: the .grad bytes alive when it steps
        self.grad_norms, self.scales, self.per_step = [], [], []
        if kind == "standard":
            self.optimizer = torch.optim.AdamW(self.params, lr=opts.learning_rate, weight_decay=0.1)
            return
        args = h.training_args(OPTIM, learning_rate=opts.learning_rate, weight_decay=0.1)
        # Outside Accelerate the window's last micro-batch is ours to say.
        clip = (MAX_GRAD_NORM, "exact")
        self.optimizer = h.layerwise_optimizer(self.model, args, clip=clip, sync_gradients=lambda: self.sync)
        self.optimizer.use_grad_scaler(self.scaler)

    def _step(self, batches: list[dict]) -> None:
        for k, batch in enumerate(batches):
            self.sync = k == len(batches) - 1
            with torch.autocast("cpu", dtype=torch.float16):
                loss = self.scaler.scale(self.model(**batch).loss / len(batches))
            if self.kind == "standard":
                loss.backward()
            else:
                # 'retain', the way whose cost this measures ('auto' holds instead where activations outweigh
                # gradients).
                self.optimizer.backward_with_norm_pass(loss, norm_pass="retain")
        if self.kind == "standard":
            self.scaler.unscale_(self.optimizer)
            norm = torch.nn.utils.clip_grad_norm_(self.params, MAX_GRAD_NORM)
            live = sum(h.nbytes(p.grad) for p in self.params if p.grad is not None)
            self.grad_bytes_at_step = max(self.grad_bytes_at_step, live)
        else:
            norm = self.optimizer.grad_norm()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.grad_norms.append(float("nan") if norm is None else float(norm))
        self.scales.append(self.scaler.get_scale())

    def step(self, batches: list[dict]) -> tuple[float, float]:
        before = dict(self.passes)
        times = self.clock(self._step, batches)
        self.per_step.append(tuple(self.passes[k] - before[k] for k in ("forward", "backward")))
        return times


def time_configs(base_model, dataset, opts) -> dict:
    runs = [Run(base_model, kind, ga, opts) for ga in opts.grad_accum for kind in KINDS]
    h.interleaved_rounds(runs, opts, lambda run, rnd: run.step(h.micro_batches(dataset, rnd, run.ga, opts.batch_size)))
    out = {}
    for run in runs:
        ref = next(r for r in runs if r.ga == run.ga and r.kind == "standard")
        skipped = [not math.isfinite(n) for n in run.grad_norms]
        # A skipped step (inf/nan found) runs no second backward: the counts are those of the last step not skipped.
        counted = [c for c, s in zip(run.per_step, skipped) if not s] or run.per_step
        lw = run.kind == "layerwise"
        out[f"{run.kind} ga{run.ga}"] = {
            "optimizer": run.kind, "grad_accum": run.ga, **h.timing_stats(run, ref),
            "forwards_per_step": counted[-1][0], "backwards_per_step": counted[-1][1], "steps": len(skipped),
            "skipped_steps": sum(skipped), "scales": run.scales, "grad_norms": run.grad_norms,
            "peak_grad_bytes": run.optimizer.peak_grad_bytes if lw else run.grad_bytes_at_step,
            "full_grad_bytes": sum(h.nbytes(p) for p in run.params),
        }  # fmt: skip
        if lw:
            run.optimizer.detach()
    return out


def main(argv=None) -> None:
    opts, started = parse_args(argv), time.perf_counter()
    base_model, dataset, desc = h.example_task(opts)
    desc = f"fp16 autocast + GradScaler(init_scale {opts.init_scale:g}), AdamW vs {OPTIM} (exact clip), {desc}"
    print(f"timing {len(KINDS) * len(opts.grad_accum)} configurations, interleaved: {desc}", flush=True)
    timing = time_configs(base_model, dataset, opts)
    print(f"\n{desc}")
    h.print_timing(timing, "optimizer", "standard", [
        ("fwd/bwd", 7, lambda e: f"{e['forwards_per_step']}/{e['backwards_per_step']}"),
        ("skipped", 8, lambda e: f"{e['skipped_steps']}/{e['steps']}"),
        ("peak grad MiB", 13, lambda e: h.mib(e["peak_grad_bytes"])),
        ("full grad MiB", 13, lambda e: h.mib(e["full_grad_bytes"])),
    ])  # fmt: skip
    print("fwd/bwd per optimizer step; skipped: steps GradScaler skipped (warm-up included); peak grad: layer-wise "
          "`peak_grad_bytes`, standard: the .grad bytes alive at its step.")  # fmt: skip
    report = {"description": desc, "config": vars(opts) | {"num_params": base_model.num_parameters()},
              "torch": torch.__version__, "timing": timing, "wall_time_s": time.perf_counter() - started}  # fmt: skip
    h.write_report(opts.output_dir, "fp16_speed", report)


if __name__ == "__main__":
    main()
