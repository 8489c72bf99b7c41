"""How long host offload takes per step (`layerwise-hf plan --offload`): the host step, the PCIe copies, and whether
they hide behind backward.

For each offload row:

- **host seconds**: with `"optimizer"` the host steps every trainable tensor once per step. Its time is measured on
  the machine running the plan for the model's own tensor shapes (`host_step_seconds`: each size's step through a host
  worker task, with the kernel an accelerator model's host step runs, `layerwise_host_step="fast"`, and the worker's
  share of the cores; a second or two, cached), so both the fixed cost per tensor (the optimizer's Python step and
  its task) and the per-element rate at that size are in it. `--host-step-rate` (ns per element) gives it instead.
- **PCIe**: the bytes each way per step. `"optimizer"`: each final gradient out (every micro-batch's under gradient
  accumulation), each updated parameter back. `"gradients"`: each gradient that waits for the step out (every
  micro-batch's, or at GA 1 every one under exact clipping or fp16), and back once for the step. At `--pcie-gbps`,
  25 GB/s by default: what a pinned, non-blocking copy reaches on PCIe 4.0 x16 one way (~80% of its nominal 31.5 GB/s;
  `layerwise_hf.estimate.offload_choice.PCIE4_BYTES_PER_S`).
- **backward**: with `--device-tflops`, the device's backward time: the FLOPs of the simulated step's backwards,
  counted by torch's `FlopCounterMode` from the ops' shapes on the fake tensors (every micro-batch's; the recompute
  of activation checkpointing included; per layer on the line of the extrapolated copies), at that many TFLOP/s
  achieved. A row whose simulation counted none falls back to the rule backward = 2 x forward = 4 x parameters x
  tokens (6 x with activation checkpointing). Without `--device-tflops` the plan does not say whether the host step
  hides.

The host step and the copies out run during backward; the copies back finish before the next forward. The slowest of
host step, copies and backward sets the pace, and the advice names it.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_PCIE_GBPS = 25.0  # PCIe 4.0 x16, one way, pinned (layerwise_hf.estimate.offload_choice.PCIE4_BYTES_PER_S)


@dataclass
class HostRate:
    """The host step's cost: `ns_per_element` per element stepped, `us_per_tensor` per tensor; `source` says where
    it comes from (`"measured"`, `"cached"`, `"given"`)."""

    ns_per_element: float
    us_per_tensor: float = 0.0
    source: str = "given"


@dataclass
class OffloadTime:
    """
    One offload row's time per step (see the module docstring); seconds, bytes.

    Example:

    ```python
    >>> from layerwise_hf.plan.offload_time import HostRate, offload_time
    >>> t = offload_time("optimizer", elements=8_030_261_248, tensors=291, grad_bytes=16 * 2**30,
    ...                  param_bytes=16 * 2**30, rate=HostRate(1.0), backward_s=1.2)
    >>> round(t.host_step_s, 2), t.bottleneck
    (8.03, 'host step')
    ```
    """

    offload: str
    host_elements: int
    host_step_s: float
    bytes_out: int
    bytes_in: int
    copy_out_s: float
    copy_in_s: float
    pcie_gbps: float
    backward_s: float | None
    bottleneck: str
    rate: HostRate
    host_tensors: int = 0
    host_add_s: float = 0.0  # gradient accumulation: the host worker's adds of the later micro-batches' gradients
    add_ns_per_element: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        parts = []
        if self.offload == "optimizer":
            tensors = f" in {self.host_tensors} tensors" if self.host_tensors else ""
            parts.append(
                f"host step {self.host_step_s:.2f} s ({self.host_elements / 1e6:.0f}M elements{tensors} at "
                f"{self.rate.ns_per_element:.2f} ns each, {self.rate.source})"
            )
        if self.host_add_s:
            parts.append(
                f"host adds {self.host_add_s:.2f} s (each later micro-batch's gradients added into their sums at "
                f"{self.add_ns_per_element:.2f} ns per element)"
            )
        parts.append(
            f"PCIe {self.bytes_out / 2**30:.2f} GiB out / {self.bytes_in / 2**30:.2f} GiB in per step "
            f"({self.copy_out_s:.2f} / {self.copy_in_s:.2f} s at {self.pcie_gbps:g} GB/s)"
        )
        if self.backward_s is not None:
            parts.append(f"backward ~{self.backward_s:.2f} s")
        return "; ".join(parts)

    def advice(self) -> str | None:
        """What sets the pace, when it is not backward (`None` then, or without a backward time)."""
        if self.backward_s is None or self.bottleneck == "backward":
            return None
        slack = f"backward ~{self.backward_s:.2f} s"
        if self.bottleneck == "host step":
            if self.host_add_s > self.host_step_s:
                return (
                    f"the host worker's adds of accumulated gradients, {self.host_add_s:.1f} s per step, set the pace "
                    f"({slack}): more host cores, fewer and larger micro-batches, or layerwise_offload='none'"
                )
            return (
                f"the host step, {self.host_step_s:.1f} s per step, sets the pace ({slack}): more host cores, an 8-bit"
                " optimizer on the device (layerwise_offload='none' or 'gradients'), or Adafactor"
            )
        seconds = max(self.copy_out_s, self.copy_in_s)
        return (
            f"PCIe, {seconds:.1f} s per step each way, sets the pace ({slack}): a faster link, more tokens per "
            "micro-batch (the copies are per step), or less offload"
        )


def offload_time(
    offload: str,
    *,
    elements: int,
    tensors: int,
    grad_bytes: int,
    param_bytes: int,
    rate: HostRate,
    pcie_gbps: float = DEFAULT_PCIE_GBPS,
    backward_s: float | None = None,
    grad_accum: int = 1,
    gradients_wait: bool = True,
    add_ns_per_element: float = 0.0,
) -> OffloadTime:
    """
    The time per step of one offload row (see the module docstring).

    Args:
        offload (`str`): `"none"`, `"gradients"` or `"optimizer"`.
        elements (`int`), tensors (`int`): trainable elements and tensors this rank steps.
        grad_bytes (`int`), param_bytes (`int`): this rank's trainable gradients and parameters, bytes.
        rate (`HostRate`): the host step's cost (`calibrate`).
        pcie_gbps (`float`, *optional*, defaults to 25): host <-> device GB/s, one way.
        backward_s (`float`, *optional*): the device's backward per step (`backward_seconds`).
        grad_accum (`int`, *optional*, defaults to 1): micro-batches per step.
        gradients_wait (`bool`, *optional*, defaults to `True`): with `"gradients"` at GA 1, whether the gradients
            wait for the step (exact clipping, fp16); without, none is offloaded.
        add_ns_per_element (`float`, *optional*): the host worker's add of a staged gradient into its sum, ns per
            element (`host_add_rate`): with gradient accumulation each later micro-batch's gradients are added on the
            host, by the same worker as the host step, while backward waits once the staging buffers are full.
    """
    host_s, out, back = 0.0, 0, 0
    add_s = 0.0
    if offload != "none" and grad_accum > 1:
        add_s = (grad_accum - 1) * elements * add_ns_per_element * 1e-9
    if offload == "optimizer":
        host_s = elements * rate.ns_per_element * 1e-9 + tensors * rate.us_per_tensor * 1e-6
        out, back = grad_bytes * grad_accum, param_bytes
    elif offload == "gradients" and (grad_accum > 1 or gradients_wait):
        out, back = grad_bytes * grad_accum, grad_bytes
    link = pcie_gbps * 1e9
    out_s, in_s = out / link, back / link
    # The host worker runs the adds and the steps in turn: its time is their sum.
    pace = {"backward": backward_s or 0.0, "host step": host_s + add_s, "PCIe": max(out_s, in_s)}
    bottleneck = max(pace, key=pace.get) if backward_s is not None else "unknown"
    return OffloadTime(
        offload, elements if offload == "optimizer" else 0, host_s, out, back, out_s, in_s, pcie_gbps, backward_s,
        bottleneck, rate, tensors if offload == "optimizer" else 0, add_s, add_ns_per_element if add_s else 0.0,
    )  # fmt: skip


def backward_seconds(
    params: int, tokens: int, device_tflops: float, gradient_checkpointing: bool = False, grad_accum: int = 1
) -> float:
    """The device's backward per step from the rule 4 x parameters x tokens FLOPs (6 x with activation
    checkpointing) at `device_tflops` achieved; `tokens` per micro-batch."""
    flops = (6 if gradient_checkpointing else 4) * params * tokens * grad_accum
    return flops / (device_tflops * 1e12)


# ---- calibration ----

# NOTE: one tensor's step costs a fixed part (the optimizer's Python step and the host worker's task: 40-90 us here)
# plus its elements at a rate that depends on where its bytes are: in cache for a small model's tensors, in DRAM for a
# large one's. A line through a 1-element and a 1M-element step (the previous calibration) put single tensors of 4096
# and 16M elements at 0.61x and 0.82x of their measured step, and a hidden-256 Llama's host step at 0.73x
# (benchmarks/host_step_pace.py --plan-check, one run, 2 cores at load 5). So the model's own tensor shapes are
# measured, with as many bytes in play as the model's step has. Above CALIBRATION_CAP elements a tensor's states are
# far beyond any cache and its step is linear in its size.
CALIBRATION_CAP = 16 * 2**20
POOL_TENSORS = 256  # the most tensors of one size stepped per pass (the small ones cost their fixed part)


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "layerwise_hf" / "host_step_rate.json"


def _read_cache() -> dict[str, Any]:
    # The machine's measured host rates; a missing or unreadable file measures again.
    path = _cache_path()
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}


def _write_cache(known: dict[str, Any]) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known, indent=2) + "\n")
    except OSError:
        pass  # a read-only home: the next plan measures again


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def median_seconds(fn, repeats: int) -> float:
    """The median wall time of `fn()` over `repeats` calls after one warm-up call (lazy state, kernels, caches)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _builder(optimizer: str, weight: torch.nn.Parameter) -> Callable[[torch.nn.Parameter], torch.optim.Optimizer]:
    """Builds the optimizer the plugin builds for a hidden layer's projection of `weight`'s shape, for each tensor it
    is given (`optimizer`: a Trainer name or its layer-wise form)."""
    import tempfile

    from transformers import TrainingArguments

    from ..bases.params import LayerwiseParam
    from ..bases.registry import parse_optim_name, resolve_factory

    name = optimizer if optimizer.endswith("_layerwise") else f"{optimizer}_layerwise"
    base = parse_optim_name(name)
    model = torch.nn.Module()
    model.self_attn = torch.nn.Module()
    model.self_attn.q_proj = torch.nn.Linear(1, 1, bias=False)
    model.self_attn.q_proj.weight = weight
    extra = {"optim_target_modules": ["attn"]} if (base or "").startswith(("galore", "apollo")) else {}
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(tmp, optim=base or "adamw_torch", report_to="none", use_cpu=True, **extra)
    args.optim = name
    factory = resolve_factory(args, model)
    return lambda tensor: factory(LayerwiseParam("self_attn.q_proj.weight", tensor, 0.0), args)


def worker_seconds(worker: Any, tasks: Sequence[Callable[[], Any]], threads: int, repeats: int) -> float:
    """
    The host worker's time to run `tasks` in order, the median of `repeats` passes after a warm-up pass (lazy state,
    caches). With one intra-op thread it is the worker thread's CPU time: what the pass costs with a core to itself,
    which a shared machine's wall clock is not (other processes' time slices land in it, more in long tasks than in
    short ones). With more threads, wall time from the first task's start to the last one's end.

    Example:

    ```python
    >>> from layerwise_hf.placement.offload import HostWorker
    >>> from layerwise_hf.plan.offload_time import worker_seconds
    >>> worker_seconds(HostWorker(), [lambda: sum(range(1000))], threads=1, repeats=3)  # e.g. 2e-05
    ```
    """
    clock = time.thread_time if threads == 1 else time.perf_counter

    def one_pass() -> float:
        first = worker.submit(clock)
        for task in tasks:
            worker.submit(task)
        return worker.submit(clock).result() - first.result()

    one_pass()
    return statistics.median(one_pass() for _ in range(repeats))


def _pool_seconds(
    optimizer: str, dtype: torch.dtype, shape: tuple[int, ...], pool: int, threads: int, repeats: int
) -> float:
    """One tensor's host step, of `pool` tensors of `shape` stepped one task each on a host worker with `threads`
    intra-op threads, as the host steps a model's parameters (`worker_seconds`)."""
    from ..placement.host_kernel import claim_thread_share, host_kernel_flags
    from ..placement.offload import HostWorker

    weights = []
    for _ in range(pool):
        weight = torch.nn.Parameter(torch.rand(shape, dtype=dtype).sub_(0.5).mul_(0.04))
        weight.grad = torch.rand_like(weight).sub_(0.5).mul_(2e-3)
        weights.append(weight)
    build = _builder(optimizer, weights[0])
    # One optimizer per tensor, as the plugin builds them: one optimizer stepping each tensor in turn would keep its
    # Python objects warm.
    inners = [build(w) for w in weights]
    flags = host_kernel_flags(inners[0], torch.device("cuda"), "fast")
    for inner in inners:
        inner.param_groups[0].update(flags)

    def step(inner: torch.optim.Optimizer) -> None:
        claim_thread_share(threads)
        inner.step()

    worker = HostWorker()
    try:
        tasks = [functools.partial(step, inner) for inner in inners]
        return worker_seconds(worker, tasks, threads, repeats) / pool
    finally:
        worker.close()


def _capped(shape: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` with dim 0 cut so that it holds at most `CALIBRATION_CAP` elements (rows of a large matrix)."""
    rest = math.prod(shape[1:])
    if math.prod(shape) <= CALIBRATION_CAP:
        return shape
    if rest > CALIBRATION_CAP:
        return (CALIBRATION_CAP,)
    return (CALIBRATION_CAP // rest, *shape[1:])


def host_step_seconds(
    shapes: Sequence[int | Sequence[int]],
    optimizer: str = "adamw_torch",
    dtype: torch.dtype = torch.float32,
    cache: bool = True,
    repeats: int = 3,
) -> tuple[float, str]:
    """
    The host step of tensors of `shapes` (an int: a 1-D tensor of that size), seconds, measured on this machine, and
    where the figure comes from (`"measured"` or `"cached"`).

    Each distinct shape is measured as a pass over a pool of tensors of that shape, `optimizer`'s step of each (the
    kernel of `layerwise_host_step="fast"`) a task on a host worker with the worker's share of the cores
    (`host_threads`): the fixed cost per tensor and the thread handoff are in it, and shape-dependent steps (Adafactor
    factors a matrix's second moment, Muon steps matrices only) step as they will. The pool holds as many elements as
    the model steps, up to `CALIBRATION_CAP`, so its bytes are in cache when the model's would be; a tensor larger
    than `CALIBRATION_CAP` is measured on its first rows up to the cap and scaled by its size. Each shape takes well
    under a second and is cached by optimizer, dtype, threads, torch version and CPU.

    Example:

    ```python
    >>> from layerwise_hf.plan.offload_time import host_step_seconds
    >>> seconds, source = host_step_seconds([4096, (1024, 1024), (1024, 1024)])  # e.g. (0.002, 'measured')
    ```
    """
    from ..placement.host_kernel import host_threads

    threads = host_threads()
    shapes = [(int(s),) if isinstance(s, int) else tuple(int(d) for d in s) for s in shapes]
    counts = collections.Counter(s for s in shapes if math.prod(s) > 0)
    footprint = min(sum(math.prod(s) for s in shapes), CALIBRATION_CAP)
    prefix = f"{optimizer}|{str(dtype).removeprefix('torch.')}|{threads}|{torch.__version__}|{_cpu_name()}"
    known = _read_cache() if cache else {}
    measured, total = False, 0.0
    previous = torch.get_num_threads()
    try:
        for shape, count in counts.items():
            capped = _capped(shape)
            pool = max(1, min(POOL_TENSORS, -(-footprint // math.prod(capped))))
            key = f"{prefix}|{'x'.join(map(str, capped))}*{pool}"
            if not isinstance(known.get(key), float):
                torch.set_num_threads(threads)
                known[key] = _pool_seconds(optimizer, dtype, capped, pool, threads, repeats)
                measured = True
            total += count * known[key] * math.prod(shape) / math.prod(capped)
    finally:
        torch.set_num_threads(previous)
    if cache and measured:
        _write_cache(known)
    return total, "measured" if measured else "cached"


def host_add_rate(dtype: torch.dtype = torch.float32, cache: bool = True, repeats: int = 3) -> float:
    """
    The host worker's add of a staged gradient into its sum (`buffer.add_(staged)`, gradient accumulation with
    offload), ns per element, measured on this machine on `CALIBRATION_CAP` elements (far beyond any cache, as a
    large model's gradients are) with the worker's share of the cores, and cached like the host step.

    Example:

    ```python
    >>> from layerwise_hf.plan.offload_time import host_add_rate
    >>> host_add_rate()  # e.g. 0.3
    ```
    """
    from ..placement.host_kernel import claim_thread_share, host_threads
    from ..placement.offload import HostWorker

    threads = host_threads()
    key = f"add|{str(dtype).removeprefix('torch.')}|{threads}|{torch.__version__}|{_cpu_name()}"
    known = _read_cache() if cache else {}
    if isinstance(known.get(key), float):
        return known[key]
    total, staged = torch.zeros(CALIBRATION_CAP, dtype=dtype), torch.full((CALIBRATION_CAP,), 1e-3, dtype=dtype)
    worker = HostWorker()
    try:
        worker.submit(claim_thread_share, threads).result()
        seconds = worker_seconds(worker, [functools.partial(total.add_, staged)], threads, repeats)
    finally:
        worker.close()
    known[key] = seconds / CALIBRATION_CAP * 1e9
    if cache:
        _write_cache(known)
    return known[key]


def calibrate(
    optimizer: str = "adamw_torch",
    dtype: torch.dtype = torch.float32,
    shapes: Sequence[int | Sequence[int]] | None = None,
    cache: bool = True,
    repeats: int = 3,
) -> HostRate:
    """
    The host step's rate on this machine for tensors of `shapes` (`host_step_seconds`) as ns per element stepped.
    Without `shapes`, the rate of a 4096 x 4096 matrix: large tensors, at the rate the host's memory allows, what a
    model whose tensor shapes are not known is planned at.

    Example:

    ```python
    >>> from layerwise_hf.plan.offload_time import calibrate
    >>> calibrate("adamw_torch").ns_per_element  # e.g. 1.2
    ```
    """
    shapes = list(shapes) if shapes else [(4096, CALIBRATION_CAP // 4096)]
    seconds, source = host_step_seconds(shapes, optimizer, dtype, cache, repeats)
    elements = sum(math.prod((s,) if isinstance(s, int) else s) for s in shapes)
    return HostRate(seconds / max(1, elements) * 1e9, 0.0, source)


def stepped_tensors(result: Any, elements: int) -> list[tuple[int, ...]] | None:
    """
    The shapes of the tensors the host steps in `result`'s plan: the model's parameters, LoRA's adapters
    with `lora_r`, this rank's shard of each under FSDP2. The model is built again on the meta device from the plan's
    config file or preset; `None` when it cannot be (a config given as a dict or object) or when the sizes do not add
    up to the `elements` the simulation kept on the host.
    """
    from transformers import AutoModelForCausalLM

    from ..estimate.models import resolve_config

    setup = result.setup
    try:
        config, _, _ = resolve_config(result.source or result.model)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - no sizes: the plan falls back to large tensors
        return None
    if setup.lora_r:
        targets = tuple(setup.lora_targets)
        shapes = [
            shape
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)
            for shape in ((setup.lora_r, module.in_features), (module.out_features, setup.lora_r))  # lora_A, lora_B
        ]
    else:
        shapes = [tuple(p.shape) for p in model.parameters()]
    # FSDP2 shards dim 0 and pads every rank's shard to the first rank's (`plan.ranks.RANK`).
    ranks = setup.shards if setup.sharding == "fsdp2" else 1
    shapes = [(-(-s[0] // ranks), *s[1:]) if s else (1,) for s in shapes]
    if not elements or abs(sum(math.prod(s) for s in shapes) - elements) > 0.02 * elements:
        return None
    return shapes


def _dtype_size(name: str) -> int:
    return torch.empty(0, dtype=getattr(torch, name)).element_size()


def plan_times(
    result: Any,
    host_step_rate: float | None = None,
    pcie_gbps: float = DEFAULT_PCIE_GBPS,
    device_tflops: float | None = None,
) -> dict[tuple[str, str], OffloadTime]:
    """
    `offload_time` for every offload row of a `Plan`, keyed by (optimizer, offload). The elements stepped are the
    host copies of the parameters the simulation kept (`host_categories["weights"]`, this rank's shards); the
    gradient bytes those of the trainable parameters in the weights' dtype. The host step is measured on the model's
    own tensor shapes (`stepped_tensors`, `host_step_seconds`); `host_step_rate` (ns per element) skips that.

    Example:

    ```python
    >>> from layerwise_hf.plan.offload_time import plan_times
    >>> times = plan_times(plan_result, pcie_gbps=25, device_tflops=400)  # doctest: +SKIP
    ```
    """
    setup = result.setup
    size = _dtype_size(setup.torch_dtype)
    rows = [r for r in result.rows if r.offload == "optimizer"]
    elements = max((r.host_categories.get("weights", 0) // size for r in rows), default=0)
    if not elements:  # no "optimizer" row: the trainable elements from a "gradients" row's buffers (GA 1: exact)
        grads = [r.host_categories.get("gradients", 0) for r in result.rows if r.offload == "gradients"]
        elements = min(grads, default=0) // size
    out = {}
    rates: dict[str, HostRate] = {}
    shapes: list[tuple[int, ...]] | None = None
    add_rate = 0.0
    if setup.grad_accum > 1 and any(row.offload != "none" for row in result.rows):
        add_rate = host_add_rate(getattr(torch, setup.torch_dtype))
    for row in result.rows:
        if row.offload == "none":
            continue
        if row.offload == "optimizer" and row.optimizer not in rates:
            if host_step_rate is not None:
                rates[row.optimizer] = HostRate(host_step_rate)
            else:
                if shapes is None:
                    shapes = stepped_tensors(result, elements) or []
                base = row.optimizer.removesuffix("_layerwise")
                rates[row.optimizer] = calibrate(base, getattr(torch, setup.torch_dtype), shapes)
                if not shapes:
                    rates[row.optimizer].source += ", tensor sizes unknown: large ones assumed"
        backward = None
        if device_tflops and row.backward_flops:
            backward = row.backward_flops / (device_tflops * 1e12)
        elif device_tflops:
            tokens = setup.seq_len * setup.micro_batch
            backward = backward_seconds(
                elements, tokens, device_tflops, setup.gradient_checkpointing, setup.grad_accum
            )  # fmt: skip
        waits = setup.grad_accum > 1 or setup.fp16 or (setup.max_grad_norm > 0 and setup.clip_mode == "exact")
        out[(row.optimizer, row.offload)] = offload_time(
            row.offload, elements=elements, tensors=len(shapes or ()), grad_bytes=elements * size,
            param_bytes=elements * size, rate=rates.get(row.optimizer, HostRate(0.0)), pcie_gbps=pcie_gbps,
            backward_s=backward, grad_accum=setup.grad_accum, gradients_wait=waits, add_ns_per_element=add_rate,
        )  # fmt: skip
    return out
