"""LayerwiseTrainerMixin / LayerwiseTrainer: composition with other Trainer subclasses, what they add to the logs,
what they leave to Trainer, and what they refuse before training."""

import pytest
import torch
from helpers import TokenDataset, assert_params_equal, clone, tiny_llama, train, training_args
from peft import LoraConfig, get_peft_model
from transformers import Trainer

from layerwise_hf import LayerwiseCallback, LayerwiseOptimizer, LayerwiseTrainer, LayerwiseTrainerMixin
from layerwise_hf.integrations.trainer import is_compiled

SAVE = dict(max_steps=4, save_strategy="steps", save_steps=2)


class CountingTrainer(Trainer):
    """Stands in for a user's or a library's Trainer subclass (TRL's SFTTrainer overrides compute_loss too)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.loss_calls = getattr(self, "loss_calls", 0) + 1
        return super().compute_loss(model, inputs, *args, **kwargs)


class LayerwiseCountingTrainer(LayerwiseTrainerMixin, CountingTrainer):
    pass


def test_mixin_composes_with_a_trainer_subclass(tmp_path):
    model = tiny_llama()
    standard = train(clone(model), training_args(tmp_path, "adamw_torch", max_steps=3), trainer_cls=CountingTrainer)
    layerwise = train(
        clone(model),
        training_args(tmp_path, "adamw_torch_layerwise", max_steps=3),
        trainer_cls=LayerwiseCountingTrainer,
    )
    # The subclass's override ran on every step, and the mixin's optimizer did the training.
    assert layerwise.loss_calls == standard.loss_calls == 3
    assert isinstance(layerwise.layerwise_optimizer, LayerwiseOptimizer)
    assert_params_equal(standard.model, layerwise.model)
    assert sum(isinstance(cb, LayerwiseCallback) for cb in layerwise.callback_handler.callbacks) == 1


def test_a_callback_passed_in_is_not_added_twice(tmp_path):
    callback = LayerwiseCallback()
    trainer = LayerwiseTrainer(model=tiny_llama(), args=training_args(tmp_path, "sgd_layerwise"), callbacks=[callback])
    assert [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, LayerwiseCallback)] == [callback]


def test_layerwise_optimizer_property(tmp_path):
    trainer = LayerwiseTrainer(
        model=tiny_llama(), args=training_args(tmp_path, "sgd_layerwise", max_steps=2), train_dataset=TokenDataset()
    )
    assert trainer.layerwise_optimizer is None
    built = trainer.create_optimizer()
    assert trainer.layerwise_optimizer is built
    trainer.train()
    # After train() Accelerate has wrapped the optimizer; the property still finds the same one under it.
    assert trainer.optimizer is not built
    assert trainer.layerwise_optimizer is built and built.steps_taken == 2


def test_memory_figures_reach_the_logs(tmp_path):
    trainer = train(tiny_llama(), training_args(tmp_path, "adamw_torch_layerwise", max_steps=2))
    entry = trainer.state.log_history[0]
    largest = max(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert entry["layerwise_peak_grad_mib"] == round(largest / 2**20, 3)
    assert (
        entry["layerwise_optimizer_state_mib"]
        == round(trainer.layerwise_optimizer.pipeline.memory.state_bytes() / 2**20, 3)
        > 0
    )


def test_standard_optimizer_names_are_left_to_trainer(tmp_path):
    model = tiny_llama()
    for n, p in model.named_parameters():
        p.requires_grad_(".layers.0." not in n)
    standard = train(clone(model), training_args(tmp_path, "adamw_torch", max_steps=3))
    ours = train(clone(model), training_args(tmp_path, "adamw_torch", max_steps=3), trainer_cls=LayerwiseTrainer)
    assert ours.layerwise_optimizer is None
    assert type(ours.optimizer.optimizer) is torch.optim.AdamW
    assert_params_equal(standard.model, ours.model)
    assert all(not any(k.startswith("layerwise_") for k in entry) for entry in ours.state.log_history)


def test_standard_optimizer_groups_hold_no_frozen_parameters(tmp_path):
    # What DeepSpeed gets handed when the Trainer builds the optimizer (transformers' deepspeed_optim_sched calls
    # trainer.create_optimizer() when the DS config has no "optimizer" section; with one, it passes the
    # requires_grad-filtered parameters itself): only adapters, and no empty group (Trainer's split leaves the
    # no-decay group empty for LoRA).
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    args = training_args(tmp_path, "adamw_torch")
    plain = Trainer(model=model, args=args, train_dataset=[]).create_optimizer()
    assert any(not g["params"] for g in plain.param_groups), "Trainer alone hands over an empty group"
    optimizer = LayerwiseTrainer(model=model, args=args, train_dataset=[]).create_optimizer()
    trainable = [p for p in model.parameters() if p.requires_grad]
    handed = [p for g in optimizer.param_groups for p in g["params"]]
    assert all(g["params"] for g in optimizer.param_groups), "no empty param group"
    assert {id(p) for p in handed} == {id(p) for p in trainable}


def test_unwritable_output_dir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="is not writable"):
        LayerwiseTrainer(
            model=tiny_llama(),
            args=training_args(blocker / "out", "adamw_torch_layerwise", **SAVE),
            train_dataset=TokenDataset(),
        )
    assert blocker.read_text() == "not a directory"


def test_output_dir_that_became_unwritable_is_refused_before_a_step(tmp_path):
    out = tmp_path / "out"
    trainer = LayerwiseTrainer(
        model=tiny_llama(), args=training_args(out, "adamw_torch_layerwise", **SAVE), train_dataset=TokenDataset()
    )
    out.rmdir()
    out.write_text("now a file")
    with pytest.raises(ValueError, match="is not writable"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert trainer.optimizer is None or trainer.layerwise_optimizer.steps_taken == 0


def test_is_compiled():
    model = tiny_llama()
    assert not is_compiled(model)
    # torch.compile wraps lazily: nothing is compiled until the first call, which these checks never make.
    assert is_compiled(torch.compile(model))
    model.model.layers[1].compile()
    assert is_compiled(model)


@pytest.mark.parametrize("given", ["optimizers", "optimizer_cls_and_kwargs"])
def test_an_optimizer_passed_in_wins_over_a_layerwise_name_with_a_warning(tmp_path, given):
    # Trainer silently prefers a passed optimizer to `optim`; a user who asked for layer-wise is told.
    model = tiny_llama()
    runs = []
    for cls, optim in ((Trainer, "adamw_torch"), (LayerwiseTrainer, "adamw_torch_layerwise")):
        copy = clone(model)
        if given == "optimizers":
            kwargs = {"optimizers": (torch.optim.SGD(copy.parameters(), lr=0.1), None)}
        else:
            kwargs = {"optimizer_cls_and_kwargs": (torch.optim.SGD, {"lr": 0.1})}
        args = training_args(tmp_path, optim, max_steps=2)
        if cls is LayerwiseTrainer:
            with pytest.warns(
                UserWarning, match=f"'adamw_torch_layerwise' is not used: the optimizer given in {given}"
            ):
                runs.append(train(copy, args, trainer_cls=cls, **kwargs))
        else:
            runs.append(train(copy, args, trainer_cls=cls, **kwargs))
    standard, layerwise = runs
    assert layerwise.layerwise_optimizer is None
    assert_params_equal(standard.model, layerwise.model)
