"""2 FSDP2 ranks: LayerwiseTrainer equals Trainer + the standard optimizer under FSDP2 (params, grad_norm), the
model really is fully_shard'ed, save -> resume (DCP) equals uninterrupted, and non-elementwise optimizers are refused.

    LAYERWISE_HF_FORCE_FSDP_CPU=1 ACCELERATE_USE_CPU=true accelerate launch \
        --config_file configs/accelerate/cpu_fsdp2.yaml tests/distributed/fsdp2_trainer.py REPORT.json
"""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from common import dataset, finish_ranks, max_diff, params, ranks_agree, tiny_llama
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments  # applies LAYERWISE_HF_FORCE_FSDP_CPU

torch.set_num_threads(1)


def run(optim, out, *, ga=1, max_grad_norm=0.0, max_steps=4, save_steps=None, resume=None):
    model = tiny_llama()
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
    )
    trainer = LayerwiseTrainer(model=model, args=args, train_dataset=dataset())
    trainer.train(resume_from_checkpoint=resume)
    wrapped = trainer.model_wrapped
    optimizer = trainer.layerwise_optimizer
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    return {
        "params": params(wrapped),
        "grad_norm": [float(h["grad_norm"]) for h in logs],
        "lr": [h["learning_rate"] for h in logs],
        "fully_sharded": isinstance(wrapped, FSDPModule) and all(isinstance(p, DTensor) for p in wrapped.parameters()),
        "route": optimizer.route if optimizer is not None else None,
    }


def compare(name, standard, layerwise):
    return {
        "case": name,
        "max_diff": max_diff(standard["params"], layerwise["params"]),
        "grad_norm_equal": standard["grad_norm"] == layerwise["grad_norm"],
        "lr_equal": standard["lr"] == layerwise["lr"],
        "ranks_agree": ranks_agree(layerwise["params"]),
        "fully_sharded": standard["fully_sharded"] and layerwise["fully_sharded"],
        "route": layerwise["route"],
        "steps_logged": len(layerwise["grad_norm"]),
    }


def main(report_path):
    results = []
    for name, kwargs in [("ga1", {}), ("ga2", {"ga": 2}), ("ga1 exact clip", {"max_grad_norm": 0.5})]:
        with tempfile.TemporaryDirectory() as d:
            standard = run("adamw_torch", d, **kwargs)
            layerwise = run("adamw_torch_layerwise", d, **kwargs)
        results.append(compare(f"adamw_torch {name}", standard, layerwise))
    with tempfile.TemporaryDirectory() as d:
        results.append(compare("sgd ga1", run("sgd", d), run("sgd_layerwise", d)))

    out = os.path.join(os.path.dirname(report_path), "fsdp2_resume")
    full_run = run("adamw_torch_layerwise", out, save_steps=2)
    resumed = run("adamw_torch_layerwise", out + "_b", resume=os.path.join(out, "checkpoint-2"))
    results.append(compare("resume", full_run, resumed))

    try:
        with tempfile.TemporaryDirectory() as d:
            run("adafactor_layerwise", d, max_steps=1)
        refusal = None
    except ValueError as err:
        refusal = str(err)
    if dist.get_rank() == 0:
        with open(report_path, "w") as f:
            json.dump({"world_size": dist.get_world_size(), "results": results, "adafactor": refusal}, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    finish_ranks()
