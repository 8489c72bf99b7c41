"""The benchmark harness: model sizes and builders, the example task, the optimizers under test, RSS / gradient /
optimizer-state meters, forked measurement and launched ranks, interleaved timing rounds, cProfile rows, tables and
the JSON report. Each script under benchmarks/ keeps its configurations and its question.

Imported as `benchmarks._common` (each script puts the repository root on `sys.path`). The optimizer is observed only
through public names of `layerwise_hf`: `LayerwiseOptimizer.inner` (one `torch.optim.Optimizer` per trainable
parameter, holding exactly that parameter) and its documented methods; nothing here patches a private method.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import json
import os
import pstats
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MIB = 2**20

# ~58M parameters: 2 x 16.4M (embeddings, untied lm_head) + 8 x 3.16M (decoder layers): the memory benchmarks' model.
LLAMA_58M = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=8)  # fmt: skip
LLAMA_TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
# ~20.3M parameters: 2 x 3.07M (embeddings, untied lm_head) + 6 x 2.36M (decoder layers): step_time.py's model.
LLAMA_20M = dict(vocab_size=8000, hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                 num_attention_heads=6, num_key_value_heads=6)  # fmt: skip
# The example task's model and batch (configs/train/tiny_llama.yaml); --small shrinks both.
EXAMPLE_FULL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=688, seq_len=128, batch_size=8)  # fmt: skip
EXAMPLE_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=176, seq_len=32, batch_size=4)  # fmt: skip


# ---- arguments ----


def benchmark_parser(description: str, full: dict, small: dict, rounds: int | None = None, seed: int = 42):
    """`--output_dir`, `--small`, one `--<size>` flag per key of `full` (unset: the full or `--small` value) and, with
    `rounds`, the timing flags `--warmup --rounds --threads --seed`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output_dir", default=str(RESULTS), help="JSON and PNG go here")
    parser.add_argument("--small", action="store_true", help="a tiny model (smoke run); explicit size flags win")
    for key, value in full.items():
        parser.add_argument(f"--{key}", type=int, default=None, help=f"default {value} ({small[key]} with --small)")
    parser.set_defaults(_sizes=(full, small))
    if rounds is not None:
        parser.add_argument("--warmup", type=int, default=2, help="rounds dropped before timing")
        parser.add_argument("--rounds", type=int, default=rounds, help="timed rounds (each configuration each round)")
        parser.add_argument("--threads", type=int, default=1, help="torch threads (1: less sensitive to shared cores)")
        parser.add_argument("--seed", type=int, default=seed)
    return parser


def parse(parser, argv=None) -> argparse.Namespace:
    """Parse; size flags left unset take the `--small` or full values."""
    opts = parser.parse_args(argv)
    full, small = opts._sizes
    del opts._sizes
    for key, value in (small if opts.small else full).items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    return opts


def size_args(opts, keys) -> list[str]:
    """`--key value` for each key: how a driver hands its sizes to the processes it starts."""
    return [arg for key in keys for arg in (f"--{key}", str(getattr(opts, key)))]


# ---- models and data ----


def llama_config(opts=None, tie: bool = False, **sizes):
    """A Llama (untied unless `tie`) of the sizes in `opts` / `sizes` (vocab_size, hidden_size, ... seq_len)."""
    from transformers import LlamaConfig

    sizes = {**(vars(opts) if opts is not None else {}), **sizes}
    shape = {k: sizes[k] for k in LLAMA_58M}
    return LlamaConfig(**shape, max_position_embeddings=sizes["seq_len"], tie_word_embeddings=tie)


def build_llama(opts=None, seed: int = 0, tie: bool = False, **sizes):
    """A randomly initialised `LlamaForCausalLM` of `llama_config(opts, tie, **sizes)`, the same for the same seed."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(opts, tie, **sizes))


def random_tokens(vocab_size: int, batch_size: int, seq_len: int, seed: int):
    return torch.randint(0, vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(seed))


class TokenRows:
    """Random token rows (`input_ids` = `labels`), the same on every rank; Trainer's sampler splits them."""

    def __init__(self, vocab_size: int, seq_len: int, rows: int, seed: int = 0):
        self.rows = [random_tokens(vocab_size, 1, seq_len, seed + k)[0] for k in range(rows)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, k: int) -> dict:
        return {"input_ids": self.rows[k], "labels": self.rows[k]}


def example_task(opts):
    """The example task of `examples/train.py` (its model and grammar corpus) at the sizes in `opts`, torch's threads
    set: (model, dataset)."""
    from examples.train import ScriptArguments, build_dataset, build_model

    torch.set_num_threads(opts.threads)
    # Every size of EXAMPLE_FULL but the batch is a field of the example's ScriptArguments.
    script_args = ScriptArguments(**{k: getattr(opts, k) for k in EXAMPLE_FULL if k != "batch_size"}, num_samples=512)
    torch.manual_seed(opts.seed)
    return build_model(script_args), build_dataset(script_args)


def micro_batches(dataset, step: int, ga: int, batch_size: int) -> list[dict]:
    """The `ga` micro-batches of optimizer step `step`, the same for every configuration."""
    out = []
    for k in range(ga):
        start = ((step * ga + k) * batch_size) % (len(dataset) - batch_size + 1)
        rows = dataset[start : start + batch_size]
        out.append({key: torch.stack([r[key] for r in rows]) for key in rows[0]})
    return out


def count_passes(model) -> dict:
    """`{"forward": n, "backward": n}`, counted from now on: forward pre-hooks on `model` and a hook on the input
    embedding's gradient (the last one each backward computes, a measuring one included)."""
    counts = {"forward": 0, "backward": 0}
    model.register_forward_pre_hook(lambda *a: counts.__setitem__("forward", counts["forward"] + 1))
    model.get_input_embeddings().weight.register_hook(lambda g: counts.__setitem__("backward", counts["backward"] + 1))
    return counts


def copy_model(base_model):
    """A deep copy of `base_model` in training mode: every configuration starts from the same weights."""
    return copy.deepcopy(base_model).train()


# ---- the optimizers under test ----


def training_args(optim: str, output_dir: str = "unused", **kwargs):
    """`LayerwiseTrainingArguments` for a benchmark: nothing reported, nothing written to `output_dir`."""
    from layerwise_hf import LayerwiseTrainingArguments

    return LayerwiseTrainingArguments(output_dir=output_dir, optim=optim, report_to="none", use_cpu=True, **kwargs)


def trainer_optimizer(model, args):
    """The standard optimizer exactly as Trainer builds it (`Trainer.create_optimizer`):
    `get_optimizer_cls_and_kwargs`, its decay split, bitsandbytes' 32-bit embedding override, GaLore's groups."""
    from transformers import Trainer

    # NOTE: run on a stand-in with the attributes it reads; a function of its own so no local keeps the unsharded
    # parameters alive once FSDP2 has swapped them.
    trainer = types.SimpleNamespace(model=model, args=args, optimizer=None, optimizer_cls_and_kwargs=None,
                                    get_optimizer_cls_and_kwargs=Trainer.get_optimizer_cls_and_kwargs)  # fmt: skip
    trainer.get_decay_parameter_names = types.MethodType(Trainer.get_decay_parameter_names, trainer)
    return Trainer.create_optimizer(trainer)


def layerwise_optimizer(model, args, *, clip: tuple[float, str] = (0.0, "exact"), attach: bool = True, **kwargs):
    """`build_layerwise_optimizer(model, args, **kwargs)` with clipping configured and, by default, hooks attached."""
    from layerwise_hf import build_layerwise_optimizer

    optimizer = build_layerwise_optimizer(model, args, **kwargs)
    optimizer.configure_clipping(*clip)
    if attach:
        optimizer.attach()
    return optimizer


def build_optimizer(model, args, clip: float = 0.0, sync=None, **kwargs):
    """The optimizer `args.optim` names, as Trainer builds it, and the `LayerwiseOptimizer` (or None): layer-wise with
    exact clipping at `clip` and, outside Accelerate, `sync()` saying whether a micro-batch ends its window."""
    if not args.optim.endswith("_layerwise"):
        return trainer_optimizer(model, args), None
    if sync is not None:
        kwargs["sync_gradients"] = sync
    optimizer = layerwise_optimizer(model, args, clip=(clip, "exact"), **kwargs)
    return optimizer, optimizer


def trainer(model, args, dataset, callbacks=()):
    """`LayerwiseTrainer` for a layer-wise `args.optim` (`LayerwiseTrainingArguments.is_layerwise`), else `Trainer`."""
    from transformers import Trainer

    from layerwise_hf import LayerwiseTrainer

    cls = LayerwiseTrainer if args.is_layerwise else Trainer
    return cls(model=model, args=args, train_dataset=dataset, callbacks=list(callbacks))


def norm_pass_name(layerwise) -> str | None:
    """The way the last step measured its gradients' norm (`layerwise_hf.optim.norm_pass`), if it did."""
    from layerwise_hf.optim.norm_pass import last_norm_pass

    chosen = last_norm_pass(layerwise)
    return None if chosen is None else chosen.value


def check_distributed(accelerator, sharding: str) -> None:
    """Refuse a launched rank that is not in the 2-process mode it was launched for: a silent fallback would measure
    the wrong thing."""
    from accelerate.utils import DistributedType

    expected = DistributedType.FSDP if sharding == "fsdp2" else DistributedType.MULTI_CPU
    if accelerator.distributed_type != expected or accelerator.num_processes != 2:
        raise RuntimeError(f"{sharding}: got {accelerator.distributed_type} with {accelerator.num_processes} processes"
                           " (ACCELERATE_USE_CPU / LAYERWISE_HF_FORCE_FSDP_CPU missing?)")  # fmt: skip


# ---- meters ----


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


def rss_at_rest() -> int:
    """The RSS once garbage is collected (`settle`); the peak is reset to it."""
    settle()
    rss = proc_status_bytes("VmRSS")
    reset_peak_rss()
    return rss


def settle() -> None:
    # Garbage from the previous phase must not be counted in the next one, nor heap the allocator still holds.
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def limit_mmap_threshold() -> None:
    # NOTE: glibc serves allocations above the threshold by mmap and returns them to the OS on free, so RSS follows
    # live tensors instead of heap slack; set by mallopt (M_MMAP_THRESHOLD = -3) it also stops the threshold from
    # growing. Not for timing: an mmap per tensor makes every step pay for page faults.
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)


def local(t):
    """The local shard of a DTensor (FSDP2), the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def nbytes(t) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def state_tensors(obj, found: dict | None = None) -> dict:
    """Every tensor in `obj` by id, also inside objects kept in an optimizer state (GaLore's projector)."""
    found = {} if found is None else found
    if isinstance(obj, torch.Tensor):
        found[id(obj)] = obj
    elif isinstance(obj, (dict, list, tuple)) or (hasattr(obj, "__dict__") and not isinstance(obj, type)):
        values = obj.values() if isinstance(obj, dict) else vars(obj).values() if hasattr(obj, "__dict__") else obj
        for v in values:
            state_tensors(v, found)
    return found


def optimizer_state_tensors(optimizer) -> dict:
    """The state tensors of a standard optimizer (also inside Accelerate's wrapper) or of a layer-wise one."""
    from layerwise_hf import unwrap_layerwise_optimizer

    lw = unwrap_layerwise_optimizer(optimizer)
    if lw is not None:
        return state_tensors([s for inner in lw.inner for s in inner.state.values()])
    return state_tensors(list(getattr(optimizer, "optimizer", optimizer).state.values()))


def tensor_bytes(tensors: dict) -> int:
    """What the tensors' (local) shapes say: numel x element size, what `pipeline.memory.state_bytes()` counts."""
    return sum(nbytes(t) for t in tensors.values())


def storages(tensors) -> dict[int, int]:
    """{data_ptr: bytes} of the distinct storages the tensors keep allocated, in full even for a view of a part."""
    found = {}
    for t in tensors.values() if isinstance(tensors, dict) else tensors:
        storage = local(t).untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    return found


def storage_bytes(tensors) -> int:
    return sum(storages(tensors).values())


class GradMeter:
    """
    Live `.grad` bytes of `params`, sampled at every post-accumulate-grad hook (once `attach()`ed) and wherever
    `sample()` is called: the largest sum of (local) `.grad` tensor bytes and of the distinct storages they keep alive
    (an FSDP2 shard or a bucket view pins its whole buffer) since the last `start_step()`. `attach()` it before the
    layer-wise optimizer's hooks, so each sample sees a gradient before its step frees it. `total(storages)` may add
    what an engine holds for gradients beside `.grad`.
    """

    def __init__(self, params):
        self.params, self.handles, self.samples = list(params), [], 0
        self.start_step()

    def attach(self) -> GradMeter:
        self.handles += [p.register_post_accumulate_grad_hook(self.sample) for p in self.params]
        return self

    def watch_steps(self, optimizers) -> None:
        """Sample before every step of `optimizers` too (torch's step pre-hook: the gradient is still in `.grad`)."""
        self.handles += [o.register_step_pre_hook(lambda *a: self.sample()) for o in optimizers]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def start_step(self) -> None:
        self.peak_tensor = self.peak_storage = self.peak_total = 0

    def live(self) -> int:
        return sum(nbytes(p.grad) for p in self.params if p.grad is not None)

    def total(self, grad_storages: dict) -> int:
        return sum(grad_storages.values())

    def sample(self, param=None) -> None:
        """Record the gradients alive now. Returns None: autograd refuses a post-accumulate-grad hook that returns
        anything else."""
        grads = [p.grad for p in self.params if p.grad is not None]
        held = storages(grads)
        self.peak_tensor = max(self.peak_tensor, sum(nbytes(g) for g in grads))
        self.peak_storage = max(self.peak_storage, sum(held.values()))
        self.peak_total = max(self.peak_total, self.total(held))
        self.samples += 1


# ---- processes ----


def fork_each(names: list[str], measure, timeout: int, label: str, mmap: bool = True) -> dict:
    """
    With the libraries imported once by this process, fork one child per name: each runs `measure(name)` alone and
    from scratch (its own peak memory; with `mmap`, freed tensors go back to the OS: `limit_mmap_threshold`). Returns
    {name: what it returned, or {"error": ..., "traceback": ...}}. A hung child is killed after `timeout` seconds and
    the next one still runs.
    """
    # The imported objects are never garbage: keep the collector (run between phases) off them, which makes it fast
    # and leaves the pages shared with the forked processes untouched.
    gc.collect()
    gc.freeze()
    out = {}
    with tempfile.TemporaryDirectory(prefix="benchmark-") as tmp:
        for name in names:
            path, started = Path(tmp) / "result.json", time.perf_counter()
            path.unlink(missing_ok=True)
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    signal.alarm(timeout)
                    if mmap:
                        limit_mmap_threshold()
                    payload = measure(name)
                except BaseException as err:  # noqa: B036 - the child reports everything, then exits
                    payload = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
                    code = 1
                path.write_text(json.dumps(payload, indent=1))
                sys.stdout.flush()
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            died = {"error": f"the measuring process died (wait status {status})"}
            out[name] = json.loads(path.read_text()) if path.is_file() else died
            print(f"  {label} {name:<28} {time.perf_counter() - started:5.1f}s", flush=True)
    return out


def worker_env(threads: int = 1, mmap_threshold: bool = False, sharding: str = "ddp", cpu: bool = True) -> dict:
    """The environment of launched ranks: the repository importable, offline, `threads` OpenMP threads; CPU ranks
    (`cpu`) told so, and forced into FSDP2 for `sharding="fsdp2"`."""
    env = {
        **os.environ,
        # The caller's PYTHONPATH first: a checkout or an installed copy it points at is the one measured.
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": str(threads),
    }
    if cpu:
        # The multi-process launcher does not forward use_cpu, and accelerate keeps FSDP for accelerator devices.
        env |= {"ACCELERATE_USE_CPU": "true"} | ({"LAYERWISE_HF_FORCE_FSDP_CPU": "1"} if sharding == "fsdp2" else {})
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # limit_mmap_threshold, for a process started with it
    return env


def write_gathered_and_finish(path: str, result: dict) -> None:
    """In a launched rank: every rank's result in one JSON (written by rank 0), then the process group ends on every
    rank."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    # A DDP reducer freed after destroy_process_group can crash or hang the rank in gloo's destructor, now and then:
    # fail every time instead, while the group can still say so.
    gc.collect()
    alive = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    if alive:
        raise RuntimeError(f"{alive} DistributedDataParallel model(s) still alive at the end of the worker")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(gathered, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    # Without C++ static destructors: a rank was seen to abort at interpreter teardown while gloo threads wound down
    # (tests/helpers.finish_ranks), which would fail a run whose results are all written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (children first found, then theirs)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
    return children + [d for child in children for d in descendants(child)]


def launch_ranks(script, launcher: list[str], args: list[str], result: Path, timeout: float, env: dict) -> list:
    """
    Run `accelerate launch <launcher> script args` (`launcher`: `--config_file` and any other option of the launcher)
    and return what the ranks wrote to `result` (`write_gathered_and_finish`). Raises with the ranks' output on failure
    or after `timeout` seconds, killing every rank left.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *map(str, launcher), "--main_process_port", str(port)]
    cmd += [str(script), *args]
    label = " ".join(args)
    # Output goes to a file, not a pipe: ranks left behind by a killed launcher would hold a pipe open.
    log = result.with_suffix(".log")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=timeout)
        except BaseException as stopped:  # the timeout, or this process stopped (gpu_check's time limit)
            # The ranks run in sessions of their own: kill them by id, then the launcher.
            for pid in [*descendants(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            if not isinstance(stopped, subprocess.TimeoutExpired):
                raise
            raise RuntimeError(f"{label} timed out after {timeout}s:\n{log.read_text()[-4000:]}") from None
    stderr = log.read_text()
    if proc.returncode != 0 or not result.is_file():
        # The ranks' lines carry a Python error; a rank that died without one (a signal) shows only in the
        # launcher's closing summary, which names each rank's exit code.
        rank_lines = [line for line in stderr.splitlines() if line.startswith("[rank")]
        summary = stderr[stderr.rfind("Failures:") :] if "Failures:" in stderr else stderr[-3000:]
        detail = "\n".join(rank_lines[-60:]) + "\n" + summary
        raise RuntimeError(f"{label} failed (exit {proc.returncode}):\n{detail}")
    return json.loads(result.read_text())


# ---- timing ----


class TimedRun:
    """One timed configuration: `times` / `cpu_times` of its steps, filled by `interleaved_rounds`."""

    def __init__(self, name: str | None = None):
        self.name, self.times, self.cpu_times = name, [], []  # wall and process CPU seconds of each timed step

    @staticmethod
    def clock(fn, *args, **kwargs) -> tuple[float, float]:
        """Run `fn`; its wall and process CPU seconds."""
        start, cpu_start = time.perf_counter(), time.process_time()
        fn(*args, **kwargs)
        return time.perf_counter() - start, time.process_time() - cpu_start


def interleaved_rounds(runs: list, opts, step, label: str = "round") -> None:
    """`opts.warmup + opts.rounds` rounds of one `step(run, round) -> (wall s, CPU s)` per run, in a freshly shuffled
    order each round so the load of other processes falls on all runs alike. After the warm-up rounds each run's
    times go to `run.times` / `run.cpu_times`."""
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
        print(f"  {label} {rnd + 1}/{total}{' (warm-up)' if rnd < opts.warmup else ''}", flush=True)


def timing_stats(run: TimedRun, ref: TimedRun) -> dict:
    """Medians of one run's step times and its ratios to a reference timed in the same rounds: of the medians, and the
    median and quartiles of the same-round ratios (pairs cancel slow drifts of the machine load)."""
    median, cpu_median = statistics.median(run.times), statistics.median(run.cpu_times)
    paired = [t / r for t, r in zip(run.times, ref.times)]
    return {
        "times_s": run.times,
        "cpu_times_s": run.cpu_times,
        "median_s": median,
        "cpu_median_s": cpu_median,
        "ratio": median / statistics.median(ref.times),
        "paired_ratios": paired,
        "paired_ratio_median": statistics.median(paired),
        "paired_ratio_quartiles": statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3,
        # Single-threaded, the process CPU time hardly sees other processes competing for the cores.
        "cpu_ratio": cpu_median / statistics.median(ref.cpu_times),
    }


def cprofile_summary(prof, steps: int, wanted: list[tuple[str, str, str]]) -> dict:
    """cProfile's rows `wanted` (label, a part of the file name, the function name), per step: where the time goes."""
    stats, picked = pstats.Stats(prof).stats.items(), []
    for label, file_part, func in wanted:
        matches = [(ct, nc) for (file, _, name), (_, nc, _, ct, _) in stats if file_part in file and name == func]
        if matches:
            ct, nc = max(matches)
            picked.append({"label": label, "calls_per_step": nc / steps, "cumulative_ms_per_step": 1000 * ct / steps})
    return {"steps": steps, "rows": picked}


# ---- output ----


def mib(n) -> str:
    # Three decimals under 1 MiB, so a LoRA adapter's gradient does not read as zero.
    return "-" if n is None else f"{n / MIB:.3f}" if abs(n) < MIB else f"{n / MIB:.1f}"


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def verdict(ok) -> str:
    return {True: "PASS", False: "FAIL", None: "n/a"}[None if ok is None else bool(ok)]


def print_table(columns: list[tuple], rows: list, title: str | None = None) -> None:
    """A fixed-width table. `columns`: (header, width) or (header, width, "<" / ">"); the first column is left-aligned
    unless it says otherwise, the others right-aligned. Cells come formatted; a row that is a string prints as is."""
    if title:
        print(title)
    aligns = [c[2] if len(c) > 2 else "<" if k == 0 else ">" for k, c in enumerate(columns)]
    fmt = [f"{{:{a}{c[1]}}}" for a, c in zip(aligns, columns)]
    header = " ".join(f.format(c[0]) for f, c in zip(fmt, columns))
    print(f"{header}\n{'-' * len(header)}")
    for row in rows:
        print(row if isinstance(row, str) else " ".join(f.format(str(cell)) for f, cell in zip(fmt, row)))


def print_rows(items, columns: list[tuple], title: str | None = None) -> None:
    """`print_table` of one row per item: `columns` are (header, width, item -> cell) or (..., alignment)."""
    print_table([(c[0], c[1], *c[3:]) for c in columns], [[c[2](i) for c in columns] for i in items], title)


def write_report(output_dir, name: str, report: dict, plot=None) -> Path:
    """`<output_dir>/<name>.json` and, with `plot(report, png_path)`, `<name>.png`; prints where they went."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(report, indent=1))
    if plot is not None:
        plot(report, out / f"{name}.png")
    took = f" in {report['wall_time_s']:.0f}s" if "wall_time_s" in report else ""
    print(f"\nwrote {path}{' and .png' if plot is not None else ''}{took}")
    return path


def python_version() -> str:
    return sys.version.split()[0]
