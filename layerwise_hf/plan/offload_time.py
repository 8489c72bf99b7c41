"""How long host offload takes per step (`layerwise-hf plan --offload`): the host step, the PCIe copies, and whether
they hide behind backward.

For each offload row:

- **host seconds**: with `"optimizer"` the host steps every trainable element once per step. Its time is the elements
  stepped (this rank's shards) times the per-element rate, plus a fixed cost per tensor (the optimizer's Python step
  and one host worker task). Both are measured on the machine running the plan (`calibrate`: one `step()` of the
  base the plugin builds, with the kernel the host step of an accelerator model runs, `layerwise_host_step="fast"`,
  and the host worker's share of the cores; about a second, cached), or given (`--host-step-rate`, ns per element).
- **PCIe**: the bytes each way per step. `"optimizer"`: each final gradient out (every micro-batch's under gradient
  accumulation), each updated parameter back. `"gradients"`: each gradient that waits for the step out (every
  micro-batch's, or at GA 1 every one under exact clipping or fp16), and back once for the step. At `--pcie-gbps`,
  25 GB/s by default: what a pinned, non-blocking copy reaches on PCIe 4.0 x16 one way (~80% of its nominal 31.5 GB/s;
  `layerwise_hf.estimate.offload_choice.PCIE4_BYTES_PER_S`).
- **backward**: with `--device-tflops`, the device's backward time from the rule backward = 2 x forward = 4 x
  parameters x tokens FLOPs (6 x with activation checkpointing, which recomputes the forward), at that many TFLOP/s
  achieved. It is a rule, not counted on the simulation's fake tensors. Without it the plan does not say whether the
  host step hides.

The host step and the copies out run during backward; the copies back finish before the next forward. The slowest of
host step, copies and backward sets the pace, and the advice names it.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_PCIE_GBPS = 25.0  # PCIe 4.0 x16, one way, pinned (layerwise_hf.estimate.offload_choice.PCIE4_BYTES_PER_S)
CALIBRATION_ELEMENTS = 1024 * 1024


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        parts = []
        if self.offload == "optimizer":
            parts.append(
                f"host step {self.host_step_s:.2f} s ({self.host_elements / 1e6:.0f}M elements at "
                f"{self.rate.ns_per_element:.2f} ns, {self.rate.source})"
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
    """
    host_s, out, back = 0.0, 0, 0
    if offload == "optimizer":
        host_s = elements * rate.ns_per_element * 1e-9 + tensors * rate.us_per_tensor * 1e-6
        out, back = grad_bytes * grad_accum, param_bytes
    elif offload == "gradients" and (grad_accum > 1 or gradients_wait):
        out, back = grad_bytes * grad_accum, grad_bytes
    link = pcie_gbps * 1e9
    out_s, in_s = out / link, back / link
    pace = {"backward": backward_s or 0.0, "host step": host_s, "PCIe": max(out_s, in_s)}
    bottleneck = max(pace, key=pace.get) if backward_s is not None else "unknown"
    return OffloadTime(
        offload, elements if offload == "optimizer" else 0, host_s, out, back, out_s, in_s, pcie_gbps, backward_s,
        bottleneck, rate,
    )  # fmt: skip


def backward_seconds(
    params: int, tokens: int, device_tflops: float, gradient_checkpointing: bool = False, grad_accum: int = 1
) -> float:
    """The device's backward per step from the rule 4 x parameters x tokens FLOPs (6 x with activation
    checkpointing) at `device_tflops` achieved; `tokens` per micro-batch."""
    flops = (6 if gradient_checkpointing else 4) * params * tokens * grad_accum
    return flops / (device_tflops * 1e12)


# ---- calibration ----


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "layerwise_hf" / "host_step_rate.json"


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


def _build_inner(optimizer: str, weight: torch.nn.Parameter) -> torch.optim.Optimizer:
    """The optimizer the plugin builds for `weight` as a hidden layer's projection (`optimizer`: a Trainer name or
    its layer-wise form)."""
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
    return factory(LayerwiseParam("self_attn.q_proj.weight", weight, 0.0), args)


def calibrate(
    optimizer: str = "adamw_torch", dtype: torch.dtype = torch.float32, cache: bool = True, repeats: int = 3
) -> HostRate:
    """
    Measure the host step's rate on this machine: `optimizer`'s step of a 1024 x 1024 weight of `dtype` with the
    kernel a model on an accelerator steps with (`layerwise_host_step="fast"`) and the host worker's threads
    (`host_threads`), and the fixed cost of one tensor's step and host task (a 1-element weight). Cached by
    optimizer, dtype, threads, torch version and CPU.

    Example:

    ```python
    >>> from layerwise_hf.plan.offload_time import calibrate
    >>> calibrate("adamw_torch").ns_per_element  # e.g. 0.9
    ```
    """
    from ..placement.host_kernel import host_kernel_flags, host_threads
    from ..placement.offload import HostWorker

    threads = host_threads()
    key = f"{optimizer}|{str(dtype).removeprefix('torch.')}|{threads}|{torch.__version__}|{_cpu_name()}"
    path = _cache_path()
    known = {}
    if cache and path.exists():
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        if key in known:
            return HostRate(known[key]["ns_per_element"], known[key]["us_per_tensor"], "cached")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    worker = HostWorker()
    try:
        costs = []
        for numel in (CALIBRATION_ELEMENTS, 1):
            side = 1024 if numel > 1 else 1
            weight = torch.nn.Parameter(torch.randn(side, side, dtype=dtype) * 0.02)
            weight.grad = torch.randn_like(weight) * 1e-3
            inner = _build_inner(optimizer, weight)
            inner.param_groups[0].update(host_kernel_flags(inner, torch.device("cuda"), "fast"))
            step = (lambda inner=inner: worker.submit(inner.step).result()) if numel == 1 else inner.step
            costs.append(median_seconds(step, repeats if numel > 1 else 50))
    finally:
        worker.close()
        torch.set_num_threads(previous)
    per_tensor = costs[1]
    rate = HostRate(max(costs[0] - per_tensor, 0.0) / CALIBRATION_ELEMENTS * 1e9, per_tensor * 1e6, "measured")
    if cache:
        known[key] = {"ns_per_element": rate.ns_per_element, "us_per_tensor": rate.us_per_tensor}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(known, indent=2) + "\n")
        except OSError:
            pass
    return rate


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
    gradient bytes those of the trainable parameters in the weights' dtype. `host_step_rate` (ns per element) skips
    the calibration.

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
    backward = None
    if device_tflops:
        tokens = setup.seq_len * setup.micro_batch
        backward = backward_seconds(elements, tokens, device_tflops, setup.gradient_checkpointing, setup.grad_accum)
    out = {}
    rates: dict[str, HostRate] = {}
    for row in result.rows:
        if row.offload == "none":
            continue
        if row.offload == "optimizer" and row.optimizer not in rates:
            base = row.optimizer.removesuffix("_layerwise")
            rates[row.optimizer] = (
                HostRate(host_step_rate)
                if host_step_rate is not None
                else calibrate(base, getattr(torch, setup.torch_dtype))
            )
        waits = setup.grad_accum > 1 or setup.fp16 or (setup.max_grad_norm > 0 and setup.clip_mode == "exact")
        out[(row.optimizer, row.offload)] = offload_time(
            row.offload, elements=elements, tensors=0, grad_bytes=elements * size, param_bytes=elements * size,
            rate=rates.get(row.optimizer, HostRate(0.0)), pcie_gbps=pcie_gbps, backward_s=backward,
            grad_accum=setup.grad_accum, gradients_wait=waits,
        )  # fmt: skip
    return out
