"""Optimizers stepped on FSDP2's local shards (2 ranks): bitsandbytes' 8-bit AdamW and Adafactor. Each rank's local
shard equals the same optimizer run by hand on that shard and its gradients, save -> resume equals uninterrupted,
and the loss curve of a longer run.

Under the DDP config the script only writes the loss curves of the unsharded layer-wise runs (8-bit and 32-bit AdamW,
Adafactor), which the test compares with the FSDP2 ones.

    LAYERWISE_HF_FORCE_FSDP_CPU=1 ACCELERATE_USE_CPU=true accelerate launch \
        --config_file configs/accelerate/cpu_fsdp2.yaml tests/distributed/fsdp2_8bit.py REPORT.json
"""

import os
import sys
import tempfile

import torch
from common import finish_ranks, max_diff, summary, tiny_llama, training_args, write_report
from helpers import TokenDataset
from local_shards import HandRun
from transformers import TrainerCallback

from layerwise_hf import LayerwiseTrainer  # applies LAYERWISE_HF_FORCE_FSDP_CPU
from layerwise_hf.placement.local_shard import LocalShardOptimizer

torch.set_num_threads(1)
VOCAB = 256  # large enough that most local shards reach bitsandbytes' min_8bit_size (4096 elements)
CURVE_STEPS = 50


def model():
    return tiny_llama(vocab=VOCAB, hidden=64)


def trainer_for(optim, out, **overrides):
    args = training_args(out, optim, **overrides)
    # A learnable pattern (helpers.TokenDataset), so that the loss curves move.
    return LayerwiseTrainer(model=model(), args=args, train_dataset=TokenDataset(n=512, vocab=VOCAB))


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]


def fsdp2(report_path):
    results = {}
    for optim in ("adamw_8bit_layerwise", "adafactor_layerwise"):
        with tempfile.TemporaryDirectory() as d:
            trainer = trainer_for(optim, d, max_steps=4)
            hand = HandRun()
            trainer.add_callback(hand)
            trainer.train()
            optimizer = trainer.layerwise_optimizer
            states = [inner.base.state[inner.local] for inner in optimizer.inner]
            result = {
                "wrapped": all(isinstance(inner, LocalShardOptimizer) for inner in optimizer.inner),
                "states": len(states),
                "eight_bit_states": sum(s.get("state1", torch.empty(0)).dtype == torch.uint8 for s in states),
                "factored_states": sum("exp_avg_sq_row" in s for s in states),
                "hand_max_diff": hand.max_diff(),
            }

        out = os.path.join(os.path.dirname(report_path), f"fsdp2_{optim}_resume")
        whole = trainer_for(optim, out, max_steps=4, save_steps=2)
        whole.train()
        resumed = trainer_for(optim, out + "_b", max_steps=4)
        resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
        a, b = summary(whole, whole.model_wrapped), summary(resumed, resumed.model_wrapped)
        result["resume_max_diff"] = max_diff(a["params"], b["params"])
        result["resume_grad_norm_equal"] = a["grad_norm"][2:] == b["grad_norm"][-2:]

        with tempfile.TemporaryDirectory() as d:
            curve = trainer_for(optim, d, max_steps=CURVE_STEPS, warmup_steps=5)
            curve.train()
            result["curve"] = losses(curve)
        results[optim] = result
    write_report(report_path, results)


def unsharded(report_path):
    curves = {}
    for optim in ("adamw_8bit_layerwise", "adamw_torch_layerwise", "adafactor_layerwise"):
        with tempfile.TemporaryDirectory() as d:
            curve = trainer_for(optim, d, max_steps=CURVE_STEPS, warmup_steps=5)
            curve.train()
            curves[optim] = losses(curve)
    write_report(report_path, {"curves": curves})


def reshard(report_path):
    """Resume the 2-rank checkpoint of `fsdp2` on this launch's number of ranks: refused before anything loads."""
    checkpoint = os.path.join(os.path.dirname(report_path), "fsdp2_adamw_8bit_layerwise_resume", "checkpoint-2")
    steps = []

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    with tempfile.TemporaryDirectory() as d:
        trainer = trainer_for("adamw_8bit_layerwise", d, max_steps=4)
        trainer.add_callback(Steps())
        try:
            trainer.train(resume_from_checkpoint=checkpoint)
            refusal = None
        except ValueError as err:
            refusal = str(err)
    write_report(report_path, {"refusal": refusal, "steps": steps})


if __name__ == "__main__":
    mode, report = sys.argv[1:] if len(sys.argv) > 2 else (None, sys.argv[1])
    if mode is None:
        mode = "fsdp2" if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" else "unsharded"
    {"fsdp2": fsdp2, "unsharded": unsharded, "reshard": reshard}[mode](report)
    finish_ranks()
