"""Checkpoint formats and safety: conversion between standard and layer-wise optimizer states, complete-checkpoint
markers, and the `layerwise-hf convert-checkpoint` command.

A standard Trainer optimizer state has two param groups (Trainer's weight-decay group, then the no-decay group),
each listing its parameters in `model.named_parameters()` order; a layer-wise state has one named group per
parameter. Both hold the same per-parameter state for the same optimizer class, so either converts to the other
and training continues identically.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import torch

logger = logging.getLogger(__name__)

STATE_DICT_KEY = "layerwise_hf"
COMPLETE_MARKER = "layerwise_complete.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"


def is_layerwise_state_dict(state_dict: dict[str, Any]) -> bool:
    groups = state_dict.get("param_groups", [])
    return bool(groups) and all("name" in g for g in groups)


def standard_to_layerwise(state_dict: dict[str, Any], groups_names: list[list[str]]) -> dict[str, Any]:
    """
    Convert a standard optimizer state to the layer-wise layout.

    Args:
        state_dict (`dict`):
            `optimizer.state_dict()` of a standard optimizer.
        groups_names (`list[list[str]]`):
            The parameter names of each of its param groups, in order (Trainer: decay group, then no-decay group).
    """
    groups = state_dict["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    expected = [len(names) for names in groups_names]
    if sizes != expected:
        raise ValueError(
            f"The standard optimizer state has param groups of sizes {sizes}, but this model's trainable parameters "
            f"form groups of sizes {expected} (Trainer's weight-decay split): it was saved for another model or "
            "another set of trainable parameters."
        )
    state, out_groups, names = {}, [], []
    for group, group_names in zip(groups, groups_names):
        hyper = {k: v for k, v in group.items() if k != "params"}
        for saved_id, name in zip(group["params"], group_names):
            i = len(out_groups)
            if saved_id in state_dict["state"]:
                state[i] = state_dict["state"][saved_id]
            out_groups.append({**hyper, "name": name, "params": [i]})
            names.append(name)
    return {"state": state, "param_groups": out_groups, STATE_DICT_KEY: {"converted_from": "standard", "names": names}}


def standard_groups_of(state_dict: dict[str, Any]) -> list[list[str]]:
    """Trainer's (decay, no-decay) name lists recorded in a layer-wise state."""
    groups = state_dict["param_groups"]
    decay = state_dict.get(STATE_DICT_KEY, {}).get("in_decay_group")
    if decay is None:
        raise ValueError("This layer-wise state does not record Trainer's weight-decay split; pass groups_names.")
    return [[g["name"] for g, d in zip(groups, decay) if d], [g["name"] for g, d in zip(groups, decay) if not d]]


def first_members(state_dict: dict[str, Any], groups_names: list[list[str]]) -> list[int]:
    """For each target group, the index of the saved per-parameter group of its first member."""
    index = {g["name"]: i for i, g in enumerate(state_dict["param_groups"])}
    return [index[names[0]] if names else 0 for names in groups_names]


def layerwise_to_standard(state_dict: dict[str, Any], groups_names: list[list[str]] | None = None) -> dict[str, Any]:
    """
    Convert a layer-wise optimizer state to a standard optimizer's layout.

    Args:
        state_dict (`dict`):
            `LayerwiseOptimizer.state_dict()`.
        groups_names (`list[list[str]]`, *optional*):
            The names in each param group of the target optimizer, in order. Defaults to Trainer's split recorded in
            the checkpoint (weight-decay group, then no-decay group).
    """
    groups = state_dict["param_groups"]
    by_name = {g["name"]: g for g in groups}
    if groups_names is None:
        groups_names = standard_groups_of(state_dict)
    wanted = [n for names in groups_names for n in names]
    missing = sorted(set(wanted) - set(by_name))
    unexpected = sorted(set(by_name) - set(wanted))
    if missing or unexpected:
        raise ValueError(
            f"The layer-wise state does not match the standard optimizer's parameters. Missing: {missing or 'none'}. "
            f"Unexpected: {unexpected or 'none'}."
        )
    state, out_groups, k = {}, [], 0
    for names in groups_names:
        ids = []
        for name in names:
            (saved_id,) = by_name[name]["params"]
            if saved_id in state_dict["state"]:
                state[k] = state_dict["state"][saved_id]
            ids.append(k)
            k += 1
        # Every member of a Trainer group shares its hyperparameters; take them from the first.
        hyper = {key: v for key, v in by_name[names[0]].items() if key not in ("params", "name")} if names else {}
        out_groups.append({**hyper, "params": ids})
    return {"state": state, "param_groups": out_groups}


def convert_scheduler_state(state_dict: dict[str, Any], source_group: list[int], num_source_groups: int):
    """
    Re-index the per-param-group lists of an LR scheduler state (`base_lrs`, `_last_lr`, `lr_lambdas`, ...) for an
    optimizer whose group `k` takes the values of the saved group `source_group[k]`.
    """
    out = {}
    for key, value in state_dict.items():
        if isinstance(value, list) and len(value) == num_source_groups:
            value = [value[g] for g in source_group]
        out[key] = value
    return out


# ---- complete checkpoints ----


def mark_complete(checkpoint_dir: str, info: dict[str, Any] | None = None) -> None:
    """Written last, atomically: a checkpoint without it was interrupted while being written."""
    tmp = os.path.join(checkpoint_dir, COMPLETE_MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(info or {}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(checkpoint_dir, COMPLETE_MARKER))


def is_complete(checkpoint_dir: str) -> bool:
    return os.path.isfile(os.path.join(checkpoint_dir, COMPLETE_MARKER))


def latest_complete_checkpoint(run_dir: str) -> str | None:
    """The newest `checkpoint-N` that this plugin marked complete; interrupted ones are skipped with a warning."""
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


def check_checkpoint(checkpoint_dir: str) -> None:
    """Clear errors for a checkpoint that cannot be resumed from, before anything is loaded."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    if not os.path.isdir(checkpoint_dir):
        raise ValueError(f"resume_from_checkpoint={checkpoint_dir!r} is not a directory.")
    state_file = os.path.join(checkpoint_dir, "trainer_state.json")
    try:
        with open(state_file) as f:
            json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{checkpoint_dir} is incomplete or corrupt ({os.path.basename(state_file)}: {err}); it was probably "
            "interrupted while being written. Resume from an earlier checkpoint, or pass resume_from_checkpoint=True "
            f"to take the newest complete {PREFIX_CHECKPOINT_DIR}-N."
        ) from err
    optimizer_file = os.path.join(checkpoint_dir, OPTIMIZER_NAME)
    if os.path.isfile(optimizer_file):
        load_optimizer_file(optimizer_file)


def load_optimizer_file(path: str) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for truncated or foreign files
        raise ValueError(f"{path} cannot be read as an optimizer state (truncated or corrupt?): {err}") from err


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
    Copy `checkpoint_dir` to `output_dir` with its `optimizer.pt` converted `to` "layerwise" or "standard".
    Never writes into the source checkpoint; refuses an existing `output_dir`.
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
    """Add the `convert-checkpoint` subcommand."""
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
