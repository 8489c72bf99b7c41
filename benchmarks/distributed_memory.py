"""Per-rank memory and step time on 2 CPU ranks (gloo): Trainer under the DDP config (standard DDP vs the layer-wise
data-parallel route), and a plain Accelerate loop under FSDP2.
Launch, method and last results: benchmarks/README.md."""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _common as h  # noqa: E402
from benchmarks import _ranks as ranks  # noqa: E402
from benchmarks._common import MIB, local, mib, nbytes, proc_status_bytes, reset_peak_rss  # noqa: E402

ENGINES = {"ddp": "configs/accelerate/cpu_ddp.yaml", "fsdp2": "configs/accelerate/cpu_fsdp2.yaml"}
OPTIMS = ("adamw_torch", "adamw_torch_layerwise")  # the FSDP2 plain loop
# Also accepted by --optims: bitsandbytes' 8-bit steps each rank's local shard (its blocks follow the shard); there is
# no standard FSDP2 run of it to compare with (bitsandbytes does not take DTensors).
FSDP2_EXTRA_OPTIMS = ("adamw_8bit_layerwise",)
DDP_OPTIMS = ("adamw_torch", "adamw_8bit")  # the DDP Trainer runs, each as (a), (b), (c)
KINDS = {
    "standard": "(a) DDP, Trainer's default",
    "bucket_view": "(b) DDP, gradient_as_bucket_view",
    "layerwise": "(c) layer-wise route",
}
TARGET_FRACTION = 0.6  # of all gradient bytes: how far (c) must be below (b)
FULL = h.LLAMA_58M | dict(seq_len=128, batch_size=1)
SMALL = h.LLAMA_TINY | dict(seq_len=32, batch_size=1)


def parse_args(argv=None) -> argparse.Namespace:
    parser = h.benchmark_parser(__doc__.splitlines()[0], FULL, SMALL)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per memory run (GA 1)")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument(
        "--optims", nargs="+", default=list(OPTIMS), choices=[*OPTIMS, *FSDP2_EXTRA_OPTIMS], help="FSDP2 runs"
    )
    parser.add_argument("--ddp_optims", nargs="+", default=list(DDP_OPTIMS), help="DDP runs: base optimizer names")
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=list(KINDS), help="DDP memory runs")
    parser.add_argument("--time", action="store_true", help="DDP step time, (c) vs (a), interleaved rounds")
    parser.add_argument("--time_optims", nargs="+", default=["adamw_torch"], help="base optimizers timed")
    parser.add_argument("--rounds", type=int, default=4, help="--time: rounds (one train() per configuration each)")
    parser.add_argument("--time_steps", type=int, default=8, help="--time: steps per train()")
    parser.add_argument("--warmup_steps", type=int, default=2, help="--time: steps dropped at each train()'s start")
    parser.add_argument("--profile", action="store_true", help="--time: cProfile rank 0 for a few steps of each")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launched configuration")
    # Internal: set by the driver for the launched ranks.
    parser.add_argument("--worker", default=None, choices=("loop", "trainer", "time"), help=argparse.SUPPRESS)
    parser.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--optim", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kind", default=None, help=argparse.SUPPRESS)
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
    accelerator.free_memory()
    ranks.write_gathered_and_finish(opts.result, result)


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
        # local_shards: under FSDP2 a bitsandbytes optimizer steps each rank's local shard as a plain tensor.
        optimizer = h.layerwise_optimizer(model, args, attach=False, local_shards=opts.engine == "fsdp2")
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


# ---- DDP through Trainer (runs inside the launched ranks) ----


def trainer_args(opts: argparse.Namespace, optim: str, out: str, max_steps: int):
    # NOTE: built before any Accelerator: constructing TrainingArguments resets Accelerate's shared state.
    return h.training_args(
        optim,
        out,
        per_device_train_batch_size=opts.batch_size,
        max_steps=max_steps,
        learning_rate=1e-4,
        weight_decay=0.1,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        logging_steps=10**6,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )


def build_trainer(opts: argparse.Namespace, kind: str, optim: str, model, out: str, max_steps: int, callbacks=()):
    """(a) / (b): `Trainer` with `optim`; (c): `LayerwiseTrainer` with `<optim>_layerwise`."""
    from transformers import Trainer

    from layerwise_hf import LayerwiseTrainer

    name = f"{optim}_layerwise" if kind == "layerwise" else optim
    args = trainer_args(opts, name, out, max_steps)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dataset = h.TokenRows(opts.vocab_size, opts.seq_len, rows=max_steps * opts.batch_size * world)
    cls = LayerwiseTrainer if kind == "layerwise" else Trainer
    trainer = cls(model=model, args=args, train_dataset=dataset, callbacks=list(callbacks))
    if kind == "bucket_view":
        # Trainer has no argument for it: set on the DDP kwargs Accelerate will wrap the model with.
        trainer.accelerator.ddp_handler.gradient_as_bucket_view = True
    return trainer


def ddp_reducer_bucket_bytes(model) -> int | None:
    """Standard DDP: the reducer's bucket buffers (as large as all gradients, for the whole run)."""
    try:
        sizes = model._get_ddp_logging_data()["bucket_sizes"]
    except (AttributeError, KeyError):
        return None
    return sum(int(s) for s in str(sizes).split(",") if s.strip())


class TrainMeter:
    """
    A Trainer callback for one run. RSS: the peak (VmHWM) of each segment of `train()` (setup = from `train()` to
    `on_train_begin`: optimizer, DDP wrap; then each step), each reset with `echo 5 > /proc/self/clear_refs`, so the
    peak of the whole run is the largest. Gradients: the distinct storages behind every live `.grad`, plus the
    layer-wise route's bucket buffers or standard DDP's reducer buckets, sampled at every post-accumulate-grad hook
    (registered before train(), so ahead of the route's hooks) and before every optimizer step (torch's step
    pre-hooks). Time: wall and CPU seconds from `on_step_begin` to `on_step_end`.
    """

    def __init__(self, model, kind: str, sample_grads: bool = True):
        from transformers import TrainerCallback

        self.kind = kind
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.trainer = None
        self.segments: list[dict] = []
        self.step_wall: list[float] = []
        self.step_cpu: list[float] = []
        self.grad_peak = 0  # .grad storages + route buckets (layer-wise) or + reducer buckets (standard)
        self.grad_tensor_peak = 0  # .grad tensors alone
        self.bucket_bytes = None
        self.handles = [p.register_post_accumulate_grad_hook(self.hook) for p in self.params] if sample_grads else []
        meter = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
                meter.mark("setup")
                if sample_grads:
                    meter.watch_steps()

            def on_step_begin(self, args, state, control, **kwargs):
                meter._t = (time.perf_counter(), time.process_time())

            def on_step_end(self, args, state, control, **kwargs):
                meter.step_wall.append(time.perf_counter() - meter._t[0])
                meter.step_cpu.append(time.process_time() - meter._t[1])
                meter.mark(f"step {state.global_step}")

        self.callback = Callback()

    def start(self) -> None:
        h.settle()
        self.rss_before = proc_status_bytes("VmRSS")
        reset_peak_rss()

    def mark(self, label: str) -> None:
        self.segments.append({"label": label, "peak": proc_status_bytes("VmHWM"), "rss": proc_status_bytes("VmRSS")})
        reset_peak_rss()

    def watch_steps(self) -> None:
        from layerwise_hf import unwrap_layerwise_optimizer

        lw = unwrap_layerwise_optimizer(self.trainer.optimizer)
        if lw is not None:
            for inner in lw.inner:
                self.handles.append(inner.register_step_pre_hook(lambda *a, **k: self.sample()))
        else:
            inner = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)
            self.handles.append(inner.register_step_pre_hook(lambda *a, **k: self.sample()))
            self.bucket_bytes = ddp_reducer_bucket_bytes(self.trainer.model_wrapped)

    def hook(self, param) -> None:
        self.sample()

    def sample(self) -> None:
        storages, tensor_bytes = {}, 0
        for p in self.params:
            if p.grad is not None:
                tensor_bytes += nbytes(p.grad)
                storage = p.grad.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        total = sum(storages.values())
        route = None
        if self.trainer is not None and getattr(self.trainer, "layerwise_optimizer", None) is not None:
            route = self.trainer.layerwise_optimizer.gradient_route
        if route is not None:
            for bucket in getattr(route, "buckets", []):
                if bucket.buffer is not None:
                    storage = bucket.buffer.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
            total = sum(storages.values())
        elif self.bucket_bytes is not None:
            # With gradient_as_bucket_view the .grad storages are the buckets; otherwise a second copy.
            total = self.bucket_bytes + (0 if self.kind == "bucket_view" else total)
        self.grad_peak = max(self.grad_peak, total)
        self.grad_tensor_peak = max(self.grad_tensor_peak, tensor_bytes)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def check_ddp_mode(accelerator) -> None:
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.MULTI_CPU or accelerator.num_processes != 2:
        raise RuntimeError(
            f"ddp: got {accelerator.distributed_type} with {accelerator.num_processes} processes; a silent fallback "
            "would measure the wrong thing (ACCELERATE_USE_CPU missing?)"
        )


def trainer_worker(opts: argparse.Namespace) -> None:
    """One DDP memory run: (a), (b) or (c) for one optimizer, `opts.steps` Trainer steps."""
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        model = h.build_llama(opts, seed=0)
        trainer = build_trainer(opts, opts.kind, opts.optim, model, out, opts.steps)
        check_ddp_mode(trainer.accelerator)
        meter = TrainMeter(model, opts.kind)
        meter.trainer = trainer
        trainer.add_callback(meter.callback)
        meter.start()
        trainer.train()
        meter.mark("end")
        result = trainer_result(opts, trainer, model, meter)
        meter.remove()
        # The DDP objects must die while the process group is alive (see write_gathered_and_finish); the meter
        # holds the trainer, and the trainer's callback holds the meter.
        meter.trainer = None
        trainer.accelerator.free_memory()
        del trainer, model, meter
    ranks.write_gathered_and_finish(opts.result, result)


def trainer_result(opts, trainer, model, meter: TrainMeter) -> dict:
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad]
    lw = trainer.layerwise_optimizer if opts.kind == "layerwise" else None
    peak = max(s["peak"] for s in meter.segments)
    handler = trainer.accelerator.ddp_handler
    return {
        "engine": "ddp",
        "api": "trainer",
        "kind": opts.kind,
        "optim": trainer.args.optim,
        "base_optim": opts.optim,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "distributed_type": str(trainer.accelerator.distributed_type),
        "wrapped": type(trainer.model_wrapped).__name__,
        "route": lw.route if lw is not None else None,
        "ddp_kwargs": handler.to_kwargs() if handler is not None else None,
        "gradient_as_bucket_view": opts.kind == "bucket_view",
        "num_params": sum(p.numel() for p in model.parameters()),
        "grad_bytes_all": sum(nbytes(p) for p in params),
        "largest_param_bytes": max(nbytes(p) for p in params),
        "rss_before_train_bytes": meter.rss_before,
        "train_peak_rss_bytes": peak,
        "training_peak_bytes": peak - meter.rss_before,
        "segments": meter.segments,
        "grad_live_peak_bytes": meter.grad_peak,
        "grad_tensor_peak_bytes": meter.grad_tensor_peak,
        "ddp_bucket_bytes": meter.bucket_bytes,
        "optimizer_state_bytes": h.tensor_bytes(h.optimizer_state_tensors(trainer.optimizer)),
        "package_peak_grad_bytes": lw.peak_grad_bytes if lw is not None else None,
        "step_times_s": meter.step_wall,
        "step_cpu_s": meter.step_cpu,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }


# ---- DDP step time (one launch, interleaved rounds) ----


def time_worker(opts: argparse.Namespace) -> None:
    """(a) and (c) for each of `--time_optims`, one `train()` of `--time_steps` steps per configuration and round, in
    an order shuffled alike on both ranks; then, with `--profile`, cProfile of a few steps of each on rank 0."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    base = h.build_llama(opts, seed=0)
    configs = [(kind, optim) for optim in opts.time_optims for kind in ("standard", "layerwise")]
    times = {f"{k}:{o}": {"wall": [], "cpu": [], "rounds": []} for k, o in configs}
    order_rng = random.Random(42)  # the same order on both ranks: they must run the same Trainer at once
    total = opts.rounds

    def run(kind, optim, steps, profile=None):
        with tempfile.TemporaryDirectory() as out:
            model = h.copy_model(base)
            trainer = build_trainer(opts, kind, optim, model, out, steps)
            check_ddp_mode(trainer.accelerator)
            meter = TrainMeter(model, kind, sample_grads=False)
            meter.trainer = trainer
            trainer.add_callback(meter.callback)
            if profile is not None:
                profile.enable()
            trainer.train()
            if profile is not None:
                profile.disable()
            # Only the times leave: the meter holds the trainer (and its callback holds the meter), and a DDP
            # reducer still alive at destroy_process_group can crash or hang the rank in gloo's destructor.
            times = (list(meter.step_wall), list(meter.step_cpu))
            meter.trainer = None
            trainer.accelerator.free_memory()
            del trainer, model, meter
            gc.collect()
            return times

    for rnd in range(total):
        order = list(configs)
        order_rng.shuffle(order)
        for kind, optim in order:
            wall, cpu = run(kind, optim, opts.time_steps)
            entry = times[f"{kind}:{optim}"]
            entry["wall"] += wall[opts.warmup_steps :]
            entry["cpu"] += cpu[opts.warmup_steps :]
            entry["rounds"].append(statistics.median(wall[opts.warmup_steps :]))
        if dist.get_rank() == 0:
            print(f"  time round {rnd + 1}/{total}", flush=True)
    profiles = {}
    if opts.profile:
        import cProfile

        for kind, optim in configs:
            prof = cProfile.Profile() if dist.get_rank() == 0 else None
            run(kind, optim, opts.warmup_steps + 3, profile=prof)
            if prof is not None:
                profiles[f"{kind}:{optim}"] = ranks.profile_summary(prof, opts.warmup_steps + 3, PROFILE_ROWS)
    result = {"rank": dist.get_rank(), "times": times, "profiles": profiles}
    ranks.write_gathered_and_finish(opts.result, result)


RUN_BACKWARD = "<method 'run_backward' of 'torch._C._EngineBase' objects>"
# Where a step's time goes: (label, how to recognise the function in cProfile's stats: file part, function name).
PROFILE_ROWS = [
    ("forward (LlamaForCausalLM.forward)", "modeling_llama.py", "forward"),
    ("backward (autograd engine; DDP reducer / layer-wise hooks inside)", "~", RUN_BACKWARD),
    ("  layer-wise hook: _local_ready (cumulative)", "data_parallel.py", "_local_ready"),
    ("    copies into buckets (torch.mul out=)", "~", "<built-in method torch.mul>"),
    ("    all_reduce launches", "distributed_c10d.py", "all_reduce"),
    ("    bucket steps: _step_bucket (cumulative)", "data_parallel.py", "_step_bucket"),
    ("      all-reduce waits (Work.wait)", "~", "<built-in method torch._C._distributed_c10d.wait>"),
    ("      grad_ready -> gate -> inner step (cumulative)", "layerwise_hf/optim/optimizer.py", "grad_ready"),
    ("      per-parameter grad norm (torch._foreach_norm)", "~", "<built-in method torch._foreach_norm>"),
    ("  end of backward: _finish_backward (cumulative)", "data_parallel.py", "_finish_backward"),
    ("Adam math (_single_tensor_adam, all calls)", "adam.py", "_single_tensor_adam"),
    ("Trainer optimizer.step (AcceleratedOptimizer.step)", "accelerate/optimizer.py", "step"),
    ("buffer / parameter broadcasts", "~", "<built-in method torch._C._distributed_c10d.broadcast>"),
]


# ---- driver ----


def launch(opts: argparse.Namespace, engine: str, worker_args: list[str], result: Path, mmap: bool = True) -> list:
    """Run this script's `--worker ...` on 2 ranks under `engine`'s config; the ranks' results (rank 0 writes them)."""
    env = h.worker_env(threads=1, mmap_threshold=mmap)
    if engine == "fsdp2":
        env["LAYERWISE_HF_FORCE_FSDP_CPU"] = "1"
    args = [*worker_args, "--engine", engine, "--result", str(result), "--steps", str(opts.steps)]
    return ranks.launch_ranks(
        Path(__file__).resolve(), ROOT / ENGINES[engine], [*args, *h.size_args(opts, FULL)], result, opts.timeout, env
    )


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
                f"package peak_grad_bytes {mib(c['package_peak_grad_bytes'])} (local shards)"
            )


def fsdp2_panels(runs: list[dict]) -> list[dict]:
    metrics = {
        "peak RSS - start": lambda r: max(r["step_peak_rss_bytes"]) - r["rss_start_bytes"],
        ".grad tensors": lambda r: r["grad_tensor_peak_bytes"],
        ".grad storages": lambda r: r["grad_storage_peak_bytes"],
        "all grad buffers": lambda r: r["grad_total_peak_bytes"],
        "optimizer state": lambda r: r["optimizer_state_bytes"],
    }
    bars = {f"{r['optim']} rank {r['rank']}": {m: fn(r) / MIB for m, fn in metrics.items()} for r in runs}
    last = {f"{r['optim']} {what}": {k: t[col] / MIB for k, t in enumerate(r["timeline_bytes"][-1])}
            for r in runs if r["rank"] == 0 for col, what in ((0, ".grad tensors"), (2, "all buffers"))}  # fmt: skip
    return [
        dict(title="FSDP2, 2 CPU ranks", ylabel="MiB per rank (max over steps)", series=bars),
        dict(title="FSDP2: gradient memory during the last step (rank 0, per sample)", ylabel="MiB alive", line=True,
             series=last),
    ]  # fmt: skip


# ---- DDP report ----


def by_rank_max(runs: list[dict], key: str) -> int | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return max(values) if values else None


def ddp_target(ddp_runs: list[dict]) -> list[dict]:
    """Per base optimizer: the training peak of (a), (b), (c) (max over ranks and per rank), (c)'s saving vs (b) and
    (a), and the target: (c) below (b) by at least TARGET_FRACTION of all gradient bytes."""
    out = []
    for base in dict.fromkeys(r["base_optim"] for r in ddp_runs):
        runs = {k: [r for r in ddp_runs if r["base_optim"] == base and r["kind"] == k] for k in KINDS}
        peak = {k: by_rank_max(rs, "training_peak_bytes") for k, rs in runs.items()}
        per_rank = {
            k: {str(r["rank"]): r["training_peak_bytes"] for r in sorted(rs, key=lambda r: r["rank"])}
            for k, rs in runs.items()
        }
        grads = by_rank_max(ddp_runs, "grad_bytes_all")
        need = TARGET_FRACTION * grads
        row = {"base_optim": base, "grad_bytes_all": grads, "target_saving_bytes": need, "peak_bytes": peak}
        row["peak_bytes_per_rank"] = per_rank
        lw = peak["layerwise"]
        row["saving_vs_bucket_view_bytes"] = None if None in (lw, peak["bucket_view"]) else peak["bucket_view"] - lw
        row["saving_vs_standard_bytes"] = None if None in (lw, peak["standard"]) else peak["standard"] - lw
        rank_savings = [
            per_rank["bucket_view"][k] - per_rank["layerwise"][k]
            for k in per_rank["layerwise"]
            if k in per_rank["bucket_view"]
        ]
        row["saving_vs_bucket_view_per_rank_bytes"] = rank_savings
        saving = row["saving_vs_bucket_view_bytes"]
        row["pass"] = None if saving is None else bool(saving >= need and all(s >= need for s in rank_savings))
        out.append(row)
    return out


def print_ddp_report(ddp_runs: list[dict], targets: list[dict]) -> None:
    rows = []
    for r in sorted(ddp_runs, key=lambda r: (r["base_optim"], list(KINDS).index(r["kind"]), r["rank"])):
        segs = r["segments"]
        where = max(segs, key=lambda s: s["peak"])["label"]
        rows.append(
            [r["optim"], KINDS[r["kind"]], r["rank"], r["wrapped"], mib(r["rss_before_train_bytes"]),
             mib(r["training_peak_bytes"]), where, mib(r["grad_live_peak_bytes"]), mib(r["optimizer_state_bytes"]),
             mib(r["ddp_bucket_bytes"])]
        )  # fmt: skip
    h.print_table(
        [("optim", 22), ("run", 33, "<"), ("rank", 4), ("model", 23, "<"), ("RSS before", 10), ("train peak", 10),
         ("peak in", 7), ("grads live", 10), ("opt state", 9), ("DDP buckets", 11)],
        rows,
        title="\nDDP, Trainer, 2 ranks: training peak per rank = VmHWM during train() - RSS before it (MiB)",
    )  # fmt: skip
    print(
        "grads live: the most gradient storage alive at once (.grad storages + the route's buckets in flight, or + "
        "DDP's reducer buckets).\npeak in: the segment of train() holding the peak (setup: optimizer + DDP wrap)."
    )
    print("\nTarget: layer-wise training peak below (b) by >= 60% of all gradients (max over ranks)")
    rows = []
    for t in targets:
        p = t["peak_bytes"]
        rows.append(
            [t["base_optim"], mib(p["standard"]), mib(p["bucket_view"]), mib(p["layerwise"]),
             mib(t["saving_vs_bucket_view_bytes"]), mib(t["saving_vs_standard_bytes"]),
             " / ".join(mib(s) for s in t["saving_vs_bucket_view_per_rank_bytes"]),
             f">= {mib(t['target_saving_bytes'])} of {mib(t['grad_bytes_all'])}",
             {True: "PASS", False: "FAIL", None: "-"}[t["pass"]]]
        )  # fmt: skip
    h.print_table(
        [("optimizer", 12), ("(a) std", 8), ("(b) view", 8), ("(c) lw", 8), ("c vs b", 8), ("c vs a", 8),
         ("c vs b per rank", 16), ("needed", 18), ("target", 6)],
        rows,
    )  # fmt: skip


def time_summary(results: list[dict]) -> dict:
    """Per configuration the median step time over ranks' post-warm-up steps (the slower rank), and the ratios."""
    configs = list(results[0]["times"])
    out = {"configs": {}, "ratios": {}}
    for c in configs:
        wall = [statistics.median(r["times"][c]["wall"]) for r in results]
        cpu = [statistics.median(r["times"][c]["cpu"]) for r in results]
        out["configs"][c] = {
            "median_s_per_rank": wall,
            "cpu_median_s_per_rank": cpu,
            "median_s": max(wall),
            "cpu_median_s": max(cpu),
            "round_medians_per_rank": [r["times"][c]["rounds"] for r in results],
            "steps_per_rank": len(results[0]["times"][c]["wall"]),
        }
    for c in configs:
        kind, optim = c.split(":")
        ref = f"standard:{optim}"
        if kind == "layerwise" and ref in out["configs"]:
            a, b = out["configs"][c], out["configs"][ref]
            paired = [
                statistics.median([x / y for x, y in zip(r["times"][c]["rounds"], r["times"][ref]["rounds"])])
                for r in results
            ]
            out["ratios"][optim] = {
                "wall_ratio": a["median_s"] / b["median_s"],
                "cpu_ratio": a["cpu_median_s"] / b["cpu_median_s"],
                "paired_round_ratio_per_rank": paired,
                "goal": 1.10,
                "pass": a["median_s"] / b["median_s"] <= 1.10,
            }
    out["profiles"] = results[0].get("profiles", {})
    return out


def print_time_report(summary: dict) -> None:
    rows = []
    for c, t in summary["configs"].items():
        rows.append(
            [c, " / ".join(f"{x:.3f}" for x in t["median_s_per_rank"]), " / ".join(f"{x:.3f}" for x in
             t["cpu_median_s_per_rank"]), t["steps_per_rank"]]
        )  # fmt: skip
    h.print_table(
        [("config", 28), ("median s/step (rank 0 / 1)", 27), ("CPU s/step (rank 0 / 1)", 24), ("steps", 5)],
        rows,
        title="\nDDP step time, Trainer, interleaved rounds, no malloc setting",
    )
    for optim, r in summary["ratios"].items():
        print(
            f"{optim}: layer-wise / standard DDP = {r['wall_ratio']:.3f}x wall (slower rank), {r['cpu_ratio']:.3f}x "
            f"CPU, paired rounds {' / '.join(f'{x:.3f}' for x in r['paired_round_ratio_per_rank'])} -> goal <= 1.10: "
            f"{'PASS' if r['pass'] else 'FAIL'}"
        )
    for c, p in summary["profiles"].items():
        print(
            f"\ncProfile, rank 0, {c}: {p['steps']} steps, train() {p['train_cumtime_s']:.2f}s (profiler overhead in)"
        )
        for row in p["rows"]:
            print(f"  {row['label']:<55} {row['cumtime']:8.3f}s  {row['calls']:7d} calls")


def estimator_check(opts: argparse.Namespace, ddp_runs: list[dict]) -> list[dict]:
    """`estimate()` for the same LlamaConfig, DDP on 2 ranks, vs what the ranks measured (max over ranks)."""
    from layerwise_hf.estimate import estimate

    config = h.llama_config(opts)
    out = []
    for base in dict.fromkeys(r["base_optim"] for r in ddp_runs):
        for kind in KINDS:
            rs = [r for r in ddp_runs if r["base_optim"] == base and r["kind"] == kind]
            if not rs:
                continue
            est = estimate(
                config,
                optimizer=f"{base}_layerwise" if kind == "layerwise" else base,
                dtype="float32",
                world_size=2,
                sharding="ddp",
                gradient_as_bucket_view=kind == "bucket_view",
            )
            predicted = est.gradient_bytes + est.optimizer_state_bytes
            counted = max(r["grad_live_peak_bytes"] + r["optimizer_state_bytes"] for r in rs)
            peak = by_rank_max(rs, "training_peak_bytes")
            out.append(
                {
                    "base_optim": base,
                    "kind": kind,
                    "estimated_gradient_bytes": est.gradient_bytes,
                    "estimated_state_bytes": est.optimizer_state_bytes,
                    "estimated_bytes": predicted,
                    "counted_grad_live_plus_state_bytes": counted,
                    "measured_training_peak_bytes": peak,
                    "vs_counted": predicted / counted - 1,
                    "vs_training_peak": predicted / peak - 1,
                }
            )
    return out


def print_estimator_check(rows: list[dict]) -> None:
    h.print_table(
        [("optimizer", 12), ("run", 33, "<"), ("est grads", 9), ("est state", 9), ("est sum", 8), ("counted", 8),
         ("vs counted", 10), ("train peak", 10), ("vs peak", 8)],
        [[r["base_optim"], KINDS[r["kind"]], mib(r["estimated_gradient_bytes"]), mib(r["estimated_state_bytes"]),
          mib(r["estimated_bytes"]), mib(r["counted_grad_live_plus_state_bytes"]), h.pct(r["vs_counted"]),
          mib(r["measured_training_peak_bytes"]), h.pct(r["vs_training_peak"])] for r in rows],
        title="\nEstimator (layerwise-hf estimate-memory, --sharding ddp, gradient + state terms) vs measured (MiB)",
    )  # fmt: skip
    print(
        "counted: the ranks' own count of gradient storage alive at once + optimizer state; train peak: RSS, which "
        "also holds activations and temporaries."
    )


def plot_all(report: dict, path: Path, model_desc: str) -> None:
    ddp_runs, step_time = report.get("ddp_runs") or [], report.get("step_time")
    panels = []
    for t in report.get("ddp_targets") or []:
        per_rank = {
            f"rank {k}": {kind: t["peak_bytes_per_rank"][kind].get(k, 0) / MIB for kind in KINDS} for k in "01"
        }
        line = (
            {}
            if t["peak_bytes"]["bucket_view"] is None
            else {"target: (b) - 60% of grads": (t["peak_bytes"]["bucket_view"] - t["target_saving_bytes"]) / MIB}
        )
        panels.append(dict(title=f"{t['base_optim']}: VmHWM during train() - RSS before ({h.verdict(t['pass'])})",
                           ylabel="training peak per rank, MiB", series=per_rank, lines=line))  # fmt: skip
    if ddp_runs:
        keys = {"gradients alive at once": "grad_live_peak_bytes", "optimizer state": "optimizer_state_bytes"}
        bases = dict.fromkeys(r["base_optim"] for r in ddp_runs)
        rows = {
            f"{b} {k}": [r for r in ddp_runs if (r["base_optim"], r["kind"]) == (b, k)] for b in bases for k in KINDS
        }
        counted = {
            what: {n: (by_rank_max(rs, key) or 0) / MIB for n, rs in rows.items()} for what, key in keys.items()
        }
        panels.append(dict(title="DDP: counted gradient + state bytes", ylabel="MiB per rank (max)", series=counted))
    if step_time:
        ratios = ", ".join(f"{o} {r['wall_ratio']:.3f}x" for o, r in step_time["ratios"].items())
        configs = {c: v["median_s"] for c, v in step_time["configs"].items()}
        title = f"DDP step time, layer-wise / standard: {ratios}"
        panels.append(dict(title=title, ylabel="median s/step (slower rank)", series={"median": configs}))
    fsdp2 = [r for r in report.get("runs") or [] if r["engine"] == "fsdp2"]
    panels += fsdp2_panels(fsdp2) if fsdp2 else []
    h.plot_panels(path, model_desc, panels)


def main(argv=None) -> None:
    opts = parse_args(argv)
    if opts.worker:
        {"loop": worker, "trainer": trainer_worker, "time": time_worker}[opts.worker](opts)
        return
    started = time.perf_counter()
    runs, ddp_runs, time_results = [], [], None
    with tempfile.TemporaryDirectory() as tmp:
        for engine in opts.engines:
            if engine == "ddp":
                for optim in opts.ddp_optims:
                    for kind in opts.kinds:
                        t0 = time.perf_counter()
                        args = ["--worker", "trainer", "--optim", optim, "--kind", kind]
                        ddp_runs += launch(opts, engine, args, Path(tmp) / f"ddp_{optim}_{kind}.json")
                        print(f"ddp    {optim:<12} {kind:<11} done in {time.perf_counter() - t0:.0f}s", flush=True)
                if opts.time:
                    t0 = time.perf_counter()
                    args = ["--worker", "time", "--rounds", str(opts.rounds), "--time_steps", str(opts.time_steps)]
                    args += ["--warmup_steps", str(opts.warmup_steps), "--time_optims", *opts.time_optims]
                    args += ["--profile"] if opts.profile else []
                    time_results = launch(opts, engine, args, Path(tmp) / "ddp_time.json", mmap=False)
                    print(f"ddp    step time done in {time.perf_counter() - t0:.0f}s", flush=True)
                continue
            for optim in opts.optims:
                t0 = time.perf_counter()
                args = ["--worker", "loop", "--optim", optim]
                runs += launch(opts, engine, args, Path(tmp) / f"{engine}_{optim}.json")
                print(f"{engine:<6} {optim:<22} done in {time.perf_counter() - t0:.0f}s", flush=True)
    num_params = (runs or ddp_runs or [{"num_params": h.build_llama(opts).num_parameters()}])[0]["num_params"]
    model_desc = (
        f"Llama {num_params / 1e6:.1f}M params (vocab {opts.vocab_size}, hidden {opts.hidden_size}, "
        f"{opts.num_hidden_layers} layers), batch {opts.batch_size}x{opts.seq_len} per rank, {opts.steps} steps, "
        "fp32, 2 gloo ranks"
    )
    print(f"\n{model_desc}")
    targets = ddp_target(ddp_runs) if ddp_runs else []
    estimates = estimator_check(opts, ddp_runs) if ddp_runs else []
    if ddp_runs:
        print_ddp_report(ddp_runs, targets)
        print_estimator_check(estimates)
    step_time = time_summary(time_results) if time_results else None
    if step_time:
        print_time_report(step_time)
    checks = fsdp2_checks(runs)
    if runs:
        print_report(runs, checks, model_desc)
    report = {
        "model": {k: getattr(opts, k) for k in FULL} | {"num_params": num_params, "steps": opts.steps},
        "environment": {"malloc_mmap_threshold": "65536", "omp_num_threads": 1, "backend": "gloo", "world_size": 2},
        "ddp_runs": ddp_runs,
        "ddp_targets": targets,
        "ddp_goal_pass": all(t["pass"] for t in targets) if targets else None,
        "estimator_check": estimates,
        "step_time": step_time,
        "runs": runs,
        "fsdp2_checks": checks,
        "fsdp2_goal_pass": all(c["tensor_pass"] and c["storage_pass"] for c in checks) if checks else None,
        "wall_time_s": time.perf_counter() - started,
    }
    h.write_report(opts.output_dir, "distributed_memory", report, lambda r, path: plot_all(r, path, model_desc))


if __name__ == "__main__":
    main()
