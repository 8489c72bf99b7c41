"""Shared by the 2-rank scripts: a tiny model, rank-aware data, cross-rank checks."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from helpers import finish_ranks, freeze_imported_objects, tiny_llama  # noqa: E402, F401  (re-exported)

freeze_imported_objects()

VOCAB = 64  # as helpers.tiny_llama
SEQ = 8


def dataset(n: int = 64, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(123)
    return [{"input_ids": (ids := torch.randint(0, vocab, (SEQ,), generator=g)), "labels": ids} for _ in range(n)]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def params(model) -> dict[str, torch.Tensor]:
    return {n: full(p.detach()).clone() for n, p in model.named_parameters()}


def ranks_agree(tensors: dict[str, torch.Tensor]) -> bool:
    flat = torch.cat([t.flatten().float() for t in tensors.values()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0 for k in a)


def training_args(out: str, optim: str, *, ga=1, max_grad_norm=0.0, max_steps=4, save_steps=None, **overrides):
    """The TrainingArguments every 2-rank script trains with; `overrides` for what a script changes."""
    from layerwise_hf import LayerwiseTrainingArguments

    kwargs = dict(
        output_dir=out,
        optim=optim,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ga,
        max_steps=max_steps,
        learning_rate=1e-2,
        weight_decay=0.1,
        warmup_steps=1,
        lr_scheduler_type="cosine",
        max_grad_norm=max_grad_norm,
        logging_steps=1,
        report_to="none",
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        use_cpu=True,
        disable_tqdm=True,
        seed=7,
    )
    return LayerwiseTrainingArguments(**{**kwargs, **overrides})


def summary(trainer, model) -> dict:
    """What a script compares between runs: full parameters, logged grad_norm and lr, the route taken."""
    optimizer = getattr(trainer, "layerwise_optimizer", None)
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    return {
        "params": params(model),
        "grad_norm": [float(h["grad_norm"]) for h in logs],
        "lr": [h["learning_rate"] for h in logs],
        "route": optimizer.route if optimizer is not None else None,
    }


def write_report(report_path: str, report: dict) -> None:
    if dist.get_rank() == 0:
        with open(report_path, "w") as f:
            json.dump({"world_size": dist.get_world_size(), **report}, f, indent=1)
    dist.barrier()


def set_ddp_settings(trainer, bucket_cap_mb: float, gradient_as_bucket_view: bool | None = None) -> None:
    """DDP settings TrainingArguments cannot express (a fractional bucket_cap_mb, gradient_as_bucket_view), given to
    the Trainer's DDP handler. transformers < 5.3 makes that handler from the arguments only when it wraps the model,
    after the optimizer is made (layerwise_hf.platform.compat): there the cap goes into the arguments, and
    gradient_as_bucket_view onto the handler once it is made."""
    accelerator = trainer.accelerator
    from transformers import Trainer

    # transformers >= 5.3 (which has Trainer._clip_grad_norm; LayerwiseTrainer defines one on every version): the
    # handler exists from the start.
    if hasattr(Trainer, "_clip_grad_norm"):
        accelerator.ddp_handler.bucket_cap_mb = bucket_cap_mb
        if gradient_as_bucket_view is not None:
            accelerator.ddp_handler.gradient_as_bucket_view = gradient_as_bucket_view
        return
    trainer.args.ddp_bucket_cap_mb = bucket_cap_mb
    if gradient_as_bucket_view is None:
        return
    wrap_model = trainer._wrap_model

    def _wrap_model(*args, **kwargs):
        model = wrap_model(*args, **kwargs)
        if accelerator.ddp_handler is not None:
            accelerator.ddp_handler.gradient_as_bucket_view = gradient_as_bucket_view
        return model

    trainer._wrap_model = _wrap_model


def mesh_args(mesh: str) -> dict:
    """Trainer arguments of a mesh made by Accelerate: HSDP 2 x 2 (`ParallelismConfig` with the FSDP2 config); other
    meshes (tensor parallel) come from the model's load, and add none."""
    if mesh != "hsdp":
        return {}
    from accelerate import ParallelismConfig

    return dict(
        parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2),
        fsdp="full_shard",
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )
