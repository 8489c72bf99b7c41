"""FSDP2 with accelerate's `fsdp_activation_checkpointing`, whose wrapper renames every decoder-layer parameter
(`..._checkpoint_wrapped_module...`): layer-wise equals standard FSDP2 (exact clipping) and resumes bit-exactly.
The test launches it with configs/accelerate/cpu_fsdp2.yaml plus `fsdp_activation_checkpointing: true`."""

import os
import sys
import tempfile

import torch
from common import dataset, finish_ranks, max_diff, summary, tiny_llama, training_args, write_report

from layerwise_hf import LayerwiseTrainer  # applies LAYERWISE_HF_FORCE_FSDP_CPU

torch.set_num_threads(1)


def run(optim, out, resume=None, **overrides):
    args = training_args(out, optim, **overrides)
    trainer = LayerwiseTrainer(model=tiny_llama(), args=args, train_dataset=dataset())
    trainer.train(resume_from_checkpoint=resume)
    wrapped = any("_checkpoint_wrapped_module" in n for n, _ in trainer.model_wrapped.named_parameters())
    return {**summary(trainer, trainer.model_wrapped), "wrapped": wrapped}


def main(report_path):
    with tempfile.TemporaryDirectory() as d:
        standard = run("adamw_torch", d, max_grad_norm=0.5)
        layerwise = run("adamw_torch_layerwise", d, max_grad_norm=0.5)
    out = os.path.join(os.path.dirname(report_path), "checkpointed")
    whole = run("adamw_torch_layerwise", out, save_steps=2)
    resumed = run("adamw_torch_layerwise", out + "_b", resume=os.path.join(out, "checkpoint-2"))
    write_report(
        report_path,
        {
            "wrapped": layerwise["wrapped"] and resumed["wrapped"],
            "max_diff": max_diff(standard["params"], layerwise["params"]),
            "grad_norm_equal": standard["grad_norm"] == layerwise["grad_norm"],
            "resume_max_diff": max_diff(whole["params"], resumed["params"]),
        },
    )


if __name__ == "__main__":
    main(sys.argv[1])
    finish_ranks()
