"""Two launchers as two nodes on one machine (2 ranks each, 4 in all, gloo, FSDP2): LayerwiseTrainer +
adamw_torch_layerwise equals stock Trainer + adamw_torch (every parameter, the logged grad_norm and lr) at GA 1 and
at GA 2 with clipping, in the same launch. Run one launcher per node, the same command but for `--machine_rank`:

    LAYERWISE_HF_FORCE_FSDP_CPU=1 ACCELERATE_USE_CPU=true accelerate launch \
        --config_file configs/accelerate/cpu_fsdp2.yaml --num_machines 2 --machine_rank R \
        --main_process_ip 127.0.0.1 --main_process_port P --num_processes 4 tests/distributed/two_nodes.py REPORT.json

The report also says which launcher (node) each rank came from, so that a run on one launcher cannot pass for two.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from common import dataset, finish_ranks, max_diff, ranks_agree, summary, tiny_llama, training_args, write_report
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import Trainer

from layerwise_hf import LayerwiseTrainer  # applies LAYERWISE_HF_FORCE_FSDP_CPU

torch.set_num_threads(1)
# (name, GA, max_grad_norm): one sample a micro-batch under GA 2, two per step as at GA 1.
CASES = [("ga1", 1, 0.0), ("ga2 clip1.0", 2, 1.0)]


def run(trainer_cls, optim, out, *, ga, max_grad_norm):
    args = training_args(
        out, optim, ga=ga, max_grad_norm=max_grad_norm, max_steps=3, per_device_train_batch_size=2 // ga
    )
    trainer = trainer_cls(model=tiny_llama(), args=args, train_dataset=dataset())
    trainer.train()
    wrapped = trainer.model_wrapped
    return {
        **summary(trainer, wrapped),
        "fully_sharded": isinstance(wrapped, FSDPModule) and all(isinstance(p, DTensor) for p in wrapped.parameters()),
    }


def main(report_path):
    results = []
    for name, ga, clip in CASES:
        with tempfile.TemporaryDirectory() as d:
            standard = run(Trainer, "adamw_torch", d, ga=ga, max_grad_norm=clip)
            layerwise = run(LayerwiseTrainer, "adamw_torch_layerwise", d, ga=ga, max_grad_norm=clip)
        results.append(
            {
                "case": f"adamw_torch {name}",
                "max_grad_norm": clip,
                "max_diff": max_diff(standard["params"], layerwise["params"]),
                "grad_norm": [standard["grad_norm"], layerwise["grad_norm"]],
                "lr_equal": standard["lr"] == layerwise["lr"],
                "ranks_agree": ranks_agree(layerwise["params"]),
                "fully_sharded": standard["fully_sharded"] and layerwise["fully_sharded"],
                "route": layerwise["route"],
            }
        )
        if dist.get_rank() == 0:
            print(results[-1], flush=True)
    # Each rank's node as torchrun numbered it, its rank on that node, and its launcher's process.
    ranks = [None] * dist.get_world_size()
    me = {k: int(os.environ[k]) for k in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    dist.all_gather_object(ranks, {**me, "launcher": os.getppid()})
    write_report(report_path, {"results": results, "ranks": ranks})


if __name__ == "__main__":
    main(sys.argv[1])
    finish_ranks()
