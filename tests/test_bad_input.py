"""Bad input gets a clear error before any training step, and nothing already saved is lost or overwritten.

(More cases live next to their feature: unknown / refused optimizer names, fp16, DeepSpeed and clip modes in
test_training_args.py and test_clipping.py; mismatched names, shapes and optimizer classes in test_checkpoint.py;
a hook firing twice in test_optimizer.py; FSDP2 with a non-elementwise optimizer in test_distributed.py.)
"""

import hashlib
import logging
import os
import re

import pytest
import torch
from helpers import TokenDataset, assert_params_equal, clone, tiny_llama, train, training_args

from layerwise_hf import LayerwiseTrainer, LayerwiseTrainingArguments, build_layerwise_optimizer

SAVE = dict(max_steps=4, save_strategy="steps", save_steps=2)


def snapshot(directory):
    return {
        os.path.relpath(os.path.join(root, f), directory): hashlib.sha256(
            open(os.path.join(root, f), "rb").read()
        ).hexdigest()
        for root, _, files in os.walk(directory)
        for f in files
    }


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    model = tiny_llama()
    trainer = train(clone(model), training_args(out, "adamw_torch_layerwise", **SAVE))
    return model, out, trainer


def fresh_trainer(model, out, optim="adamw_torch_layerwise", **overrides):
    args = training_args(out, optim, **{**SAVE, **overrides})
    return LayerwiseTrainer(model=clone(model), args=args, train_dataset=TokenDataset())


def assert_no_step(trainer):
    optimizer = trainer.layerwise_optimizer
    if optimizer is not None:
        assert optimizer.steps_taken == 0
    else:
        assert not trainer.optimizer.state


def test_truncated_optimizer_state(saved_run, tmp_path):
    model, out, _ = saved_run
    broken = tmp_path / "checkpoint-2"
    import shutil

    shutil.copytree(out / "checkpoint-2", broken)
    data = (broken / "optimizer.pt").read_bytes()
    (broken / "optimizer.pt").write_bytes(data[: len(data) // 3])
    before = snapshot(tmp_path)
    trainer = fresh_trainer(model, tmp_path / "new")
    with pytest.raises(ValueError, match="optimizer.pt cannot be read as an optimizer state"):
        trainer.train(resume_from_checkpoint=str(broken))
    assert snapshot(tmp_path) == before
    assert trainer.optimizer is None  # failed before the optimizer was even built


def test_checkpoint_interrupted_before_trainer_state(saved_run, tmp_path):
    model, out, _ = saved_run
    import shutil

    shutil.copytree(out / "checkpoint-2", tmp_path / "checkpoint-2")
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": ')
    trainer = fresh_trainer(model, tmp_path / "new")
    with pytest.raises(ValueError, match="incomplete or corrupt"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert trainer.state.global_step == 0


def test_resume_path_that_does_not_exist(saved_run, tmp_path):
    model, _, _ = saved_run
    with pytest.raises(ValueError, match="is not a directory"):
        fresh_trainer(model, tmp_path).train(resume_from_checkpoint=str(tmp_path / "checkpoint-99"))


def test_resume_with_another_model(saved_run):
    model, out, _ = saved_run
    before = snapshot(out)
    other = tiny_llama(hidden=48)
    trainer = LayerwiseTrainer(
        model=other, args=training_args(out, "adamw_torch_layerwise", **SAVE), train_dataset=TokenDataset()
    )
    with pytest.raises((ValueError, RuntimeError), match="size mismatch|shape"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert trainer.optimizer is None or trainer.layerwise_optimizer.steps_taken == 0
    assert snapshot(out) == before


def test_saved_state_for_a_parameter_that_is_now_frozen(saved_run, tmp_path):
    model, out, _ = saved_run
    before = snapshot(out)
    frozen = clone(model)
    frozen.model.embed_tokens.weight.requires_grad_(False)
    trainer = LayerwiseTrainer(
        model=frozen, args=training_args(tmp_path, "adamw_torch_layerwise", **SAVE), train_dataset=TokenDataset()
    )
    with pytest.raises(ValueError, match=r"Saved but not trainable here: \['model.embed_tokens.weight'\]"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert_no_step(trainer)
    assert snapshot(out) == before


def test_newly_trainable_parameter_starts_fresh_with_a_warning(tmp_path, caplog):
    model = tiny_llama()
    partly_frozen = clone(model)
    partly_frozen.model.embed_tokens.weight.requires_grad_(False)
    train(partly_frozen, training_args(tmp_path, "adamw_torch_layerwise", **SAVE))
    with caplog.at_level(logging.WARNING, logger="layerwise_hf"):
        resumed = train(
            clone(model),
            training_args(tmp_path / "b", "adamw_torch_layerwise", **{**SAVE, "max_steps": 4}),
            resume_from_checkpoint=str(tmp_path / "checkpoint-2"),
        )
    assert "newly trainable" in caplog.text and "model.embed_tokens.weight" in caplog.text
    optimizer = resumed.layerwise_optimizer
    embed = optimizer.names.index("model.embed_tokens.weight")
    # Two steps since the resume: its AdamW step counter restarted, the others continued from 2.
    steps = [
        float(inner.state[p]["step"]) for inner, (_, p) in zip(optimizer.inner, zip(optimizer.names, optimizer.params))
    ]
    assert steps[embed] == 2.0 and all(s == 4.0 for i, s in enumerate(steps) if i != embed)


def test_disk_full_while_saving_keeps_earlier_checkpoints_and_resume_recovers(tmp_path, monkeypatch):
    model = tiny_llama()
    uninterrupted = train(clone(model), training_args(tmp_path / "full", "adamw_torch_layerwise", **SAVE))
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if "checkpoint-4" in str(f) and str(f).endswith("optimizer.pt"):
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        train(clone(model), training_args(tmp_path / "run", "adamw_torch_layerwise", **SAVE))
    monkeypatch.setattr(torch, "save", real_save)
    assert (tmp_path / "run" / "checkpoint-2" / "layerwise_complete.json").is_file()
    assert not (tmp_path / "run" / "checkpoint-4" / "layerwise_complete.json").exists()
    resumed = train(
        clone(model), training_args(tmp_path / "run", "adamw_torch_layerwise", **SAVE), resume_from_checkpoint=True
    )
    assert_params_equal(uninterrupted.model, resumed.model)


def test_layerwise_state_into_standard_optimizer_with_other_parameters(saved_run, tmp_path):
    model, out, _ = saved_run
    frozen = clone(model)
    frozen.lm_head.weight.requires_grad_(False)
    trainer = LayerwiseTrainer(
        model=frozen, args=training_args(tmp_path, "adamw_torch", **SAVE), train_dataset=TokenDataset()
    )
    with pytest.raises(ValueError, match=r"Unexpected: \['lm_head.weight'\]"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert_no_step(trainer)


CLIP_MODES = "exact, previous, per_param, off"
BAD_FIELDS = [
    ("layerwise_clip", None, CLIP_MODES),
    ("layerwise_clip", 1, CLIP_MODES),
    ("layerwise_clip", "EXACT", CLIP_MODES),
    ("layerwise_clip", "global", CLIP_MODES),
    ("layerwise_accept_nonfinite_state", None, "True or False"),
    ("layerwise_accept_nonfinite_state", "no", "True or False"),  # truthy: it would have accepted NaN state
    ("layerwise_accept_nonfinite_state", 1, "True or False"),
    ("max_grad_norm", "1.0", "a number"),
    ("max_grad_norm", None, None),  # None is allowed: no clipping
]


def names_field(field, value, valid):
    return rf"^{field}={re.escape(repr(value))} .*{re.escape(valid)}"


@pytest.mark.parametrize(("field", "value", "valid"), BAD_FIELDS)
def test_bad_layerwise_argument_is_named_with_its_valid_values_when_made(tmp_path, field, value, valid):
    if valid is None:
        LayerwiseTrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise", **{field: value})
        return
    with pytest.raises(ValueError, match=names_field(field, value, valid)):
        LayerwiseTrainingArguments(output_dir=str(tmp_path), optim="adamw_torch_layerwise", **{field: value})


@pytest.mark.parametrize(("field", "value", "valid"), [f for f in BAD_FIELDS if f[0] != "max_grad_norm"])
def test_bad_layerwise_argument_set_after_construction_is_named_by_build_layerwise_optimizer(
    tmp_path, field, value, valid
):
    args = training_args(tmp_path, "adamw_torch_layerwise")
    setattr(args, field, value)  # a dataclass field can be reassigned after __post_init__ checked it
    with pytest.raises(ValueError, match=names_field(field, value, valid)):
        build_layerwise_optimizer(tiny_llama(), args)


def test_bad_clipping_arguments_are_named_by_configure_clipping(tmp_path):
    optimizer = build_layerwise_optimizer(tiny_llama(), training_args(tmp_path, "adamw_torch_layerwise"))
    with pytest.raises(ValueError, match=names_field("layerwise_clip", None, CLIP_MODES)):
        optimizer.configure_clipping(1.0, None)
    with pytest.raises(ValueError, match=names_field("max_grad_norm", "1.0", "a number")):
        optimizer.configure_clipping("1.0", "exact")
    optimizer.configure_clipping(None, "previous")  # None: no clipping
    assert optimizer.pipeline.clipper.mode.value == "off"


def test_bad_layerwise_clip_set_between_train_calls_is_named_before_any_step(tmp_path):
    model = tiny_llama()
    trainer = train(model, training_args(tmp_path, "adamw_torch_layerwise", max_steps=2, max_grad_norm=1.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.args.layerwise_clip = None
    with pytest.raises(ValueError, match=names_field("layerwise_clip", None, CLIP_MODES)):
        trainer.train()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
