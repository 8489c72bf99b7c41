"""Per-rank memory of standard vs layer-wise AdamW on 2 CPU ranks (gloo), under DDP and FSDP2, plain Accelerate loop.

Launch (each configuration runs in its own `accelerate launch` process group, spawned by this script):

    python benchmarks/distributed_memory.py                            # ~58M-param Llama, 3 steps per configuration
    python benchmarks/distributed_memory.py --small --steps 2 --output_dir /tmp/bench   # smoke run, seconds
    python benchmarks/distributed_memory.py --engines fsdp2 --hidden_size 768 --num_hidden_layers 12

Per rank it reports (see benchmarks/README.md for how to read them):
- peak RSS: VmHWM of the rank, reset (`echo 5 > /proc/self/clear_refs`) before step 1 and after every step;
- gradient bytes, three ways: local `.grad` tensors alive at once (max over every gradient hook and the end of
  backward), the distinct storages those tensors keep alive (an FSDP2 shard is a view into its unit's
  reduce-scatter output, so one live shard pins the whole buffer), and everything gradient-related: those storages
  plus FSDP2's reduce-scatter buffers or DDP's bucket buffers;
- optimizer state bytes (local shards under FSDP2), and the package's own figures (`peak_grad_bytes`, ...).

Writes `<output_dir>/distributed_memory.json` and `.png`; prints a table and the FSDP2 PASS/FAIL check.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common as h  # noqa: E402
from benchmarks._common import MIB, local, mib, nbytes, proc_status_bytes, reset_peak_rss  # noqa: E402

ENGINES = {"ddp": "configs/accelerate/cpu_ddp.yaml", "fsdp2": "configs/accelerate/cpu_fsdp2.yaml"}
OPTIMS = ("adamw_torch", "adamw_torch_layerwise")
FULL = h.LLAMA_58M | dict(seq_len=128, batch_size=4)
SMALL = h.LLAMA_TINY | dict(seq_len=32, batch_size=2)


def parse_args(argv=None) -> argparse.Namespace:
    parser = h.benchmark_parser(__doc__.splitlines()[0], FULL, SMALL)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per configuration (GA 1)")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--optims", nargs="+", default=list(OPTIMS), choices=list(OPTIMS))
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launched configuration")
    # Internal: set by the driver for the launched ranks.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--optim", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    h.fill_sizes(opts, FULL, SMALL)
    return opts


# ---- per-rank measurement (runs inside the launched ranks) ----


class BufferMeter(h.GradMeter):
    """
    The gradient meter plus what the engine holds for gradients beside `.grad`: FSDP2's reduce-scatter buffers,
    followed through weak references to what its allocator hands out, and DDP's bucket buffers (alive for the whole
    run). Each sample also goes to `timeline` while it is a list: [.grad tensors, .grad storages, all gradient
    buffers, process RSS].
    """

    def __init__(self, params):
        super().__init__(params)
        self.fsdp_buffers: list[weakref.ref] = []
        self.bucket_storages: dict[int, int] = {}  # DDP bucket buffers seen as `.grad` (layer-wise route)
        self.ddp_bucket_bytes = 0
        self.peak_fsdp_buffers = 0
        self.peak_total = 0
        self.timeline: list[list[int]] | None = None

    def track_fsdp_allocator(self, comm) -> None:
        original = comm.allocate

        def allocate(*args, **kwargs):
            tensor = original(*args, **kwargs)
            self.fsdp_buffers.append(weakref.ref(tensor))
            return tensor

        comm.allocate = allocate

    def sample(self, param=None) -> int:
        tensor_bytes = super().sample(param)
        storages = self.storages
        self.fsdp_buffers = [ref for ref in self.fsdp_buffers if ref() is not None]
        buffers: dict[int, int] = {}
        for ref in self.fsdp_buffers:
            t = ref()
            if t is not None:
                storage = t.untyped_storage()
                buffers[storage.data_ptr()] = storage.nbytes()
        # A reduce-scatter output that `.grad` views already point into is counted once.
        extra_buffers = sum(n for ptr, n in buffers.items() if ptr not in storages)
        # DDP bucket buffers live for the whole run; the ones a `.grad` views into are in ddp_bucket_bytes already.
        outside_buckets = sum(n for ptr, n in storages.items() if ptr not in self.bucket_storages)
        total = outside_buckets + extra_buffers + self.ddp_bucket_bytes
        self.peak_fsdp_buffers = max(self.peak_fsdp_buffers, extra_buffers)
        self.peak_total = max(self.peak_total, total)
        if self.timeline is not None:
            self.timeline.append([tensor_bytes, sum(storages.values()), total, proc_status_bytes("VmRSS")])
        return tensor_bytes


def fsdp_units(model) -> list[dict]:
    """Each FSDP2 unit's local shard bytes and unsharded bytes (private FSDP2 API; empty when it moved)."""
    from torch.distributed.fsdp import FSDPModule

    units = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            group = module._get_fsdp_state()._fsdp_param_group
        except AttributeError:
            return []
        if group is None:
            continue
        shards = [fp.sharded_param for fp in group.fsdp_params]
        units.append(
            {
                "name": name or "<root>",
                "local_bytes": sum(nbytes(p) for p in shards),
                "unsharded_bytes": sum(p.numel() * p.element_size() for p in shards),
                "group": group,
            }
        )
    return units


def ddp_bucket_bytes(ddp_model, grad_bytes: int) -> tuple[int, str]:
    try:
        sizes = ddp_model._get_ddp_logging_data()["bucket_sizes"]
        return sum(int(s) for s in str(sizes).split(",") if s.strip()), "measured: reducer logging data bucket_sizes"
    except (AttributeError, KeyError, ValueError):
        return grad_bytes, "estimate: sum of gradient bytes (reducer bucket sizes not accessible)"


def worker(opts: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    # NOTE: importing layerwise_hf applies LAYERWISE_HF_FORCE_FSDP_CPU before the first Accelerator.
    import layerwise_hf  # noqa: F401

    torch.set_num_threads(1)
    # Built before the Accelerator: constructing TrainingArguments resets Accelerate's shared state.
    args = h.training_args(
        opts.optim,
        str(Path(opts.result).parent / "trainer_output"),  # nothing is written there
        learning_rate=1e-4,
        weight_decay=0.1,
        max_grad_norm=0.0,
    )
    accelerator = Accelerator(gradient_accumulation_steps=1)
    expected = DistributedType.FSDP if opts.engine == "fsdp2" else DistributedType.MULTI_CPU
    if accelerator.distributed_type != expected or accelerator.num_processes != 2:
        raise RuntimeError(
            f"{opts.engine}: got {accelerator.distributed_type} with {accelerator.num_processes} processes; a silent "
            "fallback would measure the wrong thing (ACCELERATE_USE_CPU / LAYERWISE_HF_FORCE_FSDP_CPU missing?)"
        )
    result = measure(opts, args, accelerator)
    # NOTE: the DDP / FSDP2 objects must die while the process group is alive: a DDP reducer freed after
    # destroy_process_group can hang forever in ProcessGroupGloo's destructor (seen here at interpreter exit).
    accelerator.free_memory()
    gc.collect()
    gathered = [None] * accelerator.num_processes
    dist.all_gather_object(gathered, result)
    if accelerator.is_main_process:
        Path(opts.result).write_text(json.dumps(gathered, indent=1))
    accelerator.wait_for_everyone()
    accelerator.end_training()  # also destroys the process group


def measure(opts: argparse.Namespace, args, accelerator) -> dict:
    """One rank's training steps and measurements; returns them as a plain dict."""
    from accelerate.utils import set_seed

    from layerwise_hf import unwrap_layerwise_optimizer

    layerwise = opts.optim.endswith("_layerwise")
    set_seed(0)
    model = h.build_llama(opts, seed=0)
    num_params = sum(p.numel() for p in model.parameters())
    if layerwise:
        # Hooks come with connect() after prepare: FSDP2 replaces the parameters.
        optimizer = h.layerwise_optimizer(model, args, attach=False)
    else:
        optimizer = h.trainer_optimizer(model, args)
    model, optimizer = accelerator.prepare(model, optimizer)

    params = [p for p in model.parameters() if p.requires_grad]
    meter = BufferMeter(params)
    units = fsdp_units(model) if opts.engine == "fsdp2" else []
    for unit in units:
        meter.track_fsdp_allocator(unit["group"]._reduce_scatter_comm)
    # Registered before the layer-wise hooks, so each sample sees the gradient before its step frees it.
    meter.attach()
    lw = unwrap_layerwise_optimizer(optimizer)
    route = None
    steps_seen = None
    if lw is not None:
        route = lw.connect(model)

        # The DDP route steps from the comm hook, where no parameter hook fires: sample at every inner step too,
        # from torch's optimizer step pre-hook, where the gradient is still in `.grad`. On that route the `.grad` is
        # a view into the reduced bucket, which the bucket total already counts.
        def before_inner_step(param):
            if route == "ddp" and param.grad is not None:
                storage = local(param.grad).untyped_storage()
                meter.bucket_storages[storage.data_ptr()] = storage.nbytes()
            meter.sample()

        steps_seen = h.InnerStepTimer(lw, on_step=before_inner_step)

    grad_bytes_all = sum(nbytes(p) for p in params)
    bucket_source = None
    if opts.engine == "ddp":
        meter.ddp_bucket_bytes, bucket_source = ddp_bucket_bytes(model, grad_bytes_all)

    rank, world = accelerator.process_index, accelerator.num_processes
    batches = [
        h.random_tokens(opts.vocab_size, opts.batch_size, opts.seq_len, 1000 * step + rank)
        for step in range(opts.steps)
    ]

    model.train()
    h.settle()
    accelerator.wait_for_everyone()
    rss_start = proc_status_bytes("VmRSS")
    reset_peak_rss()
    step_times, losses, after_backward, timelines, step_peaks = [], [], [], [], []
    for ids in batches:
        meter.timeline = []
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        meter.sample()  # the timeline starts at the end of forward: activations alive, no gradient yet
        accelerator.backward(loss)
        after_backward.append(meter.sample())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
        timelines.append(meter.timeline)
        # Per-step peaks: the first step also allocates the optimizer state (lazily), later steps show steady state.
        step_peaks.append(proc_status_bytes("VmHWM"))
        reset_peak_rss()
    meter.timeline = None
    peak_rss = max(step_peaks)
    rss_end = proc_status_bytes("VmRSS")

    if opts.engine == "ddp" and bucket_source and bucket_source.startswith("measured"):
        # Buckets are rebuilt in the first iteration; report the sizes actually used.
        final_buckets, _ = ddp_bucket_bytes(model, grad_bytes_all)
    else:
        final_buckets = meter.ddp_bucket_bytes
    state_bytes = h.tensor_bytes(h.optimizer_state_tensors(optimizer))
    shard_sizes = {n: nbytes(p) for n, p in model.named_parameters() if p.requires_grad}
    largest_name = max(shard_sizes, key=shard_sizes.get)
    result = {
        "rank": rank,
        "world_size": world,
        "engine": opts.engine,
        "optim": opts.optim,
        "distributed_type": str(accelerator.distributed_type),
        "route": route,
        "num_params": num_params,
        "param_bytes_local": sum(nbytes(p) for p in model.parameters()),
        "grad_bytes_all_local": grad_bytes_all,
        "largest_local_shard_bytes": shard_sizes[largest_name],
        "largest_local_shard_name": largest_name,
        "fsdp_units": [{k: v for k, v in u.items() if k != "group"} for u in units],
        "rss_start_bytes": rss_start,
        "peak_rss_bytes": peak_rss,
        "step_peak_rss_bytes": step_peaks,
        "steady_peak_rss_bytes": max(step_peaks[1:]) if len(step_peaks) > 1 else None,
        "rss_end_bytes": rss_end,
        "grad_tensor_peak_bytes": meter.peak_tensor,
        "grad_after_backward_bytes": max(after_backward),
        "grad_storage_peak_bytes": meter.peak_storage,
        "fsdp_buffer_peak_bytes": meter.peak_fsdp_buffers,
        "grad_total_peak_bytes": meter.peak_total,
        "ddp_bucket_bytes": final_buckets if opts.engine == "ddp" else None,
        "ddp_bucket_source": bucket_source,
        "optimizer_state_bytes": state_bytes,
        "package_peak_grad_bytes": lw.peak_grad_bytes if lw is not None else None,
        "package_state_bytes": lw.state_bytes() if lw is not None else None,
        "package_full_grad_bytes": lw.full_grad_bytes() if lw is not None else None,
        "grad_samples": meter.samples,
        # Per step: max of [.grad tensors, .grad storages, all gradient buffers]; the full per-sample timelines too.
        "step_grad_peaks_bytes": [[max(col) for col in list(zip(*tl))[:3]] for tl in timelines],
        "timeline_bytes": timelines,
        "step_times_s": step_times,
        "losses": losses,
    }
    if lw is not None:
        lw.detach()
    if steps_seen is not None:
        steps_seen.remove()
    meter.remove()
    return result


# ---- driver ----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (children first found, then theirs)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
    return children + [d for child in children for d in descendants(child)]


def launch(opts: argparse.Namespace, engine: str, optim: str, result: Path) -> list[dict]:
    env = h.worker_env(threads=1, mmap_threshold=True)
    env["ACCELERATE_USE_CPU"] = "true"  # the multi-process launcher does not forward use_cpu
    if engine == "fsdp2":
        env["LAYERWISE_HF_FORCE_FSDP_CPU"] = "1"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / ENGINES[engine])]
    cmd += ["--main_process_port", str(free_port()), str(Path(__file__).resolve()), "--worker"]
    cmd += ["--engine", engine, "--optim", optim, "--result", str(result), "--steps", str(opts.steps)]
    cmd += h.size_args(opts, FULL)
    # Output goes to a file, not a pipe: ranks left behind by a killed launcher would hold a pipe open.
    log = result.with_suffix(".log")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=opts.timeout)
        except subprocess.TimeoutExpired:
            # The ranks run in sessions of their own: kill them by id, then the launcher.
            for pid in [*descendants(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(
                f"{engine} / {optim} timed out after {opts.timeout}s:\n{log.read_text()[-4000:]}"
            ) from None
    stderr = log.read_text()
    if proc.returncode != 0 or not result.is_file():
        # The launcher's own traceback says nothing; the ranks' lines carry the error.
        rank_lines = [line for line in stderr.splitlines() if line.startswith("[rank")]
        detail = "\n".join(rank_lines[-60:]) or stderr[-6000:]
        raise RuntimeError(f"{engine} / {optim} failed (exit {proc.returncode}):\n{detail}")
    return json.loads(result.read_text())


def fsdp2_checks(runs: list[dict]) -> list[dict]:
    """Under FSDP2, layer-wise live gradient bytes per rank vs the largest local shard plus the unit being reduced."""
    checks = []
    for r in runs:
        if r["engine"] != "fsdp2" or not r["optim"].endswith("_layerwise"):
            continue
        largest_unit = max((u["local_bytes"] for u in r["fsdp_units"]), default=r["largest_local_shard_bytes"])
        bound = r["largest_local_shard_bytes"] + largest_unit
        standard = next(
            (s for s in runs if s["engine"] == "fsdp2" and s["optim"] == "adamw_torch" and s["rank"] == r["rank"]),
            None,
        )
        checks.append(
            {
                "rank": r["rank"],
                "bound_bytes": bound,
                "largest_local_shard_bytes": r["largest_local_shard_bytes"],
                "largest_unit_local_bytes": largest_unit,
                "grad_tensor_peak_bytes": r["grad_tensor_peak_bytes"],
                "grad_storage_peak_bytes": r["grad_storage_peak_bytes"],
                "grad_total_peak_bytes": r["grad_total_peak_bytes"],
                "package_peak_grad_bytes": r["package_peak_grad_bytes"],
                "standard_grad_total_peak_bytes": standard["grad_total_peak_bytes"] if standard else None,
                "tensor_pass": r["grad_tensor_peak_bytes"] <= bound,
                "storage_pass": r["grad_storage_peak_bytes"] <= bound,
                "package_number_pass": r["package_peak_grad_bytes"] <= bound,
            }
        )
    return checks


def pair(first, steady) -> str:
    return f"{mib(first)}/{mib(steady)}"


def print_report(runs: list[dict], checks: list[dict], model_desc: str) -> None:
    print(f"\n{model_desc}")
    rows = []
    for r in runs:
        steady = r["steady_peak_rss_bytes"]
        step1 = r["step_peak_rss_bytes"][0]
        times = r["step_times_s"][1:] or r["step_times_s"]
        rows.append(
            [r["engine"], r["optim"], r["rank"], mib(r["rss_start_bytes"]), mib(step1), mib(steady),
             mib(step1 - r["rss_start_bytes"]), mib(None if steady is None else steady - r["rss_start_bytes"]),
             f"{sum(times) / len(times):.2f}"]
        )  # fmt: skip
    h.print_table(
        [("engine", 6), ("optim", 22, "<"), ("rank", 4), ("RSS start", 9), ("peak step 1", 11), ("peak steady", 11),
         ("+ step 1", 9), ("+ steady", 9), ("s/step", 7)],
        rows,
        title="\nPeak RSS per rank (MiB; VmHWM, reset before step 1 and after each step; step 1 also creates the "
        "state)",
    )  # fmt: skip
    rows = []
    for r in runs:
        peaks = r["step_grad_peaks_bytes"]
        later = [max(col) for col in zip(*peaks[1:])] if len(peaks) > 1 else [None] * 3
        rows.append(
            [r["engine"], r["optim"], r["rank"], *(pair(peaks[0][k], later[k]) for k in range(3)),
             *(mib(r[k]) for k in ("ddp_bucket_bytes", "optimizer_state_bytes", "package_peak_grad_bytes",
             "package_state_bytes"))]
        )  # fmt: skip
    h.print_table(
        [("engine", 6), ("optim", 22, "<"), ("rank", 4), (".grad tensors", 13), (".grad storages", 14),
         ("all grad buffers", 16), ("DDP buckets", 11), ("opt state", 9), ("pkg peak_grad", 13), ("pkg state", 9)],
        rows,
        title="\nGradient and optimizer-state bytes per rank (MiB; step 1 / later steps, maxima over every gradient "
        "hook)",
    )  # fmt: skip
    print(
        ".grad tensors: local .grad bytes alive at once. .grad storages: the distinct storages those tensors keep "
        "alive.\nall grad buffers: those storages plus FSDP2's reduce-scatter buffers or DDP's bucket buffers. "
        "opt state: local optimizer state.\npkg: the package's own LayerwiseOptimizer.peak_grad_bytes / state_bytes()."
    )
    for source in sorted({r["ddp_bucket_source"] for r in runs if r["ddp_bucket_source"]}):
        print(f"DDP buckets: {source}")
    for r in runs:
        if r["package_state_bytes"] is not None and r["package_state_bytes"] != r["optimizer_state_bytes"]:
            print(
                f"NOTE {r['engine']} rank {r['rank']}: the package reports state {mib(r['package_state_bytes'])} MiB "
                f"but the rank holds {mib(r['optimizer_state_bytes'])} MiB (DTensor numel() is the global size)."
            )
    if checks:
        print("\nFSDP2 goal: layer-wise live gradient bytes per rank <= largest local shard + the unit being reduced")
        for c in checks:
            print(
                f"  rank {c['rank']}: bound {mib(c['bound_bytes'])} MiB (largest shard "
                f"{mib(c['largest_local_shard_bytes'])} + largest unit {mib(c['largest_unit_local_bytes'])}); "
                f".grad tensors {mib(c['grad_tensor_peak_bytes'])} -> {'PASS' if c['tensor_pass'] else 'FAIL'}; "
                f".grad storages {mib(c['grad_storage_peak_bytes'])} -> {'PASS' if c['storage_pass'] else 'FAIL'}"
            )
            print(
                f"          all gradient buffers incl. FSDP2's reduce-scatter input/output: "
                f"{mib(c['grad_total_peak_bytes'])} MiB (standard FSDP2: {mib(c['standard_grad_total_peak_bytes'])}); "
                f"package peak_grad_bytes {mib(c['package_peak_grad_bytes'])} (global size, not the shard)"
            )


def plot(runs: list[dict], path: Path, model_desc: str) -> None:
    plt = h.pyplot()
    engines = [e for e in ENGINES if any(r["engine"] == e for r in runs)]
    metrics = [
        ("peak RSS\n- start", lambda r: max(r["step_peak_rss_bytes"]) - r["rss_start_bytes"]),
        (".grad\ntensors", lambda r: r["grad_tensor_peak_bytes"]),
        (".grad\nstorages", lambda r: r["grad_storage_peak_bytes"]),
        ("all grad\nbuffers", lambda r: r["grad_total_peak_bytes"]),
        ("optimizer\nstate", lambda r: r["optimizer_state_bytes"]),
    ]
    fig, axes = plt.subplots(2, len(engines), figsize=(7 * len(engines), 8.5), squeeze=False)
    for col, engine in enumerate(engines):
        ax, line_ax = axes[0][col], axes[1][col]
        rss_ax = line_ax.twinx()
        series = [(o, [r for r in runs if r["engine"] == engine and r["optim"] == o]) for o in OPTIMS]
        series = [(o, rs) for o, rs in series if rs]
        width = 0.8 / (2 * len(series))
        for k, (optim, rs) in enumerate(series):
            for run in sorted(rs, key=lambda r: r["rank"]):
                slot = 2 * k + run["rank"]
                xs = [i + (slot - len(series) + 0.5) * width for i in range(len(metrics))]
                ax.bar(xs, [fn(run) / MIB for _, fn in metrics], width, label=f"{optim} rank {run['rank']}",
                       color=f"C{k}", alpha=1.0 if run["rank"] == 0 else 0.55)  # fmt: skip
            rank0 = min(rs, key=lambda r: r["rank"])
            timeline = rank0["timeline_bytes"][-1]
            # Layer-wise runs sample twice per parameter (hook and step): plot against the fraction of the step.
            xs = [i / max(1, len(timeline) - 1) for i in range(len(timeline))]
            line_ax.plot(xs, [t[0] / MIB for t in timeline], color=f"C{k}", label=f"{optim} .grad tensors")
            line_ax.plot(xs, [t[2] / MIB for t in timeline], color=f"C{k}", ls="--", label=f"{optim} all buffers")
            rss_ax.plot(xs, [t[3] / MIB for t in timeline], color=f"C{k}", ls=":", label=f"{optim} RSS (right)")
        ax.set_xticks(range(len(metrics)), [m for m, _ in metrics], fontsize=8)
        ax.set_ylabel("MiB per rank (max over steps)")
        ax.set_title(f"{engine.upper()}, 2 CPU ranks")
        ax.legend(fontsize=7)
        line_ax.set_xlabel("end of forward -> gradient hooks -> end of backward (last step, rank 0)")
        line_ax.set_ylabel("MiB alive")
        line_ax.set_title(f"{engine.upper()}: gradient memory during the last step")
        rss_ax.set_ylabel("process RSS, MiB (dotted)")
        handles = line_ax.get_legend_handles_labels()[0] + rss_ax.get_legend_handles_labels()[0]
        line_ax.legend(handles=handles, fontsize=7)
    h.save_figure(fig, path, model_desc)


def main(argv=None) -> None:
    opts = parse_args(argv)
    if opts.worker:
        worker(opts)
        return
    started = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for engine in opts.engines:
            for optim in opts.optims:
                t0 = time.perf_counter()
                runs += launch(opts, engine, optim, Path(tmp) / f"{engine}_{optim}.json")
                print(f"{engine:<6} {optim:<22} done in {time.perf_counter() - t0:.0f}s", flush=True)
    num_params = runs[0]["num_params"]
    model_desc = (
        f"Llama {num_params / 1e6:.1f}M params (vocab {opts.vocab_size}, hidden {opts.hidden_size}, "
        f"{opts.num_hidden_layers} layers), batch {opts.batch_size}x{opts.seq_len} per rank, {opts.steps} steps, fp32"
    )
    checks = fsdp2_checks(runs)
    print_report(runs, checks, model_desc)
    report = {
        "model": {k: getattr(opts, k) for k in FULL} | {"num_params": num_params, "steps": opts.steps},
        "environment": {"malloc_mmap_threshold": "65536", "omp_num_threads": 1, "backend": "gloo", "world_size": 2},
        "runs": runs,
        "fsdp2_checks": checks,
        "fsdp2_goal_pass": all(c["tensor_pass"] and c["storage_pass"] for c in checks) if checks else None,
        "wall_time_s": time.perf_counter() - started,
    }
    h.write_report(opts.output_dir, "distributed_memory", report, lambda r, path: plot(r["runs"], path, model_desc))


if __name__ == "__main__":
    main()
