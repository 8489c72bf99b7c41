"""`estimate(offload=...)` / `layerwise-hf estimate-memory --offload`: the device and host bytes of an offload run,
against the storages a real run allocates (LAYERWISE_HF_OFFLOAD_SIMULATE=1: separate host buffers on a CPU)."""

import pytest
import torch
from helpers import TokenDataset, clone, tiny_llama, train, training_args

from layerwise_hf.cli import main
from layerwise_hf.estimate import EstimateError, estimate
from layerwise_hf.estimate.units import format_bytes
from layerwise_hf.optim.optimizer import offload_of
from layerwise_hf.placement import transfer as transfer_module
from layerwise_hf.placement.host_step import HostStepOptimizer


@pytest.fixture(autouse=True)
def simulated_offload(monkeypatch):
    monkeypatch.setenv(transfer_module.SIMULATE_ENV, "1")


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _real_sides(layerwise) -> tuple[int, int]:
    """(device-side optimizer-state bytes, host-side bytes) that the run's optimizer holds now."""
    offload = offload_of(layerwise)
    host = sum(_nbytes(b) for b in offload.host.values()) + offload.staging_bytes()
    shared = {id(b) for b in offload.host.values()}  # a host step's gradient buffer is the offload's, when it has one
    device_states = 0
    for inner in layerwise.inner:
        states = sum(_nbytes(v) for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor))
        if isinstance(inner, HostStepOptimizer):
            own_grad = inner.host_grad is not None and id(inner.host_grad) not in shared
            host += _nbytes(inner.host) + states + (_nbytes(inner.host_grad) if own_grad else 0)
        else:
            device_states += states
    return device_states, host


@pytest.mark.parametrize(
    "mode, ga, clip", [("optimizer", 1, 0.0), ("optimizer", 2, 1.0), ("gradients", 2, 0.0), ("gradients", 1, 1.0)]
)
def test_estimate_matches_what_an_offload_run_allocates(tmp_path, mode, ga, clip):
    model = tiny_llama()
    common = dict(gradient_accumulation_steps=ga, max_grad_norm=clip, per_device_train_batch_size=2, max_steps=2)
    args = training_args(tmp_path, "adamw_torch_layerwise", layerwise_offload=mode, **common)
    trainer = train(clone(model), args, dataset=TokenDataset(n=16))
    est = estimate(model, optimizer="adamw_torch_layerwise", offload=mode, gradient_accumulation_steps=ga)
    device_states, host = _real_sides(trainer.layerwise_optimizer)
    assert (est.host_bytes, est.optimizer_state_bytes) == (host, device_states)
    sizes = sorted((_nbytes(p) for p in model.parameters()), reverse=True)
    assert est.gradient_bytes == sum(sizes[:2])  # the copies in flight
    assert offload_of(trainer.layerwise_optimizer).peak_device_bytes <= est.gradient_bytes
    assert "holds every gradient during the window" not in " ".join(est.notes)


def test_offload_moves_the_terms_from_the_device_to_the_host():
    none, grads, opt = (
        estimate("llama-3-8b", optimizer="adamw_torch_layerwise", offload=m, gradient_accumulation_steps=4)
        for m in ("none", "gradients", "optimizer")
    )
    assert none.host_bytes == 0 and none.gradient_bytes == none.all_gradient_bytes
    # GA 4: every gradient's buffer, and two staging buffers of the largest (the 128256 x 4096 embedding, bf16).
    staging = 2 * 128256 * 4096 * 2
    assert grads.host_bytes == none.all_gradient_bytes + staging
    assert grads.optimizer_state_bytes == none.optimizer_state_bytes
    assert grads.gradient_bytes < none.gradient_bytes / 5
    assert opt.optimizer_state_bytes == 0
    assert opt.host_bytes == none.optimizer_state_bytes + 2 * none.all_gradient_bytes + staging
    assert opt.per_gpu_bytes == none.weight_bytes + opt.gradient_bytes
    sharded = estimate(
        "llama-3-8b", optimizer="adamw_torch_layerwise", offload="optimizer", world_size=4, sharding="fsdp2"
    )
    assert sharded.host_bytes == (opt.host_bytes - staging) // 4  # each rank offloads its own shards (GA 1)


def test_notes_say_what_is_pinned_and_what_is_pageable():
    # On CUDA the buffers and parameter copies are pinned; the host optimizer states are pageable, not pinned.
    for mode, ga in (("gradients", 1), ("optimizer", 4)):
        est = estimate("llama-3-8b", optimizer="adamw_torch_layerwise", offload=mode, gradient_accumulation_steps=ga)
        grads = estimate("llama-3-8b", optimizer="adamw_torch_layerwise").all_gradient_bytes
        staging = 2 * 128256 * 4096 * 2 if ga > 1 else 0
        pinned = grads * (1 if mode == "gradients" else 2) + staging
        (note,) = [n for n in est.notes if "pinned (" in n]
        assert f"{format_bytes(pinned)} pinned" in note, note
        assert f"{format_bytes(est.host_bytes - pinned)} pageable" in note, note
        assert ("optimizer states" in note) == (mode == "optimizer") and ("staging" in note) == (ga > 1)


def test_offload_of_a_standard_optimizer_or_an_unknown_mode_is_refused():
    with pytest.raises(EstimateError, match="offload='optimizer' needs a layer-wise optimizer"):
        estimate("llama-3-8b", optimizer="adamw_torch", offload="optimizer")
    with pytest.raises(EstimateError, match="offload='disk'.*none, gradients, optimizer"):
        estimate("llama-3-8b", optimizer="adamw_torch_layerwise", offload="disk")


def test_cli_shows_the_host_column_for_the_layerwise_rows(capsys):
    assert main(["estimate-memory", "llama-3-8b", "--offload", "optimizer"]) == 0
    out = capsys.readouterr().out
    assert "Host (offload)" in out and "(optimizer)" in out
    standard, layerwise = [line for line in out.splitlines() if "adamw_torch" in line and "│" in line]
    assert standard.rstrip("│ ").endswith("-")  # the standard row stays the comparison, without offload
    assert main(["estimate-memory", "llama-3-8b", "--offload", "gradients", "--json"]) == 0
    assert '"host_bytes"' in capsys.readouterr().out
