"""Step time of each layer-wise clipping mode (`layerwise_clip`) relative to no clipping, and how close `previous`
stays to `exact`, on the example task. Options, goals and the last results: benchmarks/README.md."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `examples.train` is the example task

from transformers import get_scheduler  # noqa: E402

from benchmarks import _common as h  # noqa: E402

OPTIM = "adamw_torch_layerwise"
MAX_GRAD_NORM = 1.0  # Trainer's default
# name -> (max_grad_norm, layerwise_clip). "none" is the reference; "off" clips nothing either (an A/A noise check).
MODES = {"none": (0.0, "off"), "exact": (MAX_GRAD_NORM, "exact"), "previous": (MAX_GRAD_NORM, "previous"),
         "per_param": (MAX_GRAD_NORM, "per_param"), "off": (MAX_GRAD_NORM, "off")}  # fmt: skip
GOAL_TWO_PASS = 1.7  # a second backward (about 2/3 of a step) puts the floor at 5/3
GOAL_ONE_PASS = 1.05


def parse_args(argv=None):
    parser = h.benchmark_parser(__doc__.splitlines()[0], h.EXAMPLE_FULL, h.EXAMPLE_SMALL, rounds=10)
    parser.add_argument("--grad_accum", type=int, nargs="+", default=[1, 4], help="GA values timed")
    parser.add_argument("--learning_rate", type=float, default=3e-3, help="the example task's peak lr")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--accuracy_steps", type=int, default=60, help="steps of the previous-vs-exact comparison")
    return h.parse(parser, argv)


class Run(h.TimedRun):
    """One configuration: its own model copy and layer-wise optimizer, stepped through `backward_with_norm_pass`."""

    def __init__(self, base_model, mode: str, ga: int, opts, total_steps: int | None = None):
        super().__init__()
        self.mode, self.ga, self.sync = mode, ga, True
        self.model = h.copy_model(base_model)
        self.passes = h.count_passes(self.model)
        args = h.training_args(OPTIM, learning_rate=opts.learning_rate, weight_decay=0.1)
        # Outside Accelerate the window's last micro-batch is ours to say.
        self.optimizer = h.layerwise_optimizer(self.model, args, clip=MODES[mode], sync_gradients=lambda: self.sync)
        warmup = max(1, (total_steps or 0) // 10)
        self.scheduler = total_steps and get_scheduler("cosine", self.optimizer, warmup, total_steps)
        self.losses, self.grad_norms = [], []

    def step(self, batches: list[dict]) -> tuple[float, float]:
        return self.clock(self._step, batches)

    def _step(self, batches: list[dict]) -> None:
        total = 0.0
        for k, batch in enumerate(batches):
            self.sync = k == len(batches) - 1
            loss = self.model(**batch).loss / len(batches)
            self.optimizer.backward_with_norm_pass(loss)
            total += float(loss.detach())
        norm = self.optimizer.grad_norm()
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.scheduler:
            self.scheduler.step()
        self.losses.append(total)
        self.grad_norms.append(float("nan") if norm is None else float(norm))


def time_modes(base_model, dataset, opts) -> dict:
    runs = [Run(base_model, mode, ga, opts) for ga in opts.grad_accum for mode in opts.modes]
    forwards = {}

    def step(run, rnd):
        before = run.passes["forward"]
        times = run.step(h.micro_batches(dataset, rnd, run.ga, opts.batch_size))
        forwards[run] = run.passes["forward"] - before
        return times

    h.interleaved_rounds(runs, opts, step)
    # Without the `none` reference of a GA the ratios are to the run itself.
    ref = {r.ga: r for r in runs if r.mode == "none"}
    out = {}
    for run in runs:
        base = ref.get(run.ga, run)
        stats = h.timing_stats(run.times, run.cpu_times, base.times, base.cpu_times)
        out[f"{run.mode} ga{run.ga}"] = {"mode": run.mode, "grad_accum": run.ga, **stats,
                                         "forwards_per_step": forwards[run]}  # fmt: skip
        run.optimizer.detach()
    return out


def goals(timing: dict) -> list[dict]:
    out = []
    for key, e in timing.items():
        if e["mode"] == "none":
            continue
        # Exact clipping without accumulation measures the norm with a second backward (one forward on one process).
        two_pass = e["mode"] == "exact" and e["grad_accum"] == 1
        limit = GOAL_TWO_PASS if two_pass else GOAL_ONE_PASS
        out.append({"config": key, "passes": "two-pass" if two_pass else "one-pass", "ratio": e["ratio"],
                    "cpu_ratio": e["cpu_ratio"], "limit": limit, "pass": e["ratio"] <= limit,
                    "cpu_pass": e["cpu_ratio"] <= limit})  # fmt: skip
    return out


def accuracy(base_model, dataset, opts) -> dict:
    """`exact`, `previous`, `per_param` and `none` from the same weights on the same batches: losses and how far each
    drifts from `exact` (||p - p_exact|| / ||p_exact||, all parameters after each step, per tensor at the end)."""
    modes = ("exact", "previous", "per_param", "none")
    runs = {m: Run(base_model, m, 1, opts, total_steps=opts.accuracy_steps) for m in modes}
    flat = lambda run: torch.cat([p.detach().flatten() for p in run.model.parameters()])  # noqa: E731
    drift = {m: [] for m in runs}
    for step in range(opts.accuracy_steps):
        for run in runs.values():
            run.step(h.micro_batches(dataset, step, 1, opts.batch_size))
        exact = flat(runs["exact"])
        for mode, run in runs.items():
            drift[mode].append(float((flat(run) - exact).norm() / exact.norm()))
    exact = dict(runs["exact"].model.named_parameters())
    report = {"steps": opts.accuracy_steps, "max_grad_norm": MAX_GRAD_NORM, "modes": {},
              "clipped_steps_exact": sum(n > MAX_GRAD_NORM for n in runs["exact"].grad_norms)}  # fmt: skip
    for mode, run in runs.items():
        with torch.no_grad():
            per_tensor = [(float((p - exact[n]).norm() / exact[n].norm().clamp_min(1e-12)), n)
                          for n, p in run.model.named_parameters()]  # fmt: skip
            absolute = max(float((p - exact[n]).abs().max()) for n, p in run.model.named_parameters())
        worst = max(per_tensor)
        report["modes"][mode] = {
            "losses": run.losses, "grad_norms": run.grad_norms, "final_loss": run.losses[-1],
            "rel_param_diff_vs_exact": drift[mode][-1], "rel_param_diff_vs_exact_per_step": drift[mode],
            "max_rel_param_diff_vs_exact": worst[0], "max_rel_param_diff_tensor": worst[1],
            "median_rel_param_diff_vs_exact": statistics.median(d for d, _ in per_tensor),
            "max_abs_param_diff_vs_exact": absolute,
            "max_abs_loss_diff_vs_exact": max(abs(a - b) for a, b in zip(run.losses, runs["exact"].losses)),
        }  # fmt: skip
        run.optimizer.detach()
    return report


def print_report(report: dict) -> None:
    print(f"\n{report['description']}")
    h.print_timing(report["timing"], "mode", "none", [("fwd/step", 8, lambda e: e["forwards_per_step"])])
    print("\nGoals (ratio of median step times to no clipping at the same GA; wall = the goal, cpu = cross-check):")
    for c in report["goals"]:
        print(f"  {c['config']:<16} {c['passes']:<9} <= {c['limit']:.2f}x   wall {c['ratio']:.3f}x "
              f"{h.verdict(c['pass'])}   cpu {c['cpu_ratio']:.3f}x {h.verdict(c['cpu_pass'])}")  # fmt: skip
    acc = report["accuracy"]
    h.print_table(
        [("mode", 10), ("final loss", 10), ("max |dloss|", 11), ("rel (all params)", 16), ("rel median tensor", 17),
         ("rel max tensor", 14), ("max |dp|", 9), ("worst tensor", 0, "<")],
        [[k, f"{a['final_loss']:.4f}", f"{a['max_abs_loss_diff_vs_exact']:.4f}", f"{a['rel_param_diff_vs_exact']:.3e}",
          f"{a['median_rel_param_diff_vs_exact']:.3e}", f"{a['max_rel_param_diff_vs_exact']:.3e}",
          f"{a['max_abs_param_diff_vs_exact']:.2e}",
          a["max_rel_param_diff_tensor"] if a["max_rel_param_diff_vs_exact"] else "-"]
         for k, a in acc["modes"].items()],
        title=f"\nAccuracy vs exact after {acc['steps']} steps (GA 1, max_grad_norm {acc['max_grad_norm']}; exact "
        f"clipped {acc['clipped_steps_exact']}/{acc['steps']} steps). rel = ||p - p_exact|| / ||p_exact||:",
    )  # fmt: skip


def plot(report: dict, path: Path) -> None:
    timing, acc = report["timing"], report["accuracy"]
    gas = sorted({e["grad_accum"] for e in timing.values()})
    bars = {f"GA {ga} {w}": {e["mode"]: e[k] for e in timing.values() if e["grad_accum"] == ga}
            for ga in gas for k, w in (("ratio", "wall"), ("cpu_ratio", "cpu"))}  # fmt: skip
    steps = lambda key, skip=(): {m: dict(enumerate(a[key], 1)) for m, a in acc["modes"].items() if m not in skip}  # noqa: E731
    h.plot_panels(path, report["description"], [
        dict(title="step time by layerwise_clip mode", ylabel="median step time / no clipping", series=bars,
             lines={f"two-pass goal {GOAL_TWO_PASS}x": GOAL_TWO_PASS, f"one-pass {GOAL_ONE_PASS}x": GOAL_ONE_PASS}),
        dict(title=f"loss, GA 1, max_grad_norm {acc['max_grad_norm']}", ylabel="training loss", line=True,
             series=steps("losses")),
        dict(title="parameter drift from exact clipping", ylabel="||theta - theta_exact|| / ||theta_exact||",
             line=True, log=True, series=steps("rel_param_diff_vs_exact_per_step", ("exact",))),
    ])  # fmt: skip


def main(argv=None) -> None:
    opts, started = parse_args(argv), time.perf_counter()
    base_model, dataset, desc = h.example_task(opts)
    desc = f"{OPTIM}, {desc}"
    print(f"timing {len(opts.modes) * len(opts.grad_accum)} configurations, interleaved: {desc}", flush=True)
    timing = time_modes(base_model, dataset, opts)
    print(f"accuracy: {opts.accuracy_steps} steps per mode", flush=True)
    checks = goals(timing)
    report = {"description": desc, "config": vars(opts) | {"num_params": base_model.num_parameters()},
              "timing": timing, "goals": checks, "all_goals_pass": all(c["pass"] for c in checks),
              "all_goals_pass_cpu_time": all(c["cpu_pass"] for c in checks),
              "accuracy": accuracy(base_model, dataset, opts)}  # fmt: skip
    report["wall_time_s"] = time.perf_counter() - started
    print_report(report)
    h.write_report(opts.output_dir, "clipping_speed", report, plot)


if __name__ == "__main__":
    main()
