"""Step time of each layer-wise clipping mode (`layerwise_clip`) relative to no clipping, and how close `previous`
stays to `exact`, on the example task. Options, goals and the last results: benchmarks/README.md."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `examples.train` is the example task: its model, corpus and defaults

from transformers import get_scheduler  # noqa: E402

from benchmarks import _common as h  # noqa: E402

OPTIM = "adamw_torch_layerwise"
MAX_GRAD_NORM = 1.0  # Trainer's default
# name -> (max_grad_norm, layerwise_clip). "none" is the reference; "off" clips nothing either (an A/A noise check).
MODES = {
    "none": (0.0, "off"),
    "exact": (MAX_GRAD_NORM, "exact"),
    "previous": (MAX_GRAD_NORM, "previous"),
    "per_param": (MAX_GRAD_NORM, "per_param"),
    "off": (MAX_GRAD_NORM, "off"),
}
GOAL_TWO_PASS = 1.7  # a second backward (about 2/3 of a step) puts the floor at 5/3
GOAL_ONE_PASS = 1.05


def parse_args(argv=None) -> argparse.Namespace:
    parser = h.example_task_parser(__doc__.splitlines()[0], rounds=10)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--accuracy_steps", type=int, default=60, help="steps of the previous-vs-exact comparison")
    return h.parse_example_task_args(parser, argv)


class Run(h.TimedRun):
    """One configuration: its own model copy and layer-wise optimizer, stepped through `backward_with_norm_pass`."""

    def __init__(self, base_model, mode: str, ga: int, opts, total_steps: int | None = None):
        super().__init__()
        self.mode, self.ga = mode, ga
        self.model = h.copy_model(base_model)
        self.forwards = 0
        self.model.register_forward_pre_hook(self._count)
        self.sync = True
        args = h.training_args(OPTIM, learning_rate=opts.learning_rate, weight_decay=0.1)
        # Outside Accelerate the window's last micro-batch is ours to say.
        self.optimizer = h.layerwise_optimizer(self.model, args, clip=MODES[mode], sync_gradients=lambda: self.sync)
        self.scheduler = None
        if total_steps:
            warmup = max(1, total_steps // 10)
            self.scheduler = get_scheduler(
                "cosine", self.optimizer, num_warmup_steps=warmup, num_training_steps=total_steps
            )
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def _count(self, module, inputs):
        self.forwards += 1

    def step(self, micro_batches: list[dict]) -> tuple[float, float]:
        """One optimizer step; returns its wall and process CPU seconds."""
        return self.clock(self._step, micro_batches)

    def _step(self, micro_batches: list[dict]) -> None:
        total = 0.0
        for k, batch in enumerate(micro_batches):
            self.sync = k == len(micro_batches) - 1

            loss = self.model(**batch).loss / len(micro_batches)
            self.optimizer.backward_with_norm_pass(loss)
            total += float(loss.detach())
        grad_norm = self.optimizer.grad_norm()
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.scheduler is not None:
            self.scheduler.step()
        self.losses.append(total)
        self.grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))

    def close(self) -> None:
        self.optimizer.detach()


def time_modes(base_model, dataset, opts) -> dict:
    runs = [Run(base_model, mode, ga, opts) for ga in opts.grad_accum for mode in opts.modes]
    fwd = {}

    def step(run, rnd):
        before = run.forwards
        times = run.step(h.micro_batches(dataset, rnd, run.ga, opts.batch_size))
        fwd[run] = run.forwards - before
        return times

    h.interleaved_rounds(runs, opts, step)
    # Without the `none` reference of a GA there is nothing to divide by: the run's own medians only.
    ref = {r.ga: r for r in runs if r.mode == "none"}
    results = {}
    for run in runs:
        stats = h.timing_stats(run.times, run.cpu_times, *h.ref_times(ref.get(run.ga, run)))
        stats = stats if run.ga in ref else {k: v for k, v in stats.items() if "ratio" not in k}
        results[f"{run.mode} ga{run.ga}"] = {
            "mode": run.mode,
            "grad_accum": run.ga,
            **stats,
            "forwards_per_step": fwd[run],
        }
        run.close()
    return results


def goals(timing: dict) -> list[dict]:
    out = []
    for key, entry in timing.items():
        if entry["mode"] == "none" or "ratio" not in entry:
            continue
        # Exact clipping without accumulation measures the norm with a second backward (one forward on one process).
        two_pass = entry["mode"] == "exact" and entry["grad_accum"] == 1
        limit = GOAL_TWO_PASS if two_pass else GOAL_ONE_PASS
        out.append(
            {
                "config": key,
                "passes": "two-pass" if two_pass else "one-pass",
                "ratio": entry["ratio"],
                "cpu_ratio": entry["cpu_ratio"],
                "limit": limit,
                "pass": entry["ratio"] <= limit,
                "cpu_pass": entry["cpu_ratio"] <= limit,
            }
        )
    return out


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def accuracy(base_model, dataset, opts) -> dict:
    modes = [m for m in ("exact", "previous", "per_param", "none") if m in MODES]
    runs = {m: Run(base_model, m, 1, opts, total_steps=opts.accuracy_steps) for m in modes}
    drift = {m: [] for m in modes}  # ||theta - theta_exact|| / ||theta_exact|| after each step
    for step in range(opts.accuracy_steps):
        batch = h.micro_batches(dataset, step, 1, opts.batch_size)
        for run in runs.values():
            run.step(batch)
        exact_flat = flat_params(runs["exact"].model)
        for mode, run in runs.items():
            diff = torch.linalg.vector_norm(flat_params(run.model) - exact_flat) / torch.linalg.vector_norm(exact_flat)
            drift[mode].append(float(diff))
    exact = dict(runs["exact"].model.named_parameters())
    report = {"steps": opts.accuracy_steps, "max_grad_norm": MAX_GRAD_NORM, "modes": {}}
    exact_norms = runs["exact"].grad_norms
    report["clipped_steps_exact"] = sum(n > MAX_GRAD_NORM for n in exact_norms)
    for mode, run in runs.items():
        per_tensor, absolute = [], 0.0
        with torch.no_grad():
            for name, p in run.model.named_parameters():
                ref = exact[name]
                diff = torch.linalg.vector_norm(p - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-12)
                per_tensor.append((float(diff), name))
                absolute = max(absolute, float((p - ref).abs().max()))
        worst = max(per_tensor)
        losses = run.losses
        report["modes"][mode] = {
            "losses": losses,
            "grad_norms": run.grad_norms,
            "final_loss": losses[-1],
            "rel_param_diff_vs_exact": drift[mode][-1],
            "rel_param_diff_vs_exact_per_step": drift[mode],
            "max_rel_param_diff_vs_exact": worst[0],
            "max_rel_param_diff_tensor": worst[1],
            "median_rel_param_diff_vs_exact": statistics.median(d for d, _ in per_tensor),
            "max_abs_param_diff_vs_exact": absolute,
            "max_abs_loss_diff_vs_exact": max(abs(a - b) for a, b in zip(losses, runs["exact"].losses)),
            "forwards": run.forwards,
        }
        run.close()
    return report


def print_report(timing: dict, checks: list[dict], acc: dict, desc: str) -> None:
    print(f"\n{desc}")
    h.print_timing(timing, "mode", "none", [("fwd/step", 8, lambda e: e["forwards_per_step"])])
    print("\nGoals (ratio of median step times to no clipping at the same GA; wall = the goal, cpu = cross-check):")
    for c in checks:
        print(f"  {c['config']:<16} {c['passes']:<9} <= {c['limit']:.2f}x   wall {c['ratio']:.3f}x "
              f"{h.verdict(c['pass'])}   cpu {c['cpu_ratio']:.3f}x {h.verdict(c['cpu_pass'])}")  # fmt: skip
    m = acc["modes"]
    h.print_table(
        [("mode", 10), ("final loss", 10), ("max |dloss|", 11), ("rel (all params)", 16), ("rel median tensor", 17),
         ("rel max tensor", 14), ("max |dp|", 9), ("worst tensor", 0, "<")],
        [[k, f"{a['final_loss']:.4f}", f"{a['max_abs_loss_diff_vs_exact']:.4f}", f"{a['rel_param_diff_vs_exact']:.3e}",
          f"{a['median_rel_param_diff_vs_exact']:.3e}", f"{a['max_rel_param_diff_vs_exact']:.3e}",
          f"{a['max_abs_param_diff_vs_exact']:.2e}",
          a["max_rel_param_diff_tensor"] if a["max_rel_param_diff_vs_exact"] else "-"]
         for k, a in m.items()],
        title=f"\nAccuracy vs exact after {acc['steps']} steps (GA 1, max_grad_norm {acc['max_grad_norm']}; exact "
        f"clipped {acc['clipped_steps_exact']}/{acc['steps']} steps). rel = ||p - p_exact|| / ||p_exact||:",
    )  # fmt: skip
    n = acc["steps"]
    marks = sorted({k for k in (0, 1, 4, n // 4, n // 2, 3 * n // 4, n - 1) if 0 <= k < n})
    print("\nloss / rel (all params) at steps " + ", ".join(str(k + 1) for k in marks) + ":")
    for mode, a in m.items():
        print(
            f"  {mode:<10} "
            + "  ".join(f"{a['losses'][k]:.4f}/{a['rel_param_diff_vs_exact_per_step'][k]:.1e}" for k in marks)
        )


def plot(timing: dict, acc: dict, path: Path, desc: str) -> None:
    gas = sorted({e["grad_accum"] for e in timing.values()})
    bars = {f"GA {ga} {w}": {e["mode"]: e.get(k, float("nan")) for e in timing.values() if e["grad_accum"] == ga}
            for ga in gas for k, w in (("ratio", "wall"), ("cpu_ratio", "cpu"))}  # fmt: skip
    steps = lambda key, skip=(): {m: dict(enumerate(a[key], 1)) for m, a in acc["modes"].items() if m not in skip}  # noqa: E731
    h.plot_panels(path, desc, [
        dict(title="step time by layerwise_clip mode", ylabel="median step time / no clipping", series=bars,
             lines={f"two-pass goal {GOAL_TWO_PASS}x": GOAL_TWO_PASS, f"one-pass {GOAL_ONE_PASS}x": GOAL_ONE_PASS}),
        dict(title=f"loss, GA 1, max_grad_norm {acc['max_grad_norm']}", ylabel="training loss", line=True,
             series=steps("losses")),
        dict(title="parameter drift from exact clipping", ylabel="||theta - theta_exact|| / ||theta_exact||",
             line=True, log=True, series=steps("rel_param_diff_vs_exact_per_step", ("exact",))),
    ])  # fmt: skip


def main(argv=None) -> None:
    opts = parse_args(argv)
    base_model, dataset, num_params, started = h.setup_example_task(opts)
    desc = f"{OPTIM}, {h.example_task_description(opts, num_params)}"
    print(f"timing {len(opts.modes) * len(opts.grad_accum)} configurations, interleaved: {desc}", flush=True)
    timing = time_modes(base_model, dataset, opts)
    print(f"accuracy: {opts.accuracy_steps} steps per mode", flush=True)
    acc = accuracy(base_model, dataset, opts)
    checks = goals(timing)
    print_report(timing, checks, acc, desc)
    report = {
        "config": {k: v for k, v in vars(opts).items() if k != "output_dir"} | {"num_params": num_params},
        "timing": timing,
        "goals": checks,
        "all_goals_pass": all(c["pass"] for c in checks),
        "all_goals_pass_cpu_time": all(c["cpu_pass"] for c in checks),
        "accuracy": acc,
        "wall_time_s": time.perf_counter() - started,
    }
    h.write_report(opts.output_dir, "clipping_speed", report, lambda r, path: plot(timing, acc, path, desc))


if __name__ == "__main__":
    main()
