"""FSDP2 checkpoints of a layer-wise optimizer resume on another number of ranks (DCP reshards every per-parameter
state). Two launches:

    LAYERWISE_HF_FORCE_FSDP_CPU=1 ACCELERATE_USE_CPU=true accelerate launch --config_file \
        configs/accelerate/cpu_fsdp2.yaml --num_processes 2 tests/distributed/fsdp2_reshard.py save OUT/saved.json
    ... same with --num_processes 3 ... tests/distributed/fsdp2_reshard.py resume OUT/report.json

`save` trains 4 steps on 2 ranks (3 samples each), checkpointing at step 2, and keeps the final weights and AdamW
moments. `resume` continues from that step-2 checkpoint on 3 ranks (2 samples each: the same 6 samples per step) to
step 4 and writes its report comparing with the uninterrupted run. The gradient is the same mean over the same
samples, summed in another order, so the comparison has a tolerance; the AdamW step counter must say 4 (2 saved +
2 resumed), which a fresh optimizer state would not.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from common import dataset, finish_ranks, full, params, tiny_llama
from transformers import TrainerCallback

from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments  # applies LAYERWISE_HF_FORCE_FSDP_CPU

torch.set_num_threads(1)
GLOBAL_BATCH = 6


class WeightsAt(TrainerCallback):
    def __init__(self, step):
        self.step, self.weights = step, None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            self.weights = params(model)  # every rank: full_tensor() is a collective


def train(out, resume=None):
    world = int(os.environ["WORLD_SIZE"])  # before Trainer initializes the process group
    args = LayerwiseTrainingArguments(
        output_dir=out,
        optim="adamw_torch_layerwise",
        per_device_train_batch_size=GLOBAL_BATCH // world,
        max_steps=4,
        learning_rate=1e-2,
        # A large eps keeps AdamW's update smooth in the gradient, so reordered sums stay within the tolerance.
        adam_epsilon=1e-3,
        weight_decay=0.1,
        warmup_steps=1,
        lr_scheduler_type="cosine",
        max_grad_norm=0.5,
        logging_steps=1,
        report_to="none",
        save_strategy="steps",
        save_steps=2,
        use_cpu=True,
        disable_tqdm=True,
        seed=7,
    )
    at_step_2 = WeightsAt(2)
    trainer = LayerwiseTrainer(model=tiny_llama(), args=args, train_dataset=dataset(), callbacks=[at_step_2])
    trainer.train(resume_from_checkpoint=resume)
    optimizer = trainer.layerwise_optimizer
    moments = {}
    steps = set()
    for name, inner in zip(optimizer.names, optimizer.inner):
        (state,) = inner.state.values()
        moments[name] = full(state["exp_avg"]).clone()
        steps.add(float(state["step"]))
    return {
        "params": params(trainer.model_wrapped),
        "exp_avg": moments,
        "adam_steps": sorted(steps),
        "grad_norm": [float(h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h],
        "world_size": world,
        "at_step_2": at_step_2.weights,
    }


def rel_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in a)


def main(mode, report_path):
    out = os.path.dirname(report_path)
    if mode == "save":
        result = train(os.path.join(out, "run"))
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(out, "uninterrupted.pt"))
            with open(report_path, "w") as f:
                json.dump({"world_size": result["world_size"], "grad_norm": result["grad_norm"]}, f)
    else:
        reference = torch.load(os.path.join(out, "uninterrupted.pt"))
        resumed = train(os.path.join(out, "resumed"), resume=os.path.join(out, "run", "checkpoint-2"))
        if dist.get_rank() == 0:
            report = {
                "saved_world_size": reference["world_size"],
                "resumed_world_size": resumed["world_size"],
                "param_rel_diff": rel_diff(resumed["params"], reference["params"]),
                "exp_avg_rel_diff": rel_diff(resumed["exp_avg"], reference["exp_avg"]),
                # How far the two resumed steps moved the weights: the diff above must be far below it.
                "param_rel_change": rel_diff(reference["params"], reference["at_step_2"]),
                "adam_steps": resumed["adam_steps"],
                "grad_norm": resumed["grad_norm"],
                "reference_grad_norm": reference["grad_norm"],
            }
            with open(report_path, "w") as f:
                json.dump(report, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    finish_ranks()
