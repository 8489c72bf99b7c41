"""Checkpoints saved under HSDP 2x2 and under FSDP2 on 4 ranks resume on FSDP2 with 2 ranks: LayerwiseTrainer +
adamw_torch_layerwise resumed so equals stock Trainer + adamw_torch resumed the same way, bit for bit. Two launches:

    LAYERWISE_HF_FORCE_FSDP_CPU=1 LAYERWISE_HF_FORCE_MESH_CPU=1 ACCELERATE_USE_CPU=true accelerate launch \
        --config_file configs/accelerate/cpu_ddp.yaml --num_processes 4 tests/distributed/mesh_resume.py \
        save OUT/saved.json
    ... same with --num_processes 2 ... tests/distributed/mesh_resume.py resume OUT/report.json

`save` trains stock and layer-wise for 4 steps under HSDP 2x2 (`ParallelismConfig(dp_replicate_size=2,
dp_shard_size=2)`) and under FSDP2 over the 4 ranks, 1 sample a rank, DCP checkpoints (SHARDED_STATE_DICT) at step 2,
and keeps the final weights of the uninterrupted runs. `resume` continues each from its step-2 checkpoint under FSDP2
on 2 ranks (2 samples a rank: the same 4 samples a step) to step 4. The mesh comes from the TrainingArguments (as in
meshes.py), so one launch config serves both. Resumed against uninterrupted, the same mean is summed in another order:
equal to rounding.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from common import dataset, finish_ranks, full, max_diff, params, ranks_agree, tiny_llama, training_args
from torch.distributed.tensor import DTensor
from transformers import Trainer, TrainerCallback

from layerwise_hf import LayerwiseTrainer  # applies LAYERWISE_HF_FORCE_FSDP_CPU and LAYERWISE_HF_FORCE_MESH_CPU

torch.set_num_threads(1)
GLOBAL_BATCH = 4
WEIGHTS = ("params", "at_step_2")  # full weights: kept in uninterrupted.pt, not in the JSON reports
RUNS = [("standard", Trainer, "adamw_torch"), ("layerwise", LayerwiseTrainer, "adamw_torch_layerwise")]
LAYOUTS = ("hsdp", "fsdp2")  # what the 4 ranks save under; the 2 ranks resume each under FSDP2


def mesh_args(layout: str) -> dict:
    """FSDP2 over every rank ("fsdp2"), or HSDP 2 x 2 ("hsdp")."""
    fsdp = dict(
        fsdp="full_shard",
        fsdp_config={
            "fsdp_version": 2,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "state_dict_type": "SHARDED_STATE_DICT",
        },
    )
    if layout == "fsdp2":
        return fsdp
    from accelerate import ParallelismConfig

    return dict(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), **fsdp)


class WeightsAt(TrainerCallback):
    def __init__(self, step):
        self.step, self.weights = step, None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            self.weights = params(model)  # every rank: full_tensor() is a collective


def adam_steps(trainer) -> list:
    optimizer = getattr(trainer, "layerwise_optimizer", None)
    if optimizer is not None:
        states = [s for inner in optimizer.inner for s in inner.state.values()]
    else:
        states = list(trainer.optimizer.state.values())
    return sorted({float(full(s["step"])) for s in states})


def train(trainer_cls, optim, out, layout="fsdp2", resume=None):
    environ = dict(os.environ)
    world = int(os.environ["WORLD_SIZE"])
    args = training_args(
        out,
        optim,
        max_steps=4,
        save_steps=2,
        max_grad_norm=1.0,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        # A large eps keeps AdamW's update smooth in the gradient, so reordered sums stay within the tolerance.
        adam_epsilon=1e-3,
        **mesh_args(layout),
    )
    at_step_2 = WeightsAt(2)
    trainer = trainer_cls(model=tiny_llama(), args=args, train_dataset=dataset(), callbacks=[at_step_2])
    trainer.train(resume_from_checkpoint=resume)
    wrapped = trainer.model_wrapped
    # Each parameter's mesh as (dimension names, shape); FSDP2's own 1-D mesh has no names.
    meshes = {
        (tuple(p.device_mesh.mesh_dim_names or ()), tuple(p.device_mesh.shape))
        for p in wrapped.parameters()
        if isinstance(p, DTensor)
    }
    result = {
        "params": params(wrapped),
        "grad_norm": [float(h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h],
        "adam_steps": adam_steps(trainer),
        "meshes": sorted(meshes),
        "at_step_2": at_step_2.weights,
        "plain": sum(not isinstance(p, DTensor) for p in wrapped.parameters()),
    }
    os.environ.clear()
    os.environ.update(environ)
    return result


def rel_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in a)


def save(out: str) -> dict:
    """Both layouts, stock and layer-wise: the reports, and (rank 0) the uninterrupted runs' weights."""
    report, kept = {}, {}
    for layout in LAYOUTS:
        runs = {name: train(cls, optim, os.path.join(out, layout, name), layout) for name, cls, optim in RUNS}
        report[layout] = {"max_diff": max_diff(runs["standard"]["params"], runs["layerwise"]["params"])}
        report[layout].update({name: {k: v for k, v in r.items() if k not in WEIGHTS} for name, r in runs.items()})
        kept[layout] = {name: {k: r[k] for k in WEIGHTS} for name, r in runs.items()}
    if dist.get_rank() == 0:
        torch.save(kept, os.path.join(out, "uninterrupted.pt"))
    return report


def resume(out: str) -> dict:
    """Each layout's step-2 checkpoints continued under FSDP2 on this launch's ranks, beside the uninterrupted runs."""
    uninterrupted = torch.load(os.path.join(out, "uninterrupted.pt"))
    report = {}
    for layout in LAYOUTS:
        runs = {
            name: train(cls, optim, os.path.join(out, layout, f"{name}_resumed"), "fsdp2", resume=checkpoint)
            for name, cls, optim in RUNS
            for checkpoint in [os.path.join(out, layout, name, "checkpoint-2")]
        }
        report[layout] = {
            "max_diff": max_diff(runs["standard"]["params"], runs["layerwise"]["params"]),
            "ranks_agree": ranks_agree(runs["layerwise"]["params"]),
        }
        for name, r in runs.items():
            reference = uninterrupted[layout][name]
            report[layout][name] = {
                **{k: v for k, v in r.items() if k not in WEIGHTS},
                # How far the two resumed steps moved the weights: the diffs must be far below it.
                "rel_change_steps_3_4": rel_diff(reference["params"], reference["at_step_2"]),
                "rel_diff_to_uninterrupted": rel_diff(r["params"], reference["params"]),
                "max_diff_to_uninterrupted": max_diff(r["params"], reference["params"]),
            }
    return report


def main(mode, report_path):
    out = os.path.dirname(os.path.abspath(report_path))
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    report = save(out) if mode == "save" else resume(out)
    if dist.get_rank() == 0:
        with open(report_path, "w") as f:
            json.dump({"world_size": world, **report}, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    finish_ranks()
