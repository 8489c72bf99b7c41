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


def test_resume_rejects_another_model(tmp_path):
    model = tiny_llama()
    args = training_args(tmp_path / "a", "adamw_torch_layerwise", max_steps=2, save_strategy="steps", save_steps=2)
    trainer = train(clone(model), args)
    state = torch.load(tmp_path / "a" / "checkpoint-2" / "optimizer.pt", weights_only=True)
    optimizer = trainer.layerwise_optimizer

    renamed = dict(state, param_groups=[dict(g, name="x." + g["name"]) for g in state["param_groups"]])
    with pytest.raises(ValueError, match="Missing: .*model.embed_tokens.weight"):
        optimizer.load_state_dict(renamed)

    reshaped = dict(state, layerwise_hf=dict(state["layerwise_hf"], shapes=[[1, 2]] * len(optimizer.names)))
    with pytest.raises(ValueError, match="saved shape"):
        optimizer.load_state_dict(reshaped)

    other_kind = dict(
        state, layerwise_hf=dict(state["layerwise_hf"], optimizer_classes=["x.SGD"] * len(optimizer.names))
    )
    with pytest.raises(ValueError, match="saved optimizer x.SGD"):
        optimizer.load_state_dict(other_kind)

    standard = {"state": {}, "param_groups": [{"lr": 1.0, "params": list(range(len(optimizer.names)))}]}
    with pytest.raises(ValueError, match="no parameter names"):
        optimizer.load_state_dict(standard)
