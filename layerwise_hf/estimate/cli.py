"""`layerwise-hf estimate-memory`: the argument parser, the run, and the tables it prints. The numbers come from
`estimate()` and `accelerate_estimate()`; this module only asks for them and lays them out."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from .accelerate_mode import accelerate_estimate
from .core import MemoryEstimate, estimate
from .mesh import add_mesh_arguments, layout_words, mesh_of
from .models import ModelSpec, ModuleSpec, list_presets, load_model_spec
from .offload import OFFLOAD_MODES
from .optimizers import known_names, parse_optimizer
from .units import (
    ACCELERATE_DTYPES,
    DEFAULT_LORA_TARGETS,
    FROZEN_DTYPES,
    EstimateError,
    format_bytes,
    format_count,
)


def render_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """
    A box-drawn table in the style of `accelerate estimate-memory`.

    Args:
        title (`str`):
            The line above the headers (the box widens to fit it).
        headers (`Sequence[str]`):
            Column names.
        rows (`Sequence[Sequence[str]]`):
            Cells, already formatted.

    Example:

    ```python
    >>> from layerwise_hf.estimate import render_table
    >>> print(render_table("Sizes", ["name", "bytes"], [["a", "1 B"]]))
    ┌──────────────┐
    │    Sizes     │
    ├──────┬───────┤
    │ name │ bytes │
    ├──────┼───────┤
    │  a   │  1 B  │
    └──────┴───────┘
    ```
    """
    widths = [max(len(h), *(len(r[i]) for r in rows)) + 2 for i, h in enumerate(headers)]
    inner = sum(widths) + len(widths) - 1
    if len(title) + 2 > inner:
        widths[-1] += len(title) + 2 - inner
        inner = len(title) + 2

    def line(cells: Sequence[str]) -> str:
        return "│" + "│".join(c.center(w) for c, w in zip(cells, widths)) + "│"

    out = ["┌" + "─" * inner + "┐", "│" + title.center(inner) + "│", "├" + "┬".join("─" * w for w in widths) + "┤"]
    out += [line(headers), "├" + "┼".join("─" * w for w in widths) + "┤"]
    out += [line(r) for r in rows]
    out.append("└" + "┴".join("─" * w for w in widths) + "┘")
    return "\n".join(out)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """
    Add the `estimate-memory` subcommand to a `layerwise-hf`-style parser; it sets `func=run`.

    Args:
        subparsers (`argparse._SubParsersAction`):
            What `ArgumentParser.add_subparsers()` returned.

    Example:

    ```python
    >>> import argparse
    >>> from layerwise_hf.estimate import cli
    >>> parser = argparse.ArgumentParser(prog="tool")
    >>> _ = cli.register(parser.add_subparsers(dest="command"))
    >>> args = parser.parse_args(["estimate-memory", "llama-3-8b", "--dtypes", "bf16"])
    >>> args.func is cli.run, args.dtypes
    (True, ['bf16'])
    ```
    """
    parser = subparsers.add_parser(
        "estimate-memory",
        help="Weights, gradients and optimizer state by formula, with and without layer-wise optimizers (no "
        "activations: to ask whether a run fits, use `layerwise-hf plan`).",
        description="Estimate the weights, gradients and optimizer state of training a model, with and without a "
        "layer-wise optimizer, from a preset or a local config.json (nothing is downloaded), in a second. "
        "Activations and step temporaries are not included, so the totals are a floor, not a peak: to ask whether a "
        "run fits a device, use `layerwise-hf plan` (one simulated step, activations included). Use this command "
        "for the byte-exact size of each term, or --accelerate for `accelerate estimate-memory`'s table.",
    )
    parser.add_argument(
        "model",
        nargs="?",
        help=f"A preset ({', '.join(list_presets())}), its Hub repository name, or a local config.json / directory.",
    )
    parser.add_argument(
        "--dtypes",
        "--dtype",
        nargs="+",
        default=None,
        help="Weight dtype(s): fp32, bf16, fp16 (default bf16). With --accelerate: float32 float16 int8 int4.",
    )
    parser.add_argument(
        "--optim",
        nargs="+",
        default=["adamw_torch", "adamw_torch_layerwise"],
        help=f"Optimizer name(s), one row each. Known: {known_names()}. Default: adamw_torch adamw_torch_layerwise.",
    )
    _add_training_setup_arguments(parser)
    parser.add_argument(
        "--units",
        choices=("binary", "decimal"),
        default="binary",
        help="binary: KiB/MiB/GiB (2**30 bytes; what accelerate prints as 'GB'); decimal: kB/MB/GB (10**9 bytes).",
    )
    parser.add_argument("--json", action="store_true", help="Print JSON (exact bytes) instead of a table.")
    parser.add_argument(
        "--accelerate", action="store_true", help="Reproduce `accelerate estimate-memory`'s table and conventions."
    )
    parser.add_argument("--list-presets", action="store_true", help="List the presets and their parameter counts.")
    parser.set_defaults(func=run)
    return parser


ESTIMATE_OPTIONS = (
    "trainable_fraction",
    "lora_rank",
    "lora_target_modules",
    "adapter_dtype",
    "frozen_dtype",
    "gradient_accumulation_steps",
    "world_size",
    "sharding",
    "gradient_as_bucket_view",
    "bucket_cap_mb",
    "dp_replicate",
    "tp",
)


def _add_training_setup_arguments(parser: argparse.ArgumentParser) -> None:
    # What is trained and how it is spread over devices.
    trainable = parser.add_mutually_exclusive_group()
    trainable.add_argument("--trainable-fraction", type=float, help="Fraction of every tensor that trains.")
    trainable.add_argument("--lora-rank", type=int, help="Train LoRA adapters of this rank, the base frozen.")
    parser.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=list(DEFAULT_LORA_TARGETS),
        help="LoRA targets among q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all-linear.",
    )
    parser.add_argument("--adapter-dtype", default="float32", help="LoRA adapter dtype (PEFT's default: float32).")
    parser.add_argument("--frozen-dtype", help=f"Frozen weights' storage: {', '.join(FROZEN_DTYPES)}.")
    parser.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=1,
        help="Above 1, a layer-wise optimizer holds every gradient during the window, like the standard one.",
    )
    parser.add_argument(
        "--offload",
        choices=OFFLOAD_MODES,
        default="none",
        help="layerwise_offload of the layer-wise rows: 'gradients' (gradients wait in host memory), 'optimizer' "
        "(states, a copy of the parameters and the gradients in host memory); adds a Host column.",
    )
    add_mesh_arguments(parser, "ddp or fsdp2 for several devices (default: fsdp2 with --dp-shard, --tp or "
                       "--dp-replicate, else none on one device, ddp on several).")  # fmt: skip
    parser.add_argument(
        "--gradient-as-bucket-view", action="store_true", help="Standard DDP's gradient_as_bucket_view=True."
    )
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="DDP's bucket_cap_mb (Trainer's ddp_bucket_cap_mb): the layer-wise route's bucket size under DDP. "
        "Default: DDP's, 25 MiB after a first bucket of 1 MiB.",
    )


def run(args: argparse.Namespace) -> int:
    """
    Print the table (or JSON) `args` asks for; on a bad model, optimizer or option print
    `layerwise-hf estimate-memory: error: ...` to stderr instead (no traceback).

    Args:
        args (`argparse.Namespace`):
            Parsed by the parser `register` adds.

    Returns:
        `int`: the exit status, `0`, or `2` (argparse's for a usage error) after an `EstimateError`.

    Example:

    ```python
    >>> from layerwise_hf.cli import main
    >>> main(["estimate-memory", "llama-3-8b", "--optim", "adamw_8bit_layerwise", "--json"])  # doctest: +ELLIPSIS
    {...
    0
    ```
    """
    try:
        print(_run(args))
    except EstimateError as e:
        print(f"layerwise-hf estimate-memory: error: {e}", file=sys.stderr)
        return 2
    return 0


def _run(args: argparse.Namespace) -> str:
    if args.list_presets:
        return _presets_table(args.json)
    if not args.model:
        raise EstimateError(f"give a model: a preset ({', '.join(list_presets())}) or a config.json path.")
    if args.accelerate:
        return _run_accelerate(args)
    mesh = mesh_of(args)
    spec = load_model_spec(args.model)
    args = argparse.Namespace(**{**vars(args), "world_size": mesh.world_size, "sharding": mesh.sharding,
                                 "dp_replicate": mesh.dp_replicate, "tp": mesh.tp})  # fmt: skip
    # The command line's options are estimate()'s keyword arguments, under the same names.
    options = {name: getattr(args, name) for name in ESTIMATE_OPTIONS}
    # A standard optimizer has no offload: its rows stay the comparison.
    estimates = [
        estimate(
            spec,
            optimizer=optim,
            dtype=dtype,
            offload=args.offload if parse_optimizer(optim)[1] else "none",
            **options,
        )
        for dtype in args.dtypes or ["bfloat16"]
        for optim in args.optim
    ]
    if args.json:
        payload = {"model": spec.name, "source": spec.source, "estimates": [e.to_dict() for e in estimates]}
        return json.dumps(payload, indent=2)
    return _estimates_table(spec, estimates, args.units)


def _run_accelerate(args: argparse.Namespace) -> str:
    # accelerate's table has no training setup: options that would change ours are refused rather than ignored.
    ignored = [
        flag
        for flag, value, default in (
            ("--lora-rank", args.lora_rank, None),
            ("--trainable-fraction", args.trainable_fraction, None),
            ("--world-size", args.world_size, None),
            ("--nodes", args.nodes, None),
            ("--gpus-per-node", args.gpus_per_node, None),
            ("--sharding", args.sharding, None),
            ("--dp-replicate", args.dp_replicate, None),
            ("--dp-shard", args.dp_shard, None),
            ("--tp", args.tp, None),
            ("--gradient-accumulation-steps", args.gradient_accumulation_steps, 1),
            ("--frozen-dtype", args.frozen_dtype, None),
            ("--offload", args.offload, "none"),
        )
        if value != default
    ]
    if ignored:
        raise EstimateError(f"--accelerate reproduces accelerate's table, which has no {', '.join(ignored)}.")
    rows = accelerate_estimate(args.model, args.dtypes or ACCELERATE_DTYPES)
    if args.json:
        return json.dumps({"model": args.model, "rows": [dataclasses.asdict(r) for r in rows]}, indent=2)
    headers = ["dtype", "Largest Layer", "Total Size", "Training using Adam"]
    return render_table(f"Memory Usage for loading `{args.model}`", headers, [r.format() for r in rows])


def _estimates_table(spec: ModelSpec | ModuleSpec, estimates: list[MemoryEstimate], units: str) -> str:
    first = estimates[0]
    setup = "1 device" if first.world_size == 1 else f"{first.world_size} devices, {first.sharding}"
    if first.dp_replicate > 1 or first.tp > 1:
        setup += f" ({layout_words(first.world_size, first.dp_replicate, first.tp)})"
    if first.gradient_accumulation_steps > 1:
        setup += f", gradient accumulation {first.gradient_accumulation_steps}"
    title = (
        f"Training memory for `{spec.name}`: {format_count(first.num_parameters)} parameters, "
        f"{format_count(first.num_trainable_parameters)} trainable, {setup}"
    )
    headers = ["dtype", "optimizer", "Weights", "Gradients", "Optimizer state", "Total", "Per GPU"]
    rows = [
        [
            e.dtype,
            e.optimizer,
            format_bytes(e.weight_bytes, units),
            format_bytes(e.gradient_bytes, units),
            format_bytes(e.optimizer_state_bytes, units),
            format_bytes(e.total_bytes, units),
            format_bytes(e.per_gpu_bytes, units),
        ]
        for e in estimates
    ]
    if any(e.offload != "none" for e in estimates):
        # The device columns are what stays on the device; the host's share is beside them, per device's process.
        headers.append("Host (offload)")
        for row, e in zip(rows, estimates):
            row.append(f"{format_bytes(e.host_bytes, units)} ({e.offload})" if e.offload != "none" else "-")
    lines = [render_table(title, headers, rows)]
    lw = next((e for e in estimates if e.layerwise), None)
    if lw is not None and lw.sharding != "ddp" and lw.gradient_accumulation_steps == 1:
        lines.append(
            f"Layer-wise gradients: at most {format_bytes(lw.gradient_bytes, units)} alive at once (the largest "
            f"trainable tensor is {lw.largest_parameter}, {format_bytes(lw.largest_parameter_bytes, units)}) instead "
            f"of all {format_bytes(lw.all_gradient_bytes, units)}"
            + (f"; each device holds 1/{lw.world_size // lw.dp_replicate} of it." if lw.sharding == "fsdp2" else ".")
        )
    if lw is not None and lw.ddp_in_flight_bytes is not None:
        every = format_bytes(lw.all_gradient_bytes, units)
        lines.append(
            f"Layer-wise gradients under DDP: at most {format_bytes(lw.ddp_in_flight_bytes, units)} in flight per "
            f"device (the buckets reducing and filling, a held large one, a copy) instead of standard DDP's {every} "
            f"of buckets (plus {every} of .grad without --gradient-as-bucket-view)."
        )
    notes = list(dict.fromkeys(note for e in estimates for note in e.notes))
    # The caveat that applies to every row reads best after the ones specific to this configuration.
    notes.sort(key=lambda note: note.startswith("Not included"))
    lines += [f"Note: {note}" for note in notes]
    if spec.source:
        lines.append(f"Dimensions from: {spec.source}")
    return "\n".join(lines)


def _presets_table(as_json: bool) -> str:
    specs = {name: load_model_spec(name) for name in list_presets()}
    if as_json:
        return json.dumps(
            {n: {"source": s.source, "num_parameters": s.num_parameters()} for n, s in specs.items()}, indent=2
        )
    rows = [[n, s.source, f"{s.num_parameters():,}"] for n, s in specs.items()]
    return render_table("Presets", ["preset", "dimensions from", "parameters"], rows)
