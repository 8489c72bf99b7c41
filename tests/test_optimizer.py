"""LayerwiseOptimizer mechanics: hooks' lifecycle, no double steps, frozen parameters, use without Trainer."""

import warnings

import pytest
import torch
from helpers import TokenDataset, assert_params_equal, clone, held_grad_bound, tiny_llama, train, training_args
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import TrainerCallback

from layerwise_hf import LayerwiseOptimizer, LayerwiseTrainer, build_layerwise_optimizer


def hook_count(p: torch.Tensor) -> int:
    hooks = getattr(p, "_post_accumulate_grad_hooks", None)
    return len(hooks) if hooks else 0


class CountSteps:
    def __init__(self, optimizer):
        self.count = 0
        for inner in optimizer.inner:
            inner.register_step_post_hook(self)

    def __call__(self, *args):
        self.count += 1


def test_is_a_real_optimizer_with_one_named_group_per_trainable_parameter():
    model = tiny_llama()
    args = training_args("unused", "adamw_torch_layerwise")
    optimizer = build_layerwise_optimizer(model, args)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert [g["name"] for g in optimizer.param_groups] == [n for n, _ in trainable]
    assert all(g["params"][0] is p for g, (_, p) in zip(optimizer.param_groups, trainable))
    decay = {g["name"]: g["weight_decay"] for g in optimizer.param_groups}
    assert decay["model.layers.0.self_attn.q_proj.weight"] == 0.1
    assert decay["model.layers.0.input_layernorm.weight"] == 0.0
    assert decay["model.norm.weight"] == 0.0
    # The scheduler's writes reach the inner optimizer: the group is shared, not copied.
    optimizer.param_groups[3]["lr"] = 0.123
    assert optimizer.inner[3].param_groups[0]["lr"] == 0.123
    assert optimizer.state == {}


def test_second_trainer_on_same_model_never_steps_twice(tmp_path):
    model = tiny_llama()
    first = LayerwiseTrainer(
        model=model, args=training_args(tmp_path, "adamw_torch_layerwise"), train_dataset=TokenDataset()
    )
    first.create_optimizer()
    first.layerwise_optimizer.attach()  # as if its train() had died without cleaning up
    first_steps = CountSteps(first.layerwise_optimizer)

    reference = train(clone(model), training_args(tmp_path, "adamw_torch_layerwise", max_steps=3))
    second = LayerwiseTrainer(
        model=model, args=training_args(tmp_path, "adamw_torch_layerwise", max_steps=3), train_dataset=TokenDataset()
    )
    second.create_optimizer()
    second_steps = CountSteps(second.layerwise_optimizer)
    second.train()

    assert first_steps.count == 0
    assert second_steps.count == 3 * len(second.layerwise_optimizer.inner)
    assert not first.layerwise_optimizer.attached
    assert_params_equal(reference.model, model)

    # A second train() of the same trainer does not stack hooks either.
    second.args.max_steps = 1
    second.train()
    assert second_steps.count == 4 * len(second.layerwise_optimizer.inner)


def _segment_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh())


def _layerwise_sgd(model):
    args = training_args("unused", "sgd_layerwise", weight_decay=0.0, learning_rate=0.1)
    return build_layerwise_optimizer(model, args, sync_gradients=lambda: True)


def test_reentrant_checkpointing_double_hook_is_refused():
    block = _segment_model()
    optimizer = _layerwise_sgd(block)
    optimizer.attach()
    x = torch.randn(2, 4, requires_grad=True)
    # The same weights in two reentrant segments: their hooks fire once per segment in one backward.
    y = checkpoint(block, checkpoint(block, x, use_reentrant=True), use_reentrant=True)
    with pytest.raises(RuntimeError, match="fired twice"):
        y.sum().backward()
    optimizer.detach()


def test_non_reentrant_checkpointing_matches_plain_sgd():
    block, reference = _segment_model(), _segment_model()
    optimizer = _layerwise_sgd(block)
    optimizer.attach()
    x = torch.randn(2, 4)
    checkpoint(block, checkpoint(block, x, use_reentrant=False), use_reentrant=False).sum().backward()
    optimizer.step()
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(reference(x)).sum().backward()
    sgd.step()
    assert_params_equal(reference, block)
    assert all(p.grad is None for p in block.parameters())


def test_plain_loop_without_trainer_matches_adamw():
    # The mechanism is usable without Trainer or Accelerate: hooks step, step()/zero_grad() as usual.
    model, reference = tiny_llama(), tiny_llama()
    args = training_args("unused", "adamw_torch_layerwise", weight_decay=0.0, learning_rate=1e-2)
    optimizer = build_layerwise_optimizer(model, args)
    optimizer.attach()
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    batch = TokenDataset()[0:4]
    for _ in range(3):
        for m, opt in ((model, optimizer), (reference, adamw)):
            m(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
    assert_params_equal(reference, model)
    # One gradient alive at once, next to lm_head's while its step is held.
    assert (
        optimizer.pipeline.memory.peak_grad_bytes
        == held_grad_bound(model)
        < optimizer.pipeline.memory.full_grad_bytes()
    )
    optimizer.detach()


def test_step_flushes_gradients_no_hook_consumed():
    model, reference = tiny_llama(), tiny_llama()
    optimizer = build_layerwise_optimizer(model, training_args("unused", "sgd_layerwise", weight_decay=0.0))
    sgd = torch.optim.SGD(reference.parameters(), lr=1e-2)
    batch = TokenDataset()[0:4]
    for m, opt in ((model, optimizer), (reference, sgd)):
        m(**batch).loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf")) if opt is sgd else None
        opt.step()
    assert_params_equal(reference, model)
    assert torch.equal(optimizer.grad_norm(), grad_norm)


def test_frozen_parameters_get_nothing(tmp_path):
    model = tiny_llama()
    frozen = {n for n, _ in model.named_parameters() if ".layers.0." in n or "embed" in n}
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    standard = train(clone(model), training_args(tmp_path, "adamw_torch"))
    seen = []

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            seen.append({n: hook_count(p) for n, p in model.named_parameters()})

    layerwise = train(model, training_args(tmp_path, "adamw_torch_layerwise"), callbacks=[Probe()])
    optimizer = layerwise.layerwise_optimizer
    assert frozen.isdisjoint(optimizer.names)
    assert all(counts[n] == (0 if n in frozen else 1) for counts in seen for n in counts)
    assert {id(p) for p in optimizer.state} == {id(p) for p in model.parameters() if p.requires_grad}
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, before[n]), n
    assert_params_equal(standard.model, layerwise.model)


def test_clipping_off_is_not_silent(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = LayerwiseTrainer(
            model=tiny_llama(),
            args=training_args(tmp_path, "sgd_layerwise", max_grad_norm=1.0, layerwise_clip="off"),
            train_dataset=TokenDataset(),
        )
        trainer.create_optimizer()
    assert any("max_grad_norm=1.0 is NOT applied" in str(w.message) for w in caught)


def test_factory_must_own_exactly_its_parameter():
    model = nn.Linear(2, 2)
    others = list(nn.Linear(2, 2).parameters())
    from layerwise_hf import LayerwiseParam

    params = [LayerwiseParam(n, p, 0.0) for n, p in model.named_parameters()]
    with pytest.raises(ValueError, match="exactly one param group holding exactly that parameter"):
        LayerwiseOptimizer(params, lambda lp, args: torch.optim.SGD(others, lr=0.1))


def test_follows_parameters_replaced_in_its_groups():
    # What accelerate's FSDP2 prepare does: every group's parameter swapped for a new tensor.
    model = nn.Linear(3, 3)
    optimizer = _layerwise_sgd(model)
    optimizer.attach()
    replacement = nn.Linear(3, 3)
    for group, new in zip(optimizer.param_groups, replacement.parameters()):
        group["params"] = [new]
    before = [p.detach().clone() for p in replacement.parameters()]
    replacement(torch.ones(1, 3)).sum().backward()  # hooks follow the new parameters on the next entry point
    optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, replacement.parameters()))
    assert all(hook_count(p) == 1 for p in replacement.parameters())
    assert all(hook_count(p) == 0 for p in model.parameters())
    optimizer.detach()


def test_state_bytes_count_what_quantized_state_tensors_hold():
    # torchao's 8-bit states are tensor subclasses whose numel/dtype describe the fp32 tensor they stand for.
    torchao_optim = pytest.importorskip("torchao.optim")
    from layerwise_hf.optim.memory import tensor_bytes

    param = torch.nn.Parameter(torch.randn(256, 256))
    optimizer = torchao_optim.AdamW8bit([param], lr=1e-3)
    param.grad = torch.randn_like(param)
    optimizer.step()
    state = optimizer.state[param]
    codes = param.numel()  # one byte per element
    assert codes < tensor_bytes(state["exp_avg"]) < codes * 1.1  # plus block scales and the code map
