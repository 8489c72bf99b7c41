"""What the benchmark scripts share: model-size defaults, the example task, timing ratios, /proc memory readers and
figure saving. Imported as `benchmarks._common` (each script puts the repository root on `sys.path`)."""

from __future__ import annotations

import random
import statistics
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# The example task's model and batch (configs/train/tiny_llama.yaml); --small shrinks both.
EXAMPLE_FULL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=688, seq_len=128, batch_size=8)  # fmt: skip
EXAMPLE_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=176, seq_len=32, batch_size=4)  # fmt: skip


def fill_sizes(opts, full: dict, small: dict) -> None:
    """Size flags left unset take the `--small` or full defaults."""
    for key, value in (small if opts.small else full).items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)


def example_task_parser(description: str, rounds: int):
    """The options both timing benchmarks share: output, model size of the example task, GA values, rounds."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output_dir", default=str(RESULTS), help="JSON and PNG go here")
    parser.add_argument("--small", action="store_true", help="a tiny model (smoke run); explicit size flags win")
    for key, value in EXAMPLE_FULL.items():
        parser.add_argument(
            f"--{key}", type=int, default=None, help=f"default {value} ({EXAMPLE_SMALL[key]} with --small)"
        )
    parser.add_argument("--grad_accum", type=int, nargs="+", default=[1, 4], help="GA values timed")
    parser.add_argument("--warmup", type=int, default=2, help="rounds dropped before timing")
    parser.add_argument("--rounds", type=int, default=rounds, help="timed rounds (one step per configuration each)")
    parser.add_argument("--learning_rate", type=float, default=3e-3, help="the example task's peak lr")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: less sensitive to shared cores)")
    parser.add_argument("--seed", type=int, default=42)
    return parser


def parse_example_task_args(parser, argv=None):
    opts = parser.parse_args(argv)
    fill_sizes(opts, EXAMPLE_FULL, EXAMPLE_SMALL)
    return opts


def build_example_task(opts):
    """The example task of `examples/train.py` (its model and grammar corpus) at the sizes in `opts`."""
    import torch

    from examples.train import ScriptArguments, build_dataset, build_model

    script_args = ScriptArguments(
        hidden_size=opts.hidden_size,
        num_hidden_layers=opts.num_hidden_layers,
        num_attention_heads=opts.num_attention_heads,
        num_key_value_heads=opts.num_key_value_heads,
        intermediate_size=opts.intermediate_size,
        seq_len=opts.seq_len,
        num_samples=512,
    )
    torch.manual_seed(opts.seed)
    model = build_model(script_args)
    return model, build_dataset(script_args), sum(p.numel() for p in model.parameters())


def llama_config(opts):
    """An untied Llama of the sizes in `opts` (vocab_size, hidden_size, ... seq_len)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=opts.vocab_size,
        hidden_size=opts.hidden_size,
        intermediate_size=opts.intermediate_size,
        num_hidden_layers=opts.num_hidden_layers,
        num_attention_heads=opts.num_attention_heads,
        num_key_value_heads=opts.num_key_value_heads,
        max_position_embeddings=opts.seq_len,
        tie_word_embeddings=False,
    )


def collate(examples: list[dict]) -> dict:
    import torch

    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}


def micro_batches(dataset, step: int, ga: int, batch_size: int) -> list[dict]:
    """The `ga` micro-batches of optimizer step `step`, the same for every configuration."""
    out = []
    for k in range(ga):
        start = ((step * ga + k) * batch_size) % (len(dataset) - batch_size + 1)
        out.append(collate(dataset[start : start + batch_size]))
    return out


def interleaved_rounds(runs: list, opts, step) -> None:
    """
    `opts.warmup + opts.rounds` rounds of one `step(run, round) -> (wall s, CPU s)` per run, in a freshly shuffled
    order each round so the load of other processes falls on all runs alike. After the warm-up rounds each run's
    times go to `run.times` / `run.cpu_times`.
    """
    order_rng = random.Random(opts.seed)
    total = opts.warmup + opts.rounds
    for rnd in range(total):
        order = list(runs)
        order_rng.shuffle(order)
        for run in order:
            elapsed, cpu = step(run, rnd)
            if rnd >= opts.warmup:
                run.times.append(elapsed)
                run.cpu_times.append(cpu)
        print(f"  round {rnd + 1}/{total}{' (warm-up)' if rnd < opts.warmup else ''}", flush=True)


def timing_stats(times: list[float], cpu_times: list[float], ref_times: list[float], ref_cpu: list[float]) -> dict:
    """Medians of one configuration's step times and its ratios to a reference timed in the same rounds."""
    median, cpu_median = statistics.median(times), statistics.median(cpu_times)
    return {
        "times_s": times,
        "cpu_times_s": cpu_times,
        "median_s": median,
        "cpu_median_s": cpu_median,
        "ratio": median / statistics.median(ref_times),
        # Same-round pairs cancel slow drifts of the machine load.
        "paired_ratio_median": statistics.median(t / r for t, r in zip(times, ref_times)),
        # Single-threaded, the process CPU time hardly sees other processes competing for the cores.
        "cpu_ratio": cpu_median / statistics.median(ref_cpu),
    }


def proc_status_bytes(field: str) -> int:
    """A byte field of /proc/self/status (`VmRSS`, `VmHWM`)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> None:
    # "5" resets VmHWM to the current RSS (Linux >= 4.0), so the peak read next belongs to what ran in between.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def save_figure(fig, path: Path, title: str, fontsize: int = 10) -> None:
    import matplotlib.pyplot as plt

    fig.suptitle(textwrap.fill(title, 150), fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
