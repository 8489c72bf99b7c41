"""2 ranks (DDP, or FSDP2 with LAYERWISE_HF_FORCE_FSDP_CPU=1) with fp16 loss scaling: LayerwiseTrainer equals Trainer +
the standard optimizer (params, grad_norm incl. inf on skipped steps, lr, scale after every step), with overflows that
occur naturally and one injected on rank 0 only. Writes a JSON report (rank 0).

Accelerate creates no GradScaler on CPU, so each Trainer's accelerator gets a `torch.amp.GradScaler("cpu")` and fp16
autocast (launch with --mixed_precision fp16), the objects and calls Trainer uses on GPUs.

    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/accelerate/cpu_ddp.yaml --mixed_precision fp16 \
        tests/distributed/fp16_trainer.py REPORT.json
"""

import math
import sys
import tempfile

import torch
import torch.distributed as dist
from common import (
    VOCAB,
    dataset,
    finish_ranks,
    max_diff,
    ranks_agree,
    summary,
    tiny_llama,
    training_args,
    write_report,
)
from transformers import Trainer, TrainerCallback

from layerwise_hf import LayerwiseTrainer  # applies LAYERWISE_HF_FORCE_FSDP_CPU

torch.set_num_threads(1)
INJECT_AT = 2


class Probe(TrainerCallback):
    """Scale after every step; on step INJECT_AT, part of rank 0's embedding-output gradient becomes inf."""

    def __init__(self, model):
        self.trainer = None
        self.scales = []
        self.inject = False
        model.model.embed_tokens.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        if self.inject and dist.get_rank() == 0 and output.requires_grad:
            # Only tokens < VOCAB / 2: the overflow lands in embedding rows 0..31, i.e. only in rank 0's FSDP2 shard,
            # so rank 1 finds nothing locally and must learn of it from rank 0.
            low = (inputs[0] < VOCAB // 2).unsqueeze(-1)
            output.register_hook(lambda g: torch.where(low, g * float("inf"), g))

    def on_step_begin(self, args, state, control, **kwargs):
        self.inject = state.global_step == INJECT_AT

    def on_step_end(self, args, state, control, **kwargs):
        self.inject = False
        self.scales.append(self.trainer.accelerator.scaler.get_scale())


def run(optim, out, *, ga=1, max_grad_norm=0.0):
    model = tiny_llama()
    args = training_args(out, optim, ga=ga, max_grad_norm=max_grad_norm, max_steps=5, learning_rate=5e-2, fp16=True)
    probe = Probe(model)
    trainer_cls = LayerwiseTrainer if args.is_layerwise else Trainer
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset(), callbacks=[probe])
    probe.trainer = trainer
    # FSDP2 also reduces in fp16 (MixedPrecisionPolicy), so it overflows at a lower scale than DDP's fp32 buckets;
    # these scales give a run with natural overflows and growths on each engine.
    init_scale = 2.0**10 if trainer.is_fsdp_enabled else 2.0**20
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)
    trainer.accelerator.native_amp = True
    trainer.train()
    optimizer = trainer.layerwise_optimizer if args.is_layerwise else None
    return {
        **summary(trainer, trainer.model),
        "scales": probe.scales,
        "wrapped": type(trainer.model_wrapped).__name__,
        "steps_taken": optimizer.steps_taken if optimizer is not None else None,
    }


def same_floats(a, b):
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def main(report_path):
    results = []
    cases = [
        ("ga1 exact clip", {"max_grad_norm": 0.5}),
        ("ga2 exact clip", {"ga": 2, "max_grad_norm": 0.5}),
        ("ga1 no clip", {}),
    ]
    for name, kwargs in cases:
        with tempfile.TemporaryDirectory() as d:
            standard = run("adamw_torch", d, **kwargs)
            layerwise = run("adamw_torch_layerwise", d, **kwargs)
        norms = standard["grad_norm"]
        results.append(
            {
                "case": f"adamw_torch {name} fp16",
                "max_diff": max_diff(standard["params"], layerwise["params"]),
                "grad_norm_equal": same_floats(norms, layerwise["grad_norm"]),
                "lr_equal": standard["lr"] == layerwise["lr"],
                "scales_equal": standard["scales"] == layerwise["scales"],
                "ranks_agree": ranks_agree(layerwise["params"]),
                "wrapped": layerwise["wrapped"],
                "route": layerwise["route"],
                "steps_logged": len(norms),
                "injected_step_skipped": not math.isfinite(norms[INJECT_AT]),
                "skipped_steps": sum(not math.isfinite(n) for n in norms),
                "layerwise_steps_taken": layerwise["steps_taken"],
                "scale_grew": any(b > a for a, b in zip(standard["scales"], standard["scales"][1:])),
            }
        )
    write_report(report_path, {"results": results})


if __name__ == "__main__":
    main(sys.argv[1])
    finish_ranks()
