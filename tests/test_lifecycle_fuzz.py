"""Seeded lifecycle fuzz: random sequences of what users do between and during `train()` calls, run side by side on
stock Trainer + AdamW and LayerwiseTrainer + adamw_torch_layerwise, with every parameter compared after each
sequence.

Operations: train; an exception mid-backward (or in the forward when nothing clips: then no layer has stepped in
either run); a change of `max_grad_norm`; freezing a parameter (both train on with the same optimizer) or unfreezing
one (when the optimizer was built without it, the layer-wise run must refuse it naming the parameter and change
nothing; then both build a new optimizer, as the refusal advises); resuming from the newest checkpoint in a new
trainer; a second trainer on the same model.
"""

import os
import random

import pytest
import torch
from helpers import TokenDataset, assert_params_equal, clone, tiny_llama, training_args
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from layerwise_hf import LayerwiseTrainer

SEQUENCES = int(os.environ.get("LAYERWISE_FUZZ_SEQUENCES", 50))
OPERATIONS = ("train", "exception", "clip", "freeze", "resume", "second_trainer")
KINDS = {"stock": ("adamw_torch", Trainer), "layerwise": ("adamw_torch_layerwise", LayerwiseTrainer)}


class Interrupt(Exception):
    pass


class RaiseOnce(TrainerCallback):
    """On the first step after arming: raise in the middle of backward (a tensor hook on the first layer's output,
    after the upper layers' gradients are done) or, when asked, in the forward."""

    def __init__(self, model):
        self.where = None
        model.model.layers[0].register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if self.where is None or not torch.is_grad_enabled():
            return
        where, self.where = self.where, None
        if where == "forward":
            raise Interrupt("in forward")

        def boom(grad):
            raise Interrupt("mid-backward")

        (output[0] if isinstance(output, tuple) else output).register_hook(boom)


class Run:
    """One side of the comparison: a model and its current trainer."""

    def __init__(self, kind, model, root):
        self.optim, self.trainer_cls = KINDS[kind]
        self.model, self.root, self.raiser = model, root, RaiseOnce(model)
        self.max_grad_norm, self.made, self.max_steps = 1.0, 0, 2
        # Whether the newest checkpoint was saved with the current trainable set: stock Trainer cannot resume an
        # optimizer state of another set (its groups change size), so the fuzz only resumes what both can.
        self.checkpoint_current = False
        self.trainer = self.new_trainer()

    def new_trainer(self, max_steps=2):
        self.made += 1
        self.max_steps = max_steps
        args = training_args(
            self.root / f"t{self.made}",
            self.optim,
            max_steps=max_steps,
            max_grad_norm=self.max_grad_norm,
            save_strategy="steps",
            save_steps=2,
            warmup_steps=1,
        )
        trainer = self.trainer_cls(model=self.model, args=args, train_dataset=TokenDataset(n=16))
        trainer.add_callback(self.raiser)
        return trainer


def apply(op: str, run: Run, rng_choice) -> None:
    trainer = run.trainer
    if op == "train":
        trainer.train()
        run.checkpoint_current = optimizer_covers_trainable_set(run)
    elif op == "exception":
        run.raiser.where = "backward" if run.max_grad_norm > 0 else "forward"
        with pytest.raises(Interrupt):
            trainer.train()
    elif op == "clip":
        run.max_grad_norm = trainer.args.max_grad_norm = rng_choice["clip"]
    elif op == "freeze":
        param = dict(run.model.named_parameters())[rng_choice["param"]]
        param.requires_grad_(not param.requires_grad)
        # Frozen: both train on with the same optimizer (no gradient: not stepped, its state kept). Unfrozen after
        # the optimizer was built without it: stock Trainer would never train it; the layer-wise run refuses.
        unknown = trainer.optimizer is not None and all(
            p is not param for group in trainer.optimizer.param_groups for p in group["params"]
        )
        if param.requires_grad and unknown:
            if isinstance(trainer, LayerwiseTrainer):
                before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
                with pytest.raises(ValueError, match=rng_choice["param"]):
                    trainer.train()
                assert all(torch.equal(before[n], p) for n, p in run.model.named_parameters())
            trainer.optimizer, trainer.lr_scheduler = None, None  # what the refusal advises, on both sides
        run.checkpoint_current = False
    elif op == "resume":
        if not run.checkpoint_current:
            if trainer.optimizer is not None and not optimizer_covers_trainable_set(run):
                trainer.optimizer, trainer.lr_scheduler = None, None  # a checkpoint a new trainer can resume
            trainer.train()
        last = get_last_checkpoint(str(trainer.args.output_dir))
        step = int(last.rsplit("-", 1)[1])
        run.trainer = run.new_trainer(max_steps=step + 2)
        run.trainer.train(resume_from_checkpoint=last)
        run.checkpoint_current = True
    elif op == "second_trainer":
        run.trainer = run.new_trainer()
        run.trainer.train()
        run.checkpoint_current = True


def optimizer_covers_trainable_set(run) -> bool:
    # Stock Trainer resumes only an optimizer state saved over the trainable set a new trainer builds for (after a
    # freeze, the optimizer that trains on still holds the frozen tensor, as its checkpoints do).
    in_optimizer = {id(p) for group in run.trainer.optimizer.param_groups for p in group["params"]}
    return in_optimizer == {id(p) for p in run.model.parameters() if p.requires_grad}


def sequence(seed: int, names: list[str]) -> tuple[list[str], list[dict]]:
    rng = random.Random(seed)
    ops = [rng.choice(OPERATIONS) for _ in range(4)]
    choices = [{"clip": rng.choice([0.0, 0.05, 1.0]), "param": rng.choice(names)} for _ in ops]
    return ops, choices


def tensor_names() -> list[str]:
    return [n for n, _ in tiny_llama().named_parameters() if "embed" not in n]


def test_every_operation_is_drawn():
    drawn = {op for seed in range(SEQUENCES) for op in sequence(seed, tensor_names())[0]}
    assert drawn == set(OPERATIONS)


# The sequences in PARTS tests, so that the test workers share them.
PARTS = 5


@pytest.mark.slow
@pytest.mark.parametrize("part", range(PARTS))
def test_lifecycle_sequences_match_stock_trainer(tmp_path, part):
    names = tensor_names()
    for seed in range(part, SEQUENCES, PARTS):
        ops, choices = sequence(seed, names)
        base = tiny_llama(seed=seed)
        runs = {kind: Run(kind, clone(base), tmp_path / f"s{seed}" / kind) for kind in KINDS}
        for op, choice in zip(ops, choices):
            for run in runs.values():
                apply(op, run, choice)
        for run in runs.values():
            run.trainer.train()  # every sequence ends with a step, so a stale state would show
        try:
            assert_params_equal(runs["stock"].model, runs["layerwise"].model)
        except AssertionError as err:
            raise AssertionError(f"sequence {seed}: {ops}: {err}") from err
