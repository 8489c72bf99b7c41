"""2 FSDP2 ranks: LayerwiseTrainer equals Trainer + the standard optimizer under FSDP2 (params, grad_norm), the
model really is fully_shard'ed, save -> resume (DCP) equals uninterrupted, and non-elementwise optimizers are refused.

    LAYERWISE_HF_FORCE_FSDP_CPU=1 ACCELERATE_USE_CPU=true accelerate launch \
        --config_file configs/accelerate/cpu_fsdp2.yaml tests/distributed/fsdp2_trainer.py REPORT.json
"""

import importlib.util
import os
import sys
import tempfile

import torch
from common import dataset, finish_ranks, max_diff, ranks_agree, summary, tiny_llama, training_args, write_report
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from layerwise_hf import LayerwiseTrainer, register_layerwise_optimizer  # applies LAYERWISE_HF_FORCE_FSDP_CPU

torch.set_num_threads(1)


def run(optim, out, *, ga=1, max_grad_norm=0.0, max_steps=4, save_steps=None, resume=None, vocab=64, hidden=32):
    model = tiny_llama(vocab=vocab, hidden=hidden)
    args = training_args(out, optim, ga=ga, max_grad_norm=max_grad_norm, max_steps=max_steps, save_steps=save_steps)
    trainer = LayerwiseTrainer(model=model, args=args, train_dataset=dataset(vocab=vocab))
    trainer.train(resume_from_checkpoint=resume)
    wrapped = trainer.model_wrapped
    return {
        **summary(trainer, wrapped),
        "fully_sharded": isinstance(wrapped, FSDPModule) and all(isinstance(p, DTensor) for p in wrapped.parameters()),
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

    if importlib.util.find_spec("torchao") is not None:
        # torchao quantizes tensors of 4096 elements and more: a model with such tensors.
        larger = {"vocab": 256, "hidden": 64}
        with tempfile.TemporaryDirectory() as d:
            standard = run("adamw_torch_8bit", d, max_grad_norm=0.5, **larger)
            layerwise = run("adamw_torch_8bit_layerwise", d, max_grad_norm=0.5, **larger)
        results.append(compare("torchao adamw_torch_8bit exact clip", standard, layerwise))
        out = os.path.join(os.path.dirname(report_path), "fsdp2_torchao_resume")
        full_run = run("adamw_torch_8bit_layerwise", out, save_steps=2, **larger)
        resumed = run("adamw_torch_8bit_layerwise", out + "_b", resume=os.path.join(out, "checkpoint-2"), **larger)
        results.append(compare("torchao adamw_torch_8bit resume", full_run, resumed))

    # torch's own Adafactor (factored moments, and not one the local-shard wrapper knows): refused before any step.
    register_layerwise_optimizer(
        "torch_adafactor_layerwise", lambda lp, args: torch.optim.Adafactor([lp.param], lr=args.learning_rate)
    )
    try:
        with tempfile.TemporaryDirectory() as d:
            run("torch_adafactor_layerwise", d, max_steps=1)
        refusal = None
    except ValueError as err:
        refusal = str(err)
    write_report(report_path, {"results": results, "refusal": refusal})


if __name__ == "__main__":
    main(sys.argv[1])
    finish_ranks()
