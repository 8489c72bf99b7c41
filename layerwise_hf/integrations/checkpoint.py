"""Checkpoint safety and files: complete-checkpoint markers, checks before anything loads, and the
`layerwise-hf convert-checkpoint` command (the state conversions themselves live in `layerwise_hf.optim.state`).

A standard Trainer optimizer state has two param groups (Trainer's weight-decay group, then the no-decay group),
each listing its parameters in `model.named_parameters()` order; a layer-wise state has one named group per
parameter. Both hold the same per-parameter state for the same optimizer class, so either converts to the other
and training continues identically. A checkpoint written with `layerwise_offload` has the layer-wise layout too (a
host-stepped parameter saves its wrapped optimizer's class and state), so it converts, and resumes with offload on or
off, the same way (tests/test_offload_checkpoint.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import torch

from ..optim.state import (
    convert_scheduler_state,
    first_members,
    is_layerwise_state_dict,
    layerwise_to_standard,
    standard_groups_of,
    standard_to_layerwise,
)
from ..placement.local_shard import local_shards_of
from ..platform.compat import safe_globals

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "layerwise_complete.json"
OPTIMIZER_NAME = "optimizer.pt"
FSDP_FULL_OPTIMIZER_NAME = "optimizer.bin"  # accelerate's save_fsdp_optimizer, FULL_STATE_DICT
SCHEDULER_NAME = "scheduler.pt"


# ---- complete checkpoints ----


def mark_complete(checkpoint_dir: str, info: dict[str, Any] | None = None) -> None:
    """
    Write `layerwise_complete.json` into `checkpoint_dir`, last and atomically: a checkpoint without it was
    interrupted while being written, or cannot be loaded from this folder. `LayerwiseTrainer` calls it after each save
    (on every rank that saves, once every rank has written); it writes nothing, with a warning, where the checkpoint's
    DCP folders are not whole here (`unloadable_dcp_parts`: an output folder per node without a shared file system).

    Args:
        checkpoint_dir (`str`):
            The `checkpoint-N` directory, fully written.
        info (`dict[str, Any]`, *optional*):
            JSON-serializable details recorded in the marker (`global_step`, `optim`, ...).

    Example:

    ```python
    >>> import tempfile
    >>> from layerwise_hf.integrations.checkpoint import is_complete, mark_complete
    >>> checkpoint_dir = tempfile.mkdtemp()
    >>> mark_complete(checkpoint_dir, {"global_step": 10})
    >>> is_complete(checkpoint_dir)
    True
    ```
    """
    problems = unloadable_dcp_parts(checkpoint_dir)
    if problems:
        logger.warning(
            "Not marking %s complete: it cannot be resumed from this folder (%s). %s",
            checkpoint_dir,
            "; ".join(problems),
            PER_NODE_ADVICE,
        )
        return
    tmp = os.path.join(checkpoint_dir, COMPLETE_MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(info or {}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(checkpoint_dir, COMPLETE_MARKER))


# NOTE: DCP (FSDP's SHARDED_STATE_DICT) writes each rank's `.distcp` file where that rank runs and `.metadata` from
# global rank 0 only (torch 2.13), so a folder per node (save_on_each_node=True, no shared file system) is never whole.
DCP_METADATA = ".metadata"
PER_NODE_ADVICE = (
    "FSDP's sharded checkpoints (DCP) write .metadata from global rank 0 only and each rank's .distcp file on its own "
    "node, so with an output folder per node (save_on_each_node=True without a shared file system) no node's folder "
    "holds the whole checkpoint. Save to a file system every node shares, or merge every node's copy of the folder "
    "into one that all ranks read before resuming."
)


def unloadable_dcp_parts(checkpoint_dir: str) -> list[str]:
    """
    What keeps the DCP folders of `checkpoint_dir` (`pytorch_model_fsdp_0`, `optimizer_0`) from loading here: a
    missing or unreadable `.metadata`, or `.distcp` files it lists that this folder lacks; `[]` when nothing does (no
    DCP folder at all included).

    Example:

    ```python
    >>> import tempfile
    >>> from layerwise_hf.integrations.checkpoint import unloadable_dcp_parts
    >>> unloadable_dcp_parts(tempfile.mkdtemp())
    []
    ```
    """
    if not os.path.isdir(checkpoint_dir):
        return []
    problems = []
    for entry in sorted(os.listdir(checkpoint_dir)):
        folder = os.path.join(checkpoint_dir, entry)
        if not os.path.isdir(folder):
            continue
        files = set(os.listdir(folder))
        if DCP_METADATA not in files:
            if any(f.endswith(".distcp") for f in files):
                problems.append(f"{entry}/ has no {DCP_METADATA}")
            continue
        from torch.distributed.checkpoint import FileSystemReader

        try:
            metadata = FileSystemReader(folder).read_metadata()
        except Exception as err:  # a truncated or foreign pickle raises several types
            problems.append(f"{entry}/{DCP_METADATA} cannot be read ({err})")
            continue
        listed = {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}
        missing = sorted(name for name in listed - files if name)
        if missing:
            problems.append(f"{entry}/ lacks {len(missing)} file(s) its {DCP_METADATA} lists ({', '.join(missing)})")
    return problems


def is_complete(checkpoint_dir: str) -> bool:
    """
    Whether `checkpoint_dir` holds the marker `mark_complete` writes last.

    Args:
        checkpoint_dir (`str`):
            A `checkpoint-N` directory.

    Example:

    ```python
    >>> import tempfile
    >>> from layerwise_hf.integrations.checkpoint import is_complete
    >>> is_complete(tempfile.mkdtemp())  # no marker: interrupted, or not written by this plugin
    False
    ```
    """
    return os.path.isfile(os.path.join(checkpoint_dir, COMPLETE_MARKER))


def read_marker(checkpoint_dir: str) -> dict[str, Any]:
    """
    What `mark_complete` recorded in `checkpoint_dir` (`{}` without a marker, or an unreadable one).

    Example:

    ```python
    >>> import tempfile
    >>> from layerwise_hf.integrations.checkpoint import mark_complete, read_marker
    >>> checkpoint_dir = tempfile.mkdtemp()
    >>> mark_complete(checkpoint_dir, {"global_step": 10}); read_marker(checkpoint_dir)
    {'global_step': 10}
    ```
    """
    try:
        with open(os.path.join(checkpoint_dir, COMPLETE_MARKER)) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def check_local_shards(checkpoint_dir: str, optimizer) -> None:
    """
    Refuse to resume 8-bit local-shard states saved on another number of shards (their blocks would not match), with
    what would work, before DCP loads anything.

    Example:

    ```python
    >>> from layerwise_hf.integrations.checkpoint import check_local_shards
    >>> check_local_shards("out/checkpoint-500", trainer.layerwise_optimizer)  # ValueError if saved on other ranks
    ```
    """
    saved, current = read_marker(checkpoint_dir).get("local_shards"), local_shards_of(optimizer)
    if saved is not None and current is not None and saved != current:
        raise ValueError(
            f"{checkpoint_dir} holds {optimizer.optimizer_name} states saved on {saved} FSDP2 shards; this run has "
            f"{current}. bitsandbytes' quantization blocks follow the shards, so they cannot be resharded. Resume "
            f"with {saved} processes, or start a new run from the checkpoint's model weights."
        )


def latest_complete_checkpoint(run_dir: str) -> str | None:
    """
    The newest `checkpoint-N` in `run_dir` that this plugin marked complete, or `None`; newer, interrupted ones are
    skipped with a warning. `LayerwiseTrainer.train(resume_from_checkpoint=True)` resumes from it.

    Args:
        run_dir (`str`):
            The run's `output_dir`.

    Example:

    ```python
    >>> import os, tempfile
    >>> from layerwise_hf.integrations.checkpoint import latest_complete_checkpoint, mark_complete
    >>> run_dir = tempfile.mkdtemp()
    >>> for step in (10, 20):
    ...     os.makedirs(os.path.join(run_dir, f"checkpoint-{step}"))
    >>> mark_complete(os.path.join(run_dir, "checkpoint-10"))  # checkpoint-20 was interrupted
    >>> os.path.basename(latest_complete_checkpoint(run_dir))
    'checkpoint-10'
    ```
    """
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    if not os.path.isdir(run_dir):
        return None
    found = []
    for entry in os.listdir(run_dir):
        head, _, step = entry.rpartition("-")
        if head == PREFIX_CHECKPOINT_DIR and step.isdigit() and os.path.isdir(os.path.join(run_dir, entry)):
            found.append((int(step), os.path.join(run_dir, entry)))
    skipped = []
    for _, path in sorted(found, reverse=True):
        if is_complete(path):
            if skipped:
                logger.warning("Skipping incomplete checkpoint(s) (interrupted while being written): %s", skipped)
            return path
        skipped.append(path)
    return None


def check_checkpoint(checkpoint_dir: str, accept_nonfinite: bool = False) -> None:
    """
    Raise a clear `ValueError` for a checkpoint that cannot be resumed from (not a directory, an unreadable
    `trainer_state.json` or `optimizer.pt`), before anything is loaded.

    Args:
        checkpoint_dir (`str`):
            The `resume_from_checkpoint` directory.

    Example:

    ```python
    >>> import json, os, tempfile
    >>> from layerwise_hf.integrations.checkpoint import check_checkpoint
    >>> checkpoint_dir = tempfile.mkdtemp()
    >>> with open(os.path.join(checkpoint_dir, "trainer_state.json"), "w") as f:
    ...     json.dump({"global_step": 10}, f)
    >>> check_checkpoint(checkpoint_dir)  # a truncated trainer_state.json or optimizer.pt raises ValueError
    ```
    """
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    if not os.path.isdir(checkpoint_dir):
        # NOTE: Trainer's own words first: code that resumes matches on them.
        raise ValueError(
            f"Can't find a valid checkpoint at {checkpoint_dir}: resume_from_checkpoint={checkpoint_dir!r} is not a "
            "directory."
        )
    state_file = os.path.join(checkpoint_dir, "trainer_state.json")
    advice = (
        "Resume from an earlier checkpoint, or pass resume_from_checkpoint=True to take the newest complete "
        f"{PREFIX_CHECKPOINT_DIR}-N."
    )
    if not os.path.isfile(state_file):
        # Trainer raises FileNotFoundError for it (after loading the weights); this says so before anything loads.
        raise FileNotFoundError(
            f"{checkpoint_dir} has no {os.path.basename(state_file)}: it holds no resumable training state (only "
            f"model weights, or a checkpoint interrupted while being written). {advice}"
        )
    try:
        with open(state_file) as f:
            json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{checkpoint_dir} is incomplete or corrupt ({os.path.basename(state_file)}: {err}); it was probably "
            f"interrupted while being written. {advice}"
        ) from err
    problems = unloadable_dcp_parts(checkpoint_dir)
    if problems:
        raise ValueError(f"{checkpoint_dir} cannot be resumed from: {'; '.join(problems)}. {PER_NODE_ADVICE}")
    optimizer_file = os.path.join(checkpoint_dir, OPTIMIZER_NAME)
    if os.path.isfile(optimizer_file):
        _check_finite(optimizer_file, load_optimizer_file(optimizer_file), accept_nonfinite)
    for name in sorted(os.listdir(checkpoint_dir)):
        if name == SCHEDULER_NAME or (name.startswith("rng_state") and name.endswith(".pth")):
            _check_loadable(os.path.join(checkpoint_dir, name))


def _check_finite(path: str, state_dict: dict[str, Any], accept: bool) -> None:
    # NOTE: a NaN moment loads silently and turns the weights NaN a few steps later, while the logged loss stays
    # finite for a while: say which parameters before anything is loaded.
    names = {
        i: g.get("name", f"param group {k}")
        for k, g in enumerate(state_dict.get("param_groups", []))
        for i in g["params"]
    }
    bad = sorted(
        {
            f"{names.get(i, i)}.{key}"
            for i, state in state_dict.get("state", {}).items()
            for key, value in state.items()
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all()
        }
    )
    if not bad:
        return
    message = f"{path} holds NaN or inf in the optimizer state of {len(bad)} tensor(s), e.g. {bad[:3]}"
    if not accept:
        raise ValueError(
            f"{message}; training on from it would turn the weights NaN. Resume from an earlier checkpoint, or set "
            "layerwise_accept_nonfinite_state=True to load it anyway."
        )
    logger.warning("%s; loading it anyway (layerwise_accept_nonfinite_state=True).", message)


def warn_missing_optimizer_state(checkpoint_dir: str) -> None:
    """
    Warn when a checkpoint has no optimizer or scheduler state: Trainer then resumes silently with a fresh optimizer
    (moments from zero) and a fresh schedule (warmup again).

    Example:

    ```python
    >>> from layerwise_hf.integrations.checkpoint import warn_missing_optimizer_state
    >>> warn_missing_optimizer_state("out/checkpoint-500")  # logs a warning if optimizer.pt / scheduler.pt are gone
    ```
    """
    entries = set(os.listdir(checkpoint_dir)) if os.path.isdir(checkpoint_dir) else set()
    # FSDP writes its optimizer state as a directory (optimizer_0, SHARDED_STATE_DICT) or as optimizer.bin
    # (FULL_STATE_DICT; optimizer_N.bin for more optimizers), DeepSpeed inside global_step*.
    has_optimizer = bool({OPTIMIZER_NAME, FSDP_FULL_OPTIMIZER_NAME} & entries) or any(
        e.startswith(("optimizer_", "global_step")) for e in entries
    )
    missing = [
        name for name, ok in ((OPTIMIZER_NAME, has_optimizer), (SCHEDULER_NAME, SCHEDULER_NAME in entries)) if not ok
    ]
    if missing:
        logger.warning(
            "%s has no %s: training resumes with a fresh %s (Trainer does so silently). Resume from a checkpoint "
            "that has them if this one was copied or cleaned up partially.",
            checkpoint_dir,
            " or ".join(missing),
            "optimizer and schedule"
            if len(missing) == 2
            else ("optimizer" if OPTIMIZER_NAME in missing else "schedule"),
        )


def _check_loadable(path: str) -> None:
    # The way Trainer loads them (weights_only, numpy's RNG state allowed), but before the model is touched.
    try:
        with safe_globals():
            torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for truncated or foreign files
        raise ValueError(f"{path} cannot be loaded (truncated or corrupt?); nothing was loaded: {err}") from err


def load_optimizer_file(path: str) -> dict[str, Any]:
    """
    Load an `optimizer.pt` on the CPU with `torch.load(weights_only=True)`, as Trainer does; a truncated or foreign
    file raises `ValueError` naming it.

    Args:
        path (`str`):
            The optimizer state file.

    Example:

    ```python
    >>> import os, tempfile, torch
    >>> from layerwise_hf.integrations.checkpoint import load_optimizer_file
    >>> path = os.path.join(tempfile.mkdtemp(), "optimizer.pt")
    >>> torch.save(torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1).state_dict(), path)
    >>> load_optimizer_file(path)["param_groups"][0]["lr"]
    0.1
    ```
    """
    try:
        # NOTE: memory-mapped: every rank checks the file before resuming, and a 7B AdamW state is tens of GB.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch raises several types for truncated or foreign files
        raise ValueError(f"{path} cannot be read as an optimizer state (truncated or corrupt?): {err}") from err


def is_transformers_dummy_state(state_dict: dict[str, Any]) -> bool:
    """
    Whether an optimizer state was saved by transformers' own `galore_*_layerwise` / `apollo_adamw_layerwise`: their
    Trainer optimizer is a `LayerWiseDummyOptimizer`, one group over one placeholder tensor and no state, so such a
    checkpoint holds no optimizer state at all.

    Example:

    ```python
    >>> import torch
    >>> from transformers.trainer_pt_utils import LayerWiseDummyOptimizer
    >>> from layerwise_hf.integrations.checkpoint import is_transformers_dummy_state
    >>> is_transformers_dummy_state(LayerWiseDummyOptimizer(lr=1e-3).state_dict())
    True
    ```
    """
    groups = state_dict.get("param_groups", [])
    return len(groups) == 1 and len(groups[0]["params"]) == 1 and "name" not in groups[0] and not state_dict["state"]


# ---- offline conversion ----


def _model_groups_names(checkpoint_dir: str) -> list[list[str]]:
    """Trainer's (decay, no-decay) name lists of the model saved in `checkpoint_dir`, built on the meta device."""
    import transformers
    from transformers import AutoConfig, Trainer

    if os.path.isfile(os.path.join(checkpoint_dir, "adapter_config.json")):
        raise ValueError(
            f"{checkpoint_dir} holds a PEFT adapter: its trainable set depends on the PEFT config. Resume the run "
            "with the other optimizer instead; conversion happens when the checkpoint is loaded."
        )
    config = AutoConfig.from_pretrained(checkpoint_dir)
    architectures = getattr(config, "architectures", None) or []
    model_cls = getattr(transformers, architectures[0], None) if architectures else None
    if model_cls is None:
        raise ValueError(f"{checkpoint_dir}/config.json names no model class transformers knows: {architectures}.")
    with torch.device("meta"):
        model = model_cls(config)
    decay = set(Trainer.get_decay_parameter_names(None, model))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return [[n for n in names if n in decay], [n for n in names if n not in decay]]


def convert_checkpoint(checkpoint_dir: str, to: str, output_dir: str | None = None) -> str:
    """
    Copy `checkpoint_dir` to `output_dir` with its `optimizer.pt` (and `scheduler.pt`) converted `to` "layerwise" or
    "standard". Never writes into the source checkpoint; refuses an existing `output_dir`. Returns `output_dir`.
    `layerwise-hf convert-checkpoint` runs it; resuming with the other optimizer converts on load anyway.

    Args:
        checkpoint_dir (`str`):
            A Trainer `checkpoint-N` directory with an `optimizer.pt` (a full model, not a PEFT adapter, when
            converting to "layerwise": the model is rebuilt on the meta device from its `config.json`).
        to (`str`):
            `"layerwise"` or `"standard"`.
        output_dir (`str`, *optional*):
            Where the copy goes; defaults to `<checkpoint_dir>-<to>`. Must not exist.

    Example:

    ```python
    >>> from layerwise_hf.integrations.checkpoint import convert_checkpoint
    >>> convert_checkpoint("out/checkpoint-500", to="layerwise")
    'out/checkpoint-500-layerwise'
    ```
    """
    if to not in ("layerwise", "standard"):
        raise ValueError(f"to={to!r}; choose 'layerwise' or 'standard'.")
    source = os.path.join(checkpoint_dir, OPTIMIZER_NAME)
    if not os.path.isfile(source):
        raise ValueError(f"{checkpoint_dir} has no {OPTIMIZER_NAME} to convert.")
    state_dict = load_optimizer_file(source)
    layerwise = is_layerwise_state_dict(state_dict)
    if layerwise == (to == "layerwise"):
        raise ValueError(f"{source} already is a {to} optimizer state.")
    if to == "layerwise":
        groups_names = _model_groups_names(checkpoint_dir)
        converted = standard_to_layerwise(state_dict, groups_names)
        source_group = [g for g, names in enumerate(groups_names) for _ in names]
    else:
        converted = layerwise_to_standard(state_dict)
        source_group = first_members(state_dict, standard_groups_of(state_dict))
    output_dir = output_dir or f"{checkpoint_dir.rstrip(os.sep)}-{to}"
    if os.path.exists(output_dir):
        raise ValueError(f"{output_dir} already exists; choose another --output_dir (nothing is overwritten).")
    shutil.copytree(checkpoint_dir, output_dir, ignore=shutil.ignore_patterns(OPTIMIZER_NAME, COMPLETE_MARKER))
    torch.save(converted, os.path.join(output_dir, OPTIMIZER_NAME))
    scheduler_file = os.path.join(output_dir, SCHEDULER_NAME)
    if os.path.isfile(scheduler_file):
        scheduler = torch.load(scheduler_file, weights_only=True)
        scheduler = convert_scheduler_state(scheduler, source_group, len(state_dict["param_groups"]))
        torch.save(scheduler, scheduler_file)
    mark_complete(output_dir, {"converted_to": to, "from": os.path.abspath(checkpoint_dir)})
    return output_dir


def _run_convert(args) -> int:
    import sys

    try:
        print(convert_checkpoint(args.checkpoint, args.to, args.output_dir))
    except ValueError as err:
        print(f"layerwise-hf convert-checkpoint: error: {err}", file=sys.stderr)
        return 2
    return 0


def register(subparsers) -> None:
    """
    Add the `convert-checkpoint` subcommand to the `layerwise-hf` command line.

    Args:
        subparsers (`argparse._SubParsersAction`):
            What `parser.add_subparsers()` returned.

    Example:

    ```python
    >>> from layerwise_hf.cli import build_parser  # registers this subcommand with the others
    >>> build_parser().parse_args(["convert-checkpoint", "out/checkpoint-4", "--to", "standard"]).to
    'standard'
    ```
    """
    parser = subparsers.add_parser(
        "convert-checkpoint",
        help="convert a Trainer checkpoint's optimizer state between X and X_layerwise",
        description="Copy a Trainer checkpoint with its optimizer.pt converted, so a run can switch between a "
        "standard optimizer and its _layerwise form on resume (the conversion also happens automatically on load).",
    )
    parser.add_argument("checkpoint", help="a checkpoint-N directory")
    parser.add_argument("--to", required=True, choices=["layerwise", "standard"], help="the target format")
    parser.add_argument("--output_dir", default=None, help="defaults to CHECKPOINT-<to>; must not exist")
    parser.set_defaults(func=_run_convert)
