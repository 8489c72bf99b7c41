"""How fast each base steps on the host (`layerwise_offload="optimizer"`), against the host's memory floor; and, with
`--pace`, whether that keeps pace with a Llama layer's backward on this CPU (issue 19 item 6).
Launch, method and last results: benchmarks/README.md."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import logging
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as h  # noqa: E402
from layerwise_hf import LayerwiseTrainingArguments, build_layerwise_optimizer  # noqa: E402
from layerwise_hf.plan.offload_time import median_seconds, worker_seconds  # noqa: E402

BASES = (
    "adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop", "adamw_bnb_8bit", "adamw_8bit",
    "paged_adamw_32bit", "paged_adamw_8bit", "lion_32bit", "lion_8bit", "ademamix", "ademamix_8bit",
    "adamw_torch_8bit", "adamw_torch_4bit", "galore_adamw", "galore_adamw_8bit", "galore_adafactor",
    "apollo_adamw", "muon",
)  # fmt: skip
FLOOR_BASES = (
    "adamw_torch", "sgd", "adagrad", "rmsprop", "adafactor", "lion_32bit", "lion_8bit", "adamw_8bit", "ademamix",
    "ademamix_8bit", "adamw_torch_8bit", "adamw_torch_4bit", "galore_adamw", "apollo_adamw", "muon",
)  # fmt: skip
DOCS, MARKER = h.ROOT / "docs" / "offload.md", "host-step-floor"
SIZING_DOCS, SIZING_MARKER = h.ROOT / "docs" / "sizing.md", "step-time-8b"
SIZING_BASES = ("adamw_torch", "adamw_8bit", "adafactor")
SIZING_TFLOPS = 400.0  # achieved bf16 TFLOP/s of a current GPU (the offload guide's figure)
SIZE_CHECK = (4096, 65536, 262144, 2**20, 4 * 2**20, 16 * 2**20)  # elements: a small model's tensors to a large one's


def layer_model(hidden: int):
    """A one-layer Llama at `hidden` (MLP 2.75x, heads of 128 dimensions, vocab 64)."""
    heads = max(1, hidden // 128)
    return h.build_llama(seed=0, seq_len=2048, vocab_size=64, hidden_size=hidden, intermediate_size=int(hidden * 2.75),
                         num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads)  # fmt: skip


def q_proj_inner(base: str, model):
    """The inner optimizer `<base>_layerwise` builds (no offload) for the layer's q_proj weight, and that weight, given
    a gradient."""
    extra = {"optim_target_modules": ["attn", "mlp"]} if base.startswith(("galore", "apollo")) else {}
    args = LayerwiseTrainingArguments("/tmp/host_step_pace", optim=f"{base}_layerwise", learning_rate=1e-4, **extra)
    weight = model.model.layers[0].self_attn.q_proj.weight
    optimizer = build_layerwise_optimizer(model, args, offload="none")
    weight.grad = torch.randn_like(weight) * 1e-3
    return optimizer.inner[next(i for i, p in enumerate(optimizer.params) if p is weight)], weight


def backward_time(model, tokens: int, repeats: int) -> float:
    layer = model.model.layers[0]
    x = torch.randn(1, tokens, model.config.hidden_size)
    position_embeddings = model.model.rotary_emb(x, torch.arange(tokens)[None])

    def once():
        out = layer(x, position_embeddings=position_embeddings, attention_mask=None)
        loss = (out[0] if isinstance(out, tuple) else out).float().pow(2).mean()
        start = time.perf_counter()
        loss.backward()
        elapsed = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return elapsed

    once()
    return statistics.median(once() for _ in range(repeats))


def pace_main(opts) -> dict:
    """Host step vs one Llama layer's backward (`--pace`; `SLOW_ON_HOST` reads its JSON)."""
    if opts.small:
        opts.hidden, opts.tokens, opts.repeats = 256, 64, 2
    model = layer_model(opts.hidden)
    layer_numel = sum(p.numel() for p in model.model.layers[0].parameters())
    backward = backward_time(model, opts.tokens, opts.repeats)
    rows = []
    for base in opts.bases or BASES:
        row = {"base": base}
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                seconds = median_seconds(q_proj_inner(base, model)[0].step, opts.repeats)
            layer_step = seconds * layer_numel / opts.hidden**2
            row |= {"tensor_step_s": seconds, "layer_step_s": layer_step, "ratio": layer_step / backward}
        except Exception as error:  # noqa: BLE001 - a base that cannot step on the CPU is a result here
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        model.zero_grad(set_to_none=True)
        rows.append(row)
    result = {
        "hidden": opts.hidden, "tokens": opts.tokens, "repeats": opts.repeats, "threads": torch.get_num_threads(),
        "layer_params": layer_numel, "tensor": [opts.hidden, opts.hidden], "layer_backward_s": backward, "rows": rows,
    }  # fmt: skip
    ms = lambda key: lambda r: f"{r[key] * 1e3:.1f}" if key in r else "-"  # noqa: E731
    h.print_rows(rows, [
        ("base", 20, lambda r: r["base"]), ("step/tensor ms", 14, ms("tensor_step_s")),
        ("step/layer ms", 14, ms("layer_step_s")),
        ("ratio", 7, lambda r: f"{r['ratio']:.2f}" if "ratio" in r else "-"),
        (" keeps pace", 0, lambda r: f" cannot step on the CPU: {r['error']}" if "error" in r
         else " yes" if r["ratio"] <= 1 else " no", "<"),
    ], f"Llama layer, hidden {opts.hidden} ({layer_numel / 1e6:.1f}M params), 1 x {opts.tokens} tokens, "
       f"{result['threads']} threads: backward {backward * 1e3:.1f} ms (median of {opts.repeats})")  # fmt: skip
    h.write_report(opts.output_dir, "host_step_pace", result)
    return result


def _once(fn) -> tuple[float, float]:
    """`fn()`'s wall time and the calling thread's CPU time."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def floor_rows(base: str, model, repeats: int, all_threads: int) -> list[dict]:
    """Each kernel x thread count of `base`'s step on the layer's q_proj weight, against the floor of its bytes."""
    from layerwise_hf.placement.host_kernel import host_kernel_flags

    inner, weight = q_proj_inner(base, model)
    built = {k: inner.param_groups[0].get(k) for k in ("fused", "foreach")}
    fast = host_kernel_flags(inner, torch.device("cuda"), "fast")  # what the host step of an accelerator model runs
    kernels = [("exact", built), ("fast", fast)] if fast else [("as built", {})]
    a, b = weight.detach().clone(), weight.grad.clone()
    rows = []
    try:
        for kernel, flags in kernels:
            inner.param_groups[0].update(flags)
            for threads in sorted({1, all_threads}):
                torch.set_num_threads(threads)
                # NOTE: step and floor alternate, and the ratio is the median of each pair's: on a shared machine
                # the load moves between two separate medians.
                pairs = []
                with contextlib.redirect_stdout(io.StringIO()):
                    inner.step()
                    a.add_(b, alpha=0.0)
                    for _ in range(1 if base == "muon" else repeats):
                        pairs.append((_once(inner.step), _once(lambda: a.add_(b, alpha=0.0))))  # add: 3 x weight
                state = inner.state[weight].values()
                moved = 2 * (h.nbytes(weight) + sum(h.nbytes(v) for v in state if torch.is_tensor(v)))
                moved += h.nbytes(weight.grad)
                scale = moved / (3 * h.nbytes(a))
                # NOTE: on one thread the thread's CPU time: on a shared machine the wall clock also holds other
                # processes' time slices, which fall unevenly on the step and the add it is compared with.
                clock = 1 if threads == 1 else 0
                seconds = statistics.median(st[clock] for st, _ in pairs)
                floor = statistics.median(ad[clock] for _, ad in pairs) * scale
                n = weight.numel()
                rows.append({
                    "base": base, "kernel": kernel, "dtype": str(weight.dtype).removeprefix("torch."),
                    "threads": threads, "clock": "cpu" if clock else "wall", "ns_per_element": seconds / n * 1e9,
                    "floor_ns_per_element": floor / n * 1e9, "bytes_per_element": moved / n,
                    "x_floor": statistics.median(st[clock] / (ad[clock] * scale) for st, ad in pairs),
                    "x_floor_wall": statistics.median(st[0] / (ad[0] * scale) for st, ad in pairs),
                })  # fmt: skip
    finally:
        weight.grad = None
        torch.set_num_threads(all_threads)
    return rows


def task_overhead(repeats: int = 200) -> dict:
    """A host worker task's round trip against the fused AdamW step of a small (4096-element) parameter."""
    from layerwise_hf.placement.offload import HostWorker

    torch.set_num_threads(1)
    worker = HostWorker()
    worker.submit(lambda: None).result()
    start = time.perf_counter()
    for _ in range(repeats):
        worker.submit(lambda: None).result()
    task = (time.perf_counter() - start) / repeats
    worker.close()
    small = torch.nn.Parameter(torch.randn(4096))
    small.grad = torch.randn(4096)
    step = median_seconds(torch.optim.AdamW([small], fused=True).step, repeats)
    # Tasks queued back to back, as backward queues the host steps: the worker's cost per task without the wake-ups.
    worker = HostWorker()
    queued = worker_seconds(worker, [lambda: None] * repeats, 2, 3) / repeats
    worker.close()
    return {"task_us": task * 1e6, "queued_task_us": queued * 1e6, "small_step_us": step * 1e6}


def _adamw_parts(numel: int, repeats: int) -> tuple[dict, torch.optim.Optimizer]:
    weight = torch.nn.Parameter(torch.randn(numel) * 0.02)
    weight.grad = torch.randn(numel) * 1e-3
    optimizer = torch.optim.AdamW([weight], fused=True, foreach=False, weight_decay=0.01)
    optimizer.step()
    state = optimizer.state[weight]
    p, g, m, v = weight.detach(), weight.grad, state["exp_avg"], state["exp_avg_sq"]
    kernel_args = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
    fns = {
        "step": optimizer.step,
        "kernel": lambda: torch._fused_adamw_([p], [g], [m], [v], [], [state["step"]], **kernel_args),
        "add": lambda: p.add_(g, alpha=0.0),
        "three_adds": lambda: (p.add_(g, alpha=0.0), m.add_(g, alpha=0.0), v.add_(g, alpha=0.0)),
    }
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):  # interleaved: a change of load falls on all four alike
        for k, fn in fns.items():
            times[k].append(_once(fn)[1])
    seconds = {k: statistics.median(t) for k, t in times.items()}
    out = {f"{k}_ns_per_element": t / numel * 1e9 for k, t in seconds.items()}
    out["python_us_per_tensor"] = (seconds["step"] - seconds["kernel"]) * 1e6
    out["step_x_floor"] = seconds["step"] / (seconds["add"] * 28 / 12)
    out["step_x_three_adds"] = seconds["step"] / seconds["three_adds"]
    return out, optimizer


def adamw_breakdown(hidden: int, repeats: int) -> dict:
    """Where fused AdamW's host step goes on one thread (CPU time, medians): `optimizer.step()` against the fused
    kernel called alone (the rest is the optimizer's Python, per tensor), against the add floor scaled to AdamW's 28
    bytes and against three in-place adds that stream the same tensors (weight, both states; the gradient read three
    times: 36 bytes); and the ops one step dispatches (an allocating op would be a temporary)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    out = {}
    for numel in (4096, hidden * hidden):
        out[numel], optimizer = _adamw_parts(numel, repeats)
    with Ops():
        optimizer.step()
    return {"elements": out, "ops_of_one_step": [op for op in seen if not op.startswith("profiler.")]}


def fast_vs_exact(steps: int = 100) -> dict:
    """AdamW through the real host step, `fast` against `exact`, after `steps` steps of a tiny Llama (hidden 64)."""
    from layerwise_hf.placement.offloading import wait_for_host_steps

    os.environ.setdefault("LAYERWISE_HF_OFFLOAD_SIMULATE", "1")
    weights = {}
    for mode in ("fast", "exact"):
        model = h.build_llama(seed=0, seq_len=2048, vocab_size=64, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        args = LayerwiseTrainingArguments(
            "/tmp/host_step_pace", optim="adamw_torch_layerwise", learning_rate=1e-3, max_grad_norm=0.0,
            layerwise_offload="optimizer", layerwise_host_step=mode,
        )  # fmt: skip
        optimizer = build_layerwise_optimizer(model, args)
        optimizer.attach()
        generator = torch.Generator().manual_seed(0)
        for _ in range(steps):
            ids = torch.randint(0, 64, (4, 16), generator=generator)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        wait_for_host_steps(optimizer)
        weights[mode] = [p.detach().clone() for p in model.parameters()]
    pairs = list(zip(weights["fast"], weights["exact"]))
    per_tensor = max(((f - e).abs().max() / e.abs().max()).item() for f, e in pairs)
    return {"steps": steps, "max_rel_diff_per_tensor": per_tensor,
            "identical_tensors": sum(torch.equal(f, e) for f, e in pairs), "tensors": len(pairs)}  # fmt: skip


def floor_table(result: dict) -> str:
    threads = sorted({r["threads"] for r in result["rows"]})
    cols = [(d, t) for d in ("float32", "bfloat16") for t in threads]
    head = " | ".join(f"{'fp32' if d == 'float32' else 'bf16'}, {t} thread{'s' * (t > 1)}" for d, t in cols)
    lines = [f"| base | kernel | bytes / element (fp32) | {head} |", "|---|---|---|" + "---|" * len(cols)]
    keyed = {(r["base"], r["kernel"], r["dtype"], r["threads"]): r for r in result["rows"]}
    for base, kernel in dict.fromkeys((r["base"], r["kernel"]) for r in result["rows"]):
        fp32 = keyed.get((base, kernel, "float32", threads[0]))
        cells = [f"{fp32['bytes_per_element']:.0f}" if fp32 else "-"]
        for d, t in cols:
            r = keyed.get((base, kernel, d, t))
            cells.append(f"{r['ns_per_element']:.2f} ns ({r['x_floor']:.2f}x)" if r else "-")
        lines.append(f"| `{base}` | {kernel} | " + " | ".join(cells) + " |")
    for base, error in result["errors"].items():
        cells = [f"cannot step here: {error}"] + ["-"] * (len(cols) - 1)
        lines.append(f"| `{base}` | - | - | " + " | ".join(cells) + " |")
    o, c, parts = result["task_overhead"], result["fast_vs_exact"], result["adamw_breakdown"]["elements"]
    big, small = parts[max(parts, key=int)], parts[min(parts, key=int)]
    load = result.get("load_average_1min", [float("nan")] * 2)
    wall = [f"`{r['base']}` {r['x_floor']:.2f}x / {r['x_floor_wall']:.2f}x" for r in result["rows"]
            if (r["kernel"], r["threads"], r["dtype"]) == ("fast", 1, "float32") and "x_floor_wall" in r]  # fmt: skip
    lines += [
        "",
        f"A {result['hidden']} x {result['hidden']} fp32 weight ({result['elements'] / 1e6:.1f}M elements), median of "
        f"{result['repeats']} steps after a warm-up (Muon: 1), {result['machine']}, load {load[0]:.1f} -> "
        f"{load[1]:.1f}; 1-thread columns in the thread's CPU time, the others in wall time (fast, fp32, 1 thread, "
        f"CPU / wall time over the floor in the same steps: {', '.join(wall)}). ns per element of one step, and "
        "(x) that over the floor: the step's bytes (weight and states read and written, gradient read) at the "
        "bandwidth `a.add_(b)` reaches on the same tensors in the same run. `fast` is `layerwise_host_step=\"fast\"` "
        "(the default for a model on an accelerator), `exact` torch's per-tensor loop as Trainer builds it. A host "
        f"worker task costs {o['task_us']:.0f} us ({o['queued_task_us']:.0f} us queued behind others), a fused AdamW "
        f"step of a 4096-element parameter {o['small_step_us']:.0f} us. Fused AdamW on one thread: "
        f"`optimizer.step()` {big['step_ns_per_element']:.2f} ns per element, the kernel alone "
        f"{big['kernel_ns_per_element']:.2f}, three in-place adds over the same tensors "
        f"{big['three_adds_ns_per_element']:.2f} ({big['step_x_three_adds']:.2f}x); the optimizer's Python costs "
        f"{small['python_us_per_tensor']:.0f} us per tensor, and a step allocates nothing (it dispatches "
        f"{', '.join(result['adamw_breakdown']['ops_of_one_step'])}). fast vs exact AdamW after {c['steps']} steps "
        "of a tiny Llama through the host step: max |fast - exact| "
        f"/ max |exact| per tensor {c['max_rel_diff_per_tensor']:.1e}, {c['identical_tensors']} of {c['tensors']} "
        "tensors bit-identical. Generated by `python benchmarks/host_step_pace.py`.",
    ]  # fmt: skip
    return "\n".join(lines)


def write_docs(table: str, docs: Path = DOCS, marker: str = MARKER) -> None:
    text = docs.read_text()
    pattern = re.compile(rf"<!-- {marker}:start -->\n.*?(?=<!-- {marker}:end -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{docs.name} has no <!-- {marker}:start --> / <!-- {marker}:end --> markers")
    docs.write_text(pattern.sub(lambda m: f"<!-- {marker}:start -->\n{table}\n", text))


def floor_main(opts) -> dict:
    """The floor table (default): each base's step on a `--hidden` square weight, fp32 and bf16, 1 and all threads."""
    bases = opts.bases or (["adamw_torch", "adafactor"] if opts.small else FLOOR_BASES)
    if opts.small:
        opts.hidden, opts.repeats = 256, 2
    all_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(all_threads)
    started, load = time.perf_counter(), os.getloadavg()[0]
    machine = f"{platform.machine()}, {all_threads} threads, torch {torch.__version__}"
    result = {"hidden": opts.hidden, "elements": opts.hidden**2, "repeats": opts.repeats, "threads": all_threads,
              "machine": machine, "rows": [], "errors": {}}  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        model = layer_model(opts.hidden).to(dtype)
        for base in bases:
            try:
                result["rows"] += floor_rows(base, model, opts.repeats, all_threads)
            except Exception as error:  # noqa: BLE001 - a base that cannot step on the CPU is a result here
                if dtype is torch.float32:
                    result["errors"][base] = f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
        del model
    result["task_overhead"] = task_overhead()
    result["adamw_breakdown"] = adamw_breakdown(opts.hidden, max(opts.repeats, 7))
    result["fast_vs_exact"] = fast_vs_exact(20 if opts.small else 100)
    result["load_average_1min"] = [load, os.getloadavg()[0]]
    result["seconds"] = time.perf_counter() - started
    table = floor_table(result)
    print(f"{table}\n({result['seconds']:.0f} s)")
    h.write_report(opts.output_dir, "host_step_floor" + "_small" * opts.small, result)
    if not opts.no_docs and not opts.small:
        write_docs(table)
    return result


def _check_config(hidden: int) -> dict:
    return {"model_type": "llama", "vocab_size": 1024, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}  # fmt: skip


def _real_host_step(hidden: int, threads: int):
    """A tiny Llama's host step with `layerwise_offload="optimizer"` and fused AdamW: every parameter's base step a
    task on a host worker, as the host steps them during backward (the copies aside: a GPU's DMA moves those).
    Returns its elements, tensors and a function of `repeats` giving its median seconds (`worker_seconds`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from layerwise_hf.placement.host_kernel import claim_thread_share
    from layerwise_hf.placement.offload import HostWorker
    from layerwise_hf.placement.offloading import wait_for_host_steps

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**_check_config(hidden)))
    with tempfile.TemporaryDirectory() as out:
        args = LayerwiseTrainingArguments(out, optim="adamw_torch_layerwise", layerwise_offload="optimizer",
                                          report_to="none", use_cpu=True)  # fmt: skip
        optimizer = build_layerwise_optimizer(model, args)
    optimizer.attach()
    ids = torch.randint(0, 1024, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    wait_for_host_steps(optimizer)  # states exist, the fused kernel is set on each host base
    optimizer.detach()

    def one(inner):
        claim_thread_share(threads)
        inner.host.grad = inner.host_grad
        inner.base.step()
        inner.host.grad = None

    tasks = [functools.partial(one, inner) for inner in reversed(optimizer.inner)]  # backward's order

    def measure(repeats: int) -> float:
        worker = HostWorker()
        try:
            return worker_seconds(worker, tasks, threads, repeats)
        finally:
            worker.close()

    return sum(p.numel() for p in model.parameters()), len(optimizer.inner), measure


def plan_check(opts) -> dict:
    """The plan's host-step seconds (`layerwise-hf plan --offload optimizer`: `plan_times`, calibrated on the model's
    own tensor shapes) against the real host step of three tiny Llamas with fused AdamW, and beside them a line through
    two sizes (a fixed cost per tensor from a 1-element step, a rate per element from a 1M-element one: the previous
    calibration). Each round calibrates afresh and measures the real step right after; the medians over rounds are
    printed, the ratios as the median of each round's."""
    from layerwise_hf.placement import host_kernel
    from layerwise_hf.plan import plan
    from layerwise_hf.plan.offload_time import _pool_seconds, plan_times

    os.environ.setdefault("LAYERWISE_HF_OFFLOAD_SIMULATE", "1")
    host_kernel.device_is_accelerator = lambda device: True  # the fast kernel, as for a model on a GPU
    threads = host_kernel.host_threads()
    torch.set_num_threads(threads)
    sizes, load = (256, 512, 768), [os.getloadavg()[0]]
    samples: dict[int, list[dict]] = {n: [] for n in sizes}
    by_size: dict[int, list[dict]] = {n: [] for n in SIZE_CHECK}
    with tempfile.TemporaryDirectory() as tmp:
        plans, reals = {}, {}
        for hidden in sizes:
            path = Path(tmp) / f"hidden{hidden}" / "config.json"  # plan_times builds the model again from it
            path.parent.mkdir()
            path.write_text(json.dumps(_check_config(hidden)))
            plans[hidden] = plan(str(path), ["adamw_torch_layerwise"], seq_len=16, offload="optimizer",
                                 counterparts=False)  # fmt: skip
            reals[hidden] = _real_host_step(hidden, threads)
        for round_ in range(opts.rounds):
            # NOTE: a fresh cache each round: the plan measures under the load the real step then runs under.
            os.environ["XDG_CACHE_HOME"] = str(Path(tmp) / f"cache{round_}")
            fixed = _pool_seconds("adamw_torch", torch.float32, (1,), 1, threads, 50)
            million = _pool_seconds("adamw_torch", torch.float32, (1024, 1024), 1, threads, opts.repeats)
            per_element = (million - fixed) / 2**20
            for numel in SIZE_CHECK:  # one tensor alone, against the line's figure for it
                one = _pool_seconds("adamw_torch", torch.float32, (numel,), 1, threads, opts.repeats)
                by_size[numel].append({"measured_s": one, "line_s": fixed + numel * per_element})
            for hidden in sizes:
                timed = plan_times(plans[hidden])[("adamw_torch_layerwise", "optimizer")]
                elements, tensors, measure = reals[hidden]
                samples[hidden].append({"elements": elements, "tensors": tensors, "planned_elements":
                                        timed.host_elements, "planned_tensors": timed.host_tensors, "real_s":
                                        measure(opts.repeats), "planned_s": timed.host_step_s, "line_s": tensors *
                                        fixed + elements * per_element, "line_us_per_tensor": fixed * 1e6,
                                        "line_ns_per_element": per_element * 1e9})  # fmt: skip
    load.append(os.getloadavg()[0])
    med = statistics.median
    counts = ("elements", "tensors", "planned_elements", "planned_tensors")
    rows = [{"hidden": hidden, **{k: runs[0][k] for k in counts},
             "real_s": med(r["real_s"] for r in runs), "planned_s": med(r["planned_s"] for r in runs),
             "planned_over_real": med(r["planned_s"] / r["real_s"] for r in runs),
             "two_size_line_s": med(r["line_s"] for r in runs),
             "two_size_line_over_real": med(r["line_s"] / r["real_s"] for r in runs), "rounds": runs}
            for hidden, runs in samples.items()]  # fmt: skip
    singles = [{"elements": numel, "measured_s": med(r["measured_s"] for r in runs),
                "line_over_measured": med(r["line_s"] / r["measured_s"] for r in runs)}
               for numel, runs in by_size.items()]  # fmt: skip
    clock = "CPU" if threads == 1 else "wall"

    def spread(key):  # a ratio's range over the rounds
        return lambda r: "{:.2f}-{:.2f}".format(*(f(x[key] / x["real_s"] for x in r["rounds"]) for f in (min, max)))

    h.print_rows(rows, [
        ("hidden", 6, lambda r: r["hidden"], ">"), ("elements", 10, lambda r: r["elements"]),
        ("tensors", 7, lambda r: r["tensors"]), ("real ms", 8, lambda r: f"{r['real_s'] * 1e3:.2f}"),
        ("plan ms", 8, lambda r: f"{r['planned_s'] * 1e3:.2f}"),
        ("plan/real", 9, lambda r: f"{r['planned_over_real']:.2f}"),
        ("(rounds)", 11, spread("planned_s")), ("2-size line ms", 14, lambda r: f"{r['two_size_line_s'] * 1e3:.2f}"),
        ("line/real", 9, lambda r: f"{r['two_size_line_over_real']:.2f}"), ("(rounds)", 11, spread("line_s")),
    ], f"Host step of a tiny Llama (2 layers, vocab 1024, fused AdamW, {threads} host thread(s), load "
       f"{load[0]:.2f} -> {load[1]:.2f} on {os.cpu_count()} cores): the host worker's {clock} time, median of "
       f"{opts.repeats} passes, median of {opts.rounds} rounds; goal: planned / real within 0.8-1.2")  # fmt: skip
    first = rows[0]["rounds"]
    print(f"2-size line: {med(r['line_us_per_tensor'] for r in first):.1f} us per tensor + "
          f"{med(r['line_ns_per_element'] for r in first):.2f} ns per element (medians)")  # fmt: skip
    h.print_rows(singles, [
        ("elements", 10, lambda s: s["elements"], ">"), ("measured ms", 11, lambda s: f"{s['measured_s'] * 1e3:.3f}"),
        ("ns / element", 12, lambda s: f"{s['measured_s'] / s['elements'] * 1e9:.2f}"),
        ("line / measured", 15, lambda s: f"{s['line_over_measured']:.2f}"),
    ], "One tensor alone:")  # fmt: skip
    result = {"threads": threads, "clock": clock, "load_average_1min": load, "cores": os.cpu_count(),
              "repeats": opts.repeats, "rounds": opts.rounds, "rows": rows, "one_tensor": singles}  # fmt: skip
    h.write_report(opts.output_dir, "host_step_plan_check", result)
    return result


def sizing_main(opts) -> dict:
    """The step-time columns of docs/sizing.md's 24 GiB table (`--sizing`): Llama-3-8B as that table plans it, each
    layer-wise row without offload and with `"optimizer"`, timed by the plan (`plan_times`: the host step measured
    here on the model's tensor sizes, PCIe at 25 GB/s, backward at `SIZING_TFLOPS`)."""
    from layerwise_hf.placement.host_kernel import host_threads
    from layerwise_hf.plan import plan
    from layerwise_hf.plan.offload_time import _cpu_name, plan_times

    started = time.perf_counter()
    names = [f"{base}_layerwise" for base in SIZING_BASES]
    result = plan("llama-3-8b", names, seq_len=4096, bf16=True, torch_dtype="bfloat16", gradient_checkpointing=True,
                  device_memory="24GiB", offload=("none", "optimizer"), counterparts=False)  # fmt: skip
    times = plan_times(result, device_tflops=SIZING_TFLOPS)
    rows = [{"optimizer": row.optimizer, "offload": row.offload, "device_peak_bytes": row.peak_bytes,
             "fits": row.fits, "headroom_bytes": row.headroom_bytes, "host_peak_bytes": row.host_peak_bytes,
             "offload_time": timed.to_dict() if (timed := times.get((row.optimizer, row.offload))) else None}
            for row in result.rows]  # fmt: skip
    # The backward's FLOPs as the simulated step counted them (the same for every row: one model, one batch).
    backward = max(row.backward_flops for row in result.rows) / (SIZING_TFLOPS * 1e12)
    out = {"model": "llama-3-8b", "device_tflops": SIZING_TFLOPS, "pcie_gbps": 25.0, "host_threads": host_threads(),
           "cpu": _cpu_name(), "cores": os.cpu_count(), "load_average_1min": os.getloadavg()[0],
           "backward_s": backward, "seconds": time.perf_counter() - started, "rows": rows}  # fmt: skip
    table = sizing_table(out)
    print(table)
    h.write_report(opts.output_dir, "host_step_sizing", out)
    if not opts.no_docs:
        write_docs(table, SIZING_DOCS, SIZING_MARKER)
    return out


def sizing_table(out: dict) -> str:
    gib = 2**30
    lines = [
        "| optimizer | `layerwise_offload` | device peak | fits 24 GiB | host step (here) | PCIe out / in per step | "
        "backward | sets the pace |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        fits = f"yes ({r['headroom_bytes'] / gib:.2f} GiB left)" if r["fits"] else "no"
        t = r["offload_time"]
        if t is None:
            host, link, pace = "-", "-", "backward (no host step)"
        else:
            host = f"{t['host_step_s']:.1f} s ({t['rate']['ns_per_element']:.2f} ns / element)"
            link = f"{t['copy_out_s']:.2f} / {t['copy_in_s']:.2f} s"
            pace = t["bottleneck"]
        lines.append(f"| `{r['optimizer']}` | {r['offload']} | {r['device_peak_bytes'] / gib:.2f} GiB | {fits} | "
                     f"{host} | {link} | {out['backward_s']:.2f} s | {pace} |")  # fmt: skip
    lines += [
        "",
        f"Host step: measured by the plan on this machine ({out['cpu']}, {out['host_threads']} host thread(s) of "
        f"{out['cores']} cores, load {out['load_average_1min']:.1f}) on the model's own tensor shapes, with the "
        f"kernel of `layerwise_host_step=\"fast\"`; PCIe at {out['pcie_gbps']:g} GB/s one way; backward at "
        f"{out['device_tflops']:g} TFLOP/s achieved (its FLOPs counted on the simulated step, the recompute of "
        "activation checkpointing included). "
        "Generated by `python benchmarks/host_step_pace.py --sizing` "
        f"({out['seconds']:.0f} s), which runs `layerwise-hf plan llama-3-8b --seq-len 4096 --bf16 --torch-dtype "
        "bfloat16 --gradient-checkpointing --optim adamw_torch_layerwise adamw_8bit_layerwise adafactor_layerwise "
        f"--offload none optimizer --device-memory 24GiB --device-tflops {out['device_tflops']:g}`.",
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=512, help="--pace: tokens of the layer's micro-batch")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--bases", nargs="*", default=None)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--pace", action="store_true", help="host step vs a layer's backward (host_step_pace.json)")
    parser.add_argument("--no-docs", action="store_true", help="write no docs/offload.md, docs/sizing.md")
    parser.add_argument("--output_dir", default=str(h.RESULTS))
    parser.add_argument("--plan-check", action="store_true", help="the plan's host seconds against a real host step")
    parser.add_argument("--rounds", type=int, default=5, help="--plan-check: calibrate-and-measure rounds")
    parser.add_argument("--sizing", action="store_true", help="docs/sizing.md's step-time table (Llama-3-8B, 24 GiB)")
    opts = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    return (sizing_main if opts.sizing else plan_check if opts.plan_check else pace_main if opts.pace else floor_main)(
        opts
    )


if __name__ == "__main__":
    main()
