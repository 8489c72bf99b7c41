"""2 gloo ranks, host offload under fp16 loss scaling: LayerwiseTrainer with layerwise_offload="gradients" /
"optimizer" equals Trainer + AdamW under the DDP config (the data-parallel route) and under FSDP2 (each rank offloads
and checks its local shards): every parameter, grad_norm (inf/nan on skipped steps), lr, the scale after every step;
with overflows that occur naturally and one injected on rank 0 only (fp16_trainer.Probe). Offload runs through the
CPU stand-in of the side stream with a delay on every copy (LAYERWISE_HF_OFFLOAD_SIMULATE / _DELAY, set by the test).

    ACCELERATE_USE_CPU=true LAYERWISE_HF_OFFLOAD_SIMULATE=1 accelerate launch \
        --config_file configs/accelerate/cpu_ddp.yaml --mixed_precision fp16 \
        tests/distributed/offload_fp16_trainer.py REPORT.json
"""

import math
import sys
import tempfile

import torch
from common import dataset, finish_ranks, max_diff, ranks_agree, summary, tiny_llama, training_args, write_report
from fp16_trainer import INJECT_AT, Probe, same_floats
from torch.distributed.tensor import DTensor
from transformers import Trainer

from layerwise_hf import LayerwiseTrainer  # applies LAYERWISE_HF_FORCE_FSDP_CPU
from layerwise_hf.optim.optimizer import offload_of

torch.set_num_threads(1)


def run(optim, out, *, ga=1, max_grad_norm=0.0, offload="none"):
    model = tiny_llama()
    extra = {"layerwise_offload": offload} if optim.endswith("_layerwise") else {}
    args = training_args(
        out, optim, ga=ga, max_grad_norm=max_grad_norm, max_steps=5, learning_rate=5e-2, fp16=True, **extra
    )
    probe = Probe(model)
    trainer = (LayerwiseTrainer if args.is_layerwise else Trainer)(
        model=model, args=args, train_dataset=dataset(), callbacks=[probe]
    )
    probe.trainer = trainer
    # As fp16_trainer: FSDP2 reduces in fp16, so it overflows at a lower scale than DDP's fp32 buckets.
    init_scale = 2.0**10 if trainer.is_fsdp_enabled else 2.0**20
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)
    trainer.accelerator.native_amp = True
    trainer.train()
    optimizer = trainer.layerwise_optimizer if args.is_layerwise else None
    return {
        **summary(trainer, trainer.model),
        "scales": probe.scales,
        "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
        "steps_taken": optimizer.steps_taken if optimizer is not None else None,
        "host_steps": type(optimizer.inner[0]).__name__ if optimizer is not None else None,
        "host_bytes": offload_of(optimizer).host_bytes() if optimizer is not None else 0,
    }


def main(report_path):
    results = []
    cases = [
        ("ga1 exact clip", {"max_grad_norm": 0.5}),
        ("ga4 exact clip", {"ga": 4, "max_grad_norm": 0.5}),
        ("ga1 no clip", {}),
    ]
    for name, kwargs in cases:
        with tempfile.TemporaryDirectory() as d:
            standard = run("adamw_torch", d, **kwargs)
            for mode in ("gradients", "optimizer"):
                layerwise = run("adamw_torch_layerwise", d, offload=mode, **kwargs)
                norms = standard["grad_norm"]
                results.append(
                    {
                        "case": f"{mode} adamw_torch {name} fp16",
                        "max_diff": max_diff(standard["params"], layerwise["params"]),
                        "grad_norm_equal": same_floats(norms, layerwise["grad_norm"]),
                        "lr_equal": standard["lr"] == layerwise["lr"],
                        "scales_equal": standard["scales"] == layerwise["scales"],
                        "ranks_agree": ranks_agree(layerwise["params"]),
                        "route": layerwise["route"],
                        "sharded": layerwise["sharded"],
                        "host_steps": layerwise["host_steps"],
                        "host_bytes": layerwise["host_bytes"],
                        "steps_logged": len(norms),
                        "injected_step_skipped": not math.isfinite(norms[INJECT_AT]),
                        "skipped_steps": sum(not math.isfinite(n) for n in norms),
                        "layerwise_steps_taken": layerwise["steps_taken"],
                    }
                )
    write_report(report_path, {"results": results})


if __name__ == "__main__":
    main(sys.argv[1])
    finish_ranks()
