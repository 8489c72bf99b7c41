"""The host step's kernel (`layerwise_host_step`, `layerwise_hf.placement.host_kernel`): torch's fused CPU kernel for a
model on an accelerator, the base as Trainer builds it when asked (and on a CPU model), and how far the two drift."""

from unittest import mock

import pytest
import torch
from helpers import tiny_llama, training_args

from layerwise_hf import LayerwiseTrainingArguments
from layerwise_hf.optim.optimizer import build_layerwise_optimizer
from layerwise_hf.placement import host_kernel, offloading
from layerwise_hf.placement import transfer as transfer_module
from layerwise_hf.placement.host_kernel import host_kernel_flags, host_threads, parse_host_step
from layerwise_hf.placement.offloading import host_step_factory, wait_for_host_steps

FAST = {"fused": True, "foreach": False}


@pytest.fixture(autouse=True)
def simulated_offload(monkeypatch):
    monkeypatch.setenv(transfer_module.SIMULATE_ENV, "1")
    monkeypatch.setattr(offloading, "_warned", set())


@pytest.fixture
def accelerator(monkeypatch):
    """The model's parameters count as living on an accelerator (the one decision the device makes here)."""
    monkeypatch.setattr(host_kernel, "device_is_accelerator", lambda device: True)
    monkeypatch.setenv("LAYERWISE_HF_HOST_THREADS", str(torch.get_num_threads()))


def train(optim: str, steps: int, hidden: int = 32, **overrides):
    model = tiny_llama(hidden=hidden)
    args = training_args("/tmp/unused", optim, layerwise_offload="optimizer", learning_rate=1e-3, **overrides)
    optimizer = build_layerwise_optimizer(model, args)
    optimizer.attach()
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, 64, (4, 16), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    wait_for_host_steps(optimizer)
    return model, optimizer


@pytest.mark.parametrize(
    ("optim", "kernel"),
    [
        ("adamw_torch_layerwise", "_fused_adamw_"),
        ("sgd_layerwise", "_fused_sgd_"),
        ("adagrad_layerwise", "_fused_adagrad_"),
    ],
)
def test_an_accelerator_model_steps_on_the_host_with_the_fused_kernel(accelerator, optim, kernel):
    with mock.patch.object(torch, kernel, wraps=getattr(torch, kernel)) as fused:
        _, optimizer = train(optim, steps=2)
    assert fused.call_count == 2 * len(optimizer.inner)
    for inner in optimizer.inner:
        assert inner.kernel == FAST and inner.base.param_groups[0]["fused"] is True
        # The wrapper's group (what checkpoints save) keeps the factory's flags: a resume without offload too.
        assert not inner.param_groups[0].get("fused") and not inner.state_dict()["param_groups"][0].get("fused")


def test_the_kernel_follows_where_the_model_is_at_the_first_step_not_where_it_was_built(monkeypatch):
    # A plain Accelerate loop builds the optimizer before accelerator.prepare moves the model to the GPU: built while
    # the parameters count as host memory, stepped once they count as an accelerator's.
    model = tiny_llama(hidden=32)
    args = training_args("/tmp/unused", "adamw_torch_layerwise", layerwise_offload="optimizer", learning_rate=1e-3)
    optimizer = build_layerwise_optimizer(model, args)
    monkeypatch.setattr(host_kernel, "device_is_accelerator", lambda device: True)
    monkeypatch.setenv("LAYERWISE_HF_HOST_THREADS", str(torch.get_num_threads()))
    optimizer.attach()
    ids = torch.randint(0, 64, (4, 16))
    with mock.patch.object(torch, "_fused_adamw_", wraps=torch._fused_adamw_) as fused:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        wait_for_host_steps(optimizer)
    assert fused.call_count == len(optimizer.inner)
    assert all(inner.kernel == FAST for inner in optimizer.inner)


def test_the_exact_host_step_is_the_base_as_built_when_asked(accelerator):
    with mock.patch.object(torch, "_fused_adamw_", wraps=torch._fused_adamw_) as fused:
        _, optimizer = train("adamw_torch_layerwise", steps=2, layerwise_host_step="exact")
    assert fused.call_count == 0
    assert all(inner.kernel == {} and not inner.base.param_groups[0]["fused"] for inner in optimizer.inner)


def test_a_cpu_model_steps_exact_by_default():
    _, optimizer = train("adamw_torch_layerwise", steps=1)
    assert all(inner.kernel == {} and inner.threads is None for inner in optimizer.inner)


def test_bases_without_a_fused_kernel_step_as_built(accelerator):
    _, optimizer = train("adafactor_layerwise", steps=1)
    assert all(inner.kernel == {} for inner in optimizer.inner)


def test_fast_and_exact_stay_close_after_30_steps(accelerator):
    fast, _ = train("adamw_torch_layerwise", steps=30, layerwise_host_step="fast")
    exact, _ = train("adamw_torch_layerwise", steps=30, layerwise_host_step="exact")
    drift = max(((f - e).abs().max() / e.abs().max()).item() for f, e in zip(fast.parameters(), exact.parameters()))
    assert 0 < drift < 1e-5  # they differ, in the last bits only (100 steps, hidden 64: docs/offload.md)


def test_bad_values_are_refused_before_training_listing_the_valid_ones():
    with pytest.raises(ValueError, match="layerwise_host_step='quick'.*auto, fast, exact"):
        LayerwiseTrainingArguments("/tmp/unused", optim="adamw_torch_layerwise", layerwise_host_step="quick")
    with pytest.raises(ValueError, match="host_step='FAST'.*auto, fast, exact"):
        host_step_factory(lambda lp, args: None, "optimizer", host_step="FAST")
    assert parse_host_step(None) == "auto"


def test_kernel_flags_and_thread_share():
    weight = torch.nn.Parameter(torch.ones(4))
    adamw = torch.optim.AdamW([weight])
    assert host_kernel_flags(adamw, torch.device("cpu")) == {}
    assert host_kernel_flags(adamw, torch.device("cpu"), "fast") == FAST
    assert host_kernel_flags(torch.optim.AdamW([weight], fused=True), torch.device("cpu"), "fast") == {}
    assert host_kernel_flags(torch.optim.RMSprop([weight]), torch.device("cpu"), "fast") == {}
    assert host_threads(cores=32, local_world_size=4) == 7
    assert host_threads(cores=2, local_world_size=8) == 1
