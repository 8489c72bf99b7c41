"""2 gloo ranks with host offload (issue 19): LayerwiseTrainer with layerwise_offload="gradients" / "optimizer"
equals Trainer + the standard optimizer under the DDP config (the data-parallel route) and under FSDP2 (each rank
offloads its local shards): every parameter, grad_norm, lr; the replicas agree. Offload runs through the CPU stand-in
of the side stream with a delay on every copy (LAYERWISE_HF_OFFLOAD_SIMULATE / _DELAY, set by the test).

    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/accelerate/cpu_ddp.yaml \
        tests/distributed/offload_trainer.py ddp quick REPORT.json
    LAYERWISE_HF_FORCE_FSDP_CPU=1 ACCELERATE_USE_CPU=true accelerate launch \
        --config_file configs/accelerate/cpu_fsdp2.yaml tests/distributed/offload_trainer.py fsdp2 quick REPORT.json
"""

import sys
import tempfile

import torch
from common import dataset, finish_ranks, max_diff, ranks_agree, summary, tiny_llama, training_args, write_report
from torch.distributed.tensor import DTensor
from transformers import Trainer

from layerwise_hf import LayerwiseTrainer  # applies LAYERWISE_HF_FORCE_FSDP_CPU

torch.set_num_threads(1)


def run(optim, out, *, ga, clip, offload="none"):
    model = tiny_llama()
    extra = {"layerwise_offload": offload} if optim.endswith("_layerwise") else {}
    args = training_args(out, optim, ga=ga, max_grad_norm=clip, **extra)
    trainer = (LayerwiseTrainer if args.is_layerwise else Trainer)(model=model, args=args, train_dataset=dataset())
    trainer.train()
    return {
        **summary(trainer, model),  # fully_shard works in place; DDP wraps the model, whose names it prefixes
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "host_steps": type(trainer.layerwise_optimizer.inner[0]).__name__ if args.is_layerwise else None,
    }


def compare(name, standard, layerwise):
    return {
        "case": name,
        "max_diff": max_diff(standard["params"], layerwise["params"]),
        "grad_norm_equal": standard["grad_norm"] == layerwise["grad_norm"],
        "lr_equal": standard["lr"] == layerwise["lr"],
        "ranks_agree": ranks_agree(layerwise["params"]),
        "route": layerwise["route"],
        "sharded": layerwise["sharded"],
        "host_steps": layerwise["host_steps"],
        "steps_logged": len(layerwise["grad_norm"]),
    }


def main(route, quick, report_path):
    bases = ["adamw_torch", "sgd"] if route == "fsdp2" else ["adamw_torch", "adafactor", "sgd"]
    cases = [(base, ga, clip) for base in bases for ga in (1, 4) for clip in (0.0, 1.0)]
    if quick:
        cases = [("adamw_torch", 4, 1.0), ("sgd", 1, 1.0)]
    results = []
    for base, ga, clip in cases:
        with tempfile.TemporaryDirectory() as d:
            standard = run(base, d, ga=ga, clip=clip)
            for mode in ("gradients", "optimizer"):
                layerwise = run(f"{base}_layerwise", d, ga=ga, clip=clip, offload=mode)
                results.append(compare(f"{mode} {base} ga{ga} clip{clip}", standard, layerwise))
    write_report(report_path, {"results": results})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "quick", sys.argv[3])
    finish_ranks()
