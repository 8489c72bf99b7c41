"""2 or 3 ranks with the DDP config: LayerwiseTrainer (the data-parallel route: no DDP wrapper, no persistent
buckets) equals Trainer + DDP + the standard optimizer (params, grad_norm, lr), replicas stay identical, and save ->
resume equals the uninterrupted run. Writes a JSON report (rank 0).

    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/accelerate/cpu_ddp.yaml \
        tests/distributed/ddp_trainer.py REPORT.json
"""

import os
import sys
import tempfile
from unittest import mock

import torch
import torch.distributed as dist
from common import (
    dataset,
    finish_ranks,
    max_diff,
    ranks_agree,
    set_ddp_settings,
    summary,
    tiny_llama,
    training_args,
    write_report,
)
from transformers import Trainer, TrainerCallback

from layerwise_hf import LayerwiseTrainer
from layerwise_hf.platform.compat import checkpointing_kwargs

torch.set_num_threads(1)


def run(
    optim,
    out,
    *,
    ga=1,
    sync_each_batch=False,
    max_grad_norm=0.0,
    max_steps=4,
    save_steps=None,
    resume=None,
    model_kwargs=None,
    bucket_cap_mb=None,
    unused=False,
    perturb_buffers=False,
    frozen=(),
    **extra_args,
):
    model = tiny_llama(**(model_kwargs or {}))
    if unused == "first_micro_batch":
        add_parameter_used_in_first_micro_batches(model)
    elif unused:
        add_unused_parameters(model)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    args = training_args(
        out,
        optim,
        ga=ga,
        max_grad_norm=max_grad_norm,
        max_steps=max_steps,
        save_steps=save_steps,
        accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": sync_each_batch}},
        **({"ddp_find_unused_parameters": True} if unused else {}),
        **extra_args,
    )
    data = dataset(vocab=(model_kwargs or {}).get("vocab", 64))
    trainer_cls = LayerwiseTrainer if args.is_layerwise else Trainer
    callbacks = [PerturbBuffersOnRank1()] if perturb_buffers else None
    trainer = trainer_cls(model=model, args=args, train_dataset=data, callbacks=callbacks)
    if bucket_cap_mb is not None:
        # TrainingArguments takes whole MiB only; the tiny model needs a smaller cap to make several buckets.
        set_ddp_settings(trainer, bucket_cap_mb=bucket_cap_mb)
    trainer.train(resume_from_checkpoint=resume)
    # Steps logged, whether or not grad_norm is (transformers < 5.3 logs it only when it clips).
    steps = sum("learning_rate" in h for h in trainer.state.log_history)
    return {**summary(trainer, model), "wrapped": type(trainer.model_wrapped).__name__, "steps": steps}


class PerturbBuffersOnRank1(TrainerCallback):
    """Before every step, rank 1's rotary buffer drifts: DDP's per-forward buffer broadcast (broadcast_buffers) puts
    rank 0's back before the forward, so the run only matches standard DDP if that broadcast happens."""

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if dist.get_rank() == 1:
            for name, buf in model.named_buffers():
                if name.endswith("inv_freq"):
                    buf.mul_(1.5)


QUICK = {
    "adamw_torch ga2 exact clip",
    "adamw_torch ga2 sync_each_batch",
    "adamw_torch ga1 unused parameters",
    "adamw_torch ga1 buffers broadcast",
    "adamw_torch ga1 activation checkpointing",
}


def add_unused_parameters(model):
    """One parameter no rank uses (it must keep .grad None and never step: weight decay would move it), and one
    that only rank 0 uses (the others contribute zeros to its average, as with DDP's find_unused_parameters)."""
    model.unused_everywhere = torch.nn.Parameter(torch.ones(4, 4))
    model.used_on_rank0 = torch.nn.Parameter(torch.ones(4, 4))

    def add_rank0_term(module, args, output):
        if dist.get_rank() == 0:
            output.loss = output.loss + 1e-2 * module.used_on_rank0.square().sum()
        return output

    model.register_forward_hook(add_rank0_term)


def add_parameter_used_in_first_micro_batches(model):
    """A parameter used in every micro-batch of a window but the last (the one that reduces): its accumulated
    gradient must be reduced all the same, as DDP reduces any defined .grad."""
    model.early_only = torch.nn.Parameter(torch.ones(4, 4))
    calls = [0]

    def add_term(module, args, output):
        if module.training and torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] % 2 == 1:  # GA 2: the first micro-batch of each window
                output.loss = output.loss + 1e-2 * module.early_only.square().sum()
        return output

    model.register_forward_hook(add_term)


def compare(name, standard, layerwise):
    return {
        "case": name,
        "max_diff": max_diff(standard["params"], layerwise["params"]),
        "grad_norm_equal": standard["grad_norm"] == layerwise["grad_norm"],
        "lr_equal": standard["lr"] == layerwise["lr"],
        "ranks_agree": ranks_agree(layerwise["params"]),
        "wrapped": layerwise["wrapped"],
        "route": layerwise["route"],
        "steps_logged": layerwise["steps"],
    }


def main(report_path, quick=False):
    results = []
    big = {"vocab": 256, "hidden": 64}  # bitsandbytes quantizes tensors of >= 4096 elements
    cases = [
        (f"{base} ga{ga}{' exact clip' if clip else ''}", base, {"ga": ga, "max_grad_norm": clip, **extra})
        for base, extra in [("adamw_torch", {}), ("adamw_8bit", {"model_kwargs": big}), ("adafactor", {}), ("sgd", {})]
        for ga in (1, 2)
        for clip in (0.0, 0.5)
    ]
    cases += [
        ("adamw_torch ga2 sync_each_batch", "adamw_torch", {"ga": 2, "sync_each_batch": True}),
        # Several buckets, each tensor alone in its bucket, and a parameter unused on some or all ranks.
        ("adamw_torch ga1 small buckets", "adamw_torch", {"bucket_cap_mb": 0.01, "max_grad_norm": 0.5}),
        ("adamw_torch ga2 bucket per tensor", "adamw_torch", {"ga": 2, "bucket_cap_mb": 0.0}),
        ("adamw_torch ga1 unused parameters", "adamw_torch", {"unused": True, "bucket_cap_mb": 0.01}),
        ("adamw_torch ga1 buffers broadcast", "adamw_torch", {"perturb_buffers": True}),
        # Trainer turns find_unused_parameters off with activation checkpointing: DDP then rebuilds its buckets in
        # the order gradients became ready, and so does the data-parallel route.
        (
            "adamw_torch ga1 activation checkpointing",
            "adamw_torch",
            {**checkpointing_kwargs(True), "bucket_cap_mb": 0.01, "max_grad_norm": 0.5},
        ),
        ("adamw_torch ga1 torch_compile", "adamw_torch", {"torch_compile": True, "max_grad_norm": 0.5}),
        (
            "adamw_torch ga2 parameter unused in the last micro-batch",
            "adamw_torch",
            {"ga": 2, "unused": "first_micro_batch"},
        ),
        # The first gradients ready come from inside a reentrant checkpoint's nested backward (head and final norm
        # frozen): the route's end-of-backward work must still wait for the whole backward.
        (
            "adamw_torch ga1 reentrant checkpointing, head frozen",
            "adamw_torch",
            {
                **checkpointing_kwargs(True, {"use_reentrant": True}),
                "frozen": ("lm_head.weight", "model.norm.weight"),
                "bucket_cap_mb": 0.01,
            },
        ),
    ]
    if quick:  # the fast tier: one optimizer, the mechanisms (accumulation, clipping, buckets, unused parameters)
        cases = [c for c in cases if c[1] == "adamw_torch" and c[0] in QUICK]
    for name, base, kwargs in cases:
        with tempfile.TemporaryDirectory() as d:
            standard = run(base, d, **kwargs)
            layerwise = run(f"{base}_layerwise", d, **kwargs)
            result = compare(name, standard, layerwise)
            if dist.get_world_size() > 2:
                # Beyond 2 ranks gloo's ring sums each element in an order that depends on where it sits in the
                # buffer: the scale of that rounding is standard DDP against itself with another bucket cap.
                other = run(base, d, **{**kwargs, "bucket_cap_mb": 0.0 if kwargs.get("bucket_cap_mb") else 0.01})
                result["standard_vs_other_bucket_cap"] = max_diff(standard["params"], other["params"])
        if kwargs.get("unused") is True:
            result["unused_everywhere_unchanged"] = bool(
                torch.equal(layerwise["params"]["unused_everywhere"], torch.ones(4, 4))
            )
        results.append(result)

    # Save at step 2, resume in a fresh trainer: equal to the uninterrupted 4 steps.
    out = os.path.join(os.path.dirname(report_path), "ddp_resume")
    full_run = run("adamw_torch_layerwise", out, max_steps=4, save_steps=2)
    resumed = run("adamw_torch_layerwise", out + "_b", max_steps=4, resume=os.path.join(out, "checkpoint-2"))
    # The resumed state's log history starts with the checkpoint's two entries.
    results.append(compare("resume", full_run, resumed))
    # A checkpoint written by the previous route (the model wrapped in DDP, gradients stepped from DDP's comm hook)
    # resumes on the new one.
    old = os.path.join(os.path.dirname(report_path), "ddp_old_route")
    with mock.patch("layerwise_hf.integrations.trainer._replicate_without_ddp", lambda accelerator, model: None):
        before = run("adamw_torch_layerwise", old, max_steps=4, save_steps=2)
    resumed_old = run("adamw_torch_layerwise", old + "_b", max_steps=4, resume=os.path.join(old, "checkpoint-2"))
    results.append(
        {**compare("resume from the DDP comm-hook route", full_run, resumed_old), "saved_by": before["route"]}
    )
    write_report(report_path, {"results": results})


if __name__ == "__main__":
    main(sys.argv[-1], quick="--quick" in sys.argv[1:-1])
    finish_ranks()
