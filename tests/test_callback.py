"""LayerwiseCallback: gradients reach the layer-wise optimizer only for the length of train(), and memory_logs."""

import pytest
import torch
from helpers import TokenDataset, hook_count, tiny_llama, train, training_args
from transformers import TrainerCallback, TrainerControl, TrainerState

from layerwise_hf import LayerwiseCallback, build_layerwise_optimizer
from layerwise_hf.integrations.callback import memory_logs


def test_hooks_live_only_during_train(tmp_path):
    model = tiny_llama()
    seen = []

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            seen.append([hook_count(p) for p in model.parameters()])

    trainer = train(model, training_args(tmp_path, "sgd_layerwise", max_steps=3), callbacks=[Probe()])
    assert seen and all(counts == [1] * len(counts) for counts in seen)
    assert all(hook_count(p) == 0 for p in model.parameters())
    assert not trainer.layerwise_optimizer.attached


def test_hooks_removed_when_train_raises(tmp_path):
    model = tiny_llama()

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train(model, training_args(tmp_path, "sgd_layerwise", max_steps=4), callbacks=[Boom()])
    assert all(hook_count(p) == 0 for p in model.parameters())


def _events(callback, model, optimizer, args):
    state, control = TrainerState(), TrainerControl()
    return (
        lambda: callback.on_train_begin(args, state, control, model=model, optimizer=optimizer),
        lambda: callback.on_train_end(args, state, control, model=model, optimizer=optimizer),
    )


def test_connects_at_train_begin_and_detaches_at_train_end_without_trainer(tmp_path):
    # The Trainer-free use: Trainer hands `model` and `optimizer` (possibly wrapped, as Accelerate does).
    model = tiny_llama()
    args = training_args(tmp_path, "sgd_layerwise", weight_decay=0.0)
    optimizer = build_layerwise_optimizer(model, args)

    class Wrapped:  # what AcceleratedOptimizer looks like from outside: the optimizer under `.optimizer`
        def __init__(self, inner):
            self.optimizer = inner

    begin, end = _events(LayerwiseCallback(), model, Wrapped(optimizer), args)
    assert all(hook_count(p) == 0 for p in model.parameters())
    begin()
    assert all(hook_count(p) == 1 for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    model(**TokenDataset()[0:4]).loss.backward()
    # The hooks stepped every layer during backward and freed its gradient.
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    end()
    assert all(hook_count(p) == 0 for p in model.parameters())
    after = [p.detach().clone() for p in model.parameters()]
    model(**TokenDataset()[0:4]).loss.backward()
    assert all(torch.equal(a, p) for a, p in zip(after, model.parameters()))
    assert all(p.grad is not None for p in model.parameters())


def test_standard_optimizer_is_left_alone(tmp_path):
    model = tiny_llama()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    begin, end = _events(LayerwiseCallback(), model, adamw, training_args(tmp_path, "adamw_torch"))
    begin()
    assert all(hook_count(p) == 0 for p in model.parameters())
    end()
    model(**TokenDataset()[0:4]).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_memory_logs_report_peak_gradient_and_state(tmp_path):
    model = tiny_llama()
    optimizer = build_layerwise_optimizer(model, training_args(tmp_path, "adamw_torch_layerwise"))
    assert memory_logs(optimizer)["layerwise_optimizer_state_mib"] == 0.0  # AdamW allocates state at its first step
    optimizer.attach()
    model(**TokenDataset()[0:4]).loss.backward()
    optimizer.detach()

    logs = memory_logs(optimizer)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    # exp_avg and exp_avg_sq like each parameter, plus a 4-byte step counter per tensor.
    state = sum(2 * p.numel() * p.element_size() + 4 for p in model.parameters())
    assert logs["layerwise_peak_grad_mib"] == round(largest / 2**20, 3)
    assert logs["layerwise_optimizer_state_mib"] == round(state / 2**20, 3) > 0
    assert ("max_memory_allocated_mib" in logs) == torch.cuda.is_available()
