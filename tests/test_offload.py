"""layerwise_offload="gradients": gradients wait in host buffers for the step; bit-exact with the standard optimizer.

Every test runs the path a GPU takes: host buffers apart from the gradients, the host worker, and the CPU stand-in of
the side stream (`ThreadTransfer`) with a delay on every copy, so a missing wait reads a buffer before its copy ran.
"""

import logging

import pytest
import torch
from helpers import TokenDataset, assert_params_equal, clone, logged, tiny_llama, train, training_args

from layerwise_hf import LayerwiseOptimizer, LayerwiseParam
from layerwise_hf.integrations.callback import end_training
from layerwise_hf.optim.optimizer import build_layerwise_optimizer, enable_offload, offload_of
from layerwise_hf.placement import transfer as transfer_module
from layerwise_hf.placement.host_step import HostRunner, HostStepOptimizer
from layerwise_hf.placement.offload import GradientOffload
from layerwise_hf.placement.offloading import host_step_factory, wait_for_host_steps
from layerwise_hf.placement.transfer import ThreadTransfer


@pytest.fixture(autouse=True)
def simulated_offload(monkeypatch):
    monkeypatch.setenv(transfer_module.SIMULATE_ENV, "1")
    monkeypatch.setenv(transfer_module.DELAY_ENV, "0.001")


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Linear(16, 4)
    )


def _plain_loop(ga: int, max_grad_norm: float, delay: float = 0.003, steps: int = 3, mode: str = "gradients"):
    """Layer-wise with offload and torch's AdamW + clip_grad_norm_ on the same batches; returns both models."""
    model = _mlp()
    reference = clone(model)
    sync = [True]
    params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
    factory, runner = host_step_factory(lambda lp, _: torch.optim.AdamW([lp.param], lr=1e-2), mode)
    transfer = ThreadTransfer(delay)
    if runner is not None:
        runner.transfer = transfer
    optimizer = LayerwiseOptimizer(params, factory, sync_gradients=lambda: sync[0])
    optimizer.configure_clipping(max_grad_norm, "exact")
    enable_offload(optimizer, mode, transfer=transfer, runner=runner)
    optimizer.attach()
    standard = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    torch.manual_seed(1)
    batches = [[torch.randn(5, 8) for _ in range(ga)] for _ in range(steps)]
    expected = []
    for window in batches:  # the reference first: between two layer-wise steps nothing else runs a forward
        for x in window:
            reference(x).pow(2).sum().backward()
        if max_grad_norm:
            expected.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm))
        standard.step()
        standard.zero_grad()
    norms = []
    for window in batches:
        for k, x in enumerate(window):
            sync[0] = k == ga - 1
            model(x).pow(2).sum().backward()
        if max_grad_norm:
            norms.append((optimizer.grad_norm(), expected[len(norms)]))
        optimizer.step()
        assert all(p.grad is None for p in model.parameters())
    end_training(optimizer)
    return model, reference, norms


@pytest.mark.parametrize("clip", [0.0, 0.5])
@pytest.mark.parametrize("ga", [1, 4])
@pytest.mark.parametrize("mode", ["gradients", "optimizer"])
def test_plain_loop_matches_standard_with_late_copies(mode, ga, clip):
    model, reference, norms = _plain_loop(ga, max_grad_norm=clip, mode=mode)
    assert_params_equal(model, reference)
    assert all(torch.equal(a, b) for a, b in norms)
    assert all(b > clip for _, b in norms), "the clip must bite, or the comparison proves little"


def test_the_next_forward_waits_for_the_host_steps(monkeypatch):
    # Without the wait before the next forward, it runs on weights whose update is still being copied back.
    monkeypatch.setattr(HostRunner, "wait", lambda self: self.pending.clear())
    model, reference, _ = _plain_loop(1, max_grad_norm=0.0, delay=0.05, steps=2, mode="optimizer")
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def _host_stepped(delay: float, model=None):
    """`model` (an MLP) with SGD steps run on the host, each copy to and from it `delay` seconds late; its runner."""
    model = _mlp() if model is None else model
    params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
    factory, runner = host_step_factory(lambda lp, _: torch.optim.SGD([lp.param], lr=0.1), "optimizer")
    runner.transfer = ThreadTransfer(delay)
    optimizer = LayerwiseOptimizer(params, factory)
    enable_offload(optimizer, "optimizer", transfer=runner.transfer, runner=runner)
    optimizer.attach()
    return model, optimizer, runner


def _copied_back(optimizer) -> list[bool]:
    """Per parameter: its host step has run and its copy back to the device is done (asked without waiting)."""
    return [inner.last is not None and inner.last.done() and inner.last.result().done() for inner in optimizer.inner]


def test_only_forwards_that_read_host_stepped_weights_wait():
    # 12 copies of 0.1 s each (6 gradients out, 6 parameters back) run after the backward that starts them.
    model, optimizer, runner = _host_stepped(delay=0.1)
    other = _mlp(seed=1)
    x = torch.randn(5, 8)
    reference = clone(model)
    reference(x).pow(2).sum().backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    model(x).pow(2).sum().backward()
    optimizer.step()  # the steps ran in backward: nothing left to step
    assert len(runner.pending) == 6
    # Another model's forward (a reference or reward model), and a module of the trained model that holds no
    # parameter, do not wait for the host worker.
    other(x)
    model[1](x[:, :4])
    assert len(runner.pending) == 6 and not all(_copied_back(optimizer))
    # The trained model's forward waits for every copy back first: it reads the stepped weights.
    model(x)
    assert not runner.pending and all(_copied_back(optimizer))
    assert_params_equal(model, reference)
    # A submodule called directly waits too, when it holds a stepped parameter; for all of them, as the root does.
    model(x).pow(2).sum().backward()
    optimizer.step()
    model[3](torch.randn(5, 16))
    assert not runner.pending and all(_copied_back(optimizer))
    optimizer.detach()
    runner.close()


class _ReadsChildWeight(torch.nn.Module):
    """Reads its child's weight in its own forward, never calling the child."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.child = torch.nn.Linear(8, 4)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.child.weight, self.child.bias)


def test_a_parent_reading_a_childs_weight_waits_for_it():
    # The host-stepped parameters belong to the child, whose forward never runs: the parent waits since it holds them.
    model, optimizer, runner = _host_stepped(delay=0.05, model=_ReadsChildWeight())
    reference = clone(model)
    standard = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x in torch.randn(3, 5, 8):
        reference(x).pow(2).sum().backward()
        standard.step()
        standard.zero_grad()
        model(x).pow(2).sum().backward()
        optimizer.step()
    wait_for_host_steps(optimizer)
    assert_params_equal(model, reference)
    optimizer.detach()
    runner.close()


@pytest.mark.parametrize("tie, checkpointing", [(True, False), (False, True)])
def test_tied_embeddings_and_recomputed_layers_read_updated_weights(monkeypatch, tmp_path, tie, checkpointing):
    # Tied: the embedding is stepped last (its gradient is final last) and read at both ends of the next forward.
    # Checkpointing: a layer's recompute in backward does not wait (none of its parameters has stepped yet).
    waits = []
    wait = HostRunner.wait
    monkeypatch.setattr(HostRunner, "wait", lambda self: (waits.append(len(self.pending)), wait(self)))
    model = tiny_llama(tie=tie)
    data = TokenDataset(n=16)
    common = dict(per_device_train_batch_size=2, max_steps=3, gradient_checkpointing=checkpointing)
    if checkpointing:
        common["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    standard = train(clone(model), training_args(tmp_path, "adamw_torch", **common), dataset=data)
    offloaded = train(
        clone(model),
        training_args(tmp_path, "adamw_torch_layerwise", layerwise_offload="optimizer", **common),
        dataset=data,
    )
    assert_params_equal(standard.model, offloaded.model)
    assert (offloaded.model.lm_head.weight is offloaded.model.get_input_embeddings().weight) == tie
    # Only the next step's forward and the end of training waited, each for every parameter; never in backward.
    assert [n for n in waits if n] == [len(offloaded.layerwise_optimizer.params)] * 3


def test_a_missing_wait_gives_wrong_weights(monkeypatch):
    # The stand-in's delay is what makes the parity tests above able to catch a missing wait: without the wait
    # before a gradient copied back is used, the step reads a buffer its copy has not filled yet.
    monkeypatch.setattr(transfer_module._ThreadTicket, "wait_device", lambda self: None)
    model, reference, _ = _plain_loop(1, max_grad_norm=0.5, delay=0.01, steps=1)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_accumulation_keeps_only_copies_in_flight_on_the_device():
    model = _mlp()
    sync = [False]
    params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
    optimizer = LayerwiseOptimizer(
        params, lambda lp, _: torch.optim.SGD([lp.param], lr=0.1), sync_gradients=lambda: sync[0]
    )
    enable_offload(optimizer, "gradients", transfer=ThreadTransfer(0.01), max_in_flight=1)
    optimizer.attach()
    for k in range(4):
        sync[0] = k == 3
        model(torch.randn(3, 8)).sum().backward()
        # Between micro-batches no gradient is left on the parameters: they wait on the host.
        assert all(p.grad is None for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    offload = offload_of(optimizer)
    assert offload.peak_device_bytes <= largest  # one copy in flight at a time
    assert offload.host_bytes() == sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer.step()
    optimizer.detach()


BASES = ["adamw_torch", "adafactor", "sgd"]
# The fast tier runs two corners of the matrix; the whole of it is a long parity sweep.
FAST = {("gradients", "adamw_torch", 4, 1.0), ("gradients", "adafactor", 1, 1.0), ("optimizer", "sgd", 4, 1.0)}
FAST |= {("optimizer", "adamw_torch", 1, 0.0)}
MATRIX = [
    pytest.param(mode, base, ga, clip, marks=() if (mode, base, ga, clip) in FAST else pytest.mark.slow)
    for mode in ("gradients", "optimizer")
    for base in BASES
    for ga in (1, 4)
    for clip in (0.0, 1.0)
]


@pytest.mark.parametrize("mode, base, ga, clip", MATRIX)
def test_trainer_matches_standard(tmp_path, mode, base, ga, clip):
    model = tiny_llama()
    data = TokenDataset(n=32)
    common = dict(gradient_accumulation_steps=ga, max_grad_norm=clip, per_device_train_batch_size=2, max_steps=4)
    standard = train(clone(model), training_args(tmp_path, base, **common), dataset=data)
    offloaded = train(
        clone(model),
        training_args(tmp_path, f"{base}_layerwise", layerwise_offload=mode, **common),
        dataset=data,
    )
    assert_params_equal(standard.model, offloaded.model)
    assert logged(offloaded, "grad_norm") == logged(standard, "grad_norm")
    layerwise = offloaded.layerwise_optimizer
    # Gradients waited on the host whenever the step could not take them at once (GA > 1, exact clipping).
    assert (offload_of(layerwise).host_bytes() > 0) == (ga > 1 or clip > 0)
    if mode == "optimizer":
        for inner, param in zip(layerwise.inner, layerwise.params):
            # Stepped on its own host copy: the states were made there, apart from the device parameter.
            assert isinstance(inner, HostStepOptimizer) and inner.host.data_ptr() != param.data_ptr()
            assert inner.base.state[inner.host] or base == "sgd"
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), offloaded.model.parameters()))
    assert moved > 1e-4


def _count_backwards(model):
    count = [0]
    model.get_input_embeddings().weight.register_hook(lambda grad: count.__setitem__(0, count[0] + 1))
    return count


def test_exact_clipping_needs_one_backward_per_micro_batch(tmp_path):
    model = tiny_llama()
    runs = {}
    for offload in ("none", "gradients"):
        copy = clone(model)
        count = _count_backwards(copy)
        args = training_args(
            tmp_path,
            "adamw_torch_layerwise",
            max_grad_norm=1.0,
            max_steps=3,
            layerwise_offload=offload,
            layerwise_norm_pass="retain",  # what exact clipping at GA 1 costs without offload: a second backward
        )
        runs[offload] = (train(copy, args, dataset=TokenDataset(n=32)), count[0])
    assert runs["gradients"][1] == 3  # one backward per step, no norm pass
    assert runs["none"][1] == 6  # without offload: a measuring backward, then the stepping one
    assert_params_equal(runs["none"][0].model, runs["gradients"][0].model)


def test_cpu_only_offload_warns_unless_simulated(monkeypatch, caplog):
    monkeypatch.delenv(transfer_module.SIMULATE_ENV)
    model = tiny_llama()
    args = training_args("/tmp/unused", "sgd_layerwise", layerwise_offload="gradients")
    with caplog.at_level(logging.WARNING, logger="layerwise_hf.optim.optimizer"):
        build_layerwise_optimizer(model, args)
    if not torch.cuda.is_available():
        assert "same memory" in caplog.text


def test_fsdp2_accumulation_without_a_reduction_per_micro_batch_is_named(caplog):
    from layerwise_hf.placement.offloading import check_fsdp2_accumulation

    with caplog.at_level(logging.WARNING, logger="layerwise_hf.placement.offloading"):
        check_fsdp2_accumulation("gradients", 4, reduces_each_micro_batch=True)
        check_fsdp2_accumulation("optimizer", 1, reduces_each_micro_batch=False)
        check_fsdp2_accumulation("none", 4, reduces_each_micro_batch=False)
        assert not caplog.records
        check_fsdp2_accumulation("optimizer", 4, reduces_each_micro_batch=False)
    assert "FSDP2 accumulates unsharded gradients" in caplog.text and "'sync_each_batch': True" in caplog.text


def test_bad_offload_values_are_refused_naming_the_argument():
    model = tiny_llama()
    args = training_args("/tmp/unused", "sgd_layerwise")
    with pytest.raises(ValueError, match="offload='host'.*none, gradients, optimizer"):
        build_layerwise_optimizer(model, args, offload="host")
    with pytest.raises(ValueError, match="layerwise_offload='disk'"):
        training_args("/tmp/unused", "sgd_layerwise", layerwise_offload="disk")


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _storage_sides(optimizer, offload) -> tuple[int, int, int]:
    """(device-side gradient bytes, device-side state bytes, host-side bytes) of what the optimizer holds now."""
    host = sum(_nbytes(b) for b in offload.host.values())
    device_states = 0
    for inner in optimizer.inner:
        states = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        if isinstance(inner, HostStepOptimizer):
            host += _nbytes(inner.host) + sum(_nbytes(v) for v in states)
            host += _nbytes(inner.host_grad) if inner.host_grad is not None else 0
        else:
            device_states += sum(_nbytes(v) for v in states)
    # Gradients alive on the parameters, and the ones still being copied out (their sources are alive until then).
    device_grads = sum(_nbytes(p.grad) for p in optimizer.params if p.grad is not None) + offload.device_bytes
    return device_grads, device_states, host


@pytest.mark.parametrize("ga", [1, 4])
@pytest.mark.parametrize("mode", ["none", "gradients", "optimizer"])
def test_device_side_is_bounded_by_what_is_in_flight(mode, ga):
    model = _mlp()
    sync = [True]
    params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
    factory, runner = host_step_factory(lambda lp, _: torch.optim.AdamW([lp.param], lr=1e-2), mode)
    optimizer = LayerwiseOptimizer(params, factory, sync_gradients=lambda: sync[0])
    optimizer.configure_clipping(1.0, "exact")  # every gradient waits for the global norm
    enable_offload(optimizer, mode if mode != "none" else "gradients", max_in_flight=2, runner=runner)
    if mode == "none":
        enable_offload(optimizer, "none")
    optimizer.attach()
    offload = offload_of(optimizer) or GradientOffload()
    seen = []
    for p in model.parameters():
        # Registered after the optimizer's own hooks: runs once each gradient has been handed over.
        p.register_post_accumulate_grad_hook(lambda _: seen.append(_storage_sides(optimizer, offload)))
    for _ in range(2):
        for k in range(ga):
            sync[0] = k == ga - 1
            model(torch.randn(5, 8)).sum().backward()
        seen.append(_storage_sides(optimizer, offload))  # the whole window's gradients wait for the step
        optimizer.step()
        seen.append(_storage_sides(optimizer, offload))
    end_training(optimizer)
    sizes = [_nbytes(p) for p in model.parameters()]
    peak_grads = max(g for g, _, _ in seen)
    if mode == "none":
        assert peak_grads == sum(sizes)  # exact clipping without offload holds every gradient on the device
        return
    assert peak_grads <= 2 * max(sizes)  # the copies in flight, at GA 1 and 4 alike
    assert optimizer.pipeline.memory.peak_grad_bytes <= 2 * max(
        sizes
    )  # what Trainer logs as layerwise_peak_grad_mib agrees
    state_bytes = 2 * sum(sizes) + 4 * len(sizes)  # AdamW: exp_avg, exp_avg_sq and a float32 step count
    _, device_states, host = seen[-1]
    if mode == "optimizer":
        assert device_states == 0  # states and the parameter's copy live on the host side only
        assert host >= state_bytes + 2 * sum(sizes)  # states, host copies, host gradient buffers
    else:
        assert device_states == state_bytes and host == sum(sizes)  # only the gradients' host buffers


@pytest.mark.parametrize(
    "saved_with, resumed_with",
    [
        ("optimizer", "none"),
        pytest.param("none", "optimizer", marks=pytest.mark.slow),
        pytest.param("gradients", "optimizer", marks=pytest.mark.slow),
    ],
)
def test_checkpoints_resume_across_offload_on_and_off(tmp_path, saved_with, resumed_with):
    model = tiny_llama()
    data = TokenDataset(n=32)
    kwargs = dict(max_steps=6, save_strategy="steps", save_steps=3, per_device_train_batch_size=2, max_grad_norm=1.0)
    full = train(clone(model), training_args(tmp_path / "full", "adamw_torch_layerwise", **kwargs), dataset=data)
    saved = train(
        clone(model),
        training_args(tmp_path / "saved", "adamw_torch_layerwise", layerwise_offload=saved_with, **kwargs),
        dataset=data,
    )
    checkpoint = tmp_path / "saved" / "checkpoint-3"
    # The same format as without offload: the wrapped optimizer's class and states, never the host wrapper's.
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert set(state["layerwise_hf"]["optimizer_classes"]) == {"torch.optim.adamw.AdamW"}
    assert sorted(state["state"]) == list(range(len(state["param_groups"])))
    resumed = train(
        clone(model),
        training_args(tmp_path / "resumed", "adamw_torch_layerwise", layerwise_offload=resumed_with, **kwargs),
        dataset=data,
        resume_from_checkpoint=str(checkpoint),
    )
    assert_params_equal(full.model, saved.model)
    assert_params_equal(full.model, resumed.model)


@pytest.mark.parametrize("mode", ["gradients", "optimizer"])
def test_a_sum_without_a_gradient_in_the_last_micro_batch_counts_in_the_norm(mode):
    # `extra` gets gradients in the first micro-batches of each window only: its host sum has no final gradient to
    # measure it as it arrives, and clip_grad_norm_ counts it all the same.
    from test_offload_fp16 import Branches

    model, ga = Branches(), 3
    reference = clone(model)
    sync = [True]
    params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
    factory, runner = host_step_factory(lambda lp, _: torch.optim.AdamW([lp.param], lr=1e-2), mode)
    optimizer = LayerwiseOptimizer(params, factory, sync_gradients=lambda: sync[0])
    optimizer.configure_clipping(0.5, "exact")
    enable_offload(optimizer, mode, transfer=ThreadTransfer(0.003), runner=runner)
    optimizer.attach()
    standard = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    torch.manual_seed(1)
    batches = [[torch.randn(5, 8) for _ in range(ga)] for _ in range(2)]
    expected, norms = [], []
    for net in (reference, model):
        for window in batches:
            for k, x in enumerate(window):
                sync[0] = k == ga - 1
                net(x, use_extra=k < ga - 1).pow(2).sum().backward()
            if net is reference:
                expected.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5))
                standard.step()
                standard.zero_grad()
            else:
                norms.append(optimizer.grad_norm())
                optimizer.step()
    end_training(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(norms, expected)) and len(norms) == 2
    assert_params_equal(model, reference)


def test_the_next_forward_waits_once_for_every_copy_back(monkeypatch):
    # Issue 28 item 8: one host worker runs the steps in order and every copy back goes on one stream (one copy thread
    # here), so the device waits on the last copy back's event once, not once per parameter.
    model, optimizer, runner = _host_stepped(delay=0.02)
    reference = clone(model)
    x = torch.randn(5, 8)
    reference(x).pow(2).sum().backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    model(x).pow(2).sum().backward()
    optimizer.step()
    waits = []
    wait_host = transfer_module._ThreadTicket.wait_host
    monkeypatch.setattr(
        transfer_module._ThreadTicket, "wait_device", lambda self: (waits.append(self), wait_host(self))
    )
    model(x)
    assert len(optimizer.inner) == 6 and len(waits) == 1
    assert not runner.pending and all(_copied_back(optimizer))
    assert_params_equal(model, reference)
    optimizer.detach()
    runner.close()


def test_a_failed_host_step_is_raised_by_the_next_forward_after_the_other_copies_back(monkeypatch):
    model, optimizer, runner = _host_stepped(delay=0.01)
    failing = optimizer.inner[2]

    def fail(*args):
        raise RuntimeError("host step failed")

    monkeypatch.setattr(failing, "_step_on_host", fail)
    model(torch.randn(5, 8)).pow(2).sum().backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match="host step failed"):
        model(torch.randn(5, 8))
    # Every other parameter's copy back was waited for: none is left in flight behind the error.
    assert not runner.pending
    others = [inner for inner in optimizer.inner if inner is not failing]
    assert len(others) == 5 and all(inner.last.done() and inner.last.result().done() for inner in others)
    optimizer.detach()
    runner.close()


def test_a_held_and_an_in_backward_host_gradient_share_one_buffer_per_parameter():
    # Issue 28 item 11: with "optimizer", a window whose gradients wait for the step (GA 2 here) and one whose
    # gradients step in backward (GA 1) used a host gradient buffer each: two gradient-sized pinned sets, besides the
    # parameter copies. The two uses never overlap, so they share one.
    model = _mlp()
    reference = clone(model)
    sync = [True]
    params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
    factory, runner = host_step_factory(lambda lp, _: torch.optim.AdamW([lp.param], lr=1e-2), "optimizer")
    runner.transfer = ThreadTransfer(0.003)
    optimizer = LayerwiseOptimizer(params, factory, sync_gradients=lambda: sync[0])
    enable_offload(optimizer, "optimizer", transfer=runner.transfer, runner=runner)
    optimizer.attach()
    standard = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    torch.manual_seed(1)
    windows = [[torch.randn(5, 8) for _ in range(ga)] for ga in (2, 1, 2, 1)]
    for window in windows:
        for x in window:
            reference(x).pow(2).sum().backward()
        standard.step()
        standard.zero_grad()
    for window in windows:
        for k, x in enumerate(window):
            sync[0] = k == len(window) - 1
            model(x).pow(2).sum().backward()
        optimizer.step()
    end_training(optimizer)
    offload = offload_of(optimizer)
    assert sorted(offload.host) == list(range(6))
    assert all(offload.host[i] is inner.host_grad for i, inner in enumerate(optimizer.inner))
    grads_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert offload.arena is None and runner.arenas["grads"].nbytes == grads_bytes
    assert_params_equal(model, reference)
    runner.close()


def test_host_norms_of_shards_reach_the_device_in_one_copy():
    # FSDP2 + host norms of accumulated sums: each norm moved alone was a pageable copy and a stream sync per
    # parameter at every step's end; stacked, one.
    from torch.utils._python_dispatch import TorchDispatchMode

    from layerwise_hf.platform.norms import moved_together

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default:
                Copies.count += 1
            return func(*args, **(kwargs or {}))

    norms = [torch.tensor(float(k)) for k in range(7)]
    with Copies():
        moved = moved_together(norms, torch.device("meta"))
    assert Copies.count == 1 and len(moved) == 7 and all(m.device.type == "meta" and m.shape == () for m in moved)
    assert [m.item() for m in moved_together(norms, torch.device("cpu"))] == [float(k) for k in range(7)]


@pytest.mark.parametrize("ga", [1, 2])
def test_host_copies_and_pinned_blocks_are_made_before_the_first_backward(monkeypatch, ga):
    # Taken in each parameter's first hook, every host copy was a copy and a wait inside the first backward after an
    # attach or a resume, and the pinned blocks were registered there too: a stall of the whole first step.
    from layerwise_hf.placement import host_step as host_step_module

    in_backward = []
    for cls, name in ((HostStepOptimizer, "begin_refresh"), (host_step_module.HostArena, "__init__")):
        original = getattr(cls, name)

        def recorded(self, *args, _original=original, _name=name, **kwargs):
            in_backward.append((_name, torch._C._current_graph_task_id() != -1))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, recorded)
    model, reference, _ = _plain_loop(ga, 0.0, mode="optimizer")
    assert_params_equal(model, reference)
    params = len(list(model.parameters()))
    assert [what for what, _ in in_backward].count("begin_refresh") == params
    assert sorted(set(in_backward)) == [("__init__", False), ("begin_refresh", False)]
