"""`layerwise-hf plan`: the argument parser and the run; the numbers come from `plan()`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from ..estimate.mesh import Mesh, add_mesh_arguments, mesh_of
from ..estimate.models import list_presets
from ..estimate.optimizers import known_names
from ..estimate.units import DTYPE_BYTES, EstimateError, format_bytes

if TYPE_CHECKING:
    from .core import Plan, PlanRow

from .options import CLIP_MODES, DEVICES, OFFLOAD_MODES

JSON_SCHEMA = """--json prints one object:
  model, source          the model's name and where its dimensions come from
  world_size, sharding   the run's ranks and sharding (none, ddp, fsdp2); every figure is per rank
  mesh                   nodes, gpus_per_node (as given, or null), dp_replicate, dp_shard, tp (dp_replicate x
                         dp_shard x tp = world_size under fsdp2), launch (the DistributedConfig / ParallelismConfig
                         that builds it)
  rank                   the simulated rank (null on one process)
  setup                  seq_len, micro_batch, grad_accum, max_grad_norm, clip_mode, bf16, fp16, torch_dtype,
                         gradient_checkpointing, lora_r, lora_targets, weight_decay, learning_rate, device,
                         world_size, sharding, sync_each_batch, dp_replicate, tp (HSDP replicas, tensor parallel)
  device_memory          bytes, or null
  host_memory            bytes (--host-memory), or null
  offload                the offload modes planned for the layer-wise rows (--offload), e.g. ["none"]
  extrapolated_layers    true when 2-4 decoder layers were simulated and extended (exactly)
  seconds                time the simulation took
  optimizers             one object per optimizer and offload mode:
    optimizer                   the Trainer name
    offload                     its layerwise_offload: none, gradients or optimizer (standard rows: none)
    peak_bytes                  the most device bytes alive at once in a steady-state step
    categories                  {weights, gradients, optimizer_state, activations, temporaries}: device bytes at
                                that peak
    when                        where in the step the peak falls
    optimizer_state_from_rule   true: state from the estimator's rules (kernels that cannot run on fake tensors)
    fits, headroom_bytes        with --device-memory: peak_bytes <= device memory, and device memory - peak_bytes
    saving_bytes                layer-wise rows: the standard optimizer's peak minus this one (may be 0 or less)
    max_micro_batch             with --max-batch-size: the largest micro-batch that fits (0: none)
    advice                      what would lower the peak
    between_steps               {same categories}: what stays alive after zero_grad() (weights, optimizer state,
                                DDP's buckets)
    host_peak_bytes             the most host bytes alive at once (offload: gradient buffers; with optimizer also
                                the states, parameter copies and host step temporaries); 0 without offload
    host_categories             {same categories}: host bytes at that peak
    host_pinned_bytes           offload rows: of that peak, what is pinned on CUDA (gradient buffers, staging
                                buffers, parameter copies: host_categories' weights and gradients)
    host_pageable_bytes         offload rows: the rest, pageable (the host optimizer states, the host step's
                                temporaries)
    combined_peak_bytes         the most device + host bytes alive at once (one memory, as on a CPU-only machine)
    host_fits, host_headroom_bytes  with --host-memory: host_peak_bytes <= host memory, and the difference
  offload_advice         with several --offload modes: per layer-wise optimizer, the mode to use and why (bytes)
  notes                  optimizers left out (a counterpart FSDP2 cannot step)"""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """
    Add the `plan` subcommand to a `layerwise-hf`-style parser; it sets `func=run`.

    Example:

    ```python
    >>> import argparse
    >>> from layerwise_hf.plan import cli
    >>> parser = argparse.ArgumentParser(prog="tool")
    >>> _ = cli.register(parser.add_subparsers(dest="command"))
    >>> parser.parse_args(["plan", "llama-3-8b", "--seq-len", "4096"]).seq_len
    4096
    ```
    """
    parser = subparsers.add_parser(
        "plan",
        help="Simulate one training step on fake tensors (activations included) and say whether it fits.",
        description="Run one training step of the model on fake tensors (nothing allocated, nothing downloaded), with "
        "the standard optimizer Trainer builds and with its layer-wise form, and report the peak of live memory "
        "split into weights, gradients, optimizer state, activations and temporaries.",
        epilog=JSON_SCHEMA,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help=f"A preset ({', '.join(list_presets())}) or a local config.json / directory.")
    parser.add_argument(
        "--optim",
        nargs="+",
        default=["adamw_torch"],
        help=f"Optimizer name(s); each runs standard and layer-wise. Known: {known_names()}.",
    )
    parser.add_argument("--seq-len", type=int, default=512, help="Tokens per sequence (default 512).")
    parser.add_argument("--micro-batch", type=int, default=1, help="per_device_train_batch_size (default 1).")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps (default 1).")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="Clipping (Trainer's default 1.0; 0: off).")
    parser.add_argument("--clip-mode", choices=CLIP_MODES, default="exact", help="layerwise_clip (default exact).")
    amp = parser.add_mutually_exclusive_group()
    amp.add_argument("--bf16", action="store_true", help="Trainer's bf16 autocast.")
    amp.add_argument("--fp16", action="store_true", help="Trainer's fp16 autocast (GradScaler not simulated).")
    parser.add_argument("--torch-dtype", default="float32", help=f"Weights' dtype: {', '.join(DTYPE_BYTES)}.")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="Activation checkpointing (Trainer's).")
    parser.add_argument("--lora-r", type=int, default=None, help="Train LoRA adapters of this rank (peft).")
    parser.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        help="LoRA's targets (default: peft's for the architecture, e.g. q_proj v_proj on Llama, c_attn on GPT-2).",
    )
    parser.add_argument("--device-memory", default=None, help="e.g. 80GiB: say whether each optimizer fits.")
    parser.add_argument(
        "--offload",
        nargs="+",
        choices=OFFLOAD_MODES,
        default=["none"],
        help="layerwise_offload of the layer-wise rows (several: one row each). gradients: gradients wait in host "
        "buffers (GA and exact clipping without a second backward); optimizer: states and the step on the host. "
        "The table then shows the device peak and the host peak apart.",
    )
    _add_offload_time_arguments(parser)
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cuda",
        help="Whose optimizer defaults and collectives to simulate (cuda: foreach, NCCL; cpu: a loop, gloo).",
    )
    _add_rank_arguments(parser)
    parser.add_argument(
        "--max-batch-size",
        action="store_true",
        help="With --device-memory: the largest micro-batch that fits, per optimizer (bisection).",
    )
    parser.add_argument("--no-extrapolate", action="store_true", help="Simulate every decoder layer.")
    parser.add_argument("--units", choices=("binary", "decimal"), default="binary", help="GiB or GB.")
    parser.add_argument("--json", action="store_true", help="Print JSON (the schema is below).")
    parser.set_defaults(func=run)
    return parser


def _add_offload_time_arguments(parser: argparse.ArgumentParser) -> None:
    """The offload rows' host memory and what their step costs: the host step's rate, the link, the device."""
    parser.add_argument("--host-memory", default=None, help="e.g. 256GiB: say whether each offload row's host fits.")
    parser.add_argument(
        "--host-step-rate",
        type=float,
        default=None,
        help="Offload rows: the host step's ns per element (default: measured on this machine once, cached).",
    )
    parser.add_argument(
        "--pcie-gbps",
        type=float,
        default=25.0,
        help="Offload rows: host <-> device GB/s one way (default 25: a pinned copy on PCIe 4.0 x16, ~80%% of 31.5).",
    )
    parser.add_argument(
        "--device-tflops",
        type=float,
        default=None,
        help="Offload rows: the device's achieved TFLOP/s, for backward's time (its FLOPs counted on the simulated "
        "step by torch's FlopCounterMode) and whether the host step hides behind it. Without it that is not said.",
    )


def _add_rank_arguments(parser: argparse.ArgumentParser) -> None:
    """The run's ranks (`estimate.mesh`: nodes, world size, sharding, the mesh's dimensions) and whether each
    micro-batch is reduced."""
    add_mesh_arguments(
        parser,
        "ddp or fsdp2 (Accelerate's FSDP2 config) for several ranks, simulated as one rank with a fake process group "
        "(default: fsdp2 with --dp-shard, --tp or --dp-replicate, else none on one rank, ddp on several).",
    )
    parser.add_argument(
        "--sync-each-batch",
        action="store_true",
        help="Accelerate's sync_each_batch (several ranks, --grad-accum > 1): reduce every micro-batch, so FSDP2 "
        "does not hold the window's gradients unsharded and offload sends each shard to the host as it comes.",
    )


def _options(args: argparse.Namespace, mesh: Mesh) -> dict:
    return dict(
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        max_grad_norm=args.max_grad_norm,
        clip_mode=args.clip_mode,
        bf16=args.bf16,
        fp16=args.fp16,
        torch_dtype=args.torch_dtype,
        gradient_checkpointing=args.gradient_checkpointing,
        lora_r=args.lora_r,
        lora_targets=tuple(args.lora_target_modules or ()),
        device_memory=args.device_memory,
        device=args.device,
        extrapolate=not args.no_extrapolate,
        world_size=mesh.world_size,
        sharding=mesh.sharding,
        sync_each_batch=args.sync_each_batch,
        dp_replicate=mesh.dp_replicate,
        tp=mesh.tp,
        offload=tuple(args.offload),
        host_memory=args.host_memory,
    )


def run(args: argparse.Namespace) -> int:
    """
    Print the plan (or JSON); on bad input print `layerwise-hf plan: error: ...` and return 2, before simulating.

    Example:

    ```python
    >>> from layerwise_hf.cli import main
    >>> main(["plan", "no-such-model"])  # doctest: +SKIP
    2
    ```
    """
    try:
        print(_run(args))
    except EstimateError as e:
        print(f"layerwise-hf plan: error: {e}", file=sys.stderr)
        return 2
    return 0


def _run(args: argparse.Namespace) -> str:
    if args.max_batch_size and args.device_memory is None:
        raise EstimateError("--max-batch-size needs --device-memory.")
    from .core import plan

    mesh = mesh_of(args)
    options = _options(args, mesh)
    result = plan(args.model, args.optim, **options)
    result.notes += mesh.notes()
    batches = _max_batches(args, options, result) if args.max_batch_size else {}
    times = _offload_times(args, result)
    if args.json:
        payload = result.to_dict()
        payload["mesh"] = dict(nodes=mesh.nodes, gpus_per_node=mesh.gpus_per_node, dp_replicate=mesh.dp_replicate,
                               dp_shard=mesh.dp_shard, tp=mesh.tp, launch=mesh.describe())  # fmt: skip
        for row in payload["optimizers"]:
            if row["offload"] != "none":
                row["host_pinned_bytes"], row["host_pageable_bytes"] = host_pinned_pageable(row["host_categories"])
            if (row["optimizer"], row["offload"]) in batches:
                row["max_micro_batch"] = batches[(row["optimizer"], row["offload"])]
            if (row["optimizer"], row["offload"]) in times:
                row["offload_time"] = times[(row["optimizer"], row["offload"])].to_dict()
        return json.dumps(payload, indent=2)
    text = result.format(args.units)
    offloaded = [row for row in result.rows if row.offload != "none"]
    text += "".join(_host_line(row, result.setup.grad_accum, args.units) for row in offloaded)
    for row in result.rows:
        timed = times.get((row.optimizer, row.offload))
        if timed is not None:
            text += f"\n{row.label}, offload {row.offload}: {timed.describe()}"
            text += f"; {timed.advice()}" if timed.advice() else ""
    if times and getattr(args, "device_tflops", None) is None:
        text += "\nOffload time: backward not estimated (--device-tflops says whether the host step hides)."
    for row in result.rows:
        batch = batches.get((row.optimizer, row.offload))
        if batch is not None:
            text += (f"\n{row.label}: largest micro-batch that fits in "
                     f"{format_bytes(result.device_memory, args.units)}: {batch}")  # fmt: skip
    return text


def host_pinned_pageable(host_categories: dict[str, int]) -> tuple[int, int]:
    """
    `(pinned, pageable)` bytes of an offload row's host peak: on CUDA the gradient buffers, the staging buffers and
    the parameter copies are pinned (views into blocks registered to the byte); the host optimizer states and the host
    step's temporaries are allocated like any CPU tensor, pageable.

    Example:

    ```python
    >>> from layerwise_hf.plan.cli import host_pinned_pageable
    >>> host_pinned_pageable({"weights": 4, "gradients": 4, "optimizer_state": 8, "activations": 0, "temporaries": 1})
    (8, 9)
    ```
    """
    pinned = host_categories.get("weights", 0) + host_categories.get("gradients", 0)
    return pinned, sum(host_categories.values()) - pinned


def _host_line(row: PlanRow, grad_accum: int, units: str) -> str:
    pinned, pageable = host_pinned_pageable(row.host_categories)
    kinds = "gradient buffers" + (", staging buffers" if grad_accum > 1 else "")
    hosted = row.offload == "optimizer"
    kinds += ", parameter copies" if hosted else ""
    rest = "optimizer states, the host step's temporaries" if hosted else "the host worker's temporaries"
    return (
        f"\n{row.label}, host peak {format_bytes(row.host_peak_bytes, units)}: {format_bytes(pinned, units)} pinned "
        f"on CUDA ({kinds}), {format_bytes(pageable, units)} pageable ({rest})."
    )


def _offload_times(args: argparse.Namespace, result: Plan) -> dict:
    if all(row.offload == "none" for row in result.rows):
        return {}
    from .offload_time import plan_times

    rate, gbps, tflops = (getattr(args, k, None) for k in ("host_step_rate", "pcie_gbps", "device_tflops"))
    return plan_times(result, host_step_rate=rate, pcie_gbps=gbps or 25.0, device_tflops=tflops)


def _max_batches(args: argparse.Namespace, options: dict, result: Plan) -> dict[tuple[str, str], int]:
    from .batch import max_micro_batch
    from .core import plan

    out = {}
    for row in result.rows:

        def run_one(batch: int, name: str = row.optimizer, mode: str = row.offload) -> Plan:
            changed = {**options, "micro_batch": batch, "offload": mode}
            return plan(args.model, [name], **changed, counterparts=False)

        out[(row.optimizer, row.offload)], _ = max_micro_batch(run_one, row.optimizer)
    return out
