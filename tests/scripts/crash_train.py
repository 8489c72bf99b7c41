"""Train 8 steps with a checkpoint every 2, optionally SIGKILL-ing itself at a chosen point; save the final model.

python tests/scripts/crash_train.py OUTPUT_DIR [--kill step:5 | --kill save:6] [--resume]
"""

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import TokenDataset, finish_ranks, freeze_imported_objects, tiny_llama, training_args  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from layerwise_hf import LayerwiseTrainer  # noqa: E402


class KillAtStep(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class KillDuringSave(LayerwiseTrainer):
    """Dies after the model and half of optimizer.pt of checkpoint `kill_step` are written."""

    kill_step = None

    def _save_optimizer_and_scheduler(self, output_dir):
        if self.state.global_step == self.kill_step:
            super()._save_optimizer_and_scheduler(output_dir)
            path = os.path.join(output_dir, "optimizer.pt")
            if os.path.isfile(path):  # under FSDP the optimizer goes to a DCP directory instead
                with open(path, "r+b") as f:
                    f.truncate(os.path.getsize(path) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        return super()._save_optimizer_and_scheduler(output_dir)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--kill", default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--optim", default="adamw_torch_layerwise")
    opts = parser.parse_args()
    args = training_args(opts.output_dir, opts.optim, max_steps=8, save_strategy="steps", save_steps=2)
    trainer_cls, callbacks = LayerwiseTrainer, []
    if opts.kill:
        where, step = opts.kill.split(":")
        if where == "step":
            callbacks.append(KillAtStep(int(step)))
        else:
            trainer_cls = KillDuringSave
            KillDuringSave.kill_step = int(step)
    trainer = trainer_cls(model=tiny_llama(), args=args, train_dataset=TokenDataset(), callbacks=callbacks)
    if opts.resume:
        from layerwise_hf.integrations.checkpoint import latest_complete_checkpoint

        # One rank, one write: two ranks printing at once interleave on the shared stdout.
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"resuming from {latest_complete_checkpoint(opts.output_dir)}", flush=True)
    trainer.train(resume_from_checkpoint=True if opts.resume else None)
    # Full parameters on every engine (FSDP2 shards are gathered; every rank takes part, rank 0 writes).
    final = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in trainer.model.named_parameters()
    }
    if trainer.args.process_index == 0:
        os.makedirs(os.path.join(opts.output_dir, "final"), exist_ok=True)
        from safetensors.torch import save_file

        save_file(final, os.path.join(opts.output_dir, "final", "model.safetensors"))


if __name__ == "__main__":
    freeze_imported_objects()
    main()
    finish_ranks()
