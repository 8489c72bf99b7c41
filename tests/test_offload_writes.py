"""Weights written between steps with `layerwise_offload="optimizer"`: the next host step starts from them, not from
its old host copy (pruning masks, weight constraints, EMA swaps, `load_state_dict` mid-run)."""

import pytest
import torch
from helpers import TokenDataset, assert_params_equal, clone, tiny_llama, train, training_args
from transformers import TrainerCallback

from layerwise_hf import LayerwiseOptimizer
from layerwise_hf.placement import transfer as transfer_module
from layerwise_hf.placement.offloading import wait_for_host_steps


@pytest.fixture(autouse=True)
def simulated_offload(monkeypatch):
    monkeypatch.setenv(transfer_module.SIMULATE_ENV, "1")
    monkeypatch.setenv(transfer_module.DELAY_ENV, "0.001")


class ScaleHead(TrainerCallback):
    """Scales lm_head.weight after every step, as a weight constraint would (waiting for the host steps first, as
    docs/offload.md asks)."""

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        inner = getattr(optimizer, "optimizer", optimizer)  # Trainer passes Accelerate's wrapper
        if isinstance(inner, LayerwiseOptimizer):
            wait_for_host_steps(inner)
        with torch.no_grad():
            model.lm_head.weight.mul_(0.5)


@pytest.mark.parametrize("ga, clip", [(1, 0.0), (4, 1.0)])
def test_weights_written_between_steps_are_what_the_next_host_step_starts_from(tmp_path, ga, clip):
    model = tiny_llama()
    data = TokenDataset(n=32)
    common = dict(gradient_accumulation_steps=ga, max_grad_norm=clip, per_device_train_batch_size=2, max_steps=4)
    standard = train(
        clone(model), training_args(tmp_path, "adamw_torch", **common), dataset=data, callbacks=[ScaleHead()]
    )
    offloaded = train(
        clone(model),
        training_args(tmp_path, "adamw_torch_layerwise", layerwise_offload="optimizer", **common),
        dataset=data,
        callbacks=[ScaleHead()],
    )
    assert_params_equal(standard.model, offloaded.model)
