"""Trainer's own save_steps / resume_from_checkpoint carry every per-layer state, keyed by name, bit-exactly."""

import os

import pytest
import torch
from helpers import assert_params_equal, clone, tiny_llama, train, training_args


@pytest.mark.parametrize("optim", ["adamw_torch_layerwise", "adamw_8bit_layerwise", "adafactor_layerwise"])
@pytest.mark.parametrize("ga", [1, 2])
def test_resume_equals_uninterrupted(tmp_path, optim, ga):
    model = tiny_llama(vocab=256, hidden=64) if "8bit" in optim else tiny_llama()
    from helpers import TokenDataset

    dataset = TokenDataset(vocab=256) if "8bit" in optim else TokenDataset()
    kwargs = dict(max_steps=8, save_strategy="steps", save_steps=4, gradient_accumulation_steps=ga)
    full = train(clone(model), training_args(tmp_path / "full", optim, **kwargs), dataset=dataset)

    checkpoint = tmp_path / "full" / "checkpoint-4"
    optimizer_state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    names = [g["name"] for g in optimizer_state["param_groups"]]
    assert names == [n for n, p in model.named_parameters() if p.requires_grad]
    # Every parameter's state is in the checkpoint (transformers' built-in layer-wise path saves none).
    assert sorted(optimizer_state["state"]) == list(range(len(names)))

    resumed = train(
        clone(model),
        training_args(tmp_path / "resumed", optim, **kwargs),
        dataset=dataset,
        resume_from_checkpoint=str(checkpoint),
    )
    assert resumed.state.global_step == 8
    assert_params_equal(full.model, resumed.model)
    # Resuming restored state rather than starting fresh: the states agree too.
    final_full = torch.load(tmp_path / "full" / "checkpoint-8" / "optimizer.pt", weights_only=True)
    final_resumed = torch.load(tmp_path / "resumed" / "checkpoint-8" / "optimizer.pt", weights_only=True)
    for i, state in final_full["state"].items():
        for key, value in state.items():
            other = final_resumed["state"][i][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), (names[i], key)
    assert os.path.isfile(tmp_path / "resumed" / "checkpoint-8" / "scheduler.pt")


def test_load_validates_names_shapes_and_optimizer_before_loading(tmp_path):
    model = tiny_llama()
    args = training_args(tmp_path / "a", "adamw_torch_layerwise", max_steps=2, save_strategy="steps", save_steps=2)
    trainer = train(clone(model), args)
    state = torch.load(tmp_path / "a" / "checkpoint-2" / "optimizer.pt", weights_only=True)
    optimizer = trainer.layerwise_optimizer
    before = {k: v.clone() for k, v in optimizer.inner[0].state[optimizer.param_groups[0]["params"][0]].items()}

    renamed = dict(state, param_groups=[dict(g, name="x." + g["name"]) for g in state["param_groups"]])
    with pytest.raises(ValueError, match="Saved but not trainable here: .*x.model.embed_tokens.weight"):
        optimizer.load_state_dict(renamed)

    reshaped = dict(state, layerwise_hf=dict(state["layerwise_hf"], shapes=[[1, 2]] * len(optimizer.names)))
    with pytest.raises(ValueError, match="saved shape"):
        optimizer.load_state_dict(reshaped)

    other_kind = dict(
        state, layerwise_hf=dict(state["layerwise_hf"], optimizer_classes=["x.SGD"] * len(optimizer.names))
    )
    with pytest.raises(ValueError, match="saved optimizer x.SGD"):
        optimizer.load_state_dict(other_kind)

    wrong_sizes = {"state": {}, "param_groups": [{"lr": 1.0, "params": list(range(len(optimizer.names)))}]}
    with pytest.raises(ValueError, match="groups of sizes"):
        optimizer.load_state_dict(wrong_sizes)

    # A failure half-way (here: the last parameter's inner load) restores the parameters loaded before it.
    changed = {**state, "state": {**state["state"], 0: {k: v + 7 for k, v in state["state"][0].items()}}}

    def fail(_):
        raise RuntimeError("disk read error")

    optimizer.inner[-1].load_state_dict = fail
    with pytest.raises(ValueError, match="nothing was loaded: disk read error"):
        optimizer.load_state_dict(changed)
    after = optimizer.inner[0].state[optimizer.param_groups[0]["params"][0]]
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("base", ["adamw_torch", "adamw_8bit"])
@pytest.mark.parametrize("direction", ["to_layerwise", "to_standard"])
def test_switching_between_standard_and_layerwise_on_resume(tmp_path, base, direction):
    big = "8bit" in base
    model = tiny_llama(vocab=256, hidden=64) if big else tiny_llama()
    from helpers import TokenDataset

    dataset = TokenDataset(vocab=256) if big else TokenDataset()
    first, second = (base, f"{base}_layerwise") if direction == "to_layerwise" else (f"{base}_layerwise", base)
    kwargs = dict(max_steps=8, save_strategy="steps", save_steps=4)
    uninterrupted = train(clone(model), training_args(tmp_path / "full", first, **kwargs), dataset=dataset)
    from layerwise_hf import LayerwiseTrainer

    resumed = train(
        clone(model),
        training_args(tmp_path / "switched", second, **kwargs),
        dataset=dataset,
        trainer_cls=LayerwiseTrainer,
        resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-4"),
    )
    assert_params_equal(uninterrupted.model, resumed.model)


@pytest.mark.parametrize("to", ["layerwise", "standard"])
def test_convert_checkpoint_offline(tmp_path, to):
    from transformers import Trainer

    from layerwise_hf.integrations.checkpoint import convert_checkpoint, is_layerwise_state_dict

    model = tiny_llama()
    first, second = (
        ("adamw_torch", "adamw_torch_layerwise") if to == "layerwise" else ("adamw_torch_layerwise", "adamw_torch")
    )
    kwargs = dict(max_steps=8, save_strategy="steps", save_steps=4)
    uninterrupted = train(clone(model), training_args(tmp_path / "full", first, **kwargs))
    source = tmp_path / "full" / "checkpoint-4"
    before = (source / "optimizer.pt").read_bytes()
    if to == "standard":
        # Through the command line, as a user would.
        import subprocess
        import sys

        cli = [sys.executable, "-m", "layerwise_hf.cli", "convert-checkpoint", str(source), "--to", to]
        result = subprocess.run(cli, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-2000:]
        converted = result.stdout.strip().splitlines()[-1]
    else:
        converted = convert_checkpoint(str(source), to)
    assert (source / "optimizer.pt").read_bytes() == before, "the source checkpoint must not change"
    state = torch.load(os.path.join(converted, "optimizer.pt"), weights_only=True)
    assert is_layerwise_state_dict(state) == (to == "layerwise")
    with pytest.raises(ValueError, match="already exists"):
        convert_checkpoint(str(source), to)
    # A plain Trainer (no plugin code at load time) resumes from a checkpoint converted to standard.
    resumed = train(
        clone(model),
        training_args(tmp_path / "resumed", second, **kwargs),
        trainer_cls=None if to == "layerwise" else Trainer,
        resume_from_checkpoint=converted,
    )
    assert_params_equal(uninterrupted.model, resumed.model)


def test_resume_with_previous_norm_clipping_is_exact(tmp_path):
    # layerwise_clip="previous" scales by the last step's norm: it must survive the checkpoint.
    model = tiny_llama()
    kwargs = dict(max_steps=6, save_strategy="steps", save_steps=3, max_grad_norm=0.5, layerwise_clip="previous")
    full = train(clone(model), training_args(tmp_path / "full", "adamw_torch_layerwise", **kwargs))
    resumed = train(
        clone(model),
        training_args(tmp_path / "resumed", "adamw_torch_layerwise", **kwargs),
        resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"),
    )
    assert_params_equal(full.model, resumed.model)
