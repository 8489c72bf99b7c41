"""2 DDP ranks: LayerwiseTrainer equals Trainer + the standard optimizer (params, grad_norm, lr), replicas stay
identical, and save -> resume equals the uninterrupted run. Writes a JSON report (rank 0).

    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/accelerate/cpu_ddp.yaml \
        tests/distributed/ddp_trainer.py REPORT.json
"""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from common import dataset, finish_ranks, max_diff, params, ranks_agree, tiny_llama
from transformers import Trainer

from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments

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
):
    model = tiny_llama(**(model_kwargs or {}))
    args = LayerwiseTrainingArguments(
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
        accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": sync_each_batch}},
    )
    data = dataset(vocab=(model_kwargs or {}).get("vocab", 64))
    trainer_cls = LayerwiseTrainer if args.is_layerwise else Trainer
    trainer = trainer_cls(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=resume)
    optimizer = trainer.layerwise_optimizer if args.is_layerwise else None
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    return {
        "params": params(model),
        "grad_norm": [float(h["grad_norm"]) for h in logs],
        "lr": [h["learning_rate"] for h in logs],
        "wrapped": type(trainer.model_wrapped).__name__,
        "route": optimizer.route if optimizer is not None else None,
    }


def compare(name, standard, layerwise):
    return {
        "case": name,
        "max_diff": max_diff(standard["params"], layerwise["params"]),
        "grad_norm_equal": standard["grad_norm"] == layerwise["grad_norm"],
        "lr_equal": standard["lr"] == layerwise["lr"],
        "ranks_agree": ranks_agree(layerwise["params"]),
        "wrapped": layerwise["wrapped"],
        "route": layerwise["route"],
        "steps_logged": len(layerwise["grad_norm"]),
    }


def main(report_path):
    results = []
    big = {"vocab": 256, "hidden": 64}  # bitsandbytes quantizes tensors of >= 4096 elements
    cases = [
        ("adamw_torch ga1", "adamw_torch", {}),
        ("adamw_torch ga2", "adamw_torch", {"ga": 2}),
        ("adamw_torch ga2 sync_each_batch", "adamw_torch", {"ga": 2, "sync_each_batch": True}),
        ("adamw_torch ga1 exact clip", "adamw_torch", {"max_grad_norm": 0.5}),
        ("adamw_torch ga2 exact clip", "adamw_torch", {"ga": 2, "max_grad_norm": 0.5}),
        ("adamw_8bit ga1", "adamw_8bit", {"model_kwargs": big}),
        ("adamw_8bit ga2", "adamw_8bit", {"ga": 2, "model_kwargs": big}),
    ]
    for name, base, kwargs in cases:
        with tempfile.TemporaryDirectory() as d:
            standard = run(base, d, **kwargs)
            layerwise = run(f"{base}_layerwise", d, **kwargs)
        results.append(compare(name, standard, layerwise))

    # Save at step 2, resume in a fresh trainer: equal to the uninterrupted 4 steps.
    out = os.path.join(os.path.dirname(report_path), "ddp_resume")
    full_run = run("adamw_torch_layerwise", out, max_steps=4, save_steps=2)
    resumed = run("adamw_torch_layerwise", out + "_b", max_steps=4, resume=os.path.join(out, "checkpoint-2"))
    results.append(
        {
            "case": "resume",
            "max_diff": max_diff(full_run["params"], resumed["params"]),
            # The resumed state's log history starts with the checkpoint's two entries.
            "grad_norm_equal": full_run["grad_norm"] == resumed["grad_norm"],
            "lr_equal": full_run["lr"] == resumed["lr"],
            "ranks_agree": ranks_agree(resumed["params"]),
            "wrapped": resumed["wrapped"],
            "route": resumed["route"],
            "steps_logged": len(resumed["grad_norm"]),
        }
    )
    if dist.get_rank() == 0:
        with open(report_path, "w") as f:
            json.dump({"world_size": dist.get_world_size(), "results": results}, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    finish_ranks()
