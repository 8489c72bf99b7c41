"""2 gloo ranks with host offload (issue 19): LayerwiseTrainer with layerwise_offload="gradients" / "optimizer"
equals Trainer + the standard optimizer under the DDP config (the data-parallel route) and under FSDP2 (each rank
offloads its local shards): every parameter, grad_norm, lr; the replicas agree. Offload runs through the CPU stand-in
of the side stream with a delay on every copy (LAYERWISE_HF_OFFLOAD_SIMULATE / _DELAY, set by the test).

    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/accelerate/cpu_ddp.yaml \
        tests/distributed/offload_trainer.py ddp quick|full|sync_each_batch REPORT.json
    LAYERWISE_HF_FORCE_FSDP_CPU=1 ACCELERATE_USE_CPU=true accelerate launch \
        --config_file configs/accelerate/cpu_fsdp2.yaml tests/distributed/offload_trainer.py fsdp2 quick REPORT.json
"""

import gc
import logging
import sys
import tempfile

import torch
from common import dataset, finish_ranks, max_diff, ranks_agree, summary, tiny_llama, training_args, write_report
from torch.distributed.tensor import DTensor
from transformers import Trainer, TrainerCallback

from layerwise_hf import LayerwiseTrainer  # applies LAYERWISE_HF_FORCE_FSDP_CPU

torch.set_num_threads(1)


def gradient_bytes() -> int:
    """Bytes of every parameter's gradient in the process, FSDP2's unsharded parameters (where it accumulates the
    micro-batches of a window it does not reduce) included; a DTensor counts its local shard."""
    storages = {}
    for obj in gc.get_objects():
        grad = obj.grad if isinstance(obj, torch.nn.Parameter) else None
        if grad is not None:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class BetweenMicroBatches(TrainerCallback):
    """The gradient bytes held after each micro-batch that does not end its window."""

    def __init__(self):
        self.held = []

    def on_substep_end(self, args, state, control, **kwargs):
        self.held.append(gradient_bytes())


def run(optim, out, *, ga, clip, offload="none", sync_each_batch=False):
    model = tiny_llama()
    extra = {"layerwise_offload": offload} if optim.endswith("_layerwise") else {}
    if sync_each_batch:
        extra["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    args = training_args(out, optim, ga=ga, max_grad_norm=clip, **extra)
    between = BetweenMicroBatches()
    warned = Warnings()
    logging.getLogger("layerwise_hf.placement.offloading").addHandler(warned)
    try:
        trainer = (LayerwiseTrainer if args.is_layerwise else Trainer)(
            model=model, args=args, train_dataset=dataset(), callbacks=[between]
        )
        trainer.train()
    finally:
        logging.getLogger("layerwise_hf.placement.offloading").removeHandler(warned)
    return {
        **summary(trainer, model),  # fully_shard works in place; DDP wraps the model, whose names it prefixes
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "host_steps": type(trainer.layerwise_optimizer.inner[0]).__name__ if args.is_layerwise else None,
        "held_between_micro_batches": max(between.held, default=0),
        "warned_unsharded_accumulation": any("accumulates unsharded" in m for m in warned.messages),
        "local_weight_bytes": sum(
            (p.to_local() if isinstance(p, DTensor) else p).untyped_storage().nbytes() for p in model.parameters()
        ),
    }


def compare(name, standard, layerwise):
    return {
        "case": name,
        "max_diff": max_diff(standard["params"], layerwise["params"]),
        "grad_norm_equal": standard["grad_norm"] == layerwise["grad_norm"],
        "grad_norms": [standard["grad_norm"], layerwise["grad_norm"]],
        "lr_equal": standard["lr"] == layerwise["lr"],
        "ranks_agree": ranks_agree(layerwise["params"]),
        "route": layerwise["route"],
        "sharded": layerwise["sharded"],
        "host_steps": layerwise["host_steps"],
        "steps_logged": len(layerwise["grad_norm"]),
        "held_standard": standard["held_between_micro_batches"],
        "held_layerwise": layerwise["held_between_micro_batches"],
        "warned_unsharded_accumulation": layerwise["warned_unsharded_accumulation"],
        "local_weight_bytes": layerwise["local_weight_bytes"],
    }


def main(route, size, report_path):
    bases = ["adamw_torch", "sgd"] if route == "fsdp2" else ["adamw_torch", "adafactor", "sgd"]
    cases = [(base, ga, clip) for base in bases for ga in (1, 4) for clip in (0.0, 1.0)]
    if size == "quick":
        cases = [("adamw_torch", 4, 1.0), ("sgd", 1, 1.0)]
    each = size == "sync_each_batch"
    if each:  # reduced on every micro-batch: the window's gradients wait on the host
        cases = [("adamw_torch", 4, 0.5), ("sgd", 4, 1.0)]  # the global norm is near 0.9: 0.5 clips, 1.0 does not
    results = []
    for base, ga, clip in cases:
        with tempfile.TemporaryDirectory() as d:
            standard = run(base, d, ga=ga, clip=clip, sync_each_batch=each)
            for mode in ("gradients", "optimizer"):
                layerwise = run(f"{base}_layerwise", d, ga=ga, clip=clip, offload=mode, sync_each_batch=each)
                results.append(compare(f"{mode} {base} ga{ga} clip{clip}", standard, layerwise))
    write_report(report_path, {"results": results})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
    finish_ranks()
