"""Host offload under fp16 loss scaling (GradScaler on CPU): bit-exact with the standard optimizer and its GradScaler.

Each final gradient is unscaled and inf-checked as it is offloaded (on the device when it is whole there, by the host
worker on a window's host sum), and GradScaler gets the flags at the end of the window's last backward. A step it
skips changes no parameter and no optimizer state, on the device or on the host. Every test runs the path a GPU takes
(host buffers, the host worker, the copy thread standing in for the side stream), with a delay on every copy.
"""

import math

import pytest
import torch
from helpers import assert_params_equal, clone, logged, tiny_llama, training_args
from test_fp16 import SCALER, Overflow, ScaleRecorder, fp16_train, same_floats

from layerwise_hf import LayerwiseOptimizer, LayerwiseParam, unwrap_layerwise_optimizer
from layerwise_hf.integrations.callback import end_training
from layerwise_hf.optim.optimizer import enable_offload, offload_of
from layerwise_hf.placement import offload as offload_module
from layerwise_hf.placement import transfer as transfer_module
from layerwise_hf.placement.host_step import HostStepOptimizer
from layerwise_hf.placement.offloading import host_step_factory, wait_for_host_steps
from layerwise_hf.placement.transfer import ThreadTransfer


@pytest.fixture(autouse=True)
def simulated_offload(monkeypatch):
    monkeypatch.setenv(transfer_module.SIMULATE_ENV, "1")
    monkeypatch.setenv(transfer_module.DELAY_ENV, "0.001")


class Branches(torch.nn.Module):
    """Two heads on one trunk; a micro-batch may leave the second one out (it then gets no gradient)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
        self.head = torch.nn.Linear(16, 4)
        self.extra = torch.nn.Linear(16, 4)

    def forward(self, x, use_extra=True):
        h = self.trunk(x)
        return self.head(h) + self.extra(h) if use_extra else self.head(h)


def _states(inner_or_standard, param=None):
    # A host-stepped optimizer's `state` is its host states, keyed by the device parameter.
    state = inner_or_standard.state[param] if param is not None else next(iter(inner_or_standard.state.values()), {})
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _snapshot(model, optimizer):
    wait_for_host_steps(optimizer)  # the last step's copies back ('optimizer' mode): before reading the weights
    params = [p.detach().clone() for p in model.parameters()]
    # None: a host copy not taken yet (it is taken before the first forward, from the weights: that moves nothing).
    hosts = [
        inner.host.detach().clone() if inner.host.numel() else None
        for inner in optimizer.inner
        if isinstance(inner, HostStepOptimizer)
    ]
    return params, hosts, [_states(inner) for inner in optimizer.inner]


def _same(a, b):
    if a is None:
        return True
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _plain_loop(
    mode, ga, clip, init_scale=2.0**20, steps=4, delay=0.003, skip_extra_last=False, track=True, poison_window=None
):
    """The layer-wise optimizer with offload and torch's AdamW, each under its own GradScaler, on the same batches.
    `poison_window`: in that window's last micro-batch, the last gradient backward computes (the first layer's
    weight) becomes inf; everything else stays finite."""
    model = Branches()
    reference = clone(model)
    poison = [False]
    for net in (model, reference):
        net.trunk[0].weight.register_hook(lambda grad: grad * float("inf") if poison[0] else grad)
    sync = [True]
    params = [LayerwiseParam(n, p, weight_decay=0.0) for n, p in model.named_parameters()]
    factory, runner = host_step_factory(lambda lp, _: torch.optim.AdamW([lp.param], lr=1e-2), mode)
    transfer = ThreadTransfer(delay)
    if runner is not None:
        runner.transfer = transfer
    optimizer = LayerwiseOptimizer(params, factory, sync_gradients=lambda: sync[0], track_grad_norm=track)
    optimizer.configure_clipping(clip, "exact")
    enable_offload(optimizer, mode, transfer=transfer, runner=runner)
    optimizer.attach()
    # growth_interval=1: a scale that overflows backs off step by step, then the steps train and the scale grows.
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1) for _ in range(2))
    optimizer.use_grad_scaler(scaler)
    standard = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    torch.manual_seed(1)
    batches = [[torch.randn(5, 8) for _ in range(ga)] for _ in range(steps)]

    def loss_of(net, x, k):
        with torch.autocast("cpu", dtype=torch.float16):
            return net(x, use_extra=not (skip_extra_last and k == ga - 1 and ga > 1)).float().pow(2).mean()

    expected = {"norms": [], "scales": []}
    for window in batches:
        for k, x in enumerate(window):
            poison[0] = len(expected["norms"]) == poison_window and k == ga - 1
            ref_scaler.scale(loss_of(reference, x, k)).backward()
        ref_scaler.unscale_(standard)
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip if clip else float("inf"))
        expected["norms"].append(float(norm))
        ref_scaler.step(standard)
        ref_scaler.update()
        expected["scales"].append(ref_scaler.get_scale())
        standard.zero_grad()
    got = {"norms": [], "scales": [], "skipped_changed": []}
    for window in batches:
        before = _snapshot(model, optimizer)
        for k, x in enumerate(window):
            sync[0] = k == ga - 1
            poison[0] = len(got["scales"]) == poison_window and k == ga - 1
            scaler.scale(loss_of(model, x, k)).backward()
            assert all(p.grad is None for p in model.parameters())  # every gradient waits on the host
        if track or clip:
            got["norms"].append(float(optimizer.grad_norm()))
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        got["scales"].append(scaler.get_scale())
        if scaler.get_scale() < scale:  # skipped: nothing may have moved, on the device or on the host
            got["skipped_changed"].append(not _same(before, _snapshot(model, optimizer)))
    end_training(optimizer)
    states_equal = all(
        _same(_states(inner), _states(standard, p) if p in standard.state else {})
        for inner, p in zip(optimizer.inner, reference.parameters())
    )
    return model, reference, expected, got, states_equal, optimizer


@pytest.mark.parametrize("clip", [0.0, 0.5])
@pytest.mark.parametrize("ga", [1, 4])
@pytest.mark.parametrize("mode", ["gradients", "optimizer"])
def test_plain_loop_matches_standard_gradscaler(mode, ga, clip):
    model, reference, expected, got, states_equal, optimizer = _plain_loop(mode, ga, clip)
    assert_params_equal(model, reference)
    assert states_equal
    assert same_floats(got["norms"], expected["norms"])
    assert got["scales"] == expected["scales"]
    # The run must exercise what it claims: steps GradScaler skipped (the scale too large at first), then real ones.
    skipped = sum(not math.isfinite(n) for n in expected["norms"])
    assert skipped > 0 and optimizer.steps_taken == len(expected["norms"]) - skipped > 0
    assert got["skipped_changed"] == [False] * skipped
    if clip:
        assert max(n for n in expected["norms"] if math.isfinite(n)) > clip, "the clip must bite"
    # GA > 1: the sums were unscaled and checked on the host; GA 1: on the device before the copy.
    assert (
        offload_of(optimizer).host_bytes() > 0
    ) and optimizer.pipeline.memory.peak_grad_bytes < optimizer.pipeline.memory.full_grad_bytes()


@pytest.mark.parametrize("mode", ["gradients", "optimizer"])
def test_a_sum_without_a_gradient_in_the_last_micro_batch_is_checked_too(mode):
    # `extra` gets gradients in the first three micro-batches only: its host sum is still scaled when the last
    # backward ends, and must be unscaled, inf-checked and measured then, as GradScaler.unscale_ does for any .grad.
    model, reference, expected, got, states_equal, _ = _plain_loop(mode, 4, 0.5, skip_extra_last=True)
    assert_params_equal(model, reference)
    assert states_equal and got["scales"] == expected["scales"]
    assert same_floats(got["norms"], expected["norms"])
    assert not torch.equal(model.extra.weight, Branches().extra.weight)


def test_huge_scale_skips_every_step_and_changes_nothing():
    model, reference, expected, got, states_equal, optimizer = _plain_loop("optimizer", 4, 0.0, init_scale=2.0**60)
    assert optimizer.steps_taken == 0 and got["scales"] == expected["scales"]
    assert got["skipped_changed"] == [False] * 4
    assert_params_equal(model, Branches())
    assert states_equal and all(not inner.base.state for inner in optimizer.inner)


@pytest.mark.parametrize("mode", ["gradients", "optimizer"])
def test_an_inf_in_the_last_host_sum_skips_the_step(mode):
    # The only inf/nan is in the sum the host worker checks last, after every other gradient of the window.
    model, reference, expected, got, states_equal, optimizer = _plain_loop(
        mode, 4, 0.0, init_scale=2.0**8, poison_window=1, track=False
    )
    assert expected["scales"][1] == expected["scales"][0] / 2 and got["scales"] == expected["scales"]
    assert optimizer.steps_taken == 3 and got["skipped_changed"] == [False]
    assert_params_equal(model, reference)
    assert states_equal


def test_the_verdict_waits_for_the_host_checks(monkeypatch):
    # The same run, where the end of backward does not wait for the host worker's checks: GradScaler reads a flag
    # the last check has not set yet, the poisoned step is not skipped, and the weights differ.
    def settle_without_waiting(self, window, params):
        self.waits.clear()

    monkeypatch.setattr(offload_module.GradientOffload, "settle", settle_without_waiting)
    model, reference, *_ = _plain_loop("gradients", 4, 0.0, init_scale=2.0**8, poison_window=1, delay=0.02, track=0)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


BASES = ["adamw_torch", "adafactor", "sgd"]
FAST = {("gradients", "adamw_torch", 4, 1.0), ("optimizer", "adamw_torch", 1, 1.0), ("optimizer", "sgd", 4, 0.0)}
MATRIX = [
    pytest.param(mode, base, ga, clip, marks=() if (mode, base, ga, clip) in FAST else pytest.mark.slow)
    for mode in ("gradients", "optimizer")
    for base in BASES
    for ga in (1, 4)
    for clip in (0.0, 1.0)
]


class HostOverflow(Overflow):
    """`Overflow`, reading the weights once the host steps' copies back are in ('optimizer' mode: the next forward
    waits for them by itself, a callback reading weights between steps must wait too)."""

    def _wait(self, optimizer):
        layerwise = unwrap_layerwise_optimizer(optimizer)
        if layerwise is not None:
            wait_for_host_steps(layerwise)

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self._wait(optimizer)
        super().on_step_begin(args, state, control, optimizer=optimizer, **kwargs)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self._wait(optimizer)
        super().on_step_end(args, state, control, optimizer=optimizer, **kwargs)


def _trainer_states(trainer):
    """Per parameter name, its optimizer state (host states with layerwise_offload='optimizer')."""
    layerwise = getattr(trainer, "layerwise_optimizer", None)
    if layerwise is not None:
        return {n: _states(inner) for n, inner in zip(layerwise.names, layerwise.inner)}
    inner = trainer.optimizer.optimizer
    return {n: _states(inner, p) if p in inner.state else {} for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("mode, base, ga, clip", MATRIX)
def test_trainer_matches_standard_gradscaler(tmp_path, mode, base, ga, clip):
    model = tiny_llama()
    runs = {}
    for optim, extra in ((base, {}), (f"{base}_layerwise", {"layerwise_offload": mode})):
        args = training_args(
            tmp_path / optim,
            optim,
            fp16=True,
            learning_rate=5e-2,
            max_grad_norm=clip,
            gradient_accumulation_steps=ga,
            per_device_train_batch_size=2,
            max_steps=4,
            **extra,
        )
        scales = ScaleRecorder()
        runs[optim] = (fp16_train(clone(model), args, [scales], scaler=SCALER), scales.scales)
    (standard, std_scales), (offloaded, scales) = runs[base], runs[f"{base}_layerwise"]
    norms = logged(standard, "grad_norm")
    skipped = sum(b < a for a, b in zip([SCALER["init_scale"], *std_scales], std_scales))
    assert 0 < skipped < len(std_scales), "the run must skip some steps and take others"
    assert scales == std_scales
    assert same_floats(logged(offloaded, "grad_norm"), norms)
    assert logged(offloaded, "learning_rate") == logged(standard, "learning_rate")
    assert_params_equal(standard.model, offloaded.model)
    assert _same(_trainer_states(offloaded), _trainer_states(standard))
    layerwise = offloaded.layerwise_optimizer
    assert layerwise.steps_taken == len(std_scales) - skipped
    assert offload_of(layerwise).host_bytes() > 0  # every gradient waited on the host for the verdict
    if mode == "optimizer":
        assert all(isinstance(inner, HostStepOptimizer) for inner in layerwise.inner)


@pytest.mark.parametrize("mode", ["gradients", "optimizer"])
def test_trainer_overflow_changes_nothing_on_the_host(tmp_path, mode):
    model = tiny_llama()
    runs = {}
    for optim, extra in (("adamw_torch", {}), ("adamw_torch_layerwise", {"layerwise_offload": mode})):
        m = clone(model)
        args = training_args(
            tmp_path / optim, optim, fp16=True, learning_rate=5e-2, max_grad_norm=0.5, max_steps=4, **extra
        )
        overflow = HostOverflow(m, at_step=2)
        # A scale that never overflows by itself here: the only inf/nan is the injected one.
        trainer = fp16_train(m, args, [overflow], scaler=dict(init_scale=2.0**8, growth_interval=1000))
        runs[optim] = (trainer, overflow)
    (standard, std_overflow), (offloaded, overflow) = runs["adamw_torch"], runs["adamw_torch_layerwise"]
    # The injected step: the optimizer's state (host states in 'optimizer' mode) and every weight stayed.
    assert overflow.changed_params == [] and overflow.changed_state == []
    assert std_overflow.changed_params == [] and std_overflow.changed_state == []
    assert math.isnan(logged(offloaded, "grad_norm")[2]) or math.isinf(logged(offloaded, "grad_norm")[2])
    assert offloaded.layerwise_optimizer.steps_taken == 3
    assert same_floats(logged(offloaded, "grad_norm"), logged(standard, "grad_norm"))
    assert_params_equal(standard.model, offloaded.model)
    assert _same(_trainer_states(offloaded), _trainer_states(standard))


def test_one_backward_per_micro_batch_under_fp16(tmp_path):
    # Without offload, fp16 at GA 1 checks every gradient before any layer steps by a second backward (or holds
    # them all); with offload the gradients wait on the host and one backward suffices.
    model = tiny_llama()
    count = [0]
    model.get_input_embeddings().weight.register_hook(lambda grad: count.__setitem__(0, count[0] + 1))
    args = training_args(
        tmp_path, "adamw_torch_layerwise", fp16=True, max_grad_norm=1.0, max_steps=3, layerwise_offload="gradients"
    )
    fp16_train(model, args)
    assert count[0] == 3


def test_fp16_with_offload_is_accepted_when_the_arguments_are_made(tmp_path):
    for mode in ("gradients", "optimizer"):
        args = training_args(tmp_path, "adamw_torch_layerwise", fp16=True, layerwise_offload=mode)
        assert args.layerwise_offload == mode and args.fp16
